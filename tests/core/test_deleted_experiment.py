"""A pipeline's experiment deleted in the MLflow UI (``components.core.tracking``), on the
embedded SQLite tracking store: MLflow keeps the name and makes no run in it, which was
a raw ``MlflowException`` traceback from ``create_run`` ("must be in the 'active' state").
Now one line naming the experiment and how to restore or purge it; restored, it is used
again."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core import tracking
from components.core.errors import UserError

ROOT = "file:///runs/root"


def test_a_deleted_experiment_is_named_with_its_restore(posttrain_home: Path) -> None:
    c = tracking.client()
    exp = tracking.experiment_id("gone")
    before = tracking.pipeline_run("gone", ROOT)
    c.delete_experiment(exp)
    uri = tracking.tracking_uri()
    assert uri == f"sqlite:///{posttrain_home / 'mlflow.db'}"
    for use in (lambda: tracking.experiment_id("gone"), lambda: tracking.pipeline_run("gone", ROOT),
                lambda: tracking.iteration_run("gone", 1, ROOT, "manual__1")):
        with pytest.raises(UserError) as err:
            use()
        assert err.value.line() == (
            f"MLflow experiment='gone': is deleted (experiment id {exp} at {uri}), and MLflow makes no runs in a "
            f"deleted experiment; fix: restore it (MLFLOW_TRACKING_URI={uri} mlflow experiments restore "
            f"--experiment-id {exp}), or purge it so that a new one is made (MLFLOW_TRACKING_URI={uri} mlflow gc "
            f"--backend-store-uri {uri} --experiment-ids {exp}), then run again")
    c.restore_experiment(exp)
    assert tracking.experiment_id("gone") == exp
    assert tracking.pipeline_run("gone", ROOT) == before


def test_a_purged_experiment_is_made_anew(posttrain_home: Path) -> None:
    """The fix's other way, run as written: ``mlflow gc`` with the experiment's id."""
    import os
    import subprocess
    import sys

    c = tracking.client()
    exp = tracking.experiment_id("purged")
    tracking.pipeline_run("purged", ROOT)
    c.delete_experiment(exp)
    uri = tracking.tracking_uri()
    gc = subprocess.run([sys.executable, "-m", "mlflow", "gc", "--backend-store-uri", uri, "--experiment-ids", exp],
                        env={**os.environ, "MLFLOW_TRACKING_URI": uri}, capture_output=True, text=True, timeout=120)
    assert gc.returncode == 0, gc.stderr[-2000:]
    again = tracking.experiment_id("purged")  # SQLite may give it the purged one's id again
    assert c.get_experiment(again).lifecycle_stage == "active" and c.search_runs([again]) == []
    assert c.get_run(tracking.pipeline_run("purged", ROOT)).info.experiment_id == again
