"""A sharded stage's shard count changed on a half-done iteration (``sandbox.shards``,
``rollout.shards``), through the real runner on recipes/tiny.yaml and a file:// run root.

Before, every ``shard-*`` folder was read whatever its count, so the old
``shard-0000i-of-00002`` manifests beside the new ``of-00004`` ones failed the
completeness check for good ("only shards ['0/2', '0/4', ...] of 2 are manifested",
with an empty list of shards to run). Now a stage reads an upstream stage of its own
iteration in the count the recipe gives it, and a shard run deletes the manifests of
its stage's shards of another count. Not covered: an s3:// run root (the same Store
calls; tests/core/test_manifest_and_cache.py runs the runner on both), and two runs of
different counts on one iteration at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from components.core.context import read_manifests
from components.core.errors import UserError
from components.core.manifest import MANIFEST
from components.core.runner import run_stage
from components.core.storage import Store
from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients, use_home

SANDBOX = "tiny/iter-{k:06d}/sandbox"


def variant(tmp: Path, name: str, **sections: dict) -> Path:
    """recipes/tiny.yaml with ``sections``' fields set over its own."""
    data = yaml.safe_load(TINY_RECIPE.read_text())
    for section, fields in sections.items():
        data[section] = {**data.get(section, {}), **fields}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def booted(tmp_path_factory: pytest.TempPathFactory):
    """(run root, store, folder for recipes): tiny's bootstrap has run there, with its own MLflow."""
    base = tmp_path_factory.mktemp("reshard")
    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, base / ".posttrain")
        root = f"file://{base / 'store'}"
        run_stage("bootstrap", TINY_RECIPE, root, 0)
        yield root, Store(root), base
        reset_tracking_clients()


def half_done(root: str, k: int) -> None:
    """Iteration ``k`` run with tiny (2 shards) up to its sandbox stage, as a night that failed after it."""
    run_stage("taskgen", TINY_RECIPE, root, k)
    for s in ("0/2", "1/2"):
        run_stage("rollout", TINY_RECIPE, root, k, s)
    for s in ("0/2", "1/2"):
        run_stage("sandbox", TINY_RECIPE, root, k, s)


def test_widened_sandbox_on_a_half_done_iteration_runs_its_reward_on_the_new_shards(booted) -> None:
    root, store, base = booted
    half_done(root, 1)
    wide = variant(base, "sandbox4", sandbox={"shards": 4})
    sandbox = SANDBOX.format(k=1)
    old = [f"{sandbox}/shard-0000{i}-of-00002" for i in range(2)]
    for s in ("0/2", "1/2"):
        run_stage("rollout", wide, root, 1, s)  # as the resumed night does (rollout reads sandbox.mode)

    run_stage("sandbox", wide, root, 1, "0/4")
    # the first shard of the new count took the old count's manifests away, not their files
    assert [store.exists(f"{rel}/{MANIFEST}") for rel in old] == [False, False]
    assert [store.exists(f"{rel}/executions.parquet") for rel in old] == [True, True]
    with pytest.raises(UserError) as info:
        run_stage("reward", wide, root, 1, "0/2")
    err = info.value
    assert (err.field, err.value) == ("stage sandbox", store.url(sandbox))
    assert err.problem == "only shards ['0/4'] of 4 are manifested"
    assert err.fix == (f"run 'posttrain stage sandbox --iteration 1 --shard S --run-root {store.uri}', with this run's "
                       "--recipe, for each missing shard S in ['1/4', '2/4', '3/4'] first")

    for s in ("1/4", "2/4", "3/4"):
        run_stage("sandbox", wide, root, 1, s)
    for s in ("0/2", "1/2"):
        reward = run_stage("reward", wide, root, 1, s)
        assert sorted(k for k in reward.inputs if k.startswith("sandbox")) == [f"sandbox[{i}/4]" for i in range(4)]
        assert reward.inputs["sandbox[2/4]"].uri == store.url(f"{sandbox}/shard-00002-of-00004/{MANIFEST}")
        rollout = read_manifests(store, "tiny", 1, "rollout")[int(s[0])]
        assert reward.outputs["rewards"].rows == rollout.outputs["rollouts"].rows == 16
    assert [m.shard for m in read_manifests(store, "tiny", 1, "sandbox")] == ["0/4", "1/4", "2/4", "3/4"]


