"""Run the execution plans of many (task, completion) pairs through one executor.

Domains decide what runs (``Domain.execution_plan``); this module runs it with the
recipe's concurrency and shows progress. Pairs whose domain runs nothing get no result,
nor do pairs whose plan raised or made a job with a file path no sandbox takes
(``sandbox.detect.check_paths``: before, the sandbox's ValueError was an ``infra_error``,
retried twice and then left out as an outage): the first ``LOGGED_ERRORS`` of those are logged one by
one, the rest as one line ``N more execution plans failed``.

With ``dedupe`` (``sandbox.dedupe``, on by default) jobs that would run the same thing
(equal ``job_key``: the same files, command line, stdin, timeout and steps) run once
and their pairs share that one ``JobResult`` object: a group of G samples whose
completions agree costs one sandbox run, not G. This assumes a job's outcome is a
function of what it runs, which the sandbox makes so for the domains here (no network,
a fresh work folder, no clock or randomness a verdict depends on); a program whose
verdict is not should set ``sandbox.dedupe: false``. ``runs(results)`` counts the jobs
that really ran.

``refuse_outages(results, executor, label)`` is for scores that decide something (the
eval suite): a job still ``infra_error`` after ``run_many``'s retries says nothing about
the policy, and scored as a failure it would hold a good candidate back, so it raises
``InfraError`` (the orchestrator retries the stage) instead. Training needs no such
check: the reward stage leaves those samples out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging

from components.core.errors import InfraError
from components.core.jobs import Job, JobResult, SessionJob
from components.core.progress import bar
from components.core.records import Task
from components.domains import registry
from components.domains.base import error_text, malformed
from components.sandbox.detect import check_paths
from components.sandbox.executor import Executor, run_many

log = logging.getLogger(__name__)

LOGGED_ERRORS = 20
"""Failed execution plans logged one by one per ``execute`` call; the rest as one count line
(the reward stage's cap on verifier errors, kept here as domains may import only core)."""


def job_key(job: Job | SessionJob) -> str:
    """A digest of what ``job`` runs: every field but the job ids (a session's check's
    included). Only those dataclass fields are left out: a file or a key of ``files``
    named ``job_id`` is part of what runs."""
    data = {"kind": type(job).__name__, **dataclasses.asdict(job)}
    data.pop("job_id")
    if isinstance(job, SessionJob):
        data["check"].pop("job_id")
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=repr).encode()).hexdigest()


def runs(results: dict[str, JobResult]) -> int:
    """How many jobs really ran for ``results``: deduplicated pairs share one result object."""
    return len({id(r) for r in results.values()})


def refuse_outages(results: dict[str, JobResult], executor: Executor, label: str) -> None:
    """Raise ``InfraError`` naming how many of ``results`` (and the first) ended in
    ``infra_error``; nothing when none did."""
    broken = [(key, r) for key, r in results.items() if r.status == "infra_error"]
    if broken:
        key, first = broken[0]
        raise InfraError("the sandbox", f"{executor.name} ({executor.isolation})",
                         f"{label}: {len(broken)} of {len(results)} jobs ended in infra_error after retries "
                         f"(first, {key}: {first.stderr[-200:]!r}); scored as failures they would misjudge the "
                         "policy")


def execute(pairs: list[tuple[str, Task, str]], executor: Executor, concurrency: int, label: str = "sandbox",
            dedupe: bool = True) -> dict[str, JobResult]:
    """Run plans for ``(key, task, completion)`` triples; returns {key: JobResult}."""
    keyed = []
    failed = 0
    for key, task, completion in pairs:
        if malformed(completion) is not None:  # scored 0 by the verifier without running anything
            continue
        try:
            job = registry.get(task.domain).execution_plan(task, completion)
            if isinstance(job, Job):
                check_paths(job)  # a file path no sandbox takes is the plan's bug, not an outage to retry
        except Exception as exc:  # noqa: BLE001 - a plan's bug loses this pair's run, never the stage
            failed += 1
            if failed <= LOGGED_ERRORS:
                log.error("execution plan of %s (%s) failed: %s", key, task.domain, error_text(exc))
            continue
        if job is not None:
            keyed.append((key, job_key(job) if dedupe else key, job))
    if failed > LOGGED_ERRORS:
        log.error("%d more execution plans failed (not logged one by one)", failed - LOGGED_ERRORS)
    if not keyed:
        return {}
    unique: dict[str, Job | SessionJob] = {}
    for _, digest, job in keyed:
        unique.setdefault(digest, job)
    with bar(label, len(unique)) as advance:
        results = dict(zip(unique, run_many(executor, list(unique.values()), concurrency, on_done=advance)))
    return {key: results[digest] for key, digest, _ in keyed}
