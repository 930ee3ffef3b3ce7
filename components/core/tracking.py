"""MLflow tracking and lineage: experiments, iteration and stage runs, datasets, registry.

- One experiment per pipeline, tagged ``mlflow.experimentKind=custom_model_development``
  so MLflow 3's UI opens it on the training-runs view (not GenAI traces); the tag is added
  to an existing experiment that lacks it.
- Per pipeline and run root, one summary run ``<pipeline> · timeline`` (tagged
  ``posttrain.stage=pipeline``; headline metrics per iteration, see
  :mod:`components.core.timeline`); under it one parent run per iteration, ``iter-000002``
  (tagged with the run root, iteration and orchestrator run id); under that one run per
  stage (and shard), named by stage and iteration: ``trainer · iter-000002``,
  ``rollout[1/2] · iter-000002``; bootstrap's run is ``bootstrap``, under no parent.
- A stage run ends FINISHED only after the stage's manifest is written (the runner writes
  it inside ``stage_run``), KILLED when the stage was told to stop (``Terminated``, which
  the CLI raises on SIGTERM; Airflow's ``AirflowTaskTerminated``; Ctrl-C), FAILED on any
  other error. A run whose process was SIGKILLed stays RUNNING until the next attempt of
  the same stage, iteration, shard and run root (or of the stage under another shard
  count) marks it KILLED, or until its iteration ends (the runner ends the iteration's
  stage runs still RUNNING KILLED). When a stage run ends FINISHED, the earlier FINISHED
  runs of the same stage, iteration, shard and run root are tagged
  ``posttrain.superseded_by`` = its run id: the one without the tag is current.
- An iteration's parent run ends FINISHED after its last stage (the runner,
  ``finish_iteration``: also from FAILED or KILLED, when the iteration was finished after
  the orchestrator gave up on it), FAILED when the orchestrator gives up on it
  (``fail_iteration``, from the Airflow failure callbacks; its RUNNING stage runs are
  marked KILLED). The next attempt at the same iteration's taskgen finds the parent
  again by its tags and sets it RUNNING again: one parent run per iteration, however
  often it was resumed.
- Stage inputs are logged as MLflow datasets: metadata only (source URI + digest), the
  data stays in the store.
- The model registry (versions, aliases) is :mod:`components.core.models`.

The embedded default is ``sqlite:///<POSTTRAIN_HOME>/mlflow.db`` with artifacts beside it,
its schema created whole or not at all (:mod:`components.core.trackdb`);
``MLFLOW_TRACKING_URI`` selects an MLflow server (``http(s)://``) or another database
(``sqlite:///path``, ``postgresql://``, ``mysql://``, ``mssql://``; ``SCHEMES``). Any other
value (a bare path or ``file://``: MLflow's file store; ``databricks``; an in-memory
``sqlite:///``; a database whose driver is not installed) is a UserError naming the
variable before anything is created (``check_uri``; ``posttrain run`` checks it first).
Everything goes through ``MlflowClient`` (no fluent global state), so in-process
orchestrators can run stages side by side.
A run deleted in the MLflow UI (or unknown to this tracking server) is gone for posttrain:
nothing ends, tags or logs to it (``live``). A stage whose recorded iteration run (taskgen's
manifest pins it) is gone nests under the iteration's live parent instead, found by its
tags or created (``live_iteration_run``, which also moves the gone parent's stage runs
under it), and the iteration's end logs its timeline on and ends that one.

An HTTP(S) server's credentials are MLflow's own environment variables
(``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``, ``MLFLOW_TRACKING_TOKEN``); each
process checks them with one read after ``/health``, and a 401/403 there or later in a
stage is a UserError naming them (``credentials_refused``). MLflow's HTTP retries and
timeout are bounded when unset (``HTTP_DEFAULTS``).
Not covered: setting up MLflow's authentication itself, and whether a database server
accepts the URI's credentials (that is found on first use).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from components.core import settings, trackdb

TAG_PIPELINE = "posttrain.pipeline"
TAG_ITERATION = "posttrain.iteration"
TAG_RUN_ROOT = "posttrain.run_root"
TAG_STAGE = "posttrain.stage"
TAG_ORCH = "posttrain.orchestrator_run_id"
TAG_SHARD = "posttrain.shard"  # "i/n" on the runs of sharded stages
TAG_PARENT = "mlflow.parentRunId"
TAG_SUPERSEDED_BY = "posttrain.superseded_by"
"""On a stage run a later attempt of the same stage, iteration, shard and run root
replaced: the run id of that attempt (the latest FINISHED one, whose manifest is current)."""
KIND_TAG = "mlflow.experimentKind"
KIND = "custom_model_development"  # MLflow 3's UI: the training-runs view ("genai_development": traces)
SEP = " · "  # between a run name's stage label and its iteration: "trainer · iter-000002"
ITERATION_STAGE = "iteration"  # TAG_STAGE of an iteration's parent run
PIPELINE_STAGE = "pipeline"  # TAG_STAGE of a pipeline's summary (timeline) run


class Terminated(BaseException):
    """The process was told to stop (SIGTERM) while a stage ran: its run ends KILLED, not
    FAILED. A ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception``
    in a stage swallows it."""


def end_status(exc: BaseException) -> str:
    """How a stage run that ``exc`` interrupted ends: KILLED when the process was told to
    stop (``Terminated``, Ctrl-C, Airflow's ``AirflowTaskTerminated``), else FAILED."""
    if isinstance(exc, (Terminated, KeyboardInterrupt)):
        return "KILLED"
    # Airflow's class is matched by name: this module does not import Airflow
    if any(c.__name__ == "AirflowTaskTerminated" and c.__module__.startswith("airflow") for c in type(exc).__mro__):
        return "KILLED"
    return "FAILED"


def iteration_name(iteration: int) -> str:
    return f"iter-{iteration:06d}"


def stage_run_name(label: str, iteration: int) -> str:
    """A stage run's name: the stage label (``rollout[1/2]``) and the iteration; bootstrap,
    which belongs to no iteration, keeps its label."""
    return label if label == "bootstrap" else f"{label}{SEP}{iteration_name(iteration)}"


def embedded_db() -> Path:
    """The home's own SQLite database file (made by nothing here)."""
    return settings.home() / "mlflow.db"


def embedded_uri() -> str:
    """The tracking URI of ``embedded_db``."""
    return f"sqlite:///{embedded_db()}"


def tracking_uri() -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    settings.made_home()
    return embedded_uri()


_clients: dict[str, Any] = {}
SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https")
"""The tracking URI schemes posttrain supports: a database MLflow keeps both its tracking
and its model registry in (a ``+driver`` suffix allowed, ``postgresql+psycopg2://``), and
an MLflow server. Not MLflow's file store (a bare path or ``file://``: in maintenance
mode, refused by MLflow 3 itself) nor Databricks (``databricks``, ``databricks-uc``,
``uc``: its workspace registry has no aliases, and the run root is not in Unity Catalog)."""
VARIABLE = "MLFLOW_TRACKING_URI"
FIX = ("use http(s)://host:port of an MLflow server, a database URI (sqlite:///path, postgresql://...), "
       "or unset it for the embedded SQLite database")
DRIVER_PACKAGES = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient",
                   "pymysql": "PyMySQL", "mysql": "mysql-connector-python", "pyodbc": "pyodbc", "pymssql": "pymssql",
                   "asyncpg": "asyncpg", "pg8000": "pg8000", "oracledb": "oracledb"}
