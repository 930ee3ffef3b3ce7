"""The README's "Changing the DAG" examples, each done as a data engineer would and run.

1. Add a stage: a deduplication report between reward and validation, from a package of
   its own (one module plus one ``posttrain.stages`` entry point).
2. Change the schedule: ``POSTTRAIN_SCHEDULE``.
3. Widen the sandbox fan-out: ``sandbox.shards`` in the recipe.

Examples 1 and 3 share one real ``posttrain run`` of recipes/tiny.yaml (Airflow's
``dag.test()`` on SQLite) with both changes made.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny.yaml"

DEDUP_STAGE = '''"""Stage ``dedup``: how many completions of each group repeat an earlier one."""
from collections import Counter

from components.core.records import Rollout

SECTIONS = ()


def inputs(ctx):
    ctx.depend_on("reward")
    ctx.depend_on("rollout")


def run(ctx):
    rollouts = ctx.read_records("rollout", "rollouts", Rollout)
    groups = Counter((r.task_id, r.completion) for r in rollouts)
    repeats = sum(n - 1 for n in groups.values())
    ctx.write_json("report", {"rollouts": len(rollouts), "repeats": repeats})
    return {"repeats": float(repeats), "repeat_fraction": repeats / max(1, len(rollouts))}
'''
DEDUP_SPEC = '''from components.core.stages import StageSpec

DEDUP = StageSpec("dedup", "posttrain_dedup.stage", upstream=("reward",), before=("validation",), timeout_s=600)
'''


def plugin(root: Path) -> Path:
    """The data engineer's package: a stage module and its registry entry, installed."""
    pkg = root / "posttrain_dedup"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "stage.py").write_text(DEDUP_STAGE)
    (pkg / "spec.py").write_text(DEDUP_SPEC)
    info = root / "posttrain_dedup-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: posttrain-dedup\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[posttrain.stages]\ndedup = posttrain_dedup.spec:DEDUP\n")
    return root


def env_for(home: Path, extra_path: Path | None = None, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "POSTTRAIN_"))}
    env.update(POSTTRAIN_HOME=str(home), PYTHONUNBUFFERED="1", **more)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path or ""), str(REPO)) if p)
    return env


@pytest.fixture(scope="module")
def changed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One iteration of tiny with the dedup stage added and the sandbox 3 shards wide."""
    base = tmp_path_factory.mktemp("changed")
    recipe = yaml.safe_load(TINY.read_text())
    recipe["sandbox"]["shards"] = 3
    (base / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    home = base / ".posttrain"
    proc = subprocess.run([sys.executable, "-m", "components.cli", "run", "--recipe", str(base / "recipe.yaml"),
                           "--iterations", "1"], cwd=base, env=env_for(home, plugin(base / "site")),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return home


def _task_instances(home: Path) -> dict[str, tuple[str, str, str]]:
    db = sqlite3.connect(home / "airflow" / "airflow.db")
    rows = db.execute("select task_id || coalesce('#' || nullif(map_index, -1), ''), state, start_date, end_date "
                      "from task_instance").fetchall()
    return {name: (state, start, end) for name, state, start, end in rows}


def test_add_a_stage_between_reward_and_validation(changed_run: Path) -> None:
    tis = _task_instances(changed_run)
    assert tis["dedup"][0] == "success"
    assert max(tis[f"reward#{i}"][2] for i in range(2)) <= tis["dedup"][1]  # after every reward shard
    assert tis["dedup"][2] <= tis["validation"][1]  # and before validation
    iteration = changed_run / "store" / "tiny" / "iter-000001"
    manifest = json.loads((iteration / "dedup" / "_MANIFEST.json").read_text())
    report = json.loads((iteration / "dedup" / "report.json").read_text())
    assert report["rollouts"] == 8 * 4 and manifest["metrics"]["dedup/repeats"] == report["repeats"]
    assert sorted(manifest["inputs"]) == ["reward[0/2]", "reward[1/2]", "rollout[0/2]", "rollout[1/2]"]


def test_widen_the_sandbox_fan_out(changed_run: Path) -> None:
    tis = _task_instances(changed_run)
    assert sorted(k for k in tis if k.startswith("sandbox#")) == ["sandbox#0", "sandbox#1", "sandbox#2"]
    assert sorted(k for k in tis if k.startswith(("rollout#", "reward#"))) == ["reward#0", "reward#1", "rollout#0",
                                                                               "rollout#1"]
    iteration = changed_run / "store" / "tiny" / "iter-000001"
    executions = [row for i in range(3) for row in
                  pq.read_table(iteration / f"sandbox/shard-{i:05d}-of-00003/executions.parquet").to_pylist()]
    rollouts = [row for i in range(2) for row in
                pq.read_table(iteration / f"rollout/shard-{i:05d}-of-00002/rollouts.parquet").to_pylist()]
    rewards = [row for i in range(2) for row in
               pq.read_table(iteration / f"reward/shard-{i:05d}-of-00002/rewards.parquet").to_pylist()]
    code = sorted(r["rollout_id"] for r in rollouts if r["domain"] == "code")
    assert sorted(e["rollout_id"] for e in executions) == code  # each executable rollout exactly once
    assert sorted(r["rollout_id"] for r in rewards) == sorted(r["rollout_id"] for r in rollouts)
    assert all(r["status"] == "ok" for r in rewards)  # every reward found its execution across the re-sharding


DAG_SHAPE = """
import json
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=%r)
dag = bag.dags.get("post_training_iteration")
schedule = None if dag is None else dag.schedule
print(json.dumps({"errors": [str(v) for v in bag.import_errors.values()],
                  "schedule": schedule if schedule is None or isinstance(schedule, str) else type(schedule).__name__,
                  "timetable": None if dag is None else type(dag.timetable).__name__,
                  "assets": [schedule.name] if type(schedule).__name__ == "Asset" else [],
                  "trainer_timeout_s": None if dag is None else dag.get_task("trainer").execution_timeout.total_seconds()}))
