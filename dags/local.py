"""Run the DAG on the embedded defaults: Airflow's in-process test runner, or a real
scheduler on this machine.

``prepare`` points Airflow at a SQLite home under ``POSTTRAIN_HOME`` (migrated once) and
sizes the sandbox pool; ``run_iteration`` calls ``dag.test()`` once with the recipe,
run root and lease holder as the run's params (the plan task finds the iteration through
the holder's lease) and returns the DAG run's state. Which
iterations to run (and skipping finished ones) is ``orchestrate.run_local``'s job; a
half-done iteration resumes because every stage with a matching manifest is a cache hit.

``LocalAirflow`` starts the real thing on the same SQLite home: ``airflow scheduler``
(LocalExecutor), ``airflow dag-processor`` and ``airflow api-server`` as separate
processes, each in its own session, with this folder as the DAGs folder, and stops every
process they started (tasks included). The tests (``tests/fixtures/airflow.py``) and
``benchmarks/iteration.py`` use it:

    with LocalAirflow.start(home, env) as af:
        af.api("PATCH", "/dags/post_training_iteration", {"is_paused": False})

Its scheduler runs ``PreloadingLocalExecutor``: the LocalExecutor forks one process per
task from its workers, so the libraries every stage imports (torch, transformers,
MLflow, Great Expectations, the stage modules) are imported once, in the scheduler,
before the workers fork, instead of again in every task. Not covered: a deployment
(use Airflow's Helm chart; see infra/terraform), authentication (the API server lets
everyone in as admin: it listens on this machine only for tests and benchmarks), and
Postgres.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from components.core import hfimport
from components.core.stages import SANDBOX_POOL

DAG_ID = "post_training_iteration"
DAGS_FOLDER = Path(__file__).resolve().parent
PRELOAD = ("torch", "transformers:AutoModelForCausalLM", "transformers:AutoTokenizer",
           "transformers.models.llama.modeling_llama", "mlflow.tracking:MlflowClient",
           "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.model_registry.sqlalchemy_store",
           "great_expectations", "pyarrow.parquet", "pyarrow.dataset", "pandas", "matplotlib.pyplot", "dags.wiring")
"""Imported by the scheduler before its workers fork, then every stage module and the
domains, engine and sandbox backend of ``POSTTRAIN_RECIPE``; ``module:name`` also gets
``name`` from it (transformers and MLflow load most of their code lazily)."""
SANDBOX_POOL_NOTE = "caps concurrent sandbox tasks"
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0

log = logging.getLogger("posttrain")


def airflow_settings(home: Path) -> dict[str, str]:
    """The Airflow configuration of the embedded home (no environment is changed)."""
    return {
        "AIRFLOW_HOME": str(home / "airflow"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_FOLDER),
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": os.environ.get("AIRFLOW__LOGGING__LOGGING_LEVEL", "WARNING"),
    }


def airflow_env(home: Path) -> dict[str, str]:
    """``airflow_settings`` into this process's environment (set values win), for dag.test()."""
    for key, value in airflow_settings(home).items():
        os.environ.setdefault(key, value)
    return {k: os.environ[k] for k in airflow_settings(home)}


def prepare(home: Path, sandbox_slots: int, env: dict[str, str] | None = None) -> None:
    """Migrate the SQLite metadata DB (once) and size the sandbox pool. Without ``env``
    the settings go into this process's environment (dag.test() reads them there) and the
    migration and pool run in this process (an ``airflow`` CLI process costs seconds of
    start-up on every ``posttrain run``); with ``env`` (another home: ``LocalAirflow``)
    both go through the ``airflow`` CLI."""
    in_process = env is None
    env = env if env is not None else {**os.environ, **airflow_env(home)}
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    marker = Path(env["AIRFLOW_HOME"]) / ".migrated"
    airflow = [sys.executable, "-m", "airflow"]
    if marker.exists() and "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" not in env:
        _set_aside_if_damaged(Path(env["AIRFLOW_HOME"]) / "airflow.db", marker)
    if not marker.exists():
        if in_process:
            from airflow.utils import db

            db.upgradedb()  # what `airflow db migrate` runs, without a second interpreter's start-up
            _seed_rows()
        else:
            subprocess.run([*airflow, "db", "migrate"], env=env, check=True, capture_output=True)
        marker.write_text("ok\n")
    if in_process:
        from airflow.models.pool import Pool

        current = Pool.get_pool(SANDBOX_POOL)
        if current is None or current.slots != sandbox_slots:
            Pool.create_or_update_pool(SANDBOX_POOL, sandbox_slots, SANDBOX_POOL_NOTE, include_deferred=False)
        return
    subprocess.run([*airflow, "pools", "set", SANDBOX_POOL, str(sandbox_slots), SANDBOX_POOL_NOTE],
                   env=env, check=True, capture_output=True)