"""The PyPI package of a database driver module SQLAlchemy imports, for the fix of a missing one."""
PROBE_TIMEOUT_S = 5.0
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
"""MLflow's HTTP client settings posttrain's processes use when the user has not set them
(MLflow's own: 7 retries, 120 s per attempt, about 20 minutes before a hung server's
request fails): 3 attempts of at most 30 s each and about 5 s of backoff between them,
so a request to a server that hangs fails within about 95 s, an outage the orchestrator
retries. Set either variable to keep MLflow's behaviour or choose another bound."""
CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
REFUSED_CODES = {"UNAUTHENTICATED": 401, "CUSTOMER_UNAUTHORIZED": 401, "PERMISSION_DENIED": 403}
"""MLflow error codes (``MlflowException.error_code``) that mean the tracking server refused
the request's credentials, and the HTTP status each stands for."""


def bound_http_waits() -> dict[str, str]:
    """Set ``HTTP_DEFAULTS`` in this process's environment for each variable that is unset
    or empty (an empty setting is an unset one); returns what it set. MLflow reads them at
    every request, so this also bounds the requests of clients made before it."""
    chosen = {k: v for k, v in HTTP_DEFAULTS.items() if not os.environ.get(k, "").strip()}
    os.environ.update(chosen)
    return chosen


def refused_credentials(status: int, uri: str | None = None):
    """The UserError for a tracking server that answered HTTP ``status`` (401: not
    authenticated, 403: permission denied): one line naming ``MLFLOW_TRACKING_URI``, which of
    MLflow's credential variables are set, and how to fix them."""
    from components.core.errors import UserError

    shown = shown_uri(uri if uri is not None else tracking_uri())
    given = [v for v in CREDENTIAL_VARIABLES if os.environ.get(v)]
    sent = f"{' and '.join(given)} set" if given else f"none of {', '.join(CREDENTIAL_VARIABLES)} set"
    if status == 403:
        return UserError(VARIABLE, shown, f"the tracking server denied these credentials access (HTTP 403, permission "
                         f"denied; {sent})", "use MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or "
                         "MLFLOW_TRACKING_TOKEN of a user allowed to edit the pipeline's experiment and registered "
                         "model, or have the server's admin grant this user that permission")
    return UserError(VARIABLE, shown, f"the tracking server refused the credentials (HTTP 401, not authenticated; "
                     f"{sent})", "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (basic auth) or "
                     "MLFLOW_TRACKING_TOKEN (a bearer token) to credentials this server accepts")


