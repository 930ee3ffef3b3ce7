"""The warm stage path (pooled workers, kept session workers, jobs run concurrently)
records what the plain path records when the same jobs run one by one (a session job in
a sandbox session of its own).

A fixed mix of code and terminal rollouts (single commands and multi-step sessions):
right and wrong answers, garbage, a job that hits its wall clock, a solution that kills
itself, commands that time out and crash. Only values are compared (status, exit code,
signal, the serialised result), never timings or resource use.
"""

from __future__ import annotations

import random

import pytest

from components.core.jobs import SessionJob, to_execution
from components.core.records import Rollout, Task
from components.domains import registry
from components.domains.execute import execute
from components.sandbox.executor import get_executor
from components.sandbox.session import run_session_job
from tests.sandbox.helpers import bwrap_unavailable, sandbox_config

pytestmark = pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"bwrap sandbox unavailable: {bwrap_unavailable()}")

CODE = ["REF", "x + 1", "1 // 0", "[i for i in iter(int, 1)]",  # right, wrong, raises, never ends
        "__import__('os').kill(__import__('os').getpid(), 9)", "(("]  # kills its own process, a syntax error
COMMAND = ["REF", "true", "sleep 9", "kill -9 $PPID", "mkdir a; exit 7"]  # the 2 s command limit; kills the driver
STEPS = ["REF", "mkdir a\nsleep 9", "touch b\nbash -c 'kill -9 $$'; exit $?", "rm -rf /work/*\nexit 3", "garbage ((\n"]


def rollout(task: Task, n: int, completion: str) -> Rollout:
    return Rollout(rollout_id=f"{task.task_id}-{n}", task_id=task.task_id, domain=task.domain, group_index=n,
                   policy_version="test", engine="test", prompt=task.prompt, completion=completion,
                   prompt_token_ids=[], completion_token_ids=[], logprobs=[], finish_reason="stop", prompt_tokens=0,
                   completion_tokens=0)


def fixed_mix() -> list[tuple[Rollout, Task]]:
    rng = random.Random(3)
    code, terminal = registry.get("code"), registry.get("terminal")
    single = multi = None
    while single is None or multi is None:
        task = terminal.draw(rng, "train", set())
        if task.metadata.get("multi_step"):
            multi = multi or task
        else:
            single = single or task
    pairs = []
    for task, completions in ((code.draw(rng, "train", set()), CODE), (single, COMMAND), (multi, STEPS)):
        domain = registry.get(task.domain)
        for n, text in enumerate(completions):
            pairs.append((rollout(task, n, domain.reference_completion(task) if text == "REF" else text), task))
    return pairs


def records(pairs: list[tuple[Rollout, Task]], executor, concurrency: int) -> dict[str, tuple]:
    # dedupe off: every job really runs (the doubled mix below is the point)
    results = execute([(r.rollout_id, task, r.completion) for r, task in pairs], executor, concurrency, dedupe=False)
    return {r.rollout_id: (e.status, e.exit_code, e.signal, e.result)
            for r, _ in pairs if r.rollout_id in results for e in [to_execution(r, results[r.rollout_id])]}


def plain(pairs: list[tuple[Rollout, Task]], config) -> dict[str, tuple]:
    """One job at a time: a plain job on a one-worker warm pool, a session job in a
    sandbox session started for it and closed after it (no kept workers)."""
    out = {}
    with get_executor(config) as executor:
        for r, task in pairs:
            job = registry.get(task.domain).execution_plan(task, r.completion)
            result = run_session_job(config, job) if isinstance(job, SessionJob) else executor.run(job)
            e = to_execution(r, result)
            out[r.rollout_id] = (e.status, e.exit_code, e.signal, e.result)
    return out


def test_warm_stage_path_records_what_the_plain_path_records_one_by_one():
    pairs = fixed_mix()
    with get_executor(sandbox_config(mode="warm", concurrency=2, timeout_s=1.5)) as warm:
        fast = records(pairs + pairs, warm, 2)  # twice: kept session workers serve several sessions each
        fast_again = records(pairs, warm, 2)
    one_by_one = plain(pairs, sandbox_config(mode="warm", concurrency=1, timeout_s=1.5))
    assert set(one_by_one) == {r.rollout_id for r, _ in pairs}  # every rollout ran (none is malformed)
    for key, want in one_by_one.items():
        assert fast[key] == want, key
        assert fast_again[key] == want, key
    statuses = {status for status, *_ in one_by_one.values()}
    steps = {step["status"] for *_, result in one_by_one.values() for step in (result or {}).get("steps", [])}
    assert {"ok", "timeout"} <= statuses and {"ok", "timeout", "failed", "killed"} <= steps, (statuses, steps)
