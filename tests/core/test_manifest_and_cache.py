"""The stage contract through the real runner: manifests, cache hits, config changes, errors.

Runs recipes/tiny.yaml stages with ``run_stage`` on a file:// and on an s3:// run root
(SeaweedFS on loopback). Bootstrap runs once per store kind (module fixture); each test
then works in its own iteration so the tests do not depend on each other's order.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from components.core import tracking
from components.core.context import read_manifest
from components.core.errors import UserError
from components.core.facts import Scored, StartingPolicy
from components.core.manifest import MANIFEST, InputRef, Manifest
from components.core.recipe import load_recipe
from components.core.runner import code_version, config_digest, run_stage
from components.core.storage import Store
from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients, use_home
from tests.fixtures.s3 import apply_env, new_store_uri

TINY = load_recipe(TINY_RECIPE)


@dataclass
class Booted:
    root: str
    store: Store
    boot: Manifest
    tmp: Path


@pytest.fixture(scope="module", params=["file", "s3"])
def booted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A run root (file:// or s3://) where tiny's bootstrap has run, with its own MLflow."""
    base = tmp_path_factory.mktemp(f"contract-{request.param}")
    with pytest.MonkeyPatch.context() as mp:
        server = apply_env(mp, request.getfixturevalue("s3_server")) if request.param == "s3" else None
        use_home(mp, base / ".posttrain")
        root = new_store_uri(request.param, base, server, "stage-contract")
        boot = run_stage("bootstrap", TINY_RECIPE, root, 0)
        yield Booted(root=root, store=Store(root), boot=boot, tmp=base)
        reset_tracking_clients()


def sha256_of(store: Store, rel: str) -> str:
    return hashlib.sha256(store.read_bytes(rel)).hexdigest()


def run_count() -> int:
    from mlflow.entities import ViewType

    exp = tracking.client().get_experiment_by_name("tiny")
    return len(tracking.client().search_runs([exp.experiment_id], run_view_type=ViewType.ALL, max_results=1000))


def snapshot(store: Store, rels: list[str]) -> dict[str, tuple[bytes, object]]:
    """Bytes and modification time of each file, read fresh from the backend."""
    store.fs.invalidate_cache()
    out = {}
    for rel in rels:
        info = store.fs.info(store._path(rel))
        out[rel] = (store.read_bytes(rel), info.get("mtime", info.get("LastModified")))
    return out


def test_bootstrap_manifest(booted: Booted) -> None:
    m, store = booted.boot, booted.store
    assert (m.stage, m.pipeline, m.iteration, m.shard, m.inputs) == ("bootstrap", "tiny", 0, None, {})
    assert m.config_digest == config_digest(TINY, "bootstrap")
    assert m.code_version == code_version()
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert set(m.outputs) == {"checkpoint", "eval_results", "layered", *(f"checkpoint:{f}" for f in files)}
    ckpt = m.outputs["checkpoint"]
    assert ckpt.path == "tiny/bootstrap/checkpoint"
    assert ckpt.sha256 == sha256_of(store, "tiny/bootstrap/checkpoint/model.safetensors")
    for f in files:  # every file of the checkpoint is digested, not only its weights
        assert m.outputs[f"checkpoint:{f}"].path == f"tiny/bootstrap/checkpoint/{f}"
        assert m.outputs[f"checkpoint:{f}"].sha256 == sha256_of(store, f"tiny/bootstrap/checkpoint/{f}")
    assert ckpt.rows == int(m.metrics["bootstrap/parameters"]) > 0
    evals = m.outputs["eval_results"]
    assert evals.path == "tiny/bootstrap/eval_results.parquet"
    assert evals.sha256 == sha256_of(store, evals.path)
    assert evals.rows == store.read_table(evals.path).num_rows == 2 * TINY.evaluation.tasks_per_domain
    facts = m.facts(Scored)
    assert (facts.version, facts.checkpoint_uri) == ("1", store.url("tiny/bootstrap/checkpoint"))
    assert set(facts.pass_rates) == {"arithmetic", "code"}
    assert m.mlflow_run_id
    run = tracking.client().get_run(m.mlflow_run_id)
    assert (run.info.status, run.data.tags[tracking.TAG_STAGE]) == ("FINISHED", "bootstrap")
    on_disk = store.read_json(f"tiny/bootstrap/{MANIFEST}")
    assert on_disk == m.to_json()
    assert on_disk["content_digest"] == m.content_digest