def credentials_refused(exc: BaseException):
    """``refused_credentials``' UserError if ``exc`` (or anything in its cause chain) is the
    tracking server refusing the credentials: an MLflow error whose code is one of
    ``REFUSED_CODES`` (MLflow's client turns an HTTP 401/403 reply into those), or an HTTP
    401/403 reply from the tracking server's own address (an artifact upload through it);
    None for anything else (a store's or a model hub's 403 is not the tracking server's)."""
    from urllib.parse import urlsplit

    uri = os.environ.get(VARIABLE, "")
    server = urlsplit(uri)._replace(path="", query="", fragment="").geturl() if uri.startswith(("http://", "https://")) else ""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if type(cur).__module__.startswith("mlflow") and (code := getattr(cur, "error_code", "")) in REFUSED_CODES:
            return refused_credentials(REFUSED_CODES[code], uri or None)
        reply = getattr(cur, "response", None)
        status, url = getattr(reply, "status_code", None), str(getattr(reply, "url", "") or "")
        if server and status in (401, 403) and url.startswith(server):
            return refused_credentials(status, uri)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return None


def shown_uri(uri: str) -> str:
    """``uri`` with its password (``postgresql://user:secret@host``) replaced by ``***``,
    for a message; as it is when it has none or cannot be parsed."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
        password = parts.password
    except ValueError:
        return uri
    if not password:
        return uri
    user, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{user.split(':', 1)[0]}:***@{host}").geturl()


def check_uri(uri: str) -> None:
    """A UserError naming ``MLFLOW_TRACKING_URI`` for a tracking URI posttrain cannot use
    (``POSTTRAIN_HOME`` for the embedded database, when that variable is unset),
    found without contacting a server and leaving nothing behind (an SQLite folder is probed
    with an empty file, removed at once): not a URI, a scheme
    outside ``SCHEMES``, an HTTP(S) URI without a host, an SQLite URI without a database
    file (``sqlite:///``, ``:memory:``: the registry would vanish with the process) or
    whose file cannot be made (under a regular file, a folder, no permission), and a
    database whose driver is not installed (the fix names the package)."""
    from urllib.parse import urlsplit

    from components.core.errors import UserError

    shown = shown_uri(uri)
    embedded = uri == embedded_uri()  # the home's database (posttrain itself may have exported it to the variable)

    def refuse(problem: str, fix: str = FIX) -> UserError:
        if embedded:
            return UserError("POSTTRAIN_HOME", str(settings.home()), f"holds the embedded MLflow database, but {problem}",
                             "point POSTTRAIN_HOME at a folder this user can write (default: ./.posttrain)")
        return UserError(VARIABLE, shown, problem, fix)

    if uri != uri.strip():
        raise refuse("has white space around it", "remove the spaces and newlines around the URI")
    try:
        uri.encode("utf-8")
    except UnicodeEncodeError:
        raise refuse("is not valid UTF-8 text (bytes the environment could not decode)",
                     "write the URI in UTF-8, percent-encoding anything else") from None
    if any(c.isspace() or not c.isprintable() for c in uri):
        raise refuse("holds a space or a control character", "percent-encode it (a space is %20) or remove it")
    try:
        parts = urlsplit(uri)
        scheme = parts.scheme
        port = parts.port if scheme in ("http", "https") else None
    except ValueError as exc:  # "Invalid IPv6 URL" (an unclosed '['), a port that is not a number
        raise refuse(f"not a URI ({exc})") from None
    base, _, driver = scheme.partition("+")
    if not base:
        if uri.lower() in ("databricks", "databricks-uc", "uc"):
            raise refuse(f"unsupported tracking URI scheme {uri.lower()!r} (Databricks)")
        raise refuse("not a URI (a bare path would be MLflow's file store, which posttrain does not support)")
    if base == "file":
        raise refuse("MLflow's file store is not supported (in maintenance mode in MLflow 3, which refuses it)")
    if base not in SCHEMES:
        raise refuse(f"unsupported tracking URI scheme {scheme!r}")
    if base in ("http", "https"):
        if driver:
            raise refuse(f"unsupported tracking URI scheme {scheme!r}")
        if not parts.hostname:
            raise refuse("an MLflow server URI without a host", "write http(s)://host:port of the MLflow server")
        if port == 0:
            raise refuse("port 0 is no server's port", "write http(s)://host:port of the MLflow server")
        try:
            parts.hostname.encode("idna")  # each label 1-63 characters, the name in one DNS form
        except UnicodeError as exc:
            raise refuse(f"the host is not a valid name ({exc})", "write http(s)://host:port of the MLflow server") \
                from None
        return
    if base == "sqlite":  # sqlite+pysqlite:///... is the same file (it was not checked at all)
        _check_sqlite(uri, parts.netloc, refuse)
    _check_driver(uri, refuse)


def _check_sqlite(uri: str, host: str, refuse) -> None:
    """The database file of an ``sqlite:///path`` URI can be used: opened if it exists, made if not."""
    import stat

    fix = ("write sqlite:///relative/path.db or sqlite:////absolute/path.db (four slashes), "
           "or unset it for the embedded SQLite database")
    if host:
        raise refuse(f"an SQLite URI names a file, not a host ({host!r})", fix)
    database = trackdb.sqlite_path(uri)
    if database is None:
        raise refuse("an in-memory SQLite database: every version and alias would be lost when the process ends", fix)
    if str(database).startswith("~"):
        raise refuse("'~' is not expanded in a database URI", "write the path out in full")
    try:
        if database.exists():
            mode = database.stat().st_mode
            if stat.S_ISDIR(mode):
                raise refuse(f"the database path {str(database)!r} is a folder", fix)
            if not stat.S_ISREG(mode):
                raise refuse(f"the database path {str(database)!r} is not a regular file", fix)
            if not os.access(database, os.R_OK | os.W_OK):
                raise refuse(f"the database file {str(database)!r} cannot be read and written by this user",
                             "give this user read and write permission, or use another path")
            return
        above = database.absolute().parent
        while not above.exists() and above != above.parent:
            above = above.parent
        if not above.is_dir():
            raise refuse(f"cannot make the database: {str(above)!r} is a file, not a folder", fix)
        if not os.access(above, os.W_OK | os.X_OK):
            raise refuse(f"cannot make the database: no permission to write in {str(above)!r}",
                         "use a path in a folder this user can write")
        _probe_write(above, refuse, fix)
    except OSError as exc:
        raise refuse(f"the database path cannot be used ({type(exc).__name__}: {exc.strerror or exc})", fix) from None
    except ValueError as exc:  # a NUL character
        raise refuse(f"the database path cannot be used ({exc})", fix) from None


def _probe_write(folder: Path, refuse, fix: str) -> None:
    """Make and remove an empty file in ``folder``: ``os.access`` says yes to root for
    folders no one can write in (``/proc``, ``/sys``) and, on some systems, for a
    read-only file system."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".posttrain-probe-"):
            pass
    except OSError as exc:
        raise refuse(f"cannot make the database in {str(folder)!r} ({exc.strerror or type(exc).__name__})", fix) from None


def _check_driver(uri: str, refuse) -> None:
    """SQLAlchemy knows the dialect and driver of a database URI, and the driver is installed."""
    from sqlalchemy.engine.url import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        dialect = make_url(uri).get_dialect()
    except NoSuchModuleError:
        raise refuse(f"unknown database driver in the scheme {uri.split(':', 1)[0]!r}") from None
    except (ArgumentError, ValueError) as exc:
        raise refuse(f"not a database URI ({str(exc)[:160]})") from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        module = (exc.name or "").split(".", 1)[0] or dialect.driver
        package = DRIVER_PACKAGES.get(module, module)
        raise refuse(f"needs the database driver {module!r}, which is not installed",
                     f"install it into this environment (pip install '{package}'), or unset MLFLOW_TRACKING_URI "
                     "for the embedded SQLite database") from None


def _checked(uri: str) -> None:
    """``check_uri``'s UserError for a tracking URI posttrain cannot use; an InfraError, in
    seconds, for an HTTP(S) tracking server that cannot be reached (MLflow's own client
    retries a refused connection for minutes before it says anything). A server that
    answers, with any status below 500 but 404, is reachable; a 404 at ``/health``, which
    every MLflow server answers, is a UserError (another web server). The probe goes to the
    host after any ``user:password@``. Then ``_check_credentials``: credentials the server
    refuses (HTTP 401/403) are a UserError naming MLflow's credential variables."""
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    from components.core.errors import InfraError, UserError

    check_uri(uri)
    parts = urlsplit(uri)
    if parts.scheme.lower() not in ("http", "https"):
        return
    # Credentials in the URI (http://user:pass@host) are MLflow's basic auth, not part of the host to reach.
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    probe = parts._replace(netloc=f"{host}:{parts.port}" if parts.port else host).geturl().rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(probe, timeout=PROBE_TIMEOUT_S):
            pass
    except urllib.error.HTTPError as exc:
        if exc.code == 404:  # every MLflow server answers /health (behind a proxy's path prefix too)
            raise UserError(VARIABLE, shown_uri(uri), "answers HTTP 404 at /health: not an MLflow tracking server",
                            "point it at the MLflow server's address (http(s)://host:port, with its path prefix if "
                            "it has one)") from None
        if exc.code >= 500:
            raise InfraError("tracking server", shown_uri(uri), f"HTTP {exc.code} from /health") from None
    except (OSError, ValueError) as exc:
        raise InfraError("tracking server", shown_uri(uri), f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}") \
            from None
    _check_credentials(uri)


CREDENTIALS_PROBE = "/api/2.0/mlflow/experiments/search"


def _check_credentials(uri: str) -> None:
    """One cheap authenticated read (``CREDENTIALS_PROBE``, one experiment at most) through
    MLflow's own request helper, so its credentials (``CREDENTIAL_VARIABLES``, ``user:password@``
    in the URI, an auth plug-in) are sent as every later call sends them: a 401 or 403 reply
    is ``refused_credentials``' UserError (``/health`` answers without credentials). Any other
    reply, or none within ``PROBE_TIMEOUT_S`` (reachability is ``/health``'s), passes: the
    real calls report it with their own retries."""
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        reply = http_request(get_default_host_creds(uri), CREDENTIALS_PROBE, "GET", max_retries=0, backoff_factor=0,
                             timeout=PROBE_TIMEOUT_S, raise_on_status=False, params={"max_results": 1})
    except Exception:  # noqa: BLE001 - not this probe's to report (see the docstring)
        return
    if reply.status_code in (401, 403):
        raise refused_credentials(reply.status_code, uri)


def client():
    """A client for the configured tracking URI (cached per URI)."""
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("alembic").setLevel(logging.WARNING)
    uri = tracking_uri()
    if uri not in _clients:
        bound_http_waits()
        _checked(uri)
        trackdb.ensure_created(uri)  # never a half-created SQLite schema, even if this process is killed
        trackdb.check_existing(uri)  # one that is there: no empty, foreign or cut-short file
        _clients[uri] = MlflowClient(tracking_uri=uri, registry_uri=uri)
    return _clients[uri]


def experiment_id(pipeline: str) -> str:
    """The pipeline's experiment (created when missing), with the experiment kind tag set.
    One deleted in the MLflow UI (MLflow keeps its name, and takes no runs in it) is a
    UserError naming it and how to restore or purge it."""
    c = client()
    exp = c.get_experiment_by_name(pipeline)
    if exp is not None and exp.lifecycle_stage == "deleted":
        raise _deleted(pipeline, exp.experiment_id)
    if exp is None:
        artifacts = None
        if tracking_uri().startswith("sqlite:"):
            artifacts = (settings.home() / "mlartifacts" / pipeline).as_uri()
        try:
            c.create_experiment(pipeline, artifact_location=artifacts, tags={KIND_TAG: KIND})
        except Exception:  # created concurrently by another stage
            pass
        exp = c.get_experiment_by_name(pipeline)
    if KIND_TAG not in exp.tags:  # made before the tag was set (a kind a user chose is kept)
        c.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
    return exp.experiment_id


def _deleted(pipeline: str, exp_id: str):
    """The UserError for the pipeline's experiment when it is deleted (not yet purged)."""
    import shlex

    from components.core.errors import UserError

    uri = shown_uri(tracking_uri())
    env = f"MLFLOW_TRACKING_URI={shlex.quote(uri)}"
    database = shlex.quote(uri) if not uri.startswith(("http://", "https://")) else "<the server's backend store URI>"
    return UserError("MLflow experiment", pipeline, f"is deleted (experiment id {exp_id} at {uri}), and MLflow makes "
                     "no runs in a deleted experiment",
                     f"restore it ({env} mlflow experiments restore --experiment-id {exp_id}), or purge it so that a "
                     f"new one is made ({env} mlflow gc --backend-store-uri {database} --experiment-ids {exp_id}), "
                     "then run again")


def _quoted(value: str) -> str:
    """``value`` as a string in an MLflow filter, which has no escapes: in single quotes,
    or double ones when it holds a single quote (a run root with both is refused by
    ``settings.resolve``)."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise ValueError(f"{value!r} holds both quote characters: no MLflow filter can match it")


def _first(exp: str, flt: str):
    """The earliest-started run matching ``flt`` (MLflow filter syntax), or None."""
    found = client().search_runs([exp], filter_string=flt, max_results=1, order_by=["attributes.start_time ASC"])
    return found[0] if found else None


def pipeline_run(pipeline: str, run_root: str) -> str:
    """The pipeline's summary run for ``run_root`` (``<pipeline> · timeline``): found by
    tags, or created. It is ended FINISHED at once (MLflow takes metrics and artifacts on
    a finished run), so it never shows as RUNNING; iteration runs nest under it."""
    c = client()
    exp = experiment_id(pipeline)
    found = _first(exp, f"tags.`{TAG_STAGE}` = '{PIPELINE_STAGE}' and tags.`{TAG_RUN_ROOT}` = {_quoted(run_root)}")
    if found is not None:
        run_id = found.info.run_id
    else:
        run_id = c.create_run(exp, run_name=f"{pipeline}{SEP}timeline",
                              tags={TAG_PIPELINE: pipeline, TAG_RUN_ROOT: run_root, TAG_STAGE: PIPELINE_STAGE}).info.run_id
    end_if_running(run_id)  # also one a process killed right after creating it left RUNNING
    return run_id


def find_iteration_run(pipeline: str, iteration: int, run_root: str):
    """The parent run of an iteration (an MLflow ``Run``), or None."""
    return _first(experiment_id(pipeline), f"tags.`{TAG_ITERATION}` = '{iteration}' and tags.`{TAG_RUN_ROOT}` = "
                                           f"{_quoted(run_root)} and tags.`{TAG_STAGE}` = '{ITERATION_STAGE}'")


def _known_run(run_id: str):
    """The run ``run_id`` on this tracking server, or None for "" or an id it does not
    know (a manifest from elsewhere); an outage propagates."""
    from mlflow.exceptions import MlflowException

    if not run_id:
        return None
    try:
        return client().get_run(run_id)
    except MlflowException as exc:
        if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def live(run_id: str) -> bool:
    """Whether ``run_id`` is a run this tracking server has and that is not deleted (a
    deleted run takes no status, tag or metric until it is restored)."""
    run = _known_run(run_id)
    return run is not None and run.info.lifecycle_stage != "deleted"


_replaced: dict[tuple[str, str], str] = {}
"""{(tracking URI, gone iteration run id): the live parent this process used instead}."""


def live_iteration_run(parent_run_id: str, pipeline: str, iteration: int, run_root: str,
                       orchestrator_run_id: str = "") -> str:
    """``parent_run_id`` while it is ``live``; else (deleted in the UI, or unknown here) the
    iteration's live parent run, found by its tags or created (``iteration_run``). The
    stage runs nested under a deleted parent (not deleted themselves) are moved under the
    live one, so the UI's walk from the iteration run reaches all of them again."""
    if live(parent_run_id):
        return parent_run_id
    current = iteration_run(pipeline, iteration, run_root, orchestrator_run_id)
    if parent_run_id:
        _replaced[(tracking_uri(), parent_run_id)] = current
        _adopt(parent_run_id, current)
    return current


def _adopt(gone: str, current: str) -> list[str]:
    """Nest the runs under ``gone`` (a deleted run; they are not deleted) under ``current``
    instead; returns their ids. Nothing for a run this tracking server does not know."""
    if (run := _known_run(gone)) is None:
        return []
    c, exp = client(), run.info.experiment_id
    moved = []
    for run in c.search_runs([exp], filter_string=f"tags.`{TAG_PARENT}` = {_quoted(gone)}", max_results=1000):
        if run.info.run_id != current:
            c.set_tag(run.info.run_id, TAG_PARENT, current)
            moved.append(run.info.run_id)
    return moved


def _successor(run_id: str) -> str:
    """For an iteration run that is not ``live``: the live parent of the same iteration
    (the one this process used instead, else found by the gone run's tags, which a
    deleted run keeps); "" when there is none or nothing says which iteration it was."""
    if (found := _replaced.get((tracking_uri(), run_id))) and live(found):
        return found
    if (gone := _known_run(run_id)) is None:
        return ""
    tags = gone.data.tags
    if tags.get(TAG_STAGE) != ITERATION_STAGE or not tags.get(TAG_ITERATION, "").isdigit() or TAG_PIPELINE not in tags:
        return ""
    run = find_iteration_run(tags[TAG_PIPELINE], int(tags[TAG_ITERATION]), tags.get(TAG_RUN_ROOT, ""))
    return run.info.run_id if run is not None else ""


def iteration_run(pipeline: str, iteration: int, run_root: str, orchestrator_run_id: str = "") -> str:
    """The parent run of an iteration: found by tags, or created under the pipeline's
    summary run. A parent that an earlier attempt ended FAILED or KILLED is set RUNNING
    again: the resumed iteration goes on in the same run. A deleted one is not found (a
    new one is made)."""
    c = client()
    found = find_iteration_run(pipeline, iteration, run_root)
    if found is not None:
        if found.info.status in ("FAILED", "KILLED"):
            c.update_run(found.info.run_id, status="RUNNING")
        return found.info.run_id
    summary = pipeline_run(pipeline, run_root)
    run = c.create_run(
        experiment_id(pipeline),
        run_name=iteration_name(iteration),
        tags={TAG_PIPELINE: pipeline, TAG_ITERATION: str(iteration), TAG_RUN_ROOT: run_root,
              TAG_STAGE: ITERATION_STAGE, TAG_ORCH: orchestrator_run_id, TAG_PARENT: summary},
    )
    return run.info.run_id


def end_children(parent_run_id: str, status: str = "KILLED", stage: str = "", shard_index: int = -1) -> list[str]:
    """End with ``status`` the RUNNING runs nested under ``parent_run_id`` (only those of
    ``stage``, and of shard ``shard_index`` when >= 0, if given); returns their ids. A
    parent this tracking server does not know has none; a deleted parent's live children
    are ended, and a child deleted meanwhile is skipped."""
    if (parent := _known_run(parent_run_id)) is None:
        return []
    c, exp = client(), parent.info.experiment_id
    flt = f"attributes.status = 'RUNNING' and tags.`{TAG_PARENT}` = {_quoted(parent_run_id)}"
    if stage:
        flt += f" and tags.`{TAG_STAGE}` = {_quoted(stage)}"
    if shard_index >= 0:
        flt += f" and tags.`{TAG_SHARD}` LIKE '{shard_index}/%'"
    ended = []
    for run in c.search_runs([exp], filter_string=flt, max_results=1000):  # deleted runs are not found
        if _terminated(run.info.run_id, status):
            ended.append(run.info.run_id)
    return ended


def _terminated(run_id: str, status: str) -> bool:
    """``set_terminated``; False, and nothing done, for a run deleted since it was read
    (MLflow refuses it: "must be in the 'active' state")."""
    from mlflow.exceptions import MlflowException

    try:
        client().set_terminated(run_id, status)
    except MlflowException as exc:
        if getattr(exc, "error_code", "") in ("INVALID_PARAMETER_VALUE", "INVALID_STATE") and not live(run_id):
            return False
        raise
    return True


def fail_iteration(parent_run_id: str, stage: str = "", shard_index: int = -1) -> list[str]:
    """The orchestrator gave up on an iteration: its stage runs still RUNNING end KILLED
    (only those of ``stage``, and of shard ``shard_index`` when >= 0, if given) and its
    parent run ends FAILED (if RUNNING). Returns the ids of the stage runs it ended. For a
    parent that is gone (deleted, or unknown here), the same is done to the iteration's
    live parent (``_successor``), if it has one."""
    ended = end_children(parent_run_id, "KILLED", stage, shard_index)
    for current in _current(parent_run_id):
        if current != parent_run_id:
            ended += end_children(current, "KILLED", stage, shard_index)
        end_if_running(current, "FAILED")
    return ended


def _current(parent_run_id: str) -> list[str]:
    """``[parent_run_id]`` while it is ``live``; else its ``_successor``, if any."""
    if not parent_run_id:
        return []
    if live(parent_run_id):
        return [parent_run_id]
    return [found] if (found := _successor(parent_run_id)) else []


def running_iteration_runs(pipeline: str, run_root: str, status: str = "RUNNING") -> dict[int, str]:
    """{iteration: parent run id} of the iterations of ``run_root`` whose parent has ``status``."""
    flt = (f"attributes.status = {_quoted(status)} and tags.`{TAG_STAGE}` = '{ITERATION_STAGE}' "
           f"and tags.`{TAG_RUN_ROOT}` = {_quoted(run_root)}")
    found = client().search_runs([experiment_id(pipeline)], filter_string=flt, max_results=1000)
    return {int(r.data.tags[TAG_ITERATION]): r.info.run_id for r in found}


UNFINISHED = ("RUNNING", "FAILED", "KILLED")
"""The statuses of an iteration's parent run that ``finish_iteration`` ends FINISHED."""


def unfinished_iteration_runs(pipeline: str, run_root: str) -> dict[int, str]:
    """{iteration: parent run id} of the iterations of ``run_root`` whose parent is
    RUNNING, FAILED or KILLED (``UNFINISHED``)."""
    found: dict[int, str] = {}
    for status in UNFINISHED:
        found.update(running_iteration_runs(pipeline, run_root, status))
    return found


def finish_iteration(parent_run_id: str) -> list[str]:
    """The iteration's last stage has its manifest: its stage runs still RUNNING end
    KILLED (attempts a killed process left, a shard count the recipe no longer has:
    ``kill_stale_runs`` matches neither), and its parent run ends FINISHED, also one an
    orchestrator ended FAILED or KILLED before a later attempt finished the iteration
    (``posttrain stage`` reopens the parent only at taskgen). Returns the ids of the stage
    runs it ended. A parent this tracking server does not know, or one deleted, is left
    alone; the iteration's live parent that replaced it (``live_iteration_run``) is ended
    instead, its stage runs with it."""
    ended = end_children(parent_run_id, "KILLED")
    for current in _current(parent_run_id):
        if current != parent_run_id:
            ended += end_children(current, "KILLED")
        end_if_running(current, "FINISHED", UNFINISHED)
    return ended


def end_if_running(run_id: str, status: str = "FINISHED", ending: tuple[str, ...] = ("RUNNING",)) -> bool:
    """End ``run_id`` with ``status`` if its status is one of ``ending`` (by default: it is
    still RUNNING; True when it was ended); a run id this tracking server does not know is
    left alone (the manifest came from elsewhere), and so is a deleted run."""
    run = _known_run(run_id)
    if run is None or run.info.status not in ending or run.info.lifecycle_stage == "deleted":
        return False
    return _terminated(run_id, status)


def run_url(pipeline: str, run_id: str) -> str:
    """Where a run opens in the MLflow UI: the tracking server's, or a local ``mlflow ui``'s."""
    uri = tracking_uri()
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://localhost:5000"
    return f"{base}/#/experiments/{experiment_id(pipeline)}/runs/{run_id}"


def _flatten(prefix: str, obj: Any, out: dict[str, str]) -> dict[str, str]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = str(obj)[:500]
    return out


@contextmanager
def stage_run(pipeline: str, stage: str, run_name: str, parent_run_id: str | None, params: dict[str, Any],
              tags: dict[str, str] | None = None) -> Iterator[str]:
    """A (nested) run for one stage; ends FINISHED when the body returns (so put the
    manifest write inside it), KILLED if the body was told to stop (``end_status``),
    FAILED if it raised anything else. Earlier attempts of the same stage run (same run
    name, stage, iteration and run root) still marked RUNNING, left so by a killed
    process, are marked KILLED first. A ``parent_run_id`` that is gone (deleted in the UI,
    or unknown here) is replaced by the iteration's live parent (``live_iteration_run``)."""
    from mlflow.entities import Param

    c = client()
    all_tags = {TAG_PIPELINE: pipeline, TAG_STAGE: stage, **(tags or {})}
    iteration, run_root = all_tags.get(TAG_ITERATION, ""), all_tags.get(TAG_RUN_ROOT, "")
    if parent_run_id and iteration.isdigit() and run_root:
        parent_run_id = live_iteration_run(parent_run_id, pipeline, int(iteration), run_root, all_tags.get(TAG_ORCH, ""))
    if parent_run_id:
        all_tags[TAG_PARENT] = parent_run_id
    kill_stale_runs(pipeline, stage, run_name, iteration, run_root, all_tags.get(TAG_SHARD, ""))
    run = c.create_run(experiment_id(pipeline), run_name=run_name, tags=all_tags)
    run_id = run.info.run_id
    flat = _flatten("", params, {})
    items = [Param(k, v) for k, v in sorted(flat.items())]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i:i + 100])
    try:
        yield run_id
    except BaseException as exc:
        c.set_terminated(run_id, end_status(exc))
        raise
    c.set_terminated(run_id, "FINISHED")
    supersede(pipeline, stage, run_name, iteration, run_root, run_id)