"""


@pytest.mark.parametrize(("value", "schedule", "timetable", "assets"), [
    ("", None, "NullTimetable", []),
    ("0 2 * * *", "0 2 * * *", "CronTriggerTimetable", []),
    ("@daily", "@daily", "CronTriggerTimetable", []),
    ("@continuous", "@continuous", "ContinuousTimetable", []),
    ("asset:champion", "Asset", "AssetTriggeredTimetable", ["posttrain-policy-champion"]),
    ("asset:task-file", "Asset", "AssetTriggeredTimetable", ["posttrain-task-file"]),
])
def test_change_the_schedule(value: str, schedule: str | None, timetable: str, assets: list[str], tmp_path: Path) -> None:
    shape = _parse(tmp_path, value)
    assert shape["errors"] == []
    assert (shape["schedule"], shape["timetable"], shape["assets"]) == (schedule, timetable, assets)


def test_a_bad_schedule_is_an_import_error_that_names_the_fix(tmp_path: Path) -> None:
    shape = _parse(tmp_path, "every night")
    assert len(shape["errors"]) == 1
    assert "POSTTRAIN_SCHEDULE='every night': neither a cron expression, a preset nor one of" in shape["errors"][0]
    assert "e.g. '0 2 * * *', '@daily' or 'asset:champion'" in shape["errors"][0]


def test_the_recipe_sets_a_stage_time_limit(tmp_path: Path) -> None:
    assert _parse(tmp_path, "")["trainer_timeout_s"] == 6 * 3600  # the registry's
    recipe = tmp_path / "timed.yaml"
    recipe.write_text(TINY.read_text() + "timeouts: {trainer: 123}\n")
    assert _parse(tmp_path, "", POSTTRAIN_RECIPE=str(recipe))["trainer_timeout_s"] == 123


def _parse(tmp_path: Path, schedule: str, **more: str) -> dict:
    env = env_for(tmp_path / ".posttrain", AIRFLOW_HOME=str(tmp_path / "airflow"), AIRFLOW__CORE__LOAD_EXAMPLES="False",
                  POSTTRAIN_SCHEDULE=schedule, **more)
    proc = subprocess.run([sys.executable, "-c", DAG_SHAPE % str(REPO / "dags")], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
