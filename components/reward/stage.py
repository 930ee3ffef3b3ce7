"""Stage ``reward``: verifier scores -> per-domain normalisation -> group advantages.

Each rollout is scored by its domain's verifier from the completion and, where the
domain executes code, the sandbox's serialised result. A verdict with status
``infra_error`` is *excluded* (status ``excluded``, weight 0): an infrastructure
failure is never a zero reward and never trained on.
"""

from __future__ import annotations

from collections import defaultdict

from components.core.context import StageContext
from components.core.records import Execution, Reward, Rollout, Task
from components.domains import registry
from components.reward.advantages import group_advantages
from components.sandbox.stage import to_job_result


def inputs(ctx: StageContext) -> None:
    ctx.depend_on("taskgen")
    ctx.depend_on("rollout", shard_only=True)
    ctx.depend_on("sandbox", shard_only=True)


def score(tasks: dict[str, Task], rollouts: list[Rollout], executions: dict[str, Execution], cfg) -> list[Reward]:
    """Rewards for a shard's rollouts; pure, so replay can call it with another config."""
    verdicts = {}
    for r in rollouts:
        ex = executions.get(r.rollout_id)
        verdicts[r.rollout_id] = registry.get(r.domain).verify(tasks[r.task_id], r.completion, to_job_result(ex) if ex else None)
    groups: dict[str, list[Rollout]] = defaultdict(list)
    for r in rollouts:
        groups[r.task_id].append(r)
    rewards = []
    for task_id, members in groups.items():
        raw = [None if verdicts[m.rollout_id].status == "infra_error" else verdicts[m.rollout_id].score for m in members]
        adv = group_advantages(raw, cfg.advantage_eps, cfg.scale_by_std)
        for m, a, value in zip(members, adv, raw):
            v = verdicts[m.rollout_id]
            excluded = value is None
            rewards.append(Reward(
                rollout_id=m.rollout_id, task_id=task_id, domain=m.domain, group_index=m.group_index,
                raw_reward=0.0 if excluded else v.score, components=dict(v.components),
                normalized_reward=0.0 if excluded else v.score, weight=0.0 if excluded else 1.0,
                advantage=a, status="excluded" if excluded else "ok", reason=v.detail if excluded else "",
            ))
    return rewards


def summarize(rewards: list[Reward]) -> dict[str, float]:
    metrics: dict[str, float] = {"rewards": float(len(rewards)), "excluded": float(sum(r.status == "excluded" for r in rewards))}
    by: dict[str, list[Reward]] = defaultdict(list)
    for r in rewards:
        by[r.domain].append(r)
    for domain, rs in sorted(by.items()):
        ok = [r for r in rs if r.status == "ok"]
        if ok:
            metrics[f"{domain}/mean"] = sum(r.raw_reward for r in ok) / len(ok)
            metrics[f"{domain}/pass_rate"] = sum(r.raw_reward >= 1.0 for r in ok) / len(ok)
        for name in sorted({k for r in ok for k in r.components}):
            metrics[f"{domain}/component/{name}"] = sum(r.components.get(name, 0.0) for r in ok) / len(ok)
    return metrics


def run(ctx: StageContext) -> dict[str, float]:
    tasks = {t.task_id: t for t in ctx.read_records("taskgen", "tasks", Task)}
    rollouts = ctx.read_records("rollout", "rollouts", Rollout, shard_only=True)
    executions = {e.rollout_id: e for e in ctx.read_records("sandbox", "executions", Execution, shard_only=True)}
    rewards = score(tasks, rollouts, executions, ctx.recipe.reward)
    ctx.write_records("rewards", rewards, Reward)
    return summarize(rewards)
