"""Stage ``rollout``: G samples per task from the iteration's policy, with per-token logprobs.

Shard ``i/n`` takes tasks ``i, i+n, i+2n, ...`` of taskgen's list, so every group of G
samples of one task lands in one shard and group-relative advantages need no shuffle.
The engine gets each task's prompt once with the group size (``Engine.generate_groups``),
so an engine that can shares one prefill among the group's samples.
"""

from __future__ import annotations

from components.core.context import StageContext
from components.core.facts import StartingPolicy
from components.core.policy import load_policy
from components.core.progress import bar
from components.core.records import Rollout, Task
from components.rollout.engines import get_engine

SECTIONS = ("rollout",)
"""Recipe sections read: the engine, group size and sampling settings."""


def inputs(ctx: StageContext) -> None:
    ctx.depend_on("taskgen")


def shard_tasks(ctx: StageContext) -> list[Task]:
    tasks = ctx.read_records("taskgen", "tasks", Task)
    return tasks[ctx.shard.index::ctx.shard.count]


def run(ctx: StageContext) -> dict[str, float]:
    cfg = ctx.recipe.rollout
    start = ctx.facts_of("taskgen", StartingPolicy)
    tasks = shard_tasks(ctx)
    policy = load_policy(start.policy_uri, start.policy_version)
    engine = get_engine(cfg.engine)
    engine.workers = cfg.workers
    with bar(f"rollout[{ctx.shard}]", len(tasks) * cfg.group_size) as advance:
        samples = engine.generate_groups(policy, [t.prompt for t in tasks], cfg.group_size, cfg.max_new_tokens,
                                         cfg.temperature, ctx.seed(), cfg.batch_size, progress=advance)
    rollouts = []
    for k, sample in enumerate(samples):
        task = tasks[k // cfg.group_size]
        g = k % cfg.group_size
        rollouts.append(Rollout(
            rollout_id=f"{task.task_id}-i{ctx.iteration}-g{g}", task_id=task.task_id, domain=task.domain, group_index=g,
            policy_version=policy.version, engine=engine.name, prompt=task.prompt, completion=sample.text,
            prompt_token_ids=sample.prompt_ids, completion_token_ids=sample.completion_ids, logprobs=sample.logprobs,
            finish_reason=sample.finish_reason, prompt_tokens=len(sample.prompt_ids),
            completion_tokens=len(sample.completion_ids),
        ))
    ctx.write_records("rollouts", rollouts, Rollout)
    n = max(1, len(rollouts))
    return {
        "rollouts": len(rollouts),
        "completion_tokens_mean": sum(r.completion_tokens for r in rollouts) / n,
        "stop_fraction": sum(r.finish_reason == "stop" for r in rollouts) / n,
    }
