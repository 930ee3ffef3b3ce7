"""What ``MLFLOW_TRACKING_URI`` can be, and what an unreachable tracking server is
(``components.core.tracking``, ``components.core.models.resolve_alias``).

- A scheme MLflow has no store for, or a string that is no URI: exit 2, one line naming
  ``MLFLOW_TRACKING_URI`` (before, a registry alias read through it was "not set yet").
- An HTTP server nobody listens on: exit 1 (an outage, retried by Airflow) with one line,
  in seconds; before, MLflow's client retried for about four minutes and then taskgen
  called it a user's mistake ("has no champion yet", exit 2).
- ``resolve_alias``: an unset alias or a missing model is None; a refused connection is
  an InfraError. The refused connection is injected (the real server's outage is the
  CLI test above).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from components.core import models, tracking
from components.core.errors import InfraError, UserError
from tests.fixtures.runs import TINY, cli_env, run_posttrain


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("uri", "needle"), [
    ("ftp://x", "unsupported tracking URI scheme 'ftp'"),
    ("http://[bad", "not a URI"),
])
def test_a_tracking_uri_mlflow_cannot_use_is_exit_2(uri: str, needle: str, tmp_path: Path) -> None:
    proc = run_posttrain(["stage", "taskgen", "--recipe", str(TINY)], tmp_path,
                         cli_env(tmp_path / "home", MLFLOW_TRACKING_URI=uri), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"posttrain: error: MLFLOW_TRACKING_URI='{uri}': {needle}")
    assert "unset it for the embedded SQLite database" in lines[0]


def test_a_tracking_server_nobody_listens_on_is_an_outage(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{_closed_port()}"
    proc = run_posttrain(["stage", "taskgen", "--recipe", str(TINY)], tmp_path,
                         cli_env(tmp_path / "home", MLFLOW_TRACKING_URI=uri), timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"posttrain: unreachable: tracking server unreachable at '{uri}': URLError: [Errno 111] Connection refused; "
        "retry once it is back"]


class _Client:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def get_model_version_by_alias(self, name: str, alias: str):
        raise self.exc


def test_resolve_alias_tells_an_unset_alias_from_an_outage(mlflow_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a real MLflow server: no registered model and a model without the alias are
    both "not set yet" (None); a server nobody listens on is an outage. Only a refusal
    needs a fake (this server has no authentication): it propagates as it is."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    assert models.resolve_alias("alias-probe", "champion") is None  # no registered model 'alias-probe-policy'
    MlflowClient(mlflow_server.uri).create_registered_model(models.model_name("alias-probe"))
    assert models.resolve_alias("alias-probe", "champion") is None  # the model, without the alias
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(InfraError) as info:
        models.resolve_alias("alias-probe", "champion")
    assert info.value.what == "tracking server"
    denied = MlflowException("Permission denied for registered model demo-policy", PERMISSION_DENIED)
    monkeypatch.setattr(tracking, "client", lambda: _Client(denied))
    with pytest.raises(MlflowException, match="Permission denied"):  # neither unset nor an outage: as it is
        models.resolve_alias("demo", "champion")


FIX = ("use http(s)://host:port of an MLflow server, a database URI (sqlite:///path, postgresql://...), "
       "or unset it for the embedded SQLite database")
SQLITE_FIX = ("write sqlite:///relative/path.db or sqlite:////absolute/path.db (four slashes), "
              "or unset it for the embedded SQLite database")


def _refused(uri: str) -> str:
    with pytest.raises(UserError) as info:
        tracking.check_uri(uri)
    assert info.value.field == "MLFLOW_TRACKING_URI"
    return info.value.line()


def test_only_a_server_or_a_database_is_a_tracking_uri(tmp_path: Path) -> None:
    """What MLflow 3 refuses (its file store), cannot keep (an in-memory SQLite
    database), posttrain does not support (Databricks) or cannot parse is one line naming
    MLFLOW_TRACKING_URI, before anything is created."""
    regular = tmp_path / "regular"
    regular.write_text("x")
    cases = {
        "garbage": "not a URI (a bare path would be MLflow's file store, which posttrain does not support)",
        str(tmp_path / "mlruns"): "not a URI (a bare path would be MLflow's file store, which posttrain does not support)",
        f"file://{regular}": "MLflow's file store is not supported (in maintenance mode in MLflow 3, which refuses it)",
        "databricks": "unsupported tracking URI scheme 'databricks' (Databricks)",
        "databricks-uc": "unsupported tracking URI scheme 'databricks-uc' (Databricks)",
        "databricks://profile": "unsupported tracking URI scheme 'databricks'",
        "http://[x": "not a URI (Invalid IPv6 URL)",
        "http://host:abc": "not a URI (Port could not be cast to integer value as 'abc')",
    }
    for uri, problem in cases.items():
        assert _refused(uri) == f"MLFLOW_TRACKING_URI={uri!r}: {problem}; fix: {FIX}"
    assert _refused("http://") == ("MLFLOW_TRACKING_URI='http://': an MLflow server URI without a host; "
                                   "fix: write http(s)://host:port of the MLflow server")
    memory = "an in-memory SQLite database: every version and alias would be lost when the process ends"
    # with a driver named (sqlite+pysqlite://) none of the SQLite checks ran, and these were accepted
    for uri in ("sqlite:///", "sqlite://", "sqlite:///:memory:", "sqlite+pysqlite:///", "sqlite+pysqlite://"):
        assert _refused(uri) == f"MLFLOW_TRACKING_URI={uri!r}: {memory}; fix: {SQLITE_FIX}"
    for scheme in ("sqlite", "sqlite+pysqlite"):
        under_file = f"{scheme}:///{regular}/x.db"
        assert _refused(under_file) == (f"MLFLOW_TRACKING_URI={under_file!r}: cannot make the database: "
                                        f"{str(regular)!r} is a file, not a folder; fix: {SQLITE_FIX}")
    a_folder = f"sqlite:///{tmp_path}"
    assert _refused(a_folder) == (f"MLFLOW_TRACKING_URI={a_folder!r}: the database path {str(tmp_path)!r} is a folder; "
                                  f"fix: {SQLITE_FIX}")
    assert list(tmp_path.iterdir()) == [regular]  # nothing made
    for folder in ("/proc", "/sys"):  # os.access says yes to root there; making a file does not
        assert _refused(f"sqlite:///{folder}/x.db").startswith(
            f"MLFLOW_TRACKING_URI='sqlite:///{folder}/x.db': cannot make the database in '{folder}' (")
    tracking.check_uri(f"sqlite:///{tmp_path}/new/mlflow.db")  # a file that a first run makes
    tracking.check_uri("http://127.0.0.1:5000")  # a server: reachability is _checked's, not this
    assert not (tmp_path / "new").exists()


def test_a_database_whose_driver_is_missing_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLAlchemy picks the driver (``postgresql://`` is psycopg 3 with SQLAlchemy 2.1); a
    missing one is a UserError whose fix names the PyPI package, and the password is not
    shown."""
    import builtins

    from sqlalchemy.engine.url import make_url

    module = make_url("postgresql://h/db").get_dialect().driver  # psycopg (SQLAlchemy 2.1) or psycopg2
    real_import = builtins.__import__

    def no_drivers(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002 -- __import__'s own names
        if level == 0 and name.split(".", 1)[0] in tracking.DRIVER_PACKAGES:  # as if no driver were installed
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_drivers)
    line = _refused("postgresql://u:secret@127.0.0.1:1/db")
    assert line == (f"MLFLOW_TRACKING_URI='postgresql://u:***@127.0.0.1:1/db': needs the database driver {module!r}, "
                    f"which is not installed; fix: install it into this environment (pip install "
                    f"'{tracking.DRIVER_PACKAGES[module]}'), or unset MLFLOW_TRACKING_URI for the embedded SQLite database")
    assert "secret" not in line
    assert "'PyMySQL'" in _refused("mysql+pymysql://h/db")
    assert _refused("postgresql+nosuch://h/db") == (
        f"MLFLOW_TRACKING_URI='postgresql+nosuch://h/db': unknown database driver in the scheme 'postgresql+nosuch'; "
        f"fix: {FIX}")


