"""The DAG under a real Airflow: scheduler (LocalExecutor), DAG processor and API server
as processes (``tests/fixtures/airflow.py``), on ``recipes/tiny.yaml``.

One test, in the order an operator lives it: the DAG is unpaused with ``@continuous``;
two runs start by themselves with no conf and finish iterations 1 and 2, their shards in
parallel; the third run's trainer meets a corrupted (truncated) optimizer state, fails
at once and fails the run, and the DAG pauses itself (one failed run is the limit here);
the file is restored, the failed tasks are cleared through the REST API, and the same
run finishes the same iteration without redoing a manifested stage, duplicating a
rollout or registering a second version.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from components.core import lease
from components.core.context import read_manifest
from components.core.facts import StartingPolicy
from components.core.manifest import stage_prefix
from components.core.models import checkpoint_of
from components.core.storage import Store
from dags.local import DAG_ID

PIPELINE = "tiny"
ROLLOUTS_PER_ITERATION = 8 * 4  # tiny: tasks_per_iteration x group_size
RUN_TIMEOUT_S = 240.0


def _evaluated(run_root: Path, k: int) -> bool:
    return (run_root / stage_prefix(PIPELINE, k, "evaluation") / "_MANIFEST.json").exists()


def _overlap(a, b) -> float:
    """Seconds two task instances ran at the same time (negative: apart)."""
    return min(a.end, b.end) - max(a.start, b.start)


def _rollout_ids(run_root: Path, k: int) -> list[str]:
    ids = []
    for part in sorted((run_root / stage_prefix(PIPELINE, k, "rollout")).glob("shard-*/rollouts.parquet")):
        ids += pq.read_table(part, columns=["rollout_id"]).column("rollout_id").to_pylist()
    return ids


def test_scheduled_runs_then_a_failed_run_cleared_and_rerun(local_airflow):
    # One failed run pauses the DAG (else @continuous would start the next at once); a retry waits 1 s, not 10.
    af = local_airflow(schedule="@continuous", AIRFLOW__CORE__MAX_CONSECUTIVE_FAILED_DAG_RUNS_PER_DAG="1",
                       POSTTRAIN_RETRY_DELAY_S="1")
    store = Store(str(af.run_root), "run_root")
    af.set_paused(False)

    # 1. Two runs start by themselves, with no conf, and finish iterations 1 and 2.
    af.wait("two successful scheduled runs", lambda: sum(r["state"] == "success" for r in af.runs()) >= 2,
            timeout=2 * RUN_TIMEOUT_S)
    first, second = af.runs()[:2]
    for k, run in enumerate((first, second), start=1):
        assert (run["state"], run["run_type"], run["conf"] or {}) == ("success", "scheduled", {})
        assert int(af.xcom(run["dag_run_id"], "plan", "iteration")) == k
        assert _evaluated(af.run_root, k)
        assert lease.current(store, PIPELINE, k).holder == f"airflow:{run['dag_run_id']}"
        # Mapped shards ran side by side: their task instances overlap in the Airflow DB.
        # (Every try counts: two shards logging the same MLflow input at once can lose
        # MLflow's check-then-insert race, and Airflow retries the loser.)
        rows = af.task_rows(run["dag_run_id"])
        assert {r.state for r in rows.values()} == {"success"}, rows
        for stage in ("rollout", "sandbox"):
            a, b = (af.attempts(run["dag_run_id"], stage, i) for i in (0, 1))
            assert max(_overlap(x, y) for x in a for y in b) > 0, f"{stage} shards of run {k} ran one after the other: {a} {b}"

    # 2. The third run (started by @continuous as the second ended) starts from the champion,
    #    whose optimizer state we now truncate; only the trainer reads that file.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=af.mlflow_uri)
    champion = client.get_model_version_by_alias(f"{PIPELINE}-policy", "champion")
    state_file = Path(checkpoint_of(champion).removeprefix("file://")) / "trainer_state.pt"
    good = state_file.read_bytes()
    state_file.write_bytes(good[: len(good) // 2])
    runs = af.runs()
    assert len(runs) == 2 or af.task_rows(runs[2]["dag_run_id"])[("trainer", -1)].state is None, \
        "the third run's trainer was scheduled before the fault was in place"
    af.wait("the third run's taskgen", lambda: read_manifest(store, stage_prefix(PIPELINE, 3, "taskgen")) is not None,
            timeout=RUN_TIMEOUT_S)
    third_id = af.runs()[2]["dag_run_id"]
    assert read_manifest(store, stage_prefix(PIPELINE, 3, "taskgen")).facts(StartingPolicy).policy_uri == checkpoint_of(champion)

    failed = af.wait("the third run to fail", lambda: (r := af.runs()[2])["state"] == "failed" and r, timeout=RUN_TIMEOUT_S)
    rows = af.task_rows(third_id)
    assert (rows[("trainer", -1)].state, rows[("trainer", -1)].try_number) == ("failed", 1)  # a user error: no retry
    assert rows[("evaluation", -1)].state == "upstream_failed"
    assert rows[("rollout", 0)].state == rows[("validation", -1)].state == "success"
    assert af.api("GET", f"/dags/{DAG_ID}")["is_paused"], "the DAG did not pause after a failed run"
    assert len(af.runs()) == 3
    af.wait("the failed run to hand its lease back", lambda: lease.current(store, PIPELINE, 3).holder == "", timeout=60)
    parent = af.xcom(third_id, "plan", "mlflow_run_id")
    assert "trainer_state" in client.get_run(parent).data.tags["posttrain.failed.trainer"]
    manifests = {p: p.read_bytes() for p in af.run_root.rglob("_MANIFEST.json")}
    tries = {key: row.try_number for key, row in rows.items()}

    # 3. Restore the file, clear the failed tasks through the REST API, unpause: the same run finishes.
    state_file.write_bytes(good)
    cleared = af.api("POST", f"/dags/{DAG_ID}/clearTaskInstances", {
        "dry_run": False, "dag_run_id": third_id, "only_failed": True, "include_downstream": True,
        "reset_dag_runs": True})
    assert sorted(t["task_id"] for t in cleared["task_instances"]) == ["announce_champion", "evaluation", "trainer"]
    af.set_paused(False)
    af.wait("the cleared run to succeed", lambda: af.runs()[2]["state"] == "success", timeout=RUN_TIMEOUT_S)
    af.set_paused(True)  # a fourth run may have started: it is not part of this test
    assert failed["dag_run_id"] == third_id
    rows = af.task_rows(third_id)
    assert (rows[("trainer", -1)].state, rows[("trainer", -1)].try_number) == ("success", 2)
    rerun = {("trainer", -1), ("evaluation", -1), ("announce_champion", -1)}
    assert {key: row.try_number for key, row in rows.items() if key not in rerun} == \
        {key: n for key, n in tries.items() if key not in rerun}, "the clear re-ran tasks that had succeeded"
    assert int(af.xcom(third_id, "plan", "iteration")) == 3 and _evaluated(af.run_root, 3)
    for path, data in manifests.items():
        assert path.read_bytes() == data, f"{path} was rewritten by the re-run"

    # No rollout twice, and one registry version per trained checkpoint (v1 is bootstrap's).
    ids = [i for k in (1, 2, 3) for i in _rollout_ids(af.run_root, k)]
    assert len(ids) == len(set(ids)) == 3 * ROLLOUTS_PER_ITERATION
    versions = {int(v.version): v.tags.get("posttrain.iteration") for v in client.search_model_versions(f"name = '{PIPELINE}-policy'")}
    assert versions == {1: "0", 2: "1", 3: "2", 4: "3"}, json.dumps(versions)

    # Every process the fixture started stops (the fixture checks again at teardown).
    af.af.stop()
    assert af.af.leftovers() == []
