"""Stage ``sandbox``: execute what this shard's rollouts produced, where the domain says so.

Each rollout whose domain has an execution plan becomes a job; the executor named by
``sandbox.backend`` runs the jobs ``sandbox.concurrency`` at a time. The Execution record
keeps the serialised result the job wrote (``result``), and nothing is judged here: the
reward stage verifies every rollout once, from that record, and ``posttrain replay`` can
re-score without executing again. Rollouts of domains that run nothing get no Execution
record.

Shard i of m executes the rollouts of taskgen's tasks i, i+m, i+2m, ...: with as many
shards as rollout (the default) that is exactly rollout shard i; with
``sandbox.shards`` set wider or narrower, every sandbox shard reads all rollout shards
and takes its part, so the sandbox can fan out wider than generation.
"""

from __future__ import annotations

from collections import Counter

from components.core.context import StageContext
from components.core.jobs import to_execution
from components.core.progress import say
from components.core.records import Execution, Rollout, Task
from components.domains.execute import execute, runs
from components.sandbox.executor import get_executor

MEASURED = ("duration_s", "cpu_time_s", "peak_memory_mb", "isolation")
"""Execution fields that describe the run, not its result, and that no verifier reads: the
measurements a re-run never reproduces, and the isolation the machine gave (another node,
kernel or container differs in it). Left out of what the reward stage keys on, so a
sandbox re-run (another ``sandbox.concurrency``, a retried shard, another node) that gives
every job the same result re-runs nothing after it."""

SECTIONS = ("sandbox",)
"""Recipe sections read: the backend, its limits and concurrency."""


def inputs(ctx: StageContext) -> None:
    ctx.depend_on("taskgen")
    ctx.depend_on("rollout", shard_only=ctx.aligned("rollout"))


def run(ctx: StageContext) -> dict[str, float]:
    ordered = ctx.read_records("taskgen", "tasks", Task)
    tasks = {t.task_id: t for t in ordered}
    mine = {t.task_id for t in ordered[ctx.shard.index::ctx.shard.count]}
    rollouts = [r for r in ctx.read_joined("rollout", "rollouts", Rollout, "task_id", tasks,
                                           shard_only=ctx.aligned("rollout")) if r.task_id in mine]
    with get_executor(ctx.recipe.sandbox) as executor:
        say(f"iter {ctx.iteration} | sandbox[{ctx.shard}] | isolation {executor.isolation}")
        results = execute([(r.rollout_id, tasks[r.task_id], r.completion) for r in rollouts], executor,
                          ctx.recipe.sandbox.concurrency, f"sandbox[{ctx.shard}]", ctx.recipe.sandbox.dedupe)
    executions = [to_execution(r, results[r.rollout_id]) for r in rollouts if r.rollout_id in results]
    ctx.write_records("executions", executions, Execution, measured=MEASURED)
    status = Counter(e.status for e in executions)
    n = max(1, len(executions))
    metrics = {"jobs": float(len(executions)), "jobs_run": float(runs(results)), **{f"status/{s}": float(c) for s, c in sorted(status.items())}}
    if executions:
        metrics["duration_s_mean"] = sum(e.duration_s for e in executions) / n
        metrics["cpu_time_s_mean"] = sum(e.cpu_time_s for e in executions) / n
        metrics["peak_memory_mb_max"] = max(e.peak_memory_mb for e in executions)
    return metrics
