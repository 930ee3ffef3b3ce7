"""Model output never fails the reward stage: completions of any size, depth or encoding
get a verdict in every domain, and a verifier's own failure is a per-sample
``verifier_error`` (excluded from training, counted, logged)."""

from __future__ import annotations

import logging
import random

import pytest

from components.core.facts import StartingPolicy
from components.core.manifest import Shard
from components.core.recipe import parse_recipe
from components.core.records import Execution, Reward, Rollout, Task, from_table
from components.core.storage import Store
from components.domains import registry
from components.domains.base import judge
from components.reward.stage import score, summarize
from tests.reward.builders import rollout, run_reward, write_stage

DOMAINS = ("arithmetic", "code", "terminal", "math", "extraction", "structured")
DEEP = "[" * 100_000
INVALID_UTF8 = b"\xff\xfe\xc3\x28 not \xa0\xa1 utf-8 \xed\xa0\x80".decode("utf-8", errors="surrogateescape")
# What a store can hold of undecodable bytes (Parquet strings are UTF-8): replacement
# characters, control characters and NULs, as a tokenizer's decode leaves them.
REPLACED = b"\xff\xfe\x00\x01\x1b[2J\xc3\x28 \xed\xa0\x80 \x00".decode("utf-8", errors="replace")
HOSTILE = [DEEP, REPLACED, "{" * 5000 + '"a":' * 3, "9" * 50_000, "\n" * 10_000, "", "[1,2,3]" + "]" * 999]


def tasks() -> list[Task]:
    return [registry.get(d).make_task(random.Random(7), "train") for d in DOMAINS]


def recipe():
    return parse_recipe({"pipeline": "hostile", "domains": list(DOMAINS), "rollout": {"shards": 1}})


def failed_run(r: Rollout) -> Execution:
    """What the sandbox stage records for a program that ran and reported nothing."""
    return Execution(rollout_id=r.rollout_id, task_id=r.task_id, domain=r.domain, backend="bwrap",
                     isolation="test", status="failed", exit_code=1, signal=0, stdout="", stderr="SyntaxError",
                     duration_s=0.01, cpu_time_s=0.01, peak_memory_mb=1.0, result=None)


def write(store: Store, ts: list[Task], rollouts: list[Rollout]) -> None:
    write_stage(store, "hostile", 1, "taskgen", None, {"tasks": (ts, Task)},
                StartingPolicy(policy_version="1", policy_uri="file:///no/checkpoint"))
    write_stage(store, "hostile", 1, "rollout", Shard(0, 1), {"rollouts": (rollouts, Rollout)})
    executions = [failed_run(r) for r in rollouts if r.domain in ("code", "terminal")]
    write_stage(store, "hostile", 1, "sandbox", Shard(0, 1), {"executions": (executions, Execution)})


def test_hostile_completions_score_zero_and_the_stage_finishes(tmp_path):
    store = Store(str(tmp_path / "store"))
    ts = tasks()
    rollouts = [rollout(t, i, c) for t in ts for i, c in enumerate(HOSTILE)]
    write(store, ts, rollouts)
    ctx = run_reward(recipe(), store, 1, "0/1")
    got = from_table(Reward, store.read_table(ctx.outputs["rewards"].path))
    assert len(got) == len(rollouts)
    for r in got:
        assert r.raw_reward == 0.0 and r.status == "ok", r
    deep = [r for r in got if r.group_index == 0]
    assert {r.domain for r in deep} == set(DOMAINS)
    assert store.exists(f"{ctx.prefix}/_MANIFEST.json")


@pytest.mark.parametrize("domain", DOMAINS)
@pytest.mark.parametrize("completion", [DEEP, INVALID_UTF8, "x" * 2_000_000, "\udcff"], ids=["deep", "invalid-utf8",
                                                                                           "huge", "lone-surrogate"])
def test_every_domain_judges_hostile_completions(domain, completion):
    """``score`` is what the stage runs; surrogate-escaped bytes cannot reach Parquet, so
    invalid UTF-8 is checked here and through ``posttrain verify``'s raw bytes."""
    task = registry.get(domain).make_task(random.Random(3), "train")
    r = rollout(task, 0, completion)
    other = rollout(task, 1, registry.get(domain).reference_completion(task))
    executions = {x.rollout_id: failed_run(x) for x in (r, other)} if domain in ("code", "terminal") else {}
    rewards = score({task.task_id: task}, [r, other], executions, recipe().reward)
    assert rewards[0].raw_reward == 0.0 and rewards[0].status == "ok"
    verdict = judge(registry.get(domain), task, completion, executions.get(r.rollout_id))
    assert verdict.score == 0.0
    if completion is not DEEP:
        assert verdict.status == "malformed"
    # the verifier called directly is total too
    assert registry.get(domain).verify(task, completion, executions.get(r.rollout_id)).score == 0.0


def test_a_verifier_that_raises_is_a_verifier_error_and_the_stage_finishes(tmp_path, monkeypatch, caplog):
    from components.domains.math import Math

    real = Math.verify

    def broken(self, task, completion, result):
        if completion == "boom":
            raise KeyError("a verifier bug")
        return real(self, task, completion, result)

    monkeypatch.setattr(Math, "verify", broken)
    store = Store(str(tmp_path / "store"))
    task = registry.get("math").make_task(random.Random(1), "train")
    answer = task.reference["answer"]
    rollouts = [rollout(task, 0, answer), rollout(task, 1, "boom"), rollout(task, 2, "nope"), rollout(task, 3, answer)]
    write(store, [task], rollouts)
    with caplog.at_level(logging.ERROR, logger="components.reward.stage"):
        ctx = run_reward(recipe(), store, 1, "0/1")
    got = {r.group_index: r for r in from_table(Reward, store.read_table(ctx.outputs["rewards"].path))}
    bad = got[1]
    assert bad.status == "verifier_error" and bad.weight == 0.0 and bad.advantage == 0.0 and bad.raw_reward == 0.0
    assert "KeyError" in bad.reason and "a verifier bug" in bad.reason
    assert [got[i].status for i in (0, 2, 3)] == ["ok"] * 3
    assert [got[i].raw_reward for i in (0, 2, 3)] == [1.0, 0.0, 1.0]
    assert got[0].advantage > 0 > got[2].advantage  # advantages from the three good samples only
    metrics = summarize(list(got.values()))
    assert metrics["verifier_errors"] == 1.0 and metrics["math/mean"] == pytest.approx(2 / 3)
    assert any("verifier_error" in rec.message and "a verifier bug" in rec.message for rec in caplog.records)
    assert store.exists(f"{ctx.prefix}/_MANIFEST.json")


@pytest.mark.parametrize("bad_score", [float("nan"), 2.0, -1.0, "1"])
def test_a_verdict_out_of_range_is_a_verifier_error(monkeypatch, bad_score):
    from components.domains.base import Verdict
    from components.domains.math import Math

    monkeypatch.setattr(Math, "verify", lambda self, t, c, r: Verdict(bad_score, True))
    task = registry.get("math").make_task(random.Random(1), "train")
    assert judge(registry.get("math"), task, "1", None).status == "verifier_error"