def _attempts(pipeline: str, status: str, stage: str, iteration: str, run_root: str) -> list:
    """The runs with ``status`` of ``stage`` in ``iteration`` of ``run_root`` (any shard)."""
    if not iteration or not run_root:
        return []  # nothing to match on
    try:  # a run root with ' is quoted with " (settings.resolve refuses one holding both)
        flt = (f"attributes.status = {_quoted(status)} and tags.`{TAG_STAGE}` = {_quoted(stage)} "
               f"and tags.`{TAG_ITERATION}` = {_quoted(iteration)} and tags.`{TAG_RUN_ROOT}` = {_quoted(run_root)}")
    except ValueError:
        return []  # both quote characters: no MLflow filter can match it
    return client().search_runs([experiment_id(pipeline)], filter_string=flt, max_results=1000)


def kill_stale_runs(pipeline: str, stage: str, run_name: str, iteration: str, run_root: str, shard: str = "") -> list[str]:
    """Mark KILLED the RUNNING runs of this stage attempt (same run name, which carries
    the shard, stage, iteration and run root) and, for a shard ``i/n``, those of the stage,
    iteration and run root under another shard count (the recipe's ``shards`` changed; the
    runner drops their manifests): runs whose process died without ending them. One writer
    per pipeline (the store lease) means none of them is still alive. Returns their ids.
    Not covered: a shard of another count that is really running (two runs of different
    shard counts on one iteration at once, which the iteration's lease keeps apart)."""
    count = shard.partition("/")[2]

    def stale(run) -> bool:
        if run.info.run_name == run_name:
            return True
        other = run.data.tags.get(TAG_SHARD, "")
        return bool(count) and bool(other) and other.partition("/")[2] != count

    killed = []
    for run in _attempts(pipeline, "RUNNING", stage, iteration, run_root):
        if stale(run):
            client().set_terminated(run.info.run_id, "KILLED")
            killed.append(run.info.run_id)
    return killed