@pytest.mark.parametrize(("uri", "problem"), [
    ("garbage", "not a URI (a bare path would be MLflow's file store, which posttrain does not support)"),
    ("sqlite:///", "an in-memory SQLite database: every version and alias would be lost when the process ends"),
    ("http://[x", "not a URI (Invalid IPv6 URL)"),
])
def test_posttrain_run_refuses_a_bad_tracking_uri_before_anything_is_made(uri: str, problem: str, tmp_path: Path) -> None:
    """Exit 2 and one line before the home, the run root or a database is made (before:
    a traceback and exit 1 after the run root and the home were made, or, for
    ``sqlite:///``, a run whose registry vanished with the process)."""
    proc = run_posttrain(["run", "--recipe", str(TINY), "--run-root", "rr", "--iterations", "1"], tmp_path,
                         cli_env(tmp_path / "home", MLFLOW_TRACKING_URI=uri), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    fix = SQLITE_FIX if uri.startswith("sqlite") else FIX
    assert proc.stderr.splitlines() == [f"posttrain: error: MLFLOW_TRACKING_URI={uri!r}: {problem}; fix: {fix}"]
    assert list(tmp_path.iterdir()) == []


def test_an_embedded_database_that_cannot_be_made_names_the_home(tmp_path: Path) -> None:
    """With MLFLOW_TRACKING_URI unset the database lives in the home: what keeps it from
    being made is the home's problem, and the line names POSTTRAIN_HOME, which the user
    set (or can set), not a variable the user never set."""
    home = tmp_path / "home"
    (home / "mlflow.db").mkdir(parents=True)
    proc = run_posttrain(["run", "--recipe", str(TINY), "--run-root", "rr", "--iterations", "1"], tmp_path,
                         cli_env(home), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"posttrain: error: POSTTRAIN_HOME='{home}': holds the embedded MLflow database, but the database path "
        f"'{home / 'mlflow.db'}' is a folder; fix: point POSTTRAIN_HOME at a folder this user can write "
        "(default: ./.posttrain)"]
    assert not (tmp_path / "rr").exists()


def test_a_tracking_uri_with_spaces_control_characters_or_undecodable_bytes_is_one_line() -> None:
    """Before: an ``InvalidURL`` traceback from the reachability probe (a space or control
    character), a ``UnicodeEncodeError`` from SQLAlchemy (bytes the environment could not
    decode, here a surrogate escape), exit 1 for a host name DNS cannot hold."""
    assert _refused("http://a b") == ("MLFLOW_TRACKING_URI='http://a b': holds a space or a control character; "
                                      "fix: percent-encode it (a space is %20) or remove it")
    assert "holds a space or a control character" in _refused("http://h\x01:5000")
    assert "is not valid UTF-8 text" in _refused("sqlite:////tmp/\udcff.db")
    assert "is not valid UTF-8 text" in _refused("http://\udcff")
    assert _refused("http://" + "a" * 100 + ":5000").startswith(
        f"MLFLOW_TRACKING_URI='http://{'a' * 100}:5000': the host is not a valid name (")


def test_a_relative_sqlite_database_is_made_where_the_command_runs(tmp_path: Path) -> None:
    """``sqlite:///relative.db``, the form the fix text names, is made in the working
    folder, and the command goes on to read it (here: no champion yet, as on any new
    database); before, making its schema raised "relative path can't be expressed as a
    file URI" (exit 1)."""
    proc = run_posttrain(["stage", "taskgen", "--recipe", str(TINY), "--run-root", str(tmp_path / "rr"),
                          "--iteration", "1"], tmp_path, cli_env(tmp_path / "home", MLFLOW_TRACKING_URI="sqlite:///rel.db"),
                         timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        "posttrain: error: rollout.policy='champion': registered model 'tiny-policy' has no champion yet; fix: run "
        f"'posttrain stage bootstrap --run-root {(tmp_path / 'rr').as_uri()}', with this run's --recipe, first "
        "('posttrain run' does it for you)"]
    assert (tmp_path / "rel.db").is_file() and not (tmp_path / "home" / "mlflow.db").exists()


def test_a_server_that_is_not_mlflow_is_exit_2_and_credentials_are_not_the_host(tmp_path: Path) -> None:
    """A server that answers 404 at /health (any web server) is the user's mistake, one
    line (before: a traceback with the server's HTML page, at the first MLflow call). A
    URI with ``user:password@`` reaches the host after the ``@`` (before: the probe looked
    the whole ``user:password@host`` up as a host name, an outage for ever)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 -- the base class's name
            self.send_response(200 if self.path == "/mlflow/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        with pytest.raises(UserError) as info:
            tracking._checked(f"http://u:secret@127.0.0.1:{port}")
        assert info.value.line() == (
            f"MLFLOW_TRACKING_URI='http://u:***@127.0.0.1:{port}': answers HTTP 404 at /health: not an MLflow tracking "
            "server; fix: point it at the MLflow server's address (http(s)://host:port, with its path prefix if it has one)")
        tracking._checked(f"http://u:secret@127.0.0.1:{port}/mlflow")  # reached, and it answers /health
    finally:
        server.shutdown()
