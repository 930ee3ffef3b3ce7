"""``sandbox.dedupe``: rollouts whose jobs run the same thing share one sandbox run, and
get the records they would get if every job ran (real bwrap sandbox, warm pool)."""

from __future__ import annotations

import random
import threading

import pytest

from components.core.jobs import Job, SessionJob, to_execution
from components.core.records import Task
from components.domains import registry
from components.domains.execute import execute, job_key, runs
from components.sandbox.executor import get_executor
from tests.domains.test_execute_fast_path import rollout
from tests.sandbox.helpers import bwrap_unavailable, sandbox_config

needs_bwrap = pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"bwrap sandbox unavailable: {bwrap_unavailable()}")


class Counting:
    """The real executor, counting the jobs it is handed."""

    def __init__(self, inner) -> None:
        self.inner, self.count, self.lock = inner, 0, threading.Lock()
        self.name, self.isolation = inner.name, inner.isolation

    def run(self, job):
        with self.lock:
            self.count += 1
        return self.inner.run(job)


def group() -> list[tuple[str, Task, str]]:
    """Eight samples of one code task and eight of one multi-step terminal task, as a
    trained policy's groups look: a few distinct answers, most of them repeated."""
    rng = random.Random(5)
    code, terminal = registry.get("code"), registry.get("terminal")
    task = code.draw(rng, "train", set())
    multi = next(t for t in (terminal.draw(rng, "train", set()) for _ in range(200)) if t.metadata.get("multi_step"))
    code_texts = [code.reference_completion(task)] * 4 + ["x + 1"] * 3 + ["1 // 0"]
    term_texts = [terminal.reference_completion(multi)] * 5 + ["mkdir a\ntrue"] * 3
    return ([(f"c{n}", task, text) for n, text in enumerate(code_texts)]
            + [(f"t{n}", multi, text) for n, text in enumerate(term_texts)])


def values(pairs, results) -> dict[str, tuple]:
    out = {}
    for key, task, text in pairs:
        e = to_execution(rollout(task, 0, text), results[key])
        out[key] = (e.status, e.exit_code, e.signal, e.result)
    return out


@needs_bwrap
def test_equal_jobs_run_once_and_every_rollout_gets_the_record_it_would_get_alone():
    pairs = group()
    with get_executor(sandbox_config(mode="warm", concurrency=2)) as inner:
        on, off = Counting(inner), Counting(inner)
        shared = execute(pairs, on, 2, dedupe=True)
        every = execute(pairs, off, 2, dedupe=False)
    assert (on.count, off.count) == (5, 16)  # 3 distinct code answers + 2 distinct command lists
    assert (runs(shared), runs(every)) == (5, 16)
    assert values(pairs, shared) == values(pairs, every)
    passed = {k: v[3] for k, v in values(pairs, shared).items()}
    assert passed["c0"] == passed["c3"] and passed["c0"] != passed["c4"]  # right and wrong answers stay apart


def test_job_key_ignores_only_the_job_id():
    job = Job(job_id="a", files={"s.py": "print(1)"}, argv=["{python}", "s.py"], stdin="x")
    assert job_key(job) == job_key(Job(job_id="b", files={"s.py": "print(1)"}, argv=["{python}", "s.py"], stdin="x"))
    for other in (Job(job_id="a", files={"s.py": "print(2)"}, argv=["{python}", "s.py"], stdin="x"),
                  Job(job_id="a", files={"s.py": "print(1)"}, argv=["{python}", "t.py"], stdin="x"),
                  Job(job_id="a", files={"s.py": "print(1)"}, argv=["{python}", "s.py"], stdin="y"),
                  Job(job_id="a", files={"s.py": "print(1)"}, argv=["{python}", "s.py"], stdin="x", timeout_s=1.0)):
        assert job_key(other) != job_key(job), other


def test_a_file_named_job_id_is_part_of_the_key():
    """Only the dataclass fields named ``job_id`` are left out: two jobs that differ in a
    file called ``job_id`` ran once and shared one result."""
    def job(text: str, job_id: str = "a") -> Job:
        return Job(job_id=job_id, files={"job_id": text, "s.sh": "cat job_id"}, argv=["bash", "s.sh"])

    assert job_key(job("1")) != job_key(job("2"))
    assert job_key(job("1", "a")) == job_key(job("1", "b"))
    check = job("1")
    session = SessionJob(job_id="s", files={"job_id": "1"}, steps=["cat job_id"], check=check)
    assert job_key(session) == job_key(SessionJob(job_id="t", files={"job_id": "1"}, steps=["cat job_id"],
                                                  check=job("1", "other")))
    assert job_key(session) != job_key(SessionJob(job_id="s", files={"job_id": "2"}, steps=["cat job_id"], check=check))


@needs_bwrap
@pytest.mark.parametrize("dedupe", [True, False])
def test_the_recipe_switch_changes_what_the_sandbox_stage_runs_not_what_it_records(tmp_path, dedupe):
    from components.core.manifest import Shard
    from components.core.recipe import parse_recipe
    from components.core.records import Execution, Rollout, from_table
    from components.core.runner import make_context
    from components.core.storage import Store
    from components.sandbox import stage
    from tests.reward.builders import write_stage

    pairs = group()
    tasks = list({t.task_id: t for _, t, _ in pairs}.values())
    rollouts = [rollout(t, n, text) for n, (_, t, text) in enumerate(pairs)]
    store = Store(str(tmp_path), "test")
    write_stage(store, "p", 1, "taskgen", None, {"tasks": (tasks, Task)})
    write_stage(store, "p", 1, "rollout", Shard(0, 1), {"rollouts": (rollouts, Rollout)})
    recipe = parse_recipe({"pipeline": "p", "rollout": {"shards": 1},
                           "sandbox": {"mode": "warm", "concurrency": 2, "dedupe": dedupe}})
    ctx = make_context("sandbox", recipe, store.uri, 1, "0/1")
    stage.inputs(ctx)
    metrics = stage.run(ctx)
    assert (metrics["jobs"], metrics["jobs_run"]) == (16.0, 5.0 if dedupe else 16.0)
    written = from_table(Execution, store.read_table(ctx.outputs["executions"].path))
    assert len(written) == 16  # one record per rollout either way
    by_text = {}
    for e, (_, _, text) in zip(sorted(written, key=lambda e: int(e.rollout_id.rsplit("-", 1)[1])), pairs):
        by_text.setdefault(text, set()).add((e.status, e.exit_code, repr(e.result)))
    assert all(len(v) == 1 for v in by_text.values())  # equal answers, equal records
