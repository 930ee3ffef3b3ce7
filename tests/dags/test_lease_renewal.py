"""A DAG stage task keeps its iteration's lease while the stage runs: the plan took it
for 6 hours, and one stage may run as long (the trainer's own limit)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from components.core import lease
from components.core.storage import Store


@pytest.mark.timeout(60)
def test_a_stage_task_renews_the_plans_lease(tmp_path: Path, monkeypatch) -> None:
    from dags.wiring import _lease_renewed

    monkeypatch.setattr(lease, "DEFAULT_TTL_S", 0.6)  # a beat every 0.1 s
    store = Store(f"file://{tmp_path}/store")
    taken = lease.acquire(store, "p", 3, "airflow:manual__1", ttl_s=0.5)
    plan = {"holder": "airflow:manual__1", "pipeline": "p", "iteration": 3, "run_root": store.uri}
    with _lease_renewed(plan):
        time.sleep(1.0)  # twice the lifetime the plan took it with
        cur = lease.current(store, "p", 3)
        assert cur.holder == "airflow:manual__1" and cur.live() and cur.generation > taken.generation
    after = lease.current(store, "p", 3).generation
    time.sleep(0.3)
    assert lease.current(store, "p", 3).generation == after  # renewing ends with the task


def test_a_plan_without_a_holder_renews_nothing(tmp_path: Path) -> None:
    from dags.wiring import _lease_renewed

    with _lease_renewed({"pipeline": "p", "iteration": 1, "run_root": f"file://{tmp_path}/store"}):
        pass
    assert not (tmp_path / "store").exists()
