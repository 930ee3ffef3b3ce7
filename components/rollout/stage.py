"""Stage ``rollout``: G samples per task from the iteration's policy, with per-token logprobs.

Shard ``i/n`` takes tasks ``i, i+n, i+2n, ...`` of taskgen's list, so every group of G
samples of one task lands in one shard and group-relative advantages need no shuffle.
The engine gets each task's prompt once with the group size (``Engine.generate_groups``),
so an engine that can shares one prefill among the group's samples. Prompts are put to
the policy in ``rollout.prompt_format`` (``components.core.prompts``: raw, the tokenizer's
chat template, or auto): the rollouts' ``prompt_token_ids`` are what it saw.

Tasks whose domain declares them interactive (``Domain.interactive``) are played as
multi-turn episodes against sandbox sessions instead (``components/rollout/interactive.py``:
G per task, in lockstep batches, at most ``rollout.max_turns`` actions, observations cut
to ``rollout.observation_chars``, the ``sandbox`` section's backend, limits and
concurrency; an engine other than ``hf`` is a UserError before anything is sampled);
every other task goes through the one-shot path above, unchanged. Their
rollouts are written in the tasks' order either way. Metrics: ``episodes`` (episodes
played) and ``turns_mean`` (mean commands per episode; 0 without episodes).
"""

from __future__ import annotations

from components.core.context import StageContext
from components.core.facts import StartingPolicy
from components.core.policy import load_policy
from components.core.progress import bar
from components.core.records import Rollout, Task
from components.rollout.engines import get_engine
from components.rollout.interactive import check_engine, interactive_specs, play

SECTIONS = ("rollout", "sandbox")
"""Recipe sections read: the engine, group size and sampling settings; the sandbox that
runs interactive tasks' episodes."""


def inputs(ctx: StageContext) -> None:
    ctx.depend_on("taskgen")


def shard_tasks(ctx: StageContext) -> list[Task]:
    tasks = ctx.read_records("taskgen", "tasks", Task)
    return tasks[ctx.shard.index::ctx.shard.count]


def run(ctx: StageContext) -> dict[str, float]:
    cfg = ctx.recipe.rollout
    start = ctx.facts_of("taskgen", StartingPolicy)
    tasks = shard_tasks(ctx)
    specs = interactive_specs(tasks)
    if specs:  # before the policy loads and one-shot samples are drawn, not after
        check_engine(cfg.engine)
    policy = load_policy(start.policy_uri, start.policy_version, prompt_format=cfg.prompt_format)
    sandbox = ctx.recipe.sandbox
    engine = get_engine(cfg.engine)
    engine.workers = cfg.workers
    one_shot = [t for t in tasks if t.task_id not in specs]
    played = [t for t in tasks if t.task_id in specs]
    with bar(f"rollout[{ctx.shard}]", len(tasks) * cfg.group_size) as advance:
        samples = engine.generate_groups(policy, [t.prompt for t in one_shot], cfg.group_size, cfg.max_new_tokens,
                                         cfg.temperature, ctx.seed(), cfg.batch_size, progress=advance)
        episodes = play(policy, played, specs, cfg, sandbox, seed=ctx.seed("episodes"), iteration=ctx.iteration,
                        engine=engine, engine_name=cfg.engine, progress=advance) if played else []
    rollouts = []
    for k, sample in enumerate(samples):
        task = one_shot[k // cfg.group_size]
        g = k % cfg.group_size
        rollouts.append(Rollout(
            rollout_id=f"{task.task_id}-i{ctx.iteration}-g{g}", task_id=task.task_id, domain=task.domain, group_index=g,
            policy_version=policy.version, engine=engine.name, prompt=task.prompt, completion=sample.text,
            prompt_token_ids=sample.prompt_ids, completion_token_ids=sample.completion_ids, logprobs=sample.logprobs,
            finish_reason=sample.finish_reason, prompt_tokens=len(sample.prompt_ids),
            completion_tokens=len(sample.completion_ids),
        ))
    order = {t.task_id: i for i, t in enumerate(tasks)}
    rollouts = sorted(rollouts + episodes, key=lambda r: (order[r.task_id], r.group_index))
    ctx.write_records("rollouts", rollouts, Rollout)
    n = max(1, len(rollouts))
    return {
        "rollouts": len(rollouts),
        "episodes": len(episodes),
        "turns_mean": sum(sum(t.tool_call == "bash" for t in r.turns) for r in episodes) / max(1, len(episodes)),
        "completion_tokens_mean": sum(r.completion_tokens for r in rollouts) / n,
        "stop_fraction": sum(r.finish_reason == "stop" for r in rollouts) / n,
    }
