"""``dags.local.prepare`` after a run killed inside Airflow's first migration.

Airflow commits a fresh database's tables before it adds the log template row, so a
kill in between leaves a database that ``upgradedb`` alone never repairs; every DAG run
on it then fails with ``FOREIGN KEY constraint failed``. The first process below dies
(``os._exit``, no clean-up) exactly there; the second must leave the rows in place.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

KILLED_IN_MIGRATION = """
import os
from pathlib import Path
from airflow.utils import db
db.synchronize_log_template = lambda **_: os._exit(9)
from dags.local import prepare
prepare(Path(os.environ["POSTTRAIN_HOME"]), 3)
"""

PREPARE = """
import os
from pathlib import Path
from dags.local import prepare
prepare(Path(os.environ["POSTTRAIN_HOME"]), 3)
"""


def python(code: str, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "POSTTRAIN_"))}
    env.update(POSTTRAIN_HOME=str(home), PYTHONPATH=str(REPO), AIRFLOW_HOME=str(home / "airflow"))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=home.parent)


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


def test_a_run_killed_inside_the_first_migration_leaves_a_home_the_next_run_can_use(tmp_path: Path) -> None:
    home = tmp_path / ".posttrain"
    db = home / "airflow" / "airflow.db"
    killed = python(KILLED_IN_MIGRATION, home)
    assert killed.returncode == 9, killed.stderr[-3000:]
    assert not (home / "airflow" / ".migrated").exists()
    assert rows(db, "select count(*) from log_template") == [(0,)]  # the state the kill leaves

    again = python(PREPARE, home)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (home / "airflow" / ".migrated").read_text() == "ok\n"
    default_template = (  # the pinned Airflow's default
        "dag_id={{ ti.dag_id }}/run_id={{ ti.run_id }}/task_id={{ ti.task_id }}/"
        "{% if ti.map_index >= 0 %}map_index={{ ti.map_index }}/{% endif %}"
        "attempt={{ try_number|default(ti.try_number) }}.log"
    )
    assert rows(db, "select filename from log_template order by id desc limit 1") == [(default_template,)]
    assert rows(db, "select pool, slots from slot_pool order by pool") == [("default_pool", 128), ("posttrain_sandbox", 3)]


def test_a_damaged_or_deleted_airflow_database_is_made_anew(tmp_path: Path) -> None:
    """The ``.migrated`` marker said the migration was done, so every later run failed on
    the damaged file (``database disk image is malformed``, ``no such table: slot_pool``).
    A damaged one is set aside with a line saying so; a deleted one is simply made again."""
    home = tmp_path / ".posttrain"
    db = home / "airflow" / "airflow.db"
    assert python(PREPARE, home).returncode == 0
    whole = db.read_bytes()

    db.write_bytes(whole[: len(whole) // 2])
    cut = python(PREPARE, home)
    assert cut.returncode == 0, cut.stderr[-3000:]
    [aside] = [p for p in db.parent.iterdir() if p.name.startswith("airflow.db.damaged-")]
    assert aside.read_bytes() == whole[: len(whole) // 2]  # kept, not deleted
    line = f"the Airflow database {db} is cut short ({len(whole) // 2} bytes of the {len(whole)} its header counts); " \
           f"moved it to {aside.name} and made a new one"
    assert line in cut.stdout + cut.stderr
    assert rows(db, "select pool, slots from slot_pool order by pool") == [("default_pool", 128), ("posttrain_sandbox", 3)]

    db.unlink()
    deleted = python(PREPARE, home)
    assert deleted.returncode == 0, deleted.stderr[-3000:]
    assert "Airflow database" not in deleted.stdout + deleted.stderr  # nothing to set aside
    assert rows(db, "select pool, slots from slot_pool order by pool") == [("default_pool", 128), ("posttrain_sandbox", 3)]