def test_taskgen_and_rollout_manifests_record_inputs(booted: Booted) -> None:
    store = booted.store
    tg = run_stage("taskgen", TINY_RECIPE, booted.root, 1)
    assert (tg.stage, tg.iteration, tg.shard) == ("taskgen", 1, None)
    assert tg.inputs == {"policy": InputRef(uri=booted.boot.facts(Scored).checkpoint_uri, digest="version:1")}
    assert tg.config_digest == config_digest(TINY, "taskgen")
    tasks = tg.outputs["tasks"]
    assert tasks.path == "tiny/iter-000001/taskgen/tasks.parquet"
    assert tasks.rows == TINY.taskgen.tasks_per_iteration == store.read_table(tasks.path).num_rows
    assert tasks.sha256 == sha256_of(store, tasks.path)
    assert tg.metrics["taskgen/tasks"] == 8.0
    assert tg.mlflow_run_id and tg.facts(StartingPolicy).parent_run_id
    assert read_manifest(store, "tiny/iter-000001/taskgen").to_json() == tg.to_json()

    ro = run_stage("rollout", TINY_RECIPE, booted.root, 1, "1/2")
    assert (ro.stage, ro.iteration, ro.shard) == ("rollout", 1, "1/2")
    assert ro.inputs == {"taskgen": InputRef(uri=store.url(f"tiny/iter-000001/taskgen/{MANIFEST}"), digest=tg.content_digest)}
    rollouts = ro.outputs["rollouts"]
    assert rollouts.path == "tiny/iter-000001/rollout/shard-00001-of-00002/rollouts.parquet"
    assert rollouts.rows == 4 * TINY.rollout.group_size  # tasks 1, 3, 5, 7 of 8
    assert rollouts.sha256 == sha256_of(store, rollouts.path)
    assert ro.mlflow_run_id not in ("", tg.mlflow_run_id)
    assert tracking.client().get_run(ro.mlflow_run_id).data.tags["mlflow.parentRunId"] == tg.facts(StartingPolicy).parent_run_id


def test_rerun_is_a_cache_hit(booted: Booted) -> None:
    store = booted.store
    first = run_stage("taskgen", TINY_RECIPE, booted.root, 2)
    files = [f"tiny/iter-000002/taskgen/{MANIFEST}", first.outputs["tasks"].path,
             f"tiny/bootstrap/{MANIFEST}", "tiny/bootstrap/checkpoint/model.safetensors"]
    before, runs = snapshot(store, files), run_count()
    versions = len(tracking.client().search_model_versions("name = 'tiny-policy'"))
    time.sleep(1.1)  # S3 LastModified has 1 s resolution: a rewrite would now show
    again = run_stage("taskgen", TINY_RECIPE, booted.root, 2)
    boot_again = run_stage("bootstrap", TINY_RECIPE, booted.root, 0)
    assert again == first
    assert boot_again == booted.boot
    assert snapshot(store, files) == before
    assert run_count() == runs
    assert len(tracking.client().search_model_versions("name = 'tiny-policy'")) == versions


def test_changed_stage_config_reruns(booted: Booted) -> None:
    store = booted.store
    first = run_stage("taskgen", TINY_RECIPE, booted.root, 3)
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["taskgen"]["tasks_per_iteration"] = 6
    changed = booted.tmp / "tiny-6-tasks.yaml"
    changed.write_text(yaml.safe_dump(data))
    runs = run_count()

    second = run_stage("taskgen", changed, booted.root, 3)
    assert second.config_digest == config_digest(load_recipe(changed), "taskgen") != first.config_digest
    assert second.outputs["tasks"].rows == 6 == store.read_table(second.outputs["tasks"].path).num_rows
    assert second.mlflow_run_id != first.mlflow_run_id
    assert run_count() == runs + 1
    assert read_manifest(store, "tiny/iter-000003/taskgen").config_digest == second.config_digest

    # A section taskgen does not depend on leaves its cache key alone.
    data["trainer"] = {"learning_rate": 0.5}
    unrelated = booted.tmp / "tiny-6-tasks-lr.yaml"
    unrelated.write_text(yaml.safe_dump(data))
    assert run_stage("taskgen", unrelated, booted.root, 3) == second
    assert run_count() == runs + 1


