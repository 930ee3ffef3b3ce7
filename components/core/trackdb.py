"""An SQLite tracking database comes into being whole, or not at all.

MLflow creates its schema on first use: it creates the initial tables, then runs some
fifty migrations, in place, over a few seconds. A process killed in that window (Ctrl-C
in the first seconds of a first ``posttrain run``, an OOM kill) leaves a database that
every later client fails to open (``table datasets already exists``), so the home was
unusable until someone deleted the file by hand.

``ensure_created`` builds the schema in a temporary file beside the database and links
it into place only when MLflow has finished with it, so the database path either does not
exist or holds a complete schema. A temporary file left by a killed process is removed
by the next call. Two processes creating the same database at once both build one; the
first link wins and the other is discarded.

``check_existing`` looks at a database that is there before MLflow does: a file that is
empty, no SQLite database, cut short of the pages its header counts, or without MLflow's
schema is a UserError naming it (each was a ``sqlalchemy`` traceback, and an emptied file
got a fresh schema written into it before the run was refused for another reason).

Not covered: damage inside pages a short read does not touch (SQLite's ``PRAGMA
integrity_check`` reads the whole file; MLflow's own queries meet it later), a database
left half created by a version of posttrain before this module, and an in-place schema
upgrade of an existing database after an MLflow upgrade (MLflow's ``mlflow db upgrade``,
which its documentation asks to run on a backup).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PREFIX = "sqlite:///"
_SQLITE_FILE = re.compile(r"sqlite(\+[A-Za-z0-9_]+)?:///")


def sqlite_path(uri: str) -> Path | None:
    """The database file of an ``sqlite:///...`` URI (or ``sqlite+<driver>:///...``); None
    for any other URI (and for an in-memory ``sqlite://``)."""
    found = _SQLITE_FILE.match(uri)
    if found is None:
        return None
    path = uri[found.end():].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_leftovers(path: Path) -> None:
    """Temporary databases of processes that no longer run (killed while creating)."""
    for tmp in path.parent.glob(f".{path.name}.creating-*"):
        pid = tmp.name[len(f".{path.name}.creating-"):].split("-", 1)[0]  # "<pid>" or "<pid>-journal"
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


@contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """The loggers ``names`` at WARNING for the body: a first run (or a refusal that comes
    after the database is made) prints no schema-creation INFO lines before its own."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def ensure_created(uri: str) -> None:
    """Create the MLflow schema of the SQLite database at ``uri`` if the file does not
    exist yet, atomically (see the module docstring); a no-op for other URIs and for an
    existing file."""
    path = sqlite_path(uri)
    if path is None or path.exists():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission (``tracking.check_uri`` says so first)
        from components.core.errors import UserError

        if os.environ.get("MLFLOW_TRACKING_URI"):
            raise UserError("MLFLOW_TRACKING_URI", uri, f"cannot make the database's folder "
                            f"({exc.strerror or type(exc).__name__})", "use a database path in a folder this user "
                            "can write, or unset it for the embedded SQLite database") from None
        raise UserError("POSTTRAIN_HOME", str(path.parent), f"cannot be a folder ({exc.strerror or type(exc).__name__})",
                        "point POSTTRAIN_HOME at a folder this user can write (default: ./.posttrain)") from None
    _remove_leftovers(path)
    tmp = path.with_name(f".{path.name}.creating-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        # The tracking store's migrations create the model registry's tables too.
        with _quiet("mlflow.store.db.utils", "alembic"):  # its "Creating initial MLflow database tables" lines
            store = SqlAlchemyStore(f"{PREFIX}{tmp}", (path.parent.absolute() / "mlartifacts").as_uri())
        store.engine.dispose()
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process linked its complete database first
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + "-journal")):
            leftover.unlink(missing_ok=True)


_MAGIC = b"SQLite format 3\x00"


def check_existing(uri: str) -> None:
    """A UserError when the SQLite database of ``uri`` exists but cannot be MLflow's: empty,
    another kind of file, cut short, or with no MLflow schema. Reads the 100-byte header
    and the schema's version row; a no-op for other URIs and a missing file."""
    path = sqlite_path(uri)
    if path is None or not path.is_file():
        return
    if (problem := sqlite_problem(path, "MLflow")) is not None:
        _refuse(path, uri, problem)


def sqlite_problem(path: Path, kind: str) -> str | None:
    """Why the SQLite file at ``path`` cannot be ``kind``'s whole database (MLflow and
    Airflow both stamp their schema's version in alembic's ``alembic_version``): empty,
    another kind of file, cut short of the pages its header counts, no schema version.
    None when it can be."""
    with open(path, "rb") as fh:
        head = fh.read(100)
    size = path.stat().st_size
    problem = None
    if size == 0:
        problem = "is empty (0 bytes)"
    elif len(head) < 100 or head[:16] != _MAGIC:
        problem = "is not an SQLite database"
    else:
        page_size = int.from_bytes(head[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages = int.from_bytes(head[28:32], "big")
        if head[24:28] == head[92:96] and pages and size < pages * page_size:  # the header's page count is valid
            problem = f"is cut short ({size} bytes of the {pages * page_size} its header counts)"
    if problem is None:
        try:
            with contextlib.closing(sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)) as db:
                if db.execute("SELECT version_num FROM alembic_version").fetchone() is None:
                    problem = f"has no {kind} schema version"
        except sqlite3.DatabaseError as exc:  # "no such table", "database disk image is malformed"
            problem = f"is not an {kind} database ({exc})"
    return problem


def _refuse(path: Path, uri: str, problem: str) -> None:
    from components.core.errors import UserError

    fix = ("restore it from a backup, or move it aside (then a new, empty one is made: earlier runs and registered "
           "versions are not in it)")
    if os.environ.get("MLFLOW_TRACKING_URI"):
        raise UserError("MLFLOW_TRACKING_URI", uri, f"the database {path} {problem}", fix)
    raise UserError("POSTTRAIN_HOME", str(path.parent), f"its MLflow database {path.name} {problem}", fix)
