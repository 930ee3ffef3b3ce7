"""Stage ``sandbox``: execute what this shard's rollouts produced, where the domain says so.

Each rollout whose domain has an execution plan becomes a job; the executor named by
``sandbox.backend`` runs the jobs ``sandbox.concurrency`` at a time. The Execution record
keeps the serialised result the job wrote (``verdict.result``), so the reward stage and
``posttrain replay`` can re-score without executing again. Rollouts of domains that run
nothing get no Execution record.
"""

from __future__ import annotations

from collections import Counter

from components.core.context import StageContext
from components.core.records import Execution, Rollout, Task
from components.domains import registry
from components.sandbox.dispatch import execute
from components.sandbox.executor import get_executor
from components.sandbox.job import JobResult


def inputs(ctx: StageContext) -> None:
    ctx.depend_on("taskgen")
    ctx.depend_on("rollout", shard_only=True)


def to_execution(rollout: Rollout, result: JobResult, tests_passed: int, tests_total: int) -> Execution:
    return Execution(
        rollout_id=rollout.rollout_id, task_id=rollout.task_id, domain=rollout.domain, backend=result.backend,
        isolation=result.isolation, status=result.status, exit_code=result.exit_code, signal=result.signal,
        stdout=result.stdout, stderr=result.stderr, duration_s=result.duration_s, cpu_time_s=result.cpu_time_s,
        peak_memory_mb=result.peak_memory_mb, tests_passed=tests_passed, tests_total=tests_total,
        verdict={"result": result.result},
    )


def to_job_result(execution: Execution) -> JobResult:
    """The inverse view a verifier needs: status plus the serialised result."""
    return JobResult(
        status=execution.status, exit_code=execution.exit_code, signal=execution.signal, stdout=execution.stdout,
        stderr=execution.stderr, duration_s=execution.duration_s, cpu_time_s=execution.cpu_time_s,
        peak_memory_mb=execution.peak_memory_mb, result=execution.verdict.get("result"), backend=execution.backend,
        isolation=execution.isolation,
    )


def run(ctx: StageContext) -> dict[str, float]:
    tasks = {t.task_id: t for t in ctx.read_records("taskgen", "tasks", Task)}
    rollouts = ctx.read_records("rollout", "rollouts", Rollout, shard_only=True)
    executor = get_executor(ctx.recipe.sandbox)
    try:
        results = execute([(r.rollout_id, tasks[r.task_id], r.completion) for r in rollouts], executor,
                          ctx.recipe.sandbox.concurrency, f"sandbox[{ctx.shard}]")
    finally:
        executor.close()
    executions = []
    for r in rollouts:
        if r.rollout_id in results:
            res = results[r.rollout_id]
            comps = registry.get(r.domain).verify(tasks[r.task_id], r.completion, res).components
            executions.append(to_execution(r, res, int(comps.get("tests_passed", 0)), int(comps.get("tests_total", 0))))
    ctx.write_records("executions", executions, Execution)
    status = Counter(e.status for e in executions)
    n = max(1, len(executions))
    metrics = {"jobs": float(len(executions)), **{f"status/{s}": float(c) for s, c in sorted(status.items())}}
    if executions:
        metrics["duration_s_mean"] = sum(e.duration_s for e in executions) / n
        metrics["cpu_time_s_mean"] = sum(e.cpu_time_s for e in executions) / n
        metrics["peak_memory_mb_max"] = max(e.peak_memory_mb for e in executions)
    return metrics
