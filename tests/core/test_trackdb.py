"""The embedded SQLite tracking database is whole or absent (``components.core.trackdb``).

- A process SIGKILLed while MLflow creates the schema leaves no database at the path, and
  the next client creates a complete one (before, the half-created file failed every
  later open with ``table ... already exists``). The same kill of a whole first
  ``posttrain run``, resumed to the end, is in ``tests/faults/test_kills.py``.
- Two processes creating the same database at once both succeed on one database.
- Only ``sqlite:///`` file URIs are handled; an existing file is left as it is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.core import trackdb

CREATE = "import sys; from components.core import trackdb; trackdb.ensure_created(sys.argv[1])"


def _open(uri: str) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_experiment("trackdb-check")
    client.create_registered_model("trackdb-model")
    return sorted(e.name for e in client.search_experiments())


def _spawn(uri: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CREATE, uri], cwd=Path(__file__).parents[2],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.parametrize(("uri", "path"), [
    ("sqlite:////home/u/mlflow.db", "/home/u/mlflow.db"),
    ("sqlite:///rel/mlflow.db", "rel/mlflow.db"),
    ("sqlite:////home/u/mlflow.db?timeout=30", "/home/u/mlflow.db"),
    ("sqlite://", None),
    ("sqlite:///:memory:", None),
    ("http://localhost:5000", None),
    ("postgresql://u@h/db", None),
])
def test_sqlite_path(uri, path):
    assert trackdb.sqlite_path(uri) == (Path(path) if path else None)


def test_a_kill_while_creating_leaves_no_database_and_the_next_client_creates_it(tmp_path):
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    proc = _spawn(uri)
    tmp = tmp_path / f".mlflow.db.creating-{proc.pid}"
    deadline = time.monotonic() + 60
    while not tmp.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the creating process never made its temporary file"
        time.sleep(0.01)
    time.sleep(0.3)  # inside MLflow's migrations, which take seconds
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not db.exists()
    assert any(p.name.startswith(".mlflow.db.creating-") for p in tmp_path.iterdir())

    trackdb.ensure_created(uri)
    assert db.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]  # the dead process's files are gone
    assert _open(uri) == ["Default", "trackdb-check"]


def test_two_processes_create_one_database(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    procs = [_spawn(uri), _spawn(uri)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]
    assert _open(uri) == ["Default", "trackdb-check"]


def test_an_existing_file_and_other_uris_are_left_alone(tmp_path):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"not a database")
    trackdb.ensure_created(f"sqlite:///{db}")
    assert db.read_bytes() == b"not a database"
    trackdb.ensure_created("http://127.0.0.1:9/")  # no server is contacted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


def test_creating_the_database_prints_none_of_mlflows_schema_lines(tmp_path, capfd) -> None:
    """MLflow logs "Creating initial MLflow database tables..." and "Updating database
    tables" at INFO as it builds the schema: before a refusal's one line, or a first run's
    own lines. Quiet while it builds; the loggers' levels are put back."""
    import logging

    from components.core import trackdb

    before = logging.getLogger("mlflow.store.db.utils").level
    trackdb.ensure_created(f"sqlite:///{tmp_path / 'mlflow.db'}")
    out, err = capfd.readouterr()
    assert (tmp_path / "mlflow.db").exists()
    assert "database tables" not in out + err, out + err
    assert logging.getLogger("mlflow.store.db.utils").level == before


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A complete MLflow database, made once."""
    db = tmp_path_factory.mktemp("made") / "mlflow.db"
    trackdb.ensure_created(f"sqlite:///{db}")
    return db


@pytest.mark.parametrize(("damage", "problem"), [
    (lambda b: b"", "is empty (0 bytes)"),
    (lambda b: os.urandom(4096), "is not an SQLite database"),
    (lambda b: b[: len(b) // 2], "is cut short ("),
    (lambda b: None, "is not an MLflow database (no such table: alembic_version)"),
], ids=["emptied", "random-bytes", "cut-in-half", "another-sqlite-database"])
def test_a_damaged_database_is_one_line_naming_it(damage, problem: str, made: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each was a sqlalchemy traceback out of the first MLflow call (the emptied file got
    MLflow's tables written into it first)."""
    import sqlite3

    from components.core.errors import UserError

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    db = tmp_path / "mlflow.db"
    data = damage(made.read_bytes())
    if data is None:
        sqlite3.connect(db).execute("CREATE TABLE t (x)").connection.commit()
    else:
        db.write_bytes(data)
    before = db.read_bytes()
    with pytest.raises(UserError) as err:
        trackdb.check_existing(f"sqlite:///{db}")
    assert (err.value.field, err.value.value) == ("POSTTRAIN_HOME", str(tmp_path))
    assert err.value.problem.startswith(f"its MLflow database mlflow.db {problem}"), err.value.problem
    assert err.value.fix.startswith("restore it from a backup, or move it aside")
    assert db.read_bytes() == before  # nothing written into it


def test_a_whole_database_and_other_uris_pass(made: Path) -> None:
    before, folder = made.read_bytes(), sorted(p.name for p in made.parent.iterdir())
    assert trackdb.check_existing(f"sqlite:///{made}") is None
    assert trackdb.check_existing(f"sqlite:///{made.parent / 'absent.db'}") is None
    assert trackdb.check_existing("http://127.0.0.1:9/") is None
    assert made.read_bytes() == before  # only read: nothing written into it
    assert not (made.parent / "absent.db").exists()  # a missing database is not created by the check
    assert sorted(p.name for p in made.parent.iterdir()) == folder == ["mlflow.db"]