def _set_aside_if_damaged(database: Path, marker: Path) -> None:
    """The embedded home's Airflow database, when it is gone or damaged (cut short, not a
    database, no schema), is made anew: a damaged file is renamed beside it first, with
    one line saying so. It holds only this home's ``dag.test()`` run history: what a
    pipeline has done is in its run root, so nothing a run resumes from is lost. Every
    rerun failed on it before (``no such table: slot_pool``, ``database disk image is
    malformed``), since ``.migrated`` said the migration was done."""
    from components.core.progress import say
    from components.core.trackdb import sqlite_problem

    if not (database.exists() or database.is_symlink()):  # deleted: migrated anew
        marker.unlink()
        return
    problem = sqlite_problem(database, "Airflow") if database.is_file() else "is not a regular file"
    if problem is None:
        return
    aside = database.with_name(f"{database.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    database.rename(aside)
    for extra in ("-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            database.with_name(database.name + extra).rename(aside.with_name(aside.name + extra))
    say(f"the Airflow database {database} {problem}; moved it to {aside.name} and made a new one "
        "(it held only this home's DAG run history; the run root holds the pipeline's state)")
    marker.unlink()


def _seed_rows() -> None:
    """Add the default pool and the log template row if they are missing, and commit.

    Airflow commits a fresh database's tables and revision stamp before it adds these
    rows. A run killed between the two leaves a database at the head revision with no
    log template. ``upgradedb`` on such a database adds the rows but never commits them,
    so every later DAG run fails its insert (``FOREIGN KEY constraint failed`` on
    ``dag_run.log_template_id``). Both calls are idempotent. The CLI path of ``prepare``
    (``LocalAirflow``'s fresh homes) does not repair this."""
    from airflow.utils import db
    from airflow.utils.session import create_session

    with create_session() as session:
        db.add_default_pool_if_not_exists(session=session)
        db.synchronize_log_template(session=session)


NAME = "DAG"
STAGES_IN_PROCESS = True
"""``run_local``'s driver: ``dag.test()`` runs every task in this process (the stages in the stage host)."""


def final_errors() -> list[BaseException]:
    """The UserErrors and DataQualityErrors this process's tasks raised
    (``dags.wiring.FINAL_ERRORS``), for ``run_local`` to end with the first one's line."""
    from dags.wiring import FINAL_ERRORS

    return FINAL_ERRORS


def run_iteration(recipe_path: str, run_root: str, holder: str) -> str:
    """One ``dag.test()`` run for the iteration ``holder`` has leased (its plan task finds
    it); returns the DAG run's final state."""
    from dags.post_training_iteration import iteration_dag

    # Airflow reads .airflowignore through pathspec's GitWildMatchPattern, which pathspec 1.x
    # deprecates: a warning on every run that no user of posttrain can act on.
    warnings.filterwarnings("ignore", message=r"GitWildMatchPattern \('gitwildmatch'\) is deprecated",
                            category=DeprecationWarning)
    from dags.wiring import FAILED_TASKS

    FAILED_TASKS.clear()  # this run's failures only
    dag_log = logging.getLogger("airflow.sdk.definitions.dag")
    dag_log.addFilter(_after_a_failure)
    processors = structlog_processors()
    processors.insert(0, _without_a_final_errors_traceback)
    try:
        with _signals_kept():
            dr = iteration_dag.test(run_conf={"recipe": recipe_path, "run_root": run_root, "holder": holder})
    finally:
        dag_log.removeFilter(_after_a_failure)
        with contextlib.suppress(ValueError):
            processors.remove(_without_a_final_errors_traceback)
    return str(getattr(dr, "state", "unknown"))


TASK_RUNNER = "airflow.sdk.execution_time.task_runner"


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """``dag.test()`` with posttrain's handlers: SIGTERM and Ctrl-C are recorded between
    tasks (``runner.stop_signals_recorded``: the next task refuses to start and the command
    stops after the DAG run) and raised inside a stage: an in-process one
    (``wiring.run_stage_task``), and a stage container's or pod's operator, which then stops
    its container or deletes its pod (``dags.execution.run_stoppably``; before, the
    container ran on to its end).
    Airflow's task runner installs a SIGTERM handler at every task's start that only calls
    the operator's ``on_kill`` (none here) and never puts the previous one back, so a
    SIGTERM between two tasks, or after the last, was lost and ``posttrain run`` went on
    to the next iteration. Within, ``signal.signal`` leaves SIGTERM's handler as it is
    when the task runner calls it (it imports ``signal`` inside the function that does)."""
    from components.core.runner import stop_signals_recorded

    install = signal.signal

    def keep_ours(signum: int, handler: Any) -> Any:
        if signum == signal.SIGTERM and sys._getframe(1).f_globals.get("__name__") == TASK_RUNNER:
            return signal.getsignal(signum)
        return install(signum, handler)

    signal.signal = keep_ours
    try:
        with stop_signals_recorded():
            yield
    finally:
        signal.signal = install


def structlog_processors() -> list:
    """structlog's processor list, the one object every logger made from its configuration
    shares (Airflow's task runner logs through it): changed in place, it applies to all."""
    import structlog

    return structlog.get_config()["processors"]


def _without_a_final_errors_traceback(logger: Any, method: str, event: dict) -> dict:
    """Drops the task runner's "Task failed with exception" event, with its traceback
    through Airflow's task runner, for a task that failed on a UserError or a failed
    data-quality gate, or was stopped by a signal: ``posttrain run`` ends with that
    error's one line (or "stopped by SIGTERM"), and the task's own ``posttrain task ...
    failed`` line stays. Other failures keep their traceback."""
    import structlog

    from dags.wiring import FINAL_ERRORS

    if event.get("event") == "Task failed with exception":
        error = event.get("exc_info")
        error = error[1] if isinstance(error, tuple) else error if isinstance(error, BaseException) else sys.exc_info()[1]
        name = type(error).__name__ if error is not None else ""
        if (name == "AirflowFailException" and FINAL_ERRORS) or name == "AirflowTaskTerminated":
            raise structlog.DropEvent
    return event


def _after_a_failure(record: logging.LogRecord) -> bool:
    """Drops ``dag.test()``'s "No tasks to run" warnings once a task of this process has
    failed for good: dag.test() marks the failure's downstream tasks upstream_failed one
    level per pass, a second apart, and names every one of them each time (3-6 lines of
    task-instance reprs before ``posttrain run`` can print the failure's one line). While
    a task only waits for its retry, they still show. Once the process was told to stop
    (SIGTERM or Ctrl-C, recorded by ``_signals_kept``), the wait ends here: dag.test()
    logs this once a second, after its pass committed, while a task waits for its retry
    (up to minutes), and ``tracking.Terminated`` leaves dag.test() from there."""
    from components.core import runner, tracking
    from dags.wiring import FAILED_TASKS, FINAL_ERRORS

    waiting = str(record.msg).startswith("No tasks to run")
    if waiting and runner.stopping():  # told to stop while a task waits for its retry: stop now, not after the wait
        raise tracking.Terminated(f"stopped by {runner.stop_signal().name}")
    return not ((FAILED_TASKS or FINAL_ERRORS) and waiting)


def _recipe_plugins() -> list[tuple[Any, str]]:
    """(registry, name) of the domains, engine and sandbox backend the deployment's recipe names."""
    from components.core import settings
    from components.core.plugins import BACKENDS, DOMAINS, ENGINES
    from components.core.recipe import load_recipe

    try:
        recipe = load_recipe(settings.default_recipe())
    except Exception:  # the plan task reports a bad recipe; preloading just does less
        return []
    return [(DOMAINS, d) for d in recipe.domains] + [(ENGINES, recipe.rollout.engine), (BACKENDS, recipe.sandbox.backend)]


def import_name(name: str) -> None:
    """Import a ``PRELOAD`` entry: ``module``, or ``module:name``, which also gets ``name``
    from it (transformers and MLflow load most of their code lazily)."""
    module, _, attr = name.partition(":")
    if module.split(".")[0] == "transformers":
        hfimport.lean()
    loaded = importlib.import_module(module)
    if attr:
        getattr(loaded, attr)


def preload() -> list[str]:
    """Import ``PRELOAD``, every registered stage module and the recipe's plug-ins; the
    names that imported."""
    from components.core.stages import registered

    done = []
    for name in (*PRELOAD, *(s.module for s in registered())):
        try:
            import_name(name)
            done.append(name)
        except Exception as exc:  # a missing optional library costs start-up time, not correctness
            log.warning("preload: cannot import %s (%s); tasks will import it themselves", name, exc)
    for registry, name in _recipe_plugins():
        try:
            registry.load(name)
            done.append(f"{registry.kind} {name}")
        except Exception as exc:
            log.warning("preload: cannot load %s %s (%s)", registry.kind, name, exc)
    return done


def _preloading_executor() -> type:
    from airflow.executors.local_executor import LocalExecutor

    class PreloadingLocalExecutor(LocalExecutor):
        """The LocalExecutor, with ``preload()`` run before its workers fork: a task process
        starts with the stage libraries already imported (seconds less per task)."""

        def start(self) -> None:
            started = time.perf_counter()
            names = preload()
            self.log.info("preloaded %d modules in %.1f s", len(names), time.perf_counter() - started)
            super().start()

    PreloadingLocalExecutor.__module__, PreloadingLocalExecutor.__qualname__ = __name__, "PreloadingLocalExecutor"
    return PreloadingLocalExecutor


def __getattr__(name: str) -> Any:
    """``dags.local.PreloadingLocalExecutor`` (the scheduler's ``[core] executor``), built on
    first use: importing Airflow at this module's top would fix its configuration before
    ``airflow_env`` sets AIRFLOW_HOME for dag.test()."""
    if name == "PreloadingLocalExecutor":
        globals()[name] = cls = _preloading_executor()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalAirflow:
    """A scheduler, a DAG processor and an API server on one SQLite home (see the module
    docstring). ``api()`` calls the REST API (``/api/v2``); ``stop()`` ends them all."""

    def __init__(self, home: Path, env: dict[str, str], port: int) -> None:
        self.home, self.env, self.port = home, env, port
        self.url = f"http://127.0.0.1:{port}"
        self.airflow_home = Path(env["AIRFLOW_HOME"])
        self.db_path = self.airflow_home / "airflow.db"
        self.procs: dict[str, subprocess.Popen] = {}

    @classmethod
    def start(cls, home: Path, env: dict[str, str], sandbox_slots: int = 2, preload: bool = True,
              parallelism: int = 8, overrides: dict[str, str] | None = None) -> LocalAirflow:
        """Migrate, create the pool, start the three processes and wait until the API
        answers, the scheduler and DAG processor are healthy and the DAG is parsed."""
        port = free_port()
        executor = f"{__name__}.PreloadingLocalExecutor" if preload else "LocalExecutor"
        env = {**env, **airflow_settings(home), "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
               "AIRFLOW__CORE__EXECUTOR": executor, "AIRFLOW__CORE__PARALLELISM": str(parallelism),
               "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
               "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(64), "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
               "AIRFLOW__API__HOST": "127.0.0.1", "AIRFLOW__API__PORT": str(port),
               "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
               "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
               "PYTHONPATH": os.pathsep.join(p for p in (str(DAGS_FOLDER.parent), env.get("PYTHONPATH", "")) if p),
               **(overrides or {})}
        prepare(home, sandbox_slots, env)
        af = cls(home, env, port)
        logs = af.airflow_home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        try:
            for name, args in (("api-server", ["api-server", "--port", str(port)]), ("dag-processor", ["dag-processor"]),
                               ("scheduler", ["scheduler"])):
                with open(logs / f"{name}.log", "ab") as out:
                    af.procs[name] = subprocess.Popen([sys.executable, "-m", "airflow", *args], env=env, stdout=out,
                                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                      cwd=af.airflow_home, start_new_session=True)
            af.wait_ready()
        except BaseException:
            af.stop()
            raise
        return af

    def __enter__(self) -> LocalAirflow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.airflow_home / "logs" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def api(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
        """One REST call (``/api/v2`` + path); the decoded JSON answer, HTTPError on 4xx/5xx."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.url}/api/v2{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until the three are healthy, the DAG is parsed and the executor's workers run."""
        deadline, last = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"airflow {name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            try:
                health = self.api("GET", "/monitor/health", timeout=5)
                if all(health.get(c, {}).get("status") == "healthy" for c in ("metadatabase", "scheduler", "dag_processor")):
                    self.api("GET", f"/dags/{DAG_ID}", timeout=5)  # 404 until the DAG processor has parsed it
                    if "Worker starting up" in self.log_tail("scheduler", 200):  # the executor (after preload) is up
                        return
                    last = "the scheduler's executor has not started its workers yet"
                else:
                    last = json.dumps(health)
            except (OSError, urllib.error.HTTPError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
        raise RuntimeError(f"Airflow was not ready within {timeout:.0f} s (last: {last}):\n{self.log_tail('scheduler')}")

    def leftovers(self) -> list[int]:
        """Live processes this instance started: the three, everything below them (tasks
        move to process groups and sandboxes to sessions of their own), and anything that
        carries its AIRFLOW_HOME (in case its parent died first)."""
        marker = f"AIRFLOW_HOME={self.env['AIRFLOW_HOME']}".encode()
        children: dict[int, list[int]] = {}
        ours: set[int] = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            pid = int(entry.name)
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if fields[0] == "Z":  # dead, waiting for its parent
                    continue
                children.setdefault(int(fields[1]), []).append(pid)
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    ours.add(pid)
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
        todo = [p.pid for p in self.procs.values() if p.poll() is None] + list(ours)
        while todo:
            pid = todo.pop()
            ours.add(pid)
            todo.extend(c for c in children.get(pid, ()) if c not in ours)
        return sorted(ours)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> list[int]:
        """SIGTERM every process it started, SIGKILL what is still alive after ``timeout``;
        returns the pids that needed SIGKILL."""
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        return left
