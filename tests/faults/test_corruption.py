"""Nothing corrupt is used, nothing half-written is left: the stage contract under faults.

Real stages of recipes/tiny.yaml on a file:// run root (bootstrap once per module; each
test works in its own iteration). The faults are injected into the stored bytes (a
truncated Parquet file, one flipped byte in a checkpoint's weights), into the write path
(a disk that fills up half-way through a file) and into the process (a stage killed
between its data files and its manifest).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from components.core import storage, tracking
from components.core.errors import UserError
from components.core.manifest import MANIFEST, WEIGHTS, Manifest
from components.core.policy import load_policy
from components.core.recipe import load_recipe
from components.core.runner import run_stage
from components.core.stages import shard_count
from components.core.storage import Store
from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients, use_home
from tests.fixtures.runs import cli_env, posttrain, read_until

TINY = load_recipe(TINY_RECIPE)


@dataclass
class Booted:
    root: str
    store: Store
    boot: Manifest
    home: Path
    tmp: Path


@pytest.fixture(scope="module")
def booted(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("corruption")
    with pytest.MonkeyPatch.context() as mp:
        home = use_home(mp, base / ".posttrain")
        root = f"file://{base / 'store'}"
        boot = run_stage("bootstrap", TINY_RECIPE, root, 0)
        yield Booted(root=root, store=Store(root), boot=boot, home=home, tmp=base)
        reset_tracking_clients()


def local(booted: Booted, rel: str) -> Path:
    return Path(booted.store.root) / rel


def rollouts(booted: Booted, iteration: int) -> list[Manifest]:
    run_stage("taskgen", TINY_RECIPE, booted.root, iteration)
    n = shard_count(TINY, "rollout")
    return [run_stage("rollout", TINY_RECIPE, booted.root, iteration, f"{i}/{n}") for i in range(n)]


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_parquet_is_no_cache_hit(booted: Booted) -> None:
    first = rollouts(booted, 1)[0]
    rel = first.outputs["rollouts"].path
    truncate(local(booted, rel))
    with pytest.raises(UserError) as err:
        run_stage("rollout", TINY_RECIPE, booted.root, 1, first.shard)
    line = str(err.value)
    assert "\n" not in line
    assert booted.store.url(rel) in line and "truncated" in line
    assert f"{booted.store.url(first.prefix)}/{MANIFEST}" in line and "re-run stage rollout" in line
    # the fix it names works: without the manifest the stage runs again and writes whole files
    booted.store.delete(f"{first.prefix}/{MANIFEST}")
    again = run_stage("rollout", TINY_RECIPE, booted.root, 1, first.shard)
    assert again.outputs["rollouts"] == first.outputs["rollouts"]


def test_truncated_parquet_is_refused_when_read(booted: Booted) -> None:
    first = rollouts(booted, 2)[0]
    rel = first.outputs["rollouts"].path
    truncate(local(booted, rel))
    n = shard_count(TINY, "sandbox")
    with pytest.raises(UserError) as err:
        run_stage("sandbox", TINY_RECIPE, booted.root, 2, f"0/{n}")
    line = str(err.value)
    assert booted.store.url(rel) in line and "re-run stage rollout" in line and "\n" not in line
    assert not booted.store.glob("tiny/iter-000002/sandbox/**/_MANIFEST.json"), "the stage ran on bad data"


def test_another_record_type_under_a_matching_digest_is_refused_when_read(booted: Booted) -> None:
    """The tasks' Parquet file copied over a shard's rollouts, and the manifest's digest and
    size rewritten to match: the sandbox stage refuses it in one line naming the file, the
    missing column and the stage to re-run (a KeyError traceback, retried, before)."""
    import json

    from components.core.storage import sha256_bytes

    first = rollouts(booted, 6)[0]
    tasks = run_stage("taskgen", TINY_RECIPE, booted.root, 6)  # a cache hit: the iteration's tasks
    rel = first.outputs["rollouts"].path
    data = local(booted, tasks.outputs["tasks"].path).read_bytes()
    local(booted, rel).write_bytes(data)
    manifest_path = local(booted, f"{first.prefix}/{MANIFEST}")
    edited = json.loads(manifest_path.read_text())
    edited["outputs"]["rollouts"].update(sha256=sha256_bytes(data), size=len(data))
    manifest_path.write_text(json.dumps(edited))
    n = shard_count(TINY, "sandbox")
    with pytest.raises(UserError) as err:
        run_stage("sandbox", TINY_RECIPE, booted.root, 6, f"0/{n}")
    assert err.value.value == booted.store.url(rel)
    assert err.value.problem == ("output of stage rollout is not what it writes (no column 'rollout_id' of the "
                                 "Rollout layout (another record type, or an older layout))")
    assert err.value.fix.startswith(f"delete {booted.store.url(first.prefix)}/{MANIFEST} and re-run stage rollout")
    assert not booted.store.glob("tiny/iter-000006/sandbox/**/_MANIFEST.json"), "the stage ran on bad data"


def test_a_rollout_of_another_iterations_task_is_refused_when_joined(booted: Booted) -> None:
    """A shard's rollouts rewritten (manifest digest and size to match) so one names a
    task this iteration does not have: the sandbox and reward stages refuse it in one line
    naming the file, the record's task id and the stage to re-run (before: the sandbox
    stage dropped the rollout without a word, the reward stage raised KeyError)."""
    import dataclasses
    import json

    from components.core.records import Rollout, from_table, to_table
    from components.core.storage import sha256_bytes

    first = rollouts(booted, 7)[0]
    n = shard_count(TINY, "sandbox")
    for i in range(n):
        run_stage("sandbox", TINY_RECIPE, booted.root, 7, f"{i}/{n}")
    rel = first.outputs["rollouts"].path
    records = from_table(Rollout, booted.store.read_table(rel))
    records[0] = dataclasses.replace(records[0], task_id="math-of-another-run")
    data, _ = booted.store.write_table(rel, to_table(records))
    manifest_path = local(booted, f"{first.prefix}/{MANIFEST}")
    edited = json.loads(manifest_path.read_text())
    edited["outputs"]["rollouts"].update(sha256=sha256_bytes(data), size=len(data))
    manifest_path.write_text(json.dumps(edited))
    for stage in ("reward", "sandbox"):  # reward first: the sandbox stage, run again, leaves its shard unfinished
        shards = shard_count(TINY, stage)
        with pytest.raises(UserError) as err:
            run_stage(stage, TINY_RECIPE, booted.root, 7, f"0/{shards}")
        assert (err.value.field, err.value.value) == (f"{booted.store.url(rel)}: Rollout.task_id", "math-of-another-run")
        assert err.value.problem.startswith("names nothing in the records it goes with in iteration 7")
        assert err.value.fix.startswith(f"delete {booted.store.url(first.prefix)}/{MANIFEST} and re-run stage rollout")
    assert not booted.store.glob("tiny/iter-000007/reward/**/_MANIFEST.json"), "the stage ran on bad data"


def test_flipped_byte_in_checkpoint_is_refused_before_load(booted: Booted) -> None:
    copy = booted.tmp / "flipped"
    shutil.copytree(Path(booted.store.root), copy / "store")
    root = f"file://{copy / 'store'}"
    checkpoint = f"{root}/{booted.boot.outputs['checkpoint'].path}"
    load_policy(checkpoint)  # intact: loads
    weights = copy / "store" / booted.boot.outputs["checkpoint"].path / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[len(data) - 100] ^= 0x01  # inside a tensor: safetensors itself would load it without a word
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError) as err:
        load_policy(checkpoint)
    line = str(err.value)
    assert f"{checkpoint}/{WEIGHTS}" in line and "corrupt" in line and "re-run stage bootstrap" in line
    with pytest.raises(UserError, match="re-run stage bootstrap"):  # and it is no cache hit either
        run_stage("bootstrap", TINY_RECIPE, root, 0)


@pytest.mark.parametrize("how", ["copied", "manifest-edited"])
def test_a_flipped_byte_is_refused_where_the_manifest_is_of_another_place(how: str, booted: Booted) -> None:
    """A stage's folder copied out of its run root, or its manifest's iteration edited:
    the manifest no longer named its folder and the checkpoint loaded unchecked (a run
    trained on flipped weights with exit 0). Its files are still checked by name."""
    import json

    source = Path(booted.store.root) / booted.boot.prefix
    folder = booted.tmp / f"elsewhere-{how}"
    shutil.copytree(source, folder)
    if how == "manifest-edited":
        data = json.loads((folder / MANIFEST).read_text())
        (folder / MANIFEST).write_text(json.dumps(data | {"iteration": 7}))
    name = booted.boot.outputs["checkpoint"].path.rsplit("/", 1)[1]
    checkpoint = f"file://{folder}/{name}"
    load_policy(checkpoint)  # intact: loads
    weights = folder / name / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[len(data) - 100] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError) as err:
        load_policy(checkpoint)
    assert err.value.value == f"{checkpoint}/{WEIGHTS}" and "corrupt" in err.value.problem
    assert err.value.fix == (f"copy the checkpoint again with its {MANIFEST}, or delete file://{folder}/{MANIFEST} if "
                             "the files are what you want")


def test_an_edited_checkpoint_config_is_refused_before_load_and_is_no_cache_hit(booted: Booted) -> None:
    """Only the weights were digested: a config.json edited to 2 layers loaded with the rest
    of the model newly initialised, and rollout ran on it with exit 0; re-running bootstrap,
    as the refusal said, was a cache hit that kept the edit."""
    import json

    copy = booted.tmp / "edited"
    shutil.copytree(Path(booted.store.root), copy / "store")
    root = f"file://{copy / 'store'}"
    checkpoint = f"{root}/{booted.boot.outputs['checkpoint'].path}"
    config = copy / "store" / booted.boot.outputs["checkpoint"].path / "config.json"
    edited = json.loads(config.read_text()) | {"num_hidden_layers": 1}
    config.write_text(json.dumps(edited))
    with pytest.raises(UserError) as err:
        load_policy(checkpoint)
    assert err.value.value == f"{checkpoint}/config.json" and "re-run stage bootstrap" in err.value.fix
    with pytest.raises(UserError) as again:  # the fix it names: the manifest goes, not a cache hit
        run_stage("bootstrap", TINY_RECIPE, root, 0)
    assert again.value.value == f"{checkpoint}/config.json"
    assert again.value.fix.startswith(f"delete {root}/tiny/bootstrap/{MANIFEST} and re-run stage bootstrap")


def test_a_bootstrap_cache_hit_under_another_home_is_refused(booted: Booted, tmp_path: Path) -> None:
    """``posttrain stage bootstrap`` on a finished run root under another home was a cache
    hit registering nothing, so taskgen's "no champion yet; run bootstrap first" sent the
    user round in a loop. The hit now names the database in use."""
    with pytest.MonkeyPatch.context() as mp:
        other = use_home(mp, tmp_path / "other-home")
        try:
            with pytest.raises(UserError) as err:
                run_stage("bootstrap", TINY_RECIPE, booted.root, 0)
        finally:
            reset_tracking_clients()
    assert (err.value.field, err.value.value) == ("run_root", booted.root)
    assert err.value.problem == ("was bootstrapped under another MLflow tracking database: the one in use "
                                 f"(sqlite:///{other / 'mlflow.db'}) has no 'tiny-policy'")
    assert run_stage("bootstrap", TINY_RECIPE, booted.root, 0).content_digest == booted.boot.content_digest


def test_disk_full_mid_write_leaves_no_temporary_file(booted: Booted, monkeypatch: pytest.MonkeyPatch) -> None:
    real = storage._write_local

    def half_then_full(path: str, data: bytes) -> None:
        if "/taskgen/" not in path:  # the store's reachability probe, the MLflow side: unaffected
            return real(path, data)
        with open(path, "wb") as fh:
            fh.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", path)

    prefix = local(booted, "tiny/iter-000003/taskgen")
    prefix.mkdir(parents=True)
    (prefix / "tasks.parquet.tmp-0badf00d").write_bytes(b"left by a killed write")
    monkeypatch.setattr(storage, "_write_local", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        run_stage("taskgen", TINY_RECIPE, booted.root, 3)
    assert not list(prefix.rglob("*.tmp-*")), "a failed write left its temporary file"
    assert not (prefix / MANIFEST).exists()
    monkeypatch.setattr(storage, "_write_local", real)
    (prefix / "tasks.parquet.tmp-0badf00d").write_bytes(b"left by a killed write")
    run_stage("taskgen", TINY_RECIPE, booted.root, 3)
    assert (prefix / MANIFEST).exists() and not list(prefix.rglob("*.tmp-*"))


def stage_runs(stage: str, iteration: int, root: str) -> list:
    from mlflow.entities import ViewType

    c = tracking.client()
    flt = (f"tags.`{tracking.TAG_STAGE}` = '{stage}' and tags.`{tracking.TAG_ITERATION}` = '{iteration}' "
           f"and tags.`{tracking.TAG_RUN_ROOT}` = '{root}'")
    return c.search_runs([tracking.experiment_id("tiny")], filter_string=flt, run_view_type=ViewType.ALL,
                         order_by=["attributes.start_time ASC"])


def test_killed_attempt_is_marked_killed_and_finished_means_manifested(booted: Booted, tmp_path: Path) -> None:
    """A ``posttrain stage`` process killed mid-stage leaves its MLflow run RUNNING; the
    next attempt of that stage (and shard) marks it KILLED. A rollout shard, whose
    taskgen this test runs first (``posttrain stage taskgen`` itself refuses an iteration
    whose predecessor has not finished)."""
    prefix = "tiny/iter-000004/rollout/shard-00000-of-00002"
    run_stage("taskgen", TINY_RECIPE, booted.root, 4)
    env = cli_env(booted.home, POSTTRAIN_FAILPOINT="before-manifest:rollout[0/2]")
    proc = subprocess.Popen(posttrain("stage", "rollout", "--recipe", str(TINY_RECIPE), "--run-root", booted.root,
                                      "--iteration", "4", "--shard", "0/2"), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        read_until(proc.stdout, "failpoint before-manifest:rollout[0/2] reached", [])
        [attempt] = stage_runs("rollout", 4, booted.store.uri)
        assert attempt.info.status == "RUNNING" and not booted.store.exists(f"{prefix}/{MANIFEST}")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert tracking.client().get_run(attempt.info.run_id).info.status == "RUNNING", "a killed process ends nothing"

    manifest = run_stage("rollout", TINY_RECIPE, booted.root, 4, "0/2")
    runs = {r.info.run_id: r.info.status for r in stage_runs("rollout", 4, booted.store.uri)}
    assert runs == {attempt.info.run_id: "KILLED", manifest.mlflow_run_id: "FINISHED"}
    assert booted.store.exists(f"{prefix}/{MANIFEST}")


def test_run_is_finished_only_after_its_manifest(booted: Booted, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, bool] = {}
    real = tracking.client().set_terminated

    def spy(run_id: str, status: str | None = None, *args, **kwargs):
        if status == "FINISHED":
            seen[run_id] = booted.store.exists(f"tiny/iter-000005/taskgen/{MANIFEST}")
        return real(run_id, status, *args, **kwargs)

    monkeypatch.setattr(tracking.client(), "set_terminated", spy)
    manifest = run_stage("taskgen", TINY_RECIPE, booted.root, 5)
    assert seen == {manifest.mlflow_run_id: True}
