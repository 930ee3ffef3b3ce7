"""Promotion is idempotent: an evaluation killed after it moved the champion alias and
before its manifest, then run again, gives the same report and aliases as an
uninterrupted run (it does not compare the candidate with itself).

A real ``posttrain run`` of one tiny iteration in a subprocess: once undisturbed (shared
by the module), once held at the runner's failpoint ``before-manifest:evaluation`` (data
files written, the alias already moved), SIGKILLed, and run again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from components.core.facts import StartingPolicy
from components.core.manifest import Manifest
from components.core.storage import Store
from tests.fixtures.runs import TINY, cli_env, posttrain, read_until, registry_versions, run_posttrain

pytestmark = pytest.mark.slow

REPORT = "tiny/iter-000001/evaluation/report.json"


@dataclass(frozen=True)
class Finished:
    home: Path
    store: Store


def aliases(home: Path) -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{home / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    return {k: str(v) for k, v in client.get_registered_model("tiny-policy").aliases.items()}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    tmp = tmp_path_factory.mktemp("promotion-undisturbed")
    home = tmp / ".posttrain"
    proc = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "1"], tmp, cli_env(home))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Finished(home, Store(f"file://{home / 'store'}"))


def test_the_baseline_is_fixed_in_taskgen_before_any_alias_moves(undisturbed: Finished) -> None:
    taskgen = Manifest.from_json(json.loads(undisturbed.store.read_bytes("tiny/iter-000001/taskgen/_MANIFEST.json")))
    start = taskgen.facts(StartingPolicy)
    assert (start.policy_version, start.baseline_version) == ("1", "1")
    report = json.loads(undisturbed.store.read_bytes(REPORT))
    assert (report["candidate"], report["baseline"]) == ("2", "1")
    assert report["baseline_pass_rates"] == start.baseline_pass_rates


def test_evaluation_killed_after_promoting_reruns_to_the_same_report(undisturbed: Finished, tmp_path: Path) -> None:
    home = tmp_path / ".posttrain"
    store = Store(f"file://{home / 'store'}")
    env = cli_env(home, POSTTRAIN_FAILPOINT="before-manifest:evaluation")
    proc = subprocess.Popen(posttrain("run", "--recipe", str(TINY), "--iterations", "1"), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        read_until(proc.stdout, "failpoint before-manifest:evaluation reached", [])
        assert store.exists(REPORT) and not store.exists("tiny/iter-000001/evaluation/_MANIFEST.json")
        assert aliases(home)["champion"] == "2", "the alias moves before the manifest: the hazard under test"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    rerun = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "1"], tmp_path, cli_env(home))
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "| evaluation | cache hit" not in rerun.stdout  # it ran again
    assert json.loads(store.read_bytes(REPORT)) == json.loads(undisturbed.store.read_bytes(REPORT))
    assert store.read_bytes(REPORT) == undisturbed.store.read_bytes(REPORT)
    assert aliases(home) == aliases(undisturbed.home)
    assert {v: s.replace(str(home), "") for v, s in registry_versions(home).items()} == \
        {v: s.replace(str(undisturbed.home), "") for v, s in registry_versions(undisturbed.home).items()}


def test_taskgen_rerun_under_another_task_count_keeps_the_iterations_start(undisturbed: Finished, tmp_path: Path) -> None:
    """Last in this module: it re-runs the shared run's taskgen. Iteration 1 promoted its
    candidate (version 2); a re-run of its taskgen under a changed taskgen setting resolved
    "champion" again and started iteration 1 from its own candidate, with that as its
    baseline. Only a changed ``rollout.policy`` resolves the start again."""
    import yaml

    recipe = yaml.safe_load(TINY.read_text())
    recipe["taskgen"]["tasks_per_iteration"] += 2
    changed = tmp_path / "tiny-more-tasks.yaml"
    changed.write_text(yaml.safe_dump(recipe))
    assert aliases(undisturbed.home)["champion"] == "2"
    rerun = run_posttrain(["stage", "taskgen", "--recipe", str(changed), "--run-root", undisturbed.store.uri,
                           "--iteration", "1"], tmp_path, cli_env(undisturbed.home))
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    taskgen = Manifest.from_json(json.loads(undisturbed.store.read_bytes("tiny/iter-000001/taskgen/_MANIFEST.json")))
    start = taskgen.facts(StartingPolicy)
    assert (start.policy_version, start.baseline_version, start.policy_spec) == ("1", "1", "champion")
