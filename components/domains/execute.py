"""Run the execution plans of many (task, completion) pairs through one executor.

Domains decide what runs (``Domain.execution_plan``); this module runs it with the
recipe's concurrency and shows progress. Pairs whose domain runs nothing get no result.
"""

from __future__ import annotations

import logging

from components.core.jobs import JobResult
from components.core.progress import bar
from components.core.records import Task
from components.domains import registry
from components.domains.base import error_text, malformed
from components.sandbox.executor import Executor, run_many

log = logging.getLogger(__name__)


def execute(pairs: list[tuple[str, Task, str]], executor: Executor, concurrency: int, label: str = "sandbox") -> dict[str, JobResult]:
    """Run plans for ``(key, task, completion)`` triples; returns {key: JobResult}."""
    keyed = []
    for key, task, completion in pairs:
        if malformed(completion) is not None:  # scored 0 by the verifier without running anything
            continue
        try:
            job = registry.get(task.domain).execution_plan(task, completion)
        except Exception as exc:  # noqa: BLE001 - a plan's bug loses this pair's run, never the stage
            log.error("execution plan of %s (%s) failed: %s", key, task.domain, error_text(exc))
            continue
        if job is not None:
            keyed.append((key, job))
    if not keyed:
        return {}
    with bar(label, len(keyed)) as advance:
        results = run_many(executor, [job for _, job in keyed], concurrency, on_done=advance)
    return {key: result for (key, _), result in zip(keyed, results)}
