"""Interactive tasks outside the rollout stage: SFT examples from reference episodes, and
greedy episodes scored for the eval suite.

``episode_example(policy, episode)`` turns a reference episode (``[[action,
observation], ...]``, as the terminal domain's ``reference["episode"]``) into the token
layout the episode runner produces: each action's tokens and EOS (mask 1), then its
observation's tokens (mask 0), so SFT trains on the actions only and sees the
observations as context, exactly as the policy will see them in an episode.

``score_episodes(actor, tasks, recipe, executor)`` plays one greedy episode per task
(``play_episodes``, through ``components.rollout.interactive.play``: the recipe's sandbox
sessions, ``rollout.max_turns``, ``rollout.observation_chars``, ``evaluation.max_new_tokens``
per action; ``progress`` is told as episodes end), replays each through ``executor``
(``Interactive.replay``) and judges it with the task's verifier (``judge_episodes``). Each ``EvalResult`` has ``context_bucket`` ``MULTI_TURN``, so
interactive tasks form their own slices in the layered report (``<domain>/d<k>/multi_turn``):
an episode's context grows with every observation, so the prompt's length bucket would
say little. Not covered: sampled pass@k of episodes (``sampled_pass_at_k`` leaves
interactive tasks out).
"""

from __future__ import annotations

from collections.abc import Callable

from components.core.policy import Policy
from components.core.prompts import observation_ids
from components.core.recipe import Recipe
from components.core.records import EvalResult, Rollout, Task
from components.domains import registry
from components.domains.base import DONE, judge
from components.domains.execute import execute, refuse_outages
from components.rollout.episode import Actor
from components.rollout.interactive import interactive_specs, play
from components.sandbox.executor import Executor

MULTI_TURN = "multi_turn"
"""The context bucket (and slice name part) of interactive eval tasks."""


def episode_example(policy: Policy, episode: list[list[str]]) -> tuple[list[int], list[int]]:
    """(completion token ids, mask) of a reference episode, in the layout the episode runner
    gives the policy (``components.rollout.episode``): each action and the policy's EOS at
    1, then the observation as ``prompts.observation_ids`` lays it out under the policy's
    prompt format (a user turn and the generation prompt under ``chat``) at 0."""
    ids: list[int] = []
    mask: list[int] = []
    for action, observation in episode:
        act = list(policy.tokenizer(action, add_special_tokens=False)["input_ids"]) + [policy.eos_id]
        ids += act
        mask += [1] * len(act)
        if action.strip() != DONE and observation:
            obs = observation_ids(policy.tokenizer, observation, policy.prompt_format, True)
            ids += obs
            mask += [0] * len(obs)
    return ids, mask


def score_episodes(actor: Policy | Actor, tasks: list[Task], recipe: Recipe, executor: Executor, version: str,
                   label: str = "eval episodes", progress: Callable[[int], None] | None = None) -> list[EvalResult]:
    """One greedy episode per interactive task, replayed and judged; results in the tasks' order.
    ``progress`` is called with how many episodes just ended (``progress.bar``'s ``advance``).
    A command the sandbox could not run during an episode (``infra_error``) is an
    ``InfraError`` from ``run_episodes``, as one in the replay is (``refuse_outages``):
    never scored as the policy's failure."""
    return judge_episodes(tasks, play_episodes(actor, tasks, recipe, progress), recipe, executor, version, label)


def play_episodes(actor: Policy | Actor, tasks: list[Task], recipe: Recipe,
                  progress: Callable[[int], None] | None = None) -> list[Rollout]:
    """One greedy episode per interactive task, in the tasks' order (not yet judged)."""
    if not tasks:
        return []
    return play(actor, tasks, interactive_specs(tasks), recipe.rollout, recipe.sandbox, seed=0, iteration=0,
                engine_name=recipe.rollout.engine, group_size=1, greedy=True,
                max_action_tokens=recipe.evaluation.max_new_tokens, progress=progress)


def judge_episodes(tasks: list[Task], rollouts: list[Rollout], recipe: Recipe, executor: Executor, version: str,
                   label: str = "eval episodes") -> list[EvalResult]:
    """``play_episodes``' episodes replayed through ``executor`` and judged, in the tasks' order."""
    if not tasks:
        return []
    results = execute([(t.task_id, t, r.completion) for t, r in zip(tasks, rollouts)], executor,
                      recipe.sandbox.concurrency, label, recipe.sandbox.dedupe)
    refuse_outages(results, executor, label)
    out = []
    for task, ro in zip(tasks, rollouts):
        verdict = judge(registry.get(task.domain), task, ro.completion, results.get(task.task_id))
        out.append(EvalResult(
            task_id=task.task_id, domain=task.domain, difficulty=task.difficulty, context_bucket=MULTI_TURN,
            policy_version=version, score=verdict.score, passed=verdict.passed, completion=ro.completion,
            trap=bool(task.metadata.get("trap", False)),
        ))
    return out
