"""``posttrain run`` with its run root on S3 (the SeaweedFS test server), as a user starts it.

One undisturbed run of two iterations (bootstrap included) is shared by the module: the
first test checks what it left in the store and in the MLflow registry; the second kills
another run in the middle of the trainer, resumes it, and compares its outputs with the
undisturbed run's.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from components.core import lease
from components.core.storage import Store
from tests.fixtures.runs import (
    TINY,
    TINY_STAGES_PER_ITERATION,
    cli_env,
    manifests,
    outputs_by_stage,
    posttrain,
    read_until,
    registry_versions,
    rollout_ids,
    run_posttrain,
    task_instances,
)
from tests.fixtures.s3 import S3Server, unique_prefix


@dataclass(frozen=True)
class Finished:
    home: Path
    run_root: str
    stdout: str


def s3_cli_env(server: S3Server, home: Path, run_root: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in cli_env(home, **extra).items() if not k.startswith("AWS_")}
    return {**env, **server.env(), "POSTTRAIN_RUN_ROOT": run_root}


@pytest.fixture(scope="module")
def two_iterations(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Finished:
    """``posttrain run --iterations 2`` with POSTTRAIN_RUN_ROOT on S3, undisturbed."""
    tmp = tmp_path_factory.mktemp("s3-e2e")
    home = tmp / ".posttrain"
    run_root = f"s3://{s3_server.bucket}/{unique_prefix('e2e-two-iterations')}"
    proc = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "2"], tmp, s3_cli_env(s3_server, home, run_root))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Finished(home, run_root, proc.stdout)


def test_two_iterations_with_the_run_root_on_s3(two_iterations: Finished, s3_env: S3Server) -> None:
    home, root = two_iterations.home, two_iterations.run_root
    out = two_iterations.stdout
    assert f"iter 1 | starting | run root {root}\n" in out
    assert f"iter 2 | starting | run root {root} | 1 finished\n" in out
    for k in (1, 2):
        for line in ("| taskgen |", "| rollout[0/2] |", "| sandbox[1/2] |", "| reward[0/2] |", "| validation |",
                     "| trainer |", "| evaluation |"):
            assert f"iter {k} {line}" in out, f"missing progress line 'iter {k} {line}'"
    assert "iter 0 | bootstrap | cache hit" in out  # bootstrap ran once, in the first DAG run
    assert not (home / "store").exists(), "nothing may land in the local default store"

    store = Store(root)
    found = manifests(store)
    assert sorted(found) == sorted(["tiny/bootstrap/_MANIFEST.json"] + [
        f"tiny/iter-{k:06d}/{stage}/_MANIFEST.json" for k in (1, 2) for stage in
        ("taskgen", *(f"{s}/shard-{i:05d}-of-00002" for s in ("rollout", "sandbox", "reward") for i in (0, 1)),
         "validation", "trainer", "evaluation")])
    assert len(found) == 1 + 2 * TINY_STAGES_PER_ITERATION
    for rel, data in found.items():  # every output a manifest lists is in S3 with that sha256
        for name, meta in json.loads(data)["outputs"].items():
            if name != "checkpoint":
                got = hashlib.sha256(store.read_bytes(meta["path"])).hexdigest()
                assert got == meta["sha256"], f"{rel}: {name} differs from its manifest"

    checkpoints = {1: f"{root}/tiny/bootstrap/checkpoint", 2: f"{root}/tiny/iter-000001/trainer/checkpoint",
                   3: f"{root}/tiny/iter-000002/trainer/checkpoint"}
    assert registry_versions(home) == checkpoints  # the registry points at S3, no second copy
    for version, uri in checkpoints.items():
        rel = uri[len(root) + 1:]
        assert json.loads(store.read_bytes(f"{rel}/config.json"))["model_type"] == "llama"
        assert store.exists(f"{rel}/model.safetensors"), f"version {version}: no weights at {uri}"
    trainer = json.loads(found["tiny/iter-000002/trainer/_MANIFEST.json"])
    assert trainer["info"]["checkpoint_uri"] == checkpoints[3]
    assert trainer["info"]["version"] == "3" and trainer["info"]["parent_version"] == "2"
    weights = hashlib.sha256(store.read_bytes("tiny/iter-000002/trainer/checkpoint/model.safetensors")).hexdigest()
    assert trainer["outputs"]["checkpoint"]["sha256"] == weights

    for k in (1, 2):
        report = json.loads(store.read_bytes(f"tiny/iter-{k:06d}/evaluation/report.json"))
        assert (report["candidate"], report["baseline"]) == (str(k + 1), str(k))
        assert store.read_json(f"tiny/iter-{k:06d}/recipe.json")["pipeline"] == "tiny"  # the planner's snapshot
    assert lease.held_by(store, "tiny", f"local:{home}") == [2, 1]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    assert str(client.get_model_version_by_alias("tiny-policy", "candidate").version) == "3"
    assert str(client.get_model_version_by_alias("tiny-policy", "champion").version) == "3"  # both promoted
    parents = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                                 filter_string="tags.`posttrain.stage` = 'iteration'")
    assert sorted((r.data.tags["posttrain.iteration"], r.data.tags["posttrain.run_root"]) for r in parents) == \
        [("1", root), ("2", root)]
    runs = task_instances(home)
    assert len(runs) == 2 and all(state == "success" or name == "announce_champion"
                                  for tis in runs.values() for name, (state, _) in tis.items())


def test_killed_run_on_s3_resumes_without_redoing_finished_stages(two_iterations: Finished, s3_env: S3Server,
                                                                  tmp_path: Path) -> None:
    """SIGKILL in the middle of iteration 1's trainer (checkpoint in S3, no manifest); the
    rerun finishes, rewrites no manifest, duplicates nothing, registers no second version,
    and its outputs are byte for byte those of the undisturbed run (the sandbox's
    executions: all but the time and memory measured)."""
    home = tmp_path / ".posttrain"
    root = f"s3://{s3_env.bucket}/{unique_prefix('e2e-killed')}"
    store = Store(root)
    env = s3_cli_env(s3_env, home, root, POSTTRAIN_FAILPOINT="before-manifest:trainer")
    proc = subprocess.Popen(posttrain("run", "--recipe", str(TINY), "--iterations", "1"), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        read_until(proc.stdout, "failpoint before-manifest:trainer reached", [])
        assert store.exists("tiny/iter-000001/trainer/checkpoint/model.safetensors")
        assert not store.exists("tiny/iter-000001/trainer/_MANIFEST.json")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    before = manifests(store)
    assert len(before) == 1 + TINY_STAGES_PER_ITERATION - 2  # bootstrap, and all of iteration 1 but trainer, evaluation
    assert registry_versions(home) == {1: f"{root}/tiny/bootstrap/checkpoint",
                                       2: f"{root}/tiny/iter-000001/trainer/checkpoint"}

    rerun = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "1"], tmp_path, s3_cli_env(s3_env, home, root))
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    after = manifests(store)
    for rel, data in before.items():
        assert after[rel] == data, f"{rel} was rewritten"
    assert sorted(set(after) - set(before)) == ["tiny/iter-000001/evaluation/_MANIFEST.json",
                                                "tiny/iter-000001/trainer/_MANIFEST.json"]
    assert rerun.stdout.count("cache hit") == len(before)
    ids = rollout_ids(store, 1)
    assert len(ids) == len(set(ids)) == 8 * 4  # tasks_per_iteration x group_size, no duplicates
    assert registry_versions(home) == {1: f"{root}/tiny/bootstrap/checkpoint",
                                       2: f"{root}/tiny/iter-000001/trainer/checkpoint"}, \
        "a retried trainer must not register a second checkpoint"
    resumed, undisturbed = outputs_by_stage(store, 1), outputs_by_stage(Store(two_iterations.run_root), 1)
    assert len(resumed) == TINY_STAGES_PER_ITERATION
    assert resumed == undisturbed  # byte for byte (the sandbox's executions: but for the measured columns)