def supersede(pipeline: str, stage: str, run_name: str, iteration: str, run_root: str, run_id: str) -> list[str]:
    """Tag ``TAG_SUPERSEDED_BY`` = ``run_id`` on the other FINISHED runs of this stage
    attempt (same run name, stage, iteration and run root): ``run_id`` finished after them,
    so its manifest is the current one. Returns their ids. Not covered: FINISHED runs of
    the stage under another shard count (their manifests were removed; nothing marks them)."""
    marked = []
    for run in _attempts(pipeline, "FINISHED", stage, iteration, run_root):
        if run.info.run_name == run_name and run.info.run_id != run_id \
                and run.data.tags.get(TAG_SUPERSEDED_BY) != run_id:
            client().set_tag(run.info.run_id, TAG_SUPERSEDED_BY, run_id)
            marked.append(run.info.run_id)
    return marked


def mark_superseded(run_id: str, by: str) -> bool:
    """Tag ``TAG_SUPERSEDED_BY`` = ``by`` on ``run_id`` (True when it was set now); a run
    this tracking server does not know, or one deleted, is left alone."""
    from mlflow.exceptions import MlflowException

    try:
        if client().get_run(run_id).data.tags.get(TAG_SUPERSEDED_BY) == by:
            return False
        client().set_tag(run_id, TAG_SUPERSEDED_BY, by)
    except MlflowException as exc:
        if getattr(exc, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "INVALID_PARAMETER_VALUE"):
            return False
        raise
    return True


