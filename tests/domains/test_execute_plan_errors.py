"""``execute``: failed execution plans are logged one by one up to ``LOGGED_ERRORS``, then
as one count line (a plan bug hit by every rollout of a shard logged thousands of lines)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from components.core.records import Task
from components.domains import execute as execute_module
from components.domains.execute import LOGGED_ERRORS, execute


class Broken:
    """A domain whose plan raises for every pair."""

    def execution_plan(self, task: Task, completion: str):
        raise ValueError(f"no plan for {completion!r}")


def pairs(n: int) -> list[tuple[str, Task, str]]:
    task = Task(task_id="broken-1", domain="broken", split="train", difficulty=1, prompt="p", context_tokens=1,
                reference={})
    return [(f"k{i:03d}", task, f"c{i}") for i in range(n)]


@pytest.mark.parametrize(("n", "more"), [(LOGGED_ERRORS, None), (LOGGED_ERRORS + 1, 1), (100, 100 - LOGGED_ERRORS)])
def test_failed_plans_are_logged_up_to_the_cap_then_counted(monkeypatch, caplog, n, more):
    monkeypatch.setattr(execute_module, "registry", SimpleNamespace(get=lambda domain: Broken()))
    with caplog.at_level(logging.ERROR, logger=execute_module.__name__):
        assert execute(pairs(n), executor=None, concurrency=1) == {}  # nothing to run: the executor is never used
    lines = [r.getMessage() for r in caplog.records if r.name == execute_module.__name__]
    assert LOGGED_ERRORS == 20
    assert lines[:LOGGED_ERRORS] == [f"execution plan of k{i:03d} (broken) failed: ValueError: no plan for 'c{i}'"
                                     for i in range(LOGGED_ERRORS)]
    assert lines[LOGGED_ERRORS:] == ([] if more is None else [f"{more} more execution plans failed (not logged one by one)"])


class Escaping:
    """A plug-in domain whose plan writes outside the job's work folder for one completion."""

    def execution_plan(self, task: Task, completion: str):
        from components.core.jobs import Job

        name = "../outside.py" if completion == "c1" else "main.py"
        return Job(job_id=completion, files={name: "print(1)"}, argv=["{python}", name])


class Counting:
    name, isolation = "counting", "none"

    def __init__(self) -> None:
        self.ran: list[str] = []

    def run(self, job):
        from components.sandbox.outcome import infra_error

        self.ran.append(job.job_id)
        return infra_error("not run here", self.name, self.isolation)  # a result, whatever it says


def test_a_plan_with_a_path_no_sandbox_takes_is_the_plans_failure_not_a_retried_outage(monkeypatch, caplog):
    """Before, the sandbox's own path check raised inside ``run``: an ``infra_error``, run
    three times and then left out as an outage (at evaluation, a retried stage)."""
    monkeypatch.setattr(execute_module, "registry", SimpleNamespace(get=lambda domain: Escaping()))
    executor = Counting()
    with caplog.at_level(logging.ERROR, logger=execute_module.__name__):
        results = execute(pairs(3), executor=executor, concurrency=1, dedupe=False)
    assert sorted(results) == ["k000", "k002"] and sorted(executor.ran) == ["c0", "c0", "c0", "c2", "c2", "c2"]
    lines = [r.getMessage() for r in caplog.records if r.name == execute_module.__name__]
    assert lines == ["execution plan of k001 (broken) failed: ValueError: job c1: file path '../outside.py' must be "
                     "relative and stay inside the work folder (no leading or trailing '/', no '.', '..' or '//' parts, "
                     "no NUL byte)"]
