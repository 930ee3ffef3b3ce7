"""The fixed held-out eval suite: greedy completions, verified per domain.

The suite for a recipe is ``evaluation.tasks_per_domain`` tasks per domain drawn from a
seed that depends only on the pipeline's base seed, so every policy version of a
pipeline is scored on exactly the same tasks (more than a domain has distinct is a
UserError naming ``evaluation.tasks_per_domain``). ``run_suite`` scores greedy pass@1 (what
promotion compares); ``pass_rates`` averages per domain. ``sampled_pass_at_k`` draws k
completions per task at a temperature (seeded) and returns the unbiased pass@k per
domain, a report figure that never decides promotion. Generation shows progress as the
rollout stage's does (``progress.bar``: a bar on a terminal, plain lines in a log), labelled
``<label> generate``, before the sandbox's own bar or lines.

Context lengths are counted in the scored policy's tokens: ``run_suite`` buckets a
one-shot task (``EvalResult.context_bucket``) by the length of its prompt as the policy
sees it (``Policy.encode_prompt``, in ``rollout.prompt_format``), not by the character
count a domain generator leaves in ``Task.context_tokens``.

A job the sandbox could not run even after retries (``infra_error``) is never scored as
a failure: the suite raises ``InfraError`` and the stage is retried
(``execute.refuse_outages``).

Interactive tasks (``Domain.interactive``) are scored as greedy episodes
(``components/evalsuite/episodes.py``), never as one-shot completions, and report as
their own ``multi_turn`` slices; ``sampled_pass_at_k`` leaves them out.

``eval_settings(recipe)`` are the recipe settings that shape a greedy eval result (the
generation cap, the prompt format, the engine, the episode limits, the sandbox's limits
and interpreter; not the suite's size or domains, which choose the tasks): every scoring
records them, and promotion re-scores a baseline scored under others.

Not covered: pass@k from more samples than k (n > k), or per-slice pass@k; settings of a
plug-in engine or backend beyond those named in ``EVAL_SETTINGS``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from components.core.errors import UserError
from components.core.policy import Policy
from components.core.progress import bar
from components.core.recipe import Recipe
from components.core.records import EvalResult, Task
from components.core.seeds import derive_seed
from components.domains import registry
from components.domains.base import TooFewTasks, judge
from components.domains.execute import execute, refuse_outages
from components.evalsuite.episodes import judge_episodes, play_episodes
from components.evalsuite.stats import pass_at_k
from components.rollout.engines import Engine, Generation, get_engine
from components.rollout.interactive import interactive_specs
from components.sandbox.executor import Executor

EVAL_SETTINGS = (
    "evaluation.max_new_tokens", "rollout.prompt_format", "rollout.engine", "rollout.max_turns",
    "rollout.observation_chars", "sandbox.backend", "sandbox.timeout_s", "sandbox.memory_mb",
    "sandbox.output_cap_bytes", "sandbox.python",
)
"""The recipe fields whose value changes what a greedy eval of the same policy on the same
task gives: the completion cap (a truncated answer fails), how prompts are put to the
policy, the engine, an episode's turns and observation size, and how the sandbox runs a
job (backend, time, memory, output cap, interpreter)."""


def eval_settings(recipe: Recipe) -> dict[str, str]:
    """``EVAL_SETTINGS`` of ``recipe`` (or a stage's view of it), each value as JSON text
    (``32``, ``"raw"``): what a scoring records beside its results."""
    out = {}
    for key in EVAL_SETTINGS:
        section, name = key.split(".")
        out[key] = json.dumps(getattr(getattr(recipe, section), name))
    return out


def eval_tasks(recipe: Recipe, per_domain: int | None = None) -> list[Task]:
    """The fixed eval suite: ``per_domain`` (else ``evaluation.tasks_per_domain``) tasks of
    each domain. More than a domain has distinct is a UserError naming that field."""
    n = per_domain or recipe.evaluation.tasks_per_domain
    tasks: list[Task] = []
    for name in recipe.domains:
        seed = derive_seed(recipe.seed, recipe.pipeline, 0, "eval-suite", 0, name)
        try:
            tasks.extend(registry.get(name).eval_set(n, seed))
        except TooFewTasks as exc:
            raise UserError("evaluation.tasks_per_domain", n, f"domain {name} gave only {exc.got} distinct eval "
                            "tasks", f"ask for fewer tasks of {name} (lower tasks_per_domain)") from None
    return tasks


def context_bucket(tokens: int) -> str:
    for edge in (32, 128, 512, 2048, 8192):
        if tokens <= edge:
            return f"<={edge}"
    return ">8192"


def engine_of(recipe: Recipe) -> Engine:
    """The recipe's generation engine, with ``rollout.workers`` processes."""
    engine = get_engine(recipe.rollout.engine)
    engine.workers = recipe.rollout.workers
    return engine


def run_suite(policy: Policy, tasks: list[Task], recipe: Recipe, executor: Executor, label: str = "eval") -> list[EvalResult]:
    """Greedy pass@1 of every task, in the tasks' order (interactive tasks as episodes);
    one-shot tasks are bucketed by their prompt's length in ``policy``'s tokens. Generation
    (episodes, then completions) shows one ``<label> generate`` bar (plain lines outside a
    terminal) before the sandbox scores any of it."""
    specs = interactive_specs(tasks)
    played = [t for t in tasks if t.task_id in specs]
    one_shot = [t for t in tasks if t.task_id not in specs]
    with bar(f"{label} generate", len(tasks)) as advance:
        episodes = play_episodes(policy, played, recipe, advance)
        samples = _generate(policy, one_shot, recipe, advance)
    by_id = {r.task_id: r for r in judge_episodes(played, episodes, recipe, executor, policy.version,
                                                  f"{label} episodes")}
    by_id.update({r.task_id: r for r in _one_shot(policy, one_shot, samples, recipe, executor, label)})
    return [by_id[t.task_id] for t in tasks]


def _generate(policy: Policy, tasks: list[Task], recipe: Recipe, progress: Callable[[int], None]) -> list[Generation]:
    if not tasks:
        return []
    return engine_of(recipe).generate(
        policy, [t.prompt for t in tasks], recipe.evaluation.max_new_tokens, 1.0, 0, recipe.rollout.batch_size, greedy=True,
        progress=progress,
    )


def _one_shot(policy: Policy, tasks: list[Task], samples: list[Generation], recipe: Recipe, executor: Executor,
              label: str) -> list[EvalResult]:
    if not tasks:
        return []
    results = execute([(t.task_id, t, s.text) for t, s in zip(tasks, samples)], executor, recipe.sandbox.concurrency, label,
                      recipe.sandbox.dedupe)
    refuse_outages(results, executor, label)
    out = []
    for task, sample in zip(tasks, samples):
        verdict = judge(registry.get(task.domain), task, sample.text, results.get(task.task_id))  # total: never raises
        out.append(EvalResult(
            task_id=task.task_id, domain=task.domain, difficulty=task.difficulty,
            context_bucket=context_bucket(len(policy.encode_prompt(task.prompt))), policy_version=policy.version,
            score=verdict.score, passed=verdict.passed, completion=sample.text,
            trap=bool(task.metadata.get("trap", False)),
        ))
    return out


def pass_rates(results: list[EvalResult]) -> dict[str, float]:
    by: dict[str, list[bool]] = defaultdict(list)
    for r in results:
        by[r.domain].append(r.passed)
    return {d: sum(v) / len(v) for d, v in sorted(by.items())}


def sampled_pass_at_k(policy: Policy, tasks: list[Task], recipe: Recipe, executor: Executor, k: int, temperature: float,
                      seed: int, label: str = "pass@k") -> dict[str, float]:
    """Per domain, the mean unbiased pass@k over ``tasks`` from ``k`` completions per task
    sampled at ``temperature`` (reproducible from ``seed``); interactive tasks are left out."""
    specs = interactive_specs(tasks)
    tasks = [t for t in tasks if t.task_id not in specs]
    if not tasks:
        return {}
    prompts = [t.prompt for t in tasks for _ in range(k)]
    with bar(f"{label} generate", len(prompts)) as advance:
        samples = engine_of(recipe).generate(
            policy, prompts, recipe.evaluation.max_new_tokens, temperature, seed, recipe.rollout.batch_size,
            progress=advance,
        )
    jobs = [(f"{t.task_id}#{j}", t, samples[i * k + j].text) for i, t in enumerate(tasks) for j in range(k)]
    results = execute(jobs, executor, recipe.sandbox.concurrency, label, recipe.sandbox.dedupe)
    refuse_outages(results, executor, label)
    passed = np.array([judge(registry.get(t.domain), t, text, results.get(key)).passed for key, t, text in jobs], dtype=int)
    correct = passed.reshape(len(tasks), k).sum(axis=1)
    per_task = pass_at_k(k, correct, k)
    domains = np.array([t.domain for t in tasks])
    return {d: float(per_task[domains == d].mean()) for d in sorted(set(domains.tolist()))}