def log_metrics(run_id: str, metrics: dict[str, float], step: int = 0, timestamp_ms: int | None = None) -> None:
    """Log ``metrics`` at ``step``, stamped ``timestamp_ms`` (default: now)."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    items = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items())]
    for i in range(0, len(items), 500):
        client().log_batch(run_id, metrics=items[i:i + 500])


def log_datasets(run_id: str, datasets: dict[str, tuple[str, str]], context: str = "training") -> None:
    """Log inputs as MLflow datasets: {name: (source URI, digest)}; the data is not copied."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    inputs = []
    for name, (uri, digest) in datasets.items():
        with warnings.catch_warnings():  # "file" is registered twice by MLflow itself; either is right
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(uri)
        ds = MetaDataset(source=source, name=name, digest=digest[:36])
        inputs.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]))
    try:
        client().log_inputs(run_id, datasets=inputs)
    except Exception as exc:
        # MLflow's SQL store checks for a dataset, then inserts it: two shards logging the
        # same input at once make the slower one hit the unique key. The dataset is there
        # now, so a second call links it instead of inserting it.
        if "UNIQUE constraint failed: datasets" not in str(exc) and "Duplicate entry" not in str(exc):
            raise
        client().log_inputs(run_id, datasets=inputs)


def log_artifact_text(run_id: str, text: str, artifact_file: str) -> None:
    client().log_text(run_id, text, artifact_file)