@pytest.mark.parametrize(("stage", "shard", "missing"), [("rollout", "0/2", "taskgen"), ("evaluation", None, "trainer")])
def test_stage_without_upstream_manifest_says_what_to_run(booted: Booted, stage: str, shard: str | None, missing: str) -> None:
    runs = run_count()
    # an iteration begun elsewhere (a library caller may run any iteration's stages): its upstream stage is the fix
    booted.store.write_bytes(f"tiny/iter-000007/{stage}-begun.txt", b"")
    with pytest.raises(UserError) as info:
        run_stage(stage, TINY_RECIPE, booted.root, 7, shard)
    err = info.value
    assert err.field == f"stage {missing}"
    assert err.value == booted.store.url(f"tiny/iter-000007/{missing}")
    assert "no manifested output for iteration 7" in err.problem
    assert err.fix == (f"run 'posttrain stage {missing} --iteration 7 --run-root {booted.store.uri}', with this run's "
                       "--recipe, first (or the whole iteration: 'posttrain run')")
    assert booted.store.glob(f"tiny/iter-000007/{stage}/**") == []
    assert run_count() == runs


@pytest.mark.parametrize(("stage", "shard"), [("rollout", "0/2"), ("evaluation", None)])
def test_a_stage_of_an_iteration_far_ahead_names_the_last_finished_one(booted: Booted, stage: str,
                                                                       shard: str | None) -> None:
    """The fix said to run the upstream stage of iteration 7, which is refused in turn
    while iteration 6 has not finished."""
    with pytest.raises(UserError) as info:
        run_stage(stage, TINY_RECIPE, booted.root, 77, shard)
    err = info.value
    assert (err.field, err.value) == ("--iteration", 77)
    assert err.problem == f"iteration 77 has not started in {booted.store.url('tiny')} (the last finished one is none)"
    assert err.fix == "pass --iteration 1 or lower, or let 'posttrain run' bring the pipeline there"
    assert booted.store.glob("tiny/iter-000077/**") == []


def test_missing_shard_is_named(booted: Booted) -> None:
    store = booted.store
    run_stage("taskgen", TINY_RECIPE, booted.root, 4)
    with pytest.raises(UserError) as info:
        run_stage("sandbox", TINY_RECIPE, booted.root, 4, "0/2")
    assert info.value.fix == (f"run 'posttrain stage rollout --iteration 4 --shard i/n --run-root {booted.store.uri}' "
                              "for each of the recipe's n shards i, with this run's --recipe, first (or the whole "
                              "iteration: 'posttrain run')")
    run_stage("rollout", TINY_RECIPE, booted.root, 4, "0/2")
    with pytest.raises(UserError) as info:
        run_stage("sandbox", TINY_RECIPE, booted.root, 4, "0/2")
    err = info.value
    assert err.field == "stage rollout"
    assert "only shards ['0/2'] of 2 are manifested" in err.problem
    assert err.fix == (f"run 'posttrain stage rollout --iteration 4 --shard S --run-root {booted.store.uri}', with "
                       "this run's --recipe, for each missing shard S in ['1/2'] first")
    assert not store.exists(f"tiny/iter-000004/sandbox/shard-00000-of-00002/{MANIFEST}")

    run_stage("rollout", TINY_RECIPE, booted.root, 4, "1/2")
    done = run_stage("sandbox", TINY_RECIPE, booted.root, 4, "0/2")
    assert set(done.inputs) == {"taskgen", "rollout[0/2]"}


@pytest.mark.parametrize("text", [" 0/2", "0/2 ", "+0/2", "0/+2", "1_0/20", "\u0663/5", "0/2/3", "0/", "/2", "a/b",
                                  "0-2", "0/1234567"])
def test_a_shard_is_two_ascii_numbers(text) -> None:
    """Before, int() took " 0", "+1", "1_0" and other scripts' digits."""
    from components.core.manifest import Shard

    with pytest.raises(UserError) as err:
        Shard.parse(text)
    assert err.value.field == "--shard" and "not of the form i/n" in str(err.value)


def test_a_shard_parses_and_names_its_folder() -> None:
    from components.core.manifest import Shard

    assert Shard.parse("1/2") == Shard(1, 2) and Shard.parse("1/2").folder == "shard-00001-of-00002"
    assert Shard.parse(None) == Shard.parse("") == Shard(0, 1)
    assert str(Shard.parse("007/10")) == "7/10"
    with pytest.raises(UserError, match="index out of range"):
        Shard.parse("2/2")


