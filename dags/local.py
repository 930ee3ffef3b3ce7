"""Run the DAG on the embedded defaults: Airflow's in-process test runner.

``prepare`` points Airflow at a SQLite home under ``POSTTRAIN_HOME`` (migrated once) and
sizes the sandbox pool; ``run_iteration`` calls ``dag.test()`` once with the recipe,
run root and iteration as the run's params and returns the DAG run's state. Which
iterations to run (and skipping finished ones) is ``orchestrate.run_local``'s job; a
half-done iteration resumes because every stage with a matching manifest is a cache hit.

Not covered: a scheduler or web server; for those run ``airflow standalone`` with this
folder as the DAGs folder (``.airflowignore`` keeps this module out of DAG parsing).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def airflow_env(home: Path) -> dict[str, str]:
    env = {
        "AIRFLOW_HOME": str(home / "airflow"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(Path(__file__).resolve().parent),
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": os.environ.get("AIRFLOW__LOGGING__LOGGING_LEVEL", "WARNING"),
    }
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return {k: os.environ[k] for k in env}


def prepare(home: Path, sandbox_slots: int) -> None:
    """Migrate the SQLite metadata DB (once) and size the sandbox pool."""
    env = {**os.environ, **airflow_env(home)}
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    marker = Path(env["AIRFLOW_HOME"]) / ".migrated"
    airflow = [sys.executable, "-m", "airflow"]
    if not marker.exists():
        subprocess.run([*airflow, "db", "migrate"], env=env, check=True, capture_output=True)
        marker.write_text("ok\n")
    subprocess.run([*airflow, "pools", "set", "posttrain_sandbox", str(sandbox_slots), "caps concurrent sandbox tasks"],
                   env=env, check=True, capture_output=True)


def run_iteration(recipe_path: str, run_root: str, holder: str) -> str:
    """One ``dag.test()`` run for the iteration ``holder`` has leased (its plan task finds
    it); returns the DAG run's final state."""
    from dags.post_training_iteration import iteration_dag

    dr = iteration_dag.test(run_conf={"recipe": recipe_path, "run_root": run_root, "holder": holder})
    return str(getattr(dr, "state", "unknown"))
