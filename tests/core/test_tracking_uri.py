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
- Credentials the server refuses (HTTP 401/403): exit 2, one line naming
  ``MLFLOW_TRACKING_URI`` and MLflow's credential variables, at the startup check and
  from ``run_stage`` (before: a 49-line traceback and exit 1). A stand-in server answers
  401/403 (MLflow's basic-auth app needs Flask-WTF, not installed).
- MLflow's HTTP retries and timeout are bounded unless the user set them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
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


AUTH_BODY = (b"You are not authenticated. Please see https://www.mlflow.org/docs/latest/auth/index.html"
             b"#authenticating-to-mlflow on how to authenticate.")


@contextmanager
def refusing_server(status: int) -> Iterator[str]:
    """A stand-in for an MLflow server with authentication (MLflow's own, ``mlflow server
    --app-name basic-auth``, needs Flask-WTF, which is not installed here): 200 at
    ``/health``, which answers without credentials, and ``status`` (401 or 403, with the
    basic-auth app's text body) for everything else. Yields its URI."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self):
            if self.path.startswith("/health"):
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"OK")
                return
            body = AUTH_BODY if status == 401 else b"Permission denied"
            self.send_response(status)
            if status == 401:
                self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PATCH = do_DELETE = _reply  # noqa: N815 -- the base class's names

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


NOT_AUTHENTICATED_FIX = ("fix: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (basic auth) or "
                         "MLFLOW_TRACKING_TOKEN (a bearer token) to credentials this server accepts")


def test_credentials_the_tracking_server_refuses_are_exit_2_with_one_line(tmp_path: Path) -> None:
    """Before: ``/health`` passed, the first real call got HTTP 401, and the user saw a
    49-line traceback and exit 1, which Airflow retries as an outage."""
    with refusing_server(401) as uri:
        proc = run_posttrain(["stage", "taskgen", "--recipe", str(TINY), "--iteration", "1", "--run-root",
                              str(tmp_path / "rr")], tmp_path,
                             cli_env(tmp_path / "home", MLFLOW_TRACKING_URI=uri, MLFLOW_TRACKING_USERNAME="bob",
                                     MLFLOW_TRACKING_PASSWORD="wrong"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"posttrain: error: MLFLOW_TRACKING_URI='{uri}': the tracking server refused the credentials (HTTP 401, not "
        f"authenticated; MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD set); {NOT_AUTHENTICATED_FIX}"]
    assert "wrong" not in proc.stderr


def test_the_startup_check_names_the_credentials_sent_and_a_denied_permission(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in tracking.CREDENTIAL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with refusing_server(401) as uri:
        with pytest.raises(UserError) as info:
            tracking._checked(uri)
    assert info.value.line() == (
        f"MLFLOW_TRACKING_URI='{uri}': the tracking server refused the credentials (HTTP 401, not authenticated; none "
        f"of MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN set); {NOT_AUTHENTICATED_FIX}")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "t0ken")
    with refusing_server(403) as uri:
        with pytest.raises(UserError) as info:
            tracking._checked(uri)
    assert info.value.problem == ("the tracking server denied these credentials access (HTTP 403, permission denied; "
                                  "MLFLOW_TRACKING_TOKEN set)")
    assert "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN" in info.value.fix


@pytest.mark.parametrize("status", [401, 403])
def test_a_stage_whose_credentials_are_refused_later_is_a_user_error(status: int, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials refused after the startup check (a token that expired mid-stage, a
    permission taken away): ``run_stage`` maps MLflow's own error for the reply to the
    same UserError; an HTTP 401 from another service (a model hub) is not mapped."""
    import requests
    from mlflow.tracking import MlflowClient

    from components.core import runner

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with refusing_server(status) as uri:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        try:
            MlflowClient(uri).search_experiments(max_results=1)
        except Exception as exc:  # noqa: BLE001 -- what MLflow's client raises for the reply, whatever its class
            refused = exc
        monkeypatch.setattr(runner, "_run_stage", lambda *args: (_ for _ in ()).throw(refused))
        with pytest.raises(UserError) as info:
            runner.run_stage("taskgen", TINY, str(tmp_path / "rr"), 1)
    assert info.value.field == "MLFLOW_TRACKING_URI" and info.value.value == uri
    assert f"(HTTP {status}, " in info.value.problem and "MLFLOW_TRACKING_TOKEN" in info.value.fix

    hub = requests.Response()
    hub.status_code, hub.url = 401, "https://huggingface.co/api/models/gated"
    elsewhere = requests.HTTPError("401 Client Error: Unauthorized", response=hub)
    assert tracking.credentials_refused(elsewhere) is None
    monkeypatch.setattr(runner, "_run_stage", lambda *args: (_ for _ in ()).throw(elsewhere))
    with pytest.raises(requests.HTTPError):
        runner.run_stage("taskgen", TINY, str(tmp_path / "rr"), 1)


def test_mlflow_http_retries_and_timeout_are_bounded_unless_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's defaults (7 retries, 120 s each) keep a request to a hung server going for
    about 20 minutes; posttrain's processes use ``HTTP_DEFAULTS`` unless the user set the
    variables (an empty one is unset)."""
    from mlflow import environment_variables as mlflow_env

    from tests.fixtures.home import reset_tracking_clients, use_home

    use_home(monkeypatch, tmp_path / ".posttrain")
    for name in tracking.HTTP_DEFAULTS:
        monkeypatch.setenv(name, "")  # restored after the test, whatever the client sets
    tracking.client()  # every process's first client
    retries, timeout_s = mlflow_env.MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), mlflow_env.MLFLOW_HTTP_REQUEST_TIMEOUT.get()
    backoff_s = sum(mlflow_env.MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.get() * 2 ** (n - 1) + 1 for n in range(2, retries + 1))
    assert (retries, timeout_s) == (2, 30)
    assert (retries + 1) * timeout_s + backoff_s <= 100  # a hung server's request fails within about 95 s
    reset_tracking_clients()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")
    tracking.client()
    assert (mlflow_env.MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), mlflow_env.MLFLOW_HTTP_REQUEST_TIMEOUT.get()) == (7, 120)  # the user's own
    reset_tracking_clients()