def _stored_manifest(tmp_path: Path, shard: str | None = "0/2", path: str = "demo/iter-000001/reward/r.parquet") -> Store:
    import json

    store = Store(str(tmp_path), "--run-root")
    m = Manifest(stage="reward", pipeline="demo", iteration=1, shard=shard, inputs={}, config_digest="c",
                 code_version="v", outputs={})
    data = m.to_json()
    data["outputs"] = {"rewards": {"path": path, "rows": 1, "sha256": "0" * 64, "size": 10}}
    store.write_bytes(f"demo/iter-000001/reward/{MANIFEST}", json.dumps(data).encode())
    return store


@pytest.mark.parametrize(("path", "problem"), [
    ("../../../../etc/passwd", "leaves the run root (or has an empty part)"),
    ("demo/iter-000001/../../../x", "leaves the run root (or has an empty part)"),
    ("demo//x", "leaves the run root (or has an empty part)"),
    ("demo/./x", "leaves the run root (or has an empty part)"),
    ("/etc/passwd", "is not a relative path"),
    ("", "is not a relative path"),
    ("demo\\x", "is not a relative path"),
    ("demo/x\ny", "holds a control character"),
])
def test_a_manifest_output_outside_the_run_root_is_refused_unread(tmp_path, path, problem) -> None:
    """An edited manifest's ``../../etc/passwd`` made replay open and measure that file (and
    one whose size and sha256 matched would have been parsed)."""
    store = _stored_manifest(tmp_path, path=path)
    with pytest.raises(UserError) as err:
        read_manifest(store, "demo/iter-000001/reward")
    assert err.value.field == "file" and err.value.fix == "delete it and re-run stage reward"
    assert f"outputs.rewards.path {path[:80]!r} {problem}" in err.value.problem


def test_a_stored_shard_out_of_range_names_the_manifest_not_the_flag(tmp_path) -> None:
    """It was ``--shard='5/2': index out of range`` from a command that has no --shard."""
    store = _stored_manifest(tmp_path, shard="5/2")
    with pytest.raises(UserError) as err:
        read_manifest(store, "demo/iter-000001/reward")
    assert err.value.field == "file" and "shard '5/2' is out of range (0 <= i < n)" in err.value.problem
    assert _stored_manifest(tmp_path, shard=None) and read_manifest(store, "demo/iter-000001/reward").shard is None


@pytest.mark.parametrize(("shard", "iteration", "stage"), [("1/2", 1, "reward"), (None, 2, "reward"), (None, 1, "rollout")])
def test_a_manifest_of_another_folder_is_refused(tmp_path, shard, iteration, stage) -> None:
    """A manifest whose stage, iteration or shard was edited (or that was copied from
    another folder) was taken as this folder's."""
    import json

    store = _stored_manifest(tmp_path, shard=None)
    rel = f"demo/iter-000001/reward/{MANIFEST}"
    data = json.loads(store.read_bytes(rel))
    store.write_bytes(rel, json.dumps({**data, "shard": shard, "iteration": iteration, "stage": stage}).encode())
    with pytest.raises(UserError) as err:
        read_manifest(store, "demo/iter-000001/reward")
    assert err.value.problem.endswith(", not of the folder it lies in") and err.value.fix == "delete it and re-run stage reward"


@pytest.mark.parametrize(("key", "value", "loc"), [
    ("promoted", "yes", "promoted"),
    ("promoted", 1, "promoted"),
    ("version", 3, "version"),
    ("pass_rates", {"math": "0.5"}, "pass_rates.math"),
])
def test_facts_are_read_with_the_types_they_were_written_with(key, value, loc) -> None:
    """pydantic's lax mode read an edited ``promoted: "yes"`` as true and ``"0.5"`` as a
    pass rate; a manifest's facts are JSON the stage wrote, so they must have its types."""
    from components.core.facts import Decision, to_json

    decision = Decision(version="3", pass_rates={"math": 0.5}, weakest_slice=None, promoted=False, reason="r",
                        baseline={"math": 0.25}, baseline_version="2", rule="statistical")
    m = Manifest(stage="evaluation", pipeline="demo", iteration=3, shard=None, inputs={}, config_digest="c",
                 code_version="v", info=to_json(decision))
    assert m.facts(Decision) == decision
    m.info[key] = value
    with pytest.raises(UserError) as err:
        m.facts(Decision)
    assert err.value.value == loc and err.value.fix == "re-run stage evaluation (delete its _MANIFEST.json to force it)"
    assert "its facts are not a Decision" in err.value.problem