def test_shards_of_another_count_are_ignored_by_a_stage_and_named_without_a_recipe(booted) -> None:
    """A store written before shard runs removed the other count's manifests: the old
    ``of-00002`` ones lie beside a complete ``of-00004`` set. A stage of the iteration
    reads only the recipe's count; a reader without the recipe (the timeline, a later
    iteration's curriculum) is told what to run, and a shard run clears it."""
    root, store, base = booted
    half_done(root, 2)
    sandbox = SANDBOX.format(k=2)
    old = {rel: store.read_bytes(rel) for rel in (f"{sandbox}/shard-0000{i}-of-00002/{MANIFEST}" for i in range(2))}
    wide = variant(base, "sandbox4", sandbox={"shards": 4})
    for s in ("0/4", "1/4", "2/4", "3/4"):
        run_stage("sandbox", wide, root, 2, s)
    for rel, data in old.items():  # as a run before this fix left them
        store.write_bytes(rel, data)

    for s in ("0/2", "1/2"):
        reward = run_stage("reward", wide, root, 2, s)
        assert sorted(k for k in reward.inputs if k.startswith("sandbox")) == [f"sandbox[{i}/4]" for i in range(4)]
    with pytest.raises(UserError) as info:
        read_manifests(store, "tiny", 2, "sandbox")
    err = info.value
    assert err.problem == "shards of 2 shard counts [2, 4] are manifested (['0/2', '1/2', '0/4', '1/4', '2/4', '3/4'])"
    assert err.fix == (f"run 'posttrain stage sandbox --iteration 2 --shard S --run-root {store.uri}', with this run's "
                       "--recipe, for each of its shards S (a shard run removes the manifests of another count) first")

    assert run_stage("sandbox", wide, root, 2, "3/4").shard == "3/4"  # a cache hit, which clears them too
    assert [m.shard for m in read_manifests(store, "tiny", 2, "sandbox")] == ["0/4", "1/4", "2/4", "3/4"]


def test_more_rollout_shards_on_a_half_done_iteration_finish_it(booted) -> None:
    """``rollout.shards`` 2 -> 3 re-shards rollout, sandbox (as wide as rollout) and reward;
    the iteration then runs to its end, where the timeline reads sandbox and reward
    without the recipe, and the next iteration's reward reads its rewards' statistics."""
    root, store, base = booted
    half_done(root, 3)
    for s in ("0/2", "1/2"):
        run_stage("reward", TINY_RECIPE, root, 3, s)
    three = variant(base, "rollout3", rollout={"shards": 3})
    shards = ["0/3", "1/3", "2/3"]
    with pytest.raises(UserError) as info:  # the new count has nothing yet: the old shards are not taken for it
        run_stage("sandbox", three, root, 3, "0/3")
    assert (info.value.field, info.value.problem) == ("stage rollout", "no manifested output for iteration 3")
    for stage in ("rollout", "sandbox", "reward"):
        for s in shards:
            run_stage(stage, three, root, 3, s)
        assert [m.shard for m in read_manifests(store, "tiny", 3, stage)] == shards
    for stage in ("validation", "trainer", "evaluation"):
        run_stage(stage, three, root, 3)
    assert read_manifests(store, "tiny", 3, "evaluation")[0].iteration == 3  # its end read sandbox and reward
    run_stage("taskgen", three, root, 4)
    for stage in ("rollout", "sandbox"):
        for s in shards:
            run_stage(stage, three, root, 4, s)
    nxt = run_stage("reward", three, root, 4, "0/3")  # its normalisation reads iteration 3's rewards
    assert sorted(k for k in nxt.inputs if k.startswith("reward_stats")) == [f"reward_stats[iter-3][{s}]" for s in shards]
