"""The fixed held-out eval suite: greedy completions, verified per domain.

The suite for a recipe is ``evaluation.tasks_per_domain`` tasks per domain drawn from a
seed that depends only on the pipeline's base seed, so every policy version of a
pipeline is scored on exactly the same tasks. ``pass_rates`` averages per domain.
Not covered: sampling-based pass@k (k > 1); evaluation is greedy pass@1.
"""

from __future__ import annotations

from collections import defaultdict

from components.core.policy import Policy
from components.core.recipe import Recipe
from components.core.records import EvalResult, Task
from components.core.seeds import derive_seed
from components.domains import registry
from components.domains.base import judge
from components.domains.execute import execute
from components.rollout.engines import get_engine
from components.sandbox.executor import Executor


def eval_tasks(recipe: Recipe, per_domain: int | None = None) -> list[Task]:
    n = per_domain or recipe.evaluation.tasks_per_domain
    tasks: list[Task] = []
    for name in recipe.domains:
        seed = derive_seed(recipe.seed, recipe.pipeline, 0, "eval-suite", 0, name)
        tasks.extend(registry.get(name).eval_set(n, seed))
    return tasks


def context_bucket(tokens: int) -> str:
    for edge in (32, 128, 512, 2048, 8192):
        if tokens <= edge:
            return f"<={edge}"
    return ">8192"


def run_suite(policy: Policy, tasks: list[Task], recipe: Recipe, executor: Executor, label: str = "eval") -> list[EvalResult]:
    samples = get_engine(recipe.rollout.engine).generate(
        policy, [t.prompt for t in tasks], recipe.evaluation.max_new_tokens, 1.0, 0, recipe.rollout.batch_size, greedy=True,
    )
    results = execute([(t.task_id, t, s.text) for t, s in zip(tasks, samples)], executor, recipe.sandbox.concurrency, label)
    out = []
    for task, sample in zip(tasks, samples):
        verdict = judge(registry.get(task.domain), task, sample.text, results.get(task.task_id))  # total: never raises
        out.append(EvalResult(
            task_id=task.task_id, domain=task.domain, difficulty=task.difficulty,
            context_bucket=context_bucket(task.context_tokens), policy_version=policy.version,
            score=verdict.score, passed=verdict.passed, completion=sample.text,
            trap=bool(task.metadata.get("trap", False)),
        ))
    return out


def pass_rates(results: list[EvalResult]) -> dict[str, float]:
    by: dict[str, list[bool]] = defaultdict(list)
    for r in results:
        by[r.domain].append(r.passed)
    return {d: sum(v) / len(v) for d, v in sorted(by.items())}
