"""``posttrain run``: N iterations of the Airflow DAG on the embedded defaults.

One writer per pipeline: the run first takes an exclusive lock on ``<home>/run.lock``
(before it touches the home's SQLite MLflow), then the pipeline's writer lease in the
store (``components.core.lease``, renewed while it runs); a second ``posttrain run`` on
the same home, or on the same pipeline in the same run root, is refused with one line
naming the holder (host, pid, start time) and exit status 2. A killed run leaves no lock,
and its lease is taken over at once on the same host (the process is gone), else when
it expires.

Before any of that, the settings that need nothing made: ``--iterations``,
``POSTTRAIN_TORCH_THREADS``, ``POSTTRAIN_GC``, ``MLFLOW_TRACKING_URI`` and, for the
Airflow driver, the DAG's ``POSTTRAIN_EXECUTION``, ``POSTTRAIN_SCHEDULE`` and
``POSTTRAIN_RETRY_DELAY_S`` (``dags.execution.check_settings``), and the sandbox's job
interpreter where the sandbox runs on this machine (``check_sandbox_python``), so a bad one
stops the run before the home is made. Then, under the lock, the checks of
``check_before_run`` (``components.core.preflight``: the task file and the policy's
files, then the store, then the registry; each failure is one UserError, exit 2); a run they
refuse leaves no run-root folder it made (``<home>/run.lock`` stays: a lock file is
never removed, or two runs could lock two different files). Then it drives
``dags/local.py`` (Airflow's in-process test runner on SQLite), which lives beside it
in this folder. Which iteration comes next is the planner's choice (the same one the
scheduled DAG makes), so a killed run started again resumes where it stopped. After
each iteration it prints a table of eval pass rates by domain; at the end, the command that opens the MLflow UI on this run.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import ModuleType

from components.core import lease, preflight, runner, settings, tracking
from components.core.children import alive
from components.core.context import read_manifest
from components.core.errors import UserError
from components.core.facts import Decision, Scored, Slice
from components.core.manifest import check_not_past_max, stage_prefix
from components.core.planner import finished, plan
from components.core.progress import say
from components.core.recipe import Recipe, load_recipe
from components.core.storage import Store, removed_if_refused
from components.domains.taskfile import check_task_file, check_weighted, train_pools
from dags import execution, stagehost


def weakest_text(worst: Slice | None) -> str:
    """The weakest eval slice (domain/difficulty/context bucket), or '-'."""
    return worst.text() if worst else "-"


def summary_rows(store: Store, recipe: Recipe, upto: int) -> list[tuple[str, str, dict[str, float], str, str]]:
    rows = []
    boot = read_manifest(store, stage_prefix(recipe.pipeline, 0, "bootstrap"))
    if boot is not None:
        b = boot.facts(Scored)
        rows.append(("0 (bootstrap)", b.version, b.pass_rates, "champion", weakest_text(b.weakest_slice)))
    for k in range(1, upto + 1):
        m = read_manifest(store, stage_prefix(recipe.pipeline, k, "evaluation"))
        if m is not None:
            d = m.facts(Decision)
            rows.append((str(k), d.version, d.pass_rates, "promoted" if d.promoted else "held",
                         weakest_text(d.weakest_slice)))
    return rows


def print_table(rows, domains: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="eval pass@1 by domain")
    for col in ["iteration", "version", *domains, "mean", "decision", "weakest slice"]:
        table.add_column(col)
    for it, version, rates, decision, worst in rows:
        mean = sum(rates.values()) / max(1, len(rates))
        table.add_row(it, version, *[f"{rates.get(d, float('nan')):.3f}" for d in domains], f"{mean:.3f}", decision, worst)
    Console(width=160).print(table)


_STARTED = time.time()  # this process's start, as the lock file and the lease name it


def holder_text(home: Path) -> str:
    """Who this run is, for a lock file and a lease: host, pid, start time (UTC) and home."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_STARTED))
    return f"posttrain run on host {socket.gethostname()} pid {os.getpid()} started {started} home {home}"


_HOLDER = re.compile(r"^posttrain run on host (?P<host>\S+) pid (?P<pid>\d+) started (?P<started>\S+) home (?P<home>.+)$")


def stale_on_this_host(home: Path) -> Callable[[lease.Lease], bool]:
    """Judge a live writer lease: its holder is gone if it ran on this host and its
    process no longer exists, or it used this home (whose lock this run now holds, so
    that holder is dead: the lock dies with its process). Holders on other hosts are
    judged by their lease's expiry alone."""

    def stale(cur: lease.Lease) -> bool:
        m = _HOLDER.match(cur.holder)
        if m is None or m["host"] != socket.gethostname():
            return False
        return m["home"] == str(home) or not alive(int(m["pid"]))

    return stale


def other_local_run(cur: lease.Lease) -> bool:
    """An iteration lease of another ``posttrain run`` (``local:<its home>``) is stale once
    this run holds the pipeline's writer lease: that run stopped (killed, or on another
    home) without finishing the iteration, so this run resumes it."""
    return cur.holder.startswith("local:")


def _read_holder(fh) -> str:
    for _ in range(20):  # the holder writes its line right after taking the lock
        fh.seek(0)
        text = fh.read().strip()
        if text:
            return text
        time.sleep(0.05)
    return "an unknown process"


_LOCKED_HOMES: set[str] = set()
"""The homes whose run lock (``home_lock``) this process holds now."""


def drives_here(holder: str) -> bool:
    """Whether ``holder`` is the ``local:<home>`` of the ``posttrain run`` (or ``posttrain
    kfp-local``) of this very process, which holds that home's run lock now. ``posttrain
    run`` passes its holder to the DAG run it drives here (``dag.test()``); a holder typed
    into a DAG run's conf names a home anyone can copy (the "busy" line prints it), and a
    scheduler's worker is never this process, so it is never that run's (with it, a DAG run
    would work on the iteration that command holds, and keep the lease when it fails)."""
    return holder.startswith("local:") and holder[len("local:"):] in _LOCKED_HOMES


def in_posttrain_run() -> bool:
    """Whether this process is a ``posttrain run`` (or ``posttrain kfp-local``): it holds a
    home's run lock now."""
    return bool(_LOCKED_HOMES)


@contextmanager
def home_lock(home: Path) -> Iterator[None]:
    """One ``posttrain run`` per home: an exclusive lock on ``<home>/run.lock``, which then
    holds this run's host, pid and start time. The lock dies with the process, so a killed
    run never blocks the next one. A second run is refused (UserError, exit 2) with one
    line naming the holder. Within, ``drives_here(f"local:{home}")`` is true."""
    home.mkdir(parents=True, exist_ok=True)
    with _lock_file(home / "run.lock") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError("POSTTRAIN_HOME", str(home), f"is in use by {_read_holder(fh)}",
                            "wait for that run to finish or stop it, or set POSTTRAIN_HOME to another folder") from None
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(holder_text(home) + "\n")
            fh.flush()
            _LOCKED_HOMES.add(str(home))
            yield
        finally:
            _LOCKED_HOMES.discard(str(home))
            fh.seek(0)
            fh.truncate()
            fh.flush()
            fcntl.flock(fh, fcntl.LOCK_UN)


def _lock_file(path: Path):
    """``path`` opened for reading and writing, made if missing; a UserError naming it when
    it is not a regular file (a folder, a FIFO, a link: to ``/dev/zero`` it took the
    lock's truncate as a traceback) or cannot be opened."""
    fix = "remove it: posttrain run makes it again (it holds only the running command's host and pid)"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        known = {errno.ELOOP: "is a symbolic link, not a regular file", errno.EISDIR: "is a folder, not a regular file"}
        problem = known.get(exc.errno or 0, f"cannot be opened as the home's lock file ({exc.strerror or exc})")
        raise UserError("POSTTRAIN_HOME", str(path), problem, fix) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError("POSTTRAIN_HOME", str(path), "is not a regular file (a FIFO, a device or a socket)", fix)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a+")


@contextmanager
def writer_lease(store: Store, pipeline: str, home: Path) -> Iterator[str]:
    """The pipeline's writer lease in the store (``components.core.lease``), held while the
    body runs and renewed in the background; a live lease of another ``posttrain run``
    (another home, another machine) refuses this one with one line naming it (UserError,
    exit 2). A lease left by a killed run is taken over: at once when it ran on this host
    (its process is gone), else once it expires (``lease.WRITER_TTL_S``).

    A run that loses its lease stops: when a renewal finds another holder, or when no
    renewal has succeeded for the lease's whole lifetime (the store was unreachable, or
    the process was paused: another run may have taken it over since), the renewing thread
    sends this process SIGTERM, so the running stage ends as a stopped one does (its
    MLflow run KILLED) and no further task starts, and the body's end becomes a UserError
    (exit 2) naming the reason. Not covered: a stage whose process ignores SIGTERM, and
    writes between the lease's expiry and the signal landing."""
    holder = holder_text(home)
    ttl_s = lease.WRITER_TTL_S
    try:
        lease.acquire_writer(store, pipeline, holder, stale=stale_on_this_host(home), ttl_s=ttl_s)
    except lease.LeaseHeld as exc:
        left = max(0.0, exc.lease.expires_at - time.time())
        raise UserError("run_root", store.uri, f"pipeline {pipeline!r} is being run by {exc.lease.holder} "
                        f"(its lease expires in {left:.0f} s unless renewed)",
                        "wait for that run to finish or stop it (a stopped run's lease is taken over once it "
                        "expires), or use another run root") from None
    stop = threading.Event()
    lost: list[str] = []

    def lose(reason: str) -> None:
        lost.append(reason)
        say(f"writer lease of {pipeline!r} {reason}; this run stops")
        os.kill(os.getpid(), signal.SIGTERM)

    def renew() -> None:
        renewed = time.monotonic()
        while not stop.wait(ttl_s / 5):
            try:
                if not lease.renew_writer(store, pipeline, holder, ttl_s=ttl_s):
                    cur = lease.current(store, pipeline, lease.WRITER)
                    return lose(f"was taken over by {cur.holder if cur else 'nobody (it was released)'}")
                renewed = time.monotonic()
            except Exception as exc:  # an outage: try again at the next beat, while the lease lasts
                if time.monotonic() - renewed >= ttl_s:
                    return lose(f"was not renewed for {ttl_s:.0f} s ({type(exc).__name__}: the store is "
                                "unreachable) and has expired: another run may hold it now")
                say(f"could not renew the writer lease of {pipeline!r} ({type(exc).__name__}); retrying")

    beat = threading.Thread(target=renew, name="posttrain-writer-lease", daemon=True)
    beat.start()
    try:
        yield holder
    except tracking.Terminated:
        if not lost:
            raise
    finally:
        stop.set()
        beat.join(timeout=5)
        if not lost:
            with suppress(Exception):  # an outage at the end: the lease expires by itself
                lease.release_writer(store, pipeline, holder)
    if lost:
        raise UserError("run_root", store.uri, f"this run's writer lease of pipeline {pipeline!r} {lost[0]}, "
                        "so it stopped", "run the same command again once the other run has finished or the "
                        "store is reachable: it resumes the iteration")


def check_sandbox_python(recipe: Recipe) -> None:
    """The bwrap backend's job interpreter (``sandbox.python``, empty: /usr/bin/python3)
    exists on this host and runs in its sandbox's terms (``detect.resolve_python``): a
    UserError naming ``sandbox.python``. A typo was found only when the sandbox stage
    started, after bootstrap, and blamed the host (``sandbox.allow_weak_isolation``). For
    where the sandbox stage runs on this machine: a stage image has its own /usr."""
    if recipe.sandbox.backend == "bwrap":
        from components.sandbox.detect import resolve_python

        resolve_python(recipe.sandbox)


def weight_schedule(recipe: Recipe, first: int, last: int) -> list[tuple[str, dict[str, float]]]:
    """The domain weights of iterations ``first``..``last``, one ``(when, weights)`` pair a
    curriculum step (and one for ``taskgen.domain_weights`` after the last step), ``when``
    as ``"in iterations 3-5"``; only the steps those iterations fall in."""
    cfg, domains = recipe.taskgen, list(recipe.domains)
    edges = [(lo, step.until) for lo, step in zip([1] + [s.until + 1 for s in cfg.curriculum], cfg.curriculum)]
    edges.append((cfg.curriculum[-1].until + 1 if cfg.curriculum else 1, last))
    schedule = []
    for lo, hi in edges:
        lo, hi = max(lo, first), min(hi, last)
        if lo <= hi:
            schedule.append((f"in iteration {lo}" if lo == hi else f"in iterations {lo}-{hi}", cfg.weights_for(lo, domains)))
    return schedule


def check_before_run(recipe: Recipe, store: Store, sandbox_here: bool = True, iterations: int | None = None) -> None:
    """What ``run_local`` checks before any work, each a UserError (exit 2) or an
    InfraError. First what needs neither the store nor MLflow: the sandbox's interpreter
    where the sandbox stage runs on this machine (``sandbox_here``: not in the docker or
    kubernetes mode, whose images hold their own; ``check_sandbox_python``), the tracking
    URI and it against the run root, the task file (every row), and a ``model.source`` or
    ``rollout.policy`` that is a path or store URI. Then the store's probe (it makes a
    missing local run root; a store that is down is an outage before MLflow's database
    is opened), and last what reads the registry: the registered model's owner (another
    run root's model is refused before any work, and before its champion is read), that
    a bootstrapped run root's model is in this database, and the starting policy's alias
    or ``models:/`` source. With ``iterations`` (the run's target), after the store's probe
    tells which iterations are left to run: each domain weighted above 0 in one of them
    has train rows in the task file (``taskfile.check_weighted``). ``run_local`` removes a
    run root made here if a later check refuses the run (``removed_if_refused``)."""
    if sandbox_here:
        check_sandbox_python(recipe)
    preflight.tracking_uri()
    preflight.tracking_vs_run_root(store.uri)
    preflight.task_file(recipe)
    tasks = check_task_file(recipe.taskgen.task_file, list(recipe.domains))
    preflight.policy_source(recipe, registry=False)
    store.check_reachable()
    if tasks and iterations is not None:  # a weighted domain without rows: taskgen would drop it without a word
        pools = train_pools(tasks)
        for when, weights in weight_schedule(recipe, max(finished(store, recipe.pipeline), default=0) + 1, iterations):
            check_weighted(tasks, pools, weights, recipe.taskgen.task_file, when)
    preflight.registry_owner(recipe, store.uri)  # before the champion is read: another run root's is not ours to read
    preflight.registered_here(recipe, store)
    preflight.policy_source(recipe)


CUDA_CHECK = (
    "import sys\nfrom components.core.errors import UserError\nfrom components.trainer.device import resolve_device\n"
    "try:\n    resolve_device('cuda')\nexcept UserError as exc:\n    sys.stdout.write(exc.to_json())\n"
)


def check_cuda() -> None:
    """``trainer.device: cuda`` on a machine whose torch sees no GPU: the trainer's own
    UserError, found in a child process. In this one, asking torch would import it before
    the stage host forks and mark CUDA unusable in every process forked after (torch's
    fork poisoning), the stage host's trainer among them. A child that fails for another
    reason (torch does not import) decides nothing here: the trainer meets that failure
    itself, with its own traceback."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", CUDA_CHECK], capture_output=True, text=True, timeout=300,
                          cwd=str(Path(__file__).resolve().parents[1]))
    if proc.returncode == 0 and proc.stdout.strip():
        raise UserError.from_json(proc.stdout.strip())


def run_local(recipe_arg: str | None, run_root_arg: str | None, iterations: int, stage_host: bool = False,
              driver: ModuleType | None = None) -> int:
    """Bring the pipeline to ``iterations`` finished iterations, one orchestrator run each.

    The planner (``components.core.planner``) picks each iteration and leases it for this
    home (``local:<home>``); the orchestrator run's own plan task, given the same holder,
    finds the same iteration. A killed or failed run started again resumes the iteration
    it held. ``driver`` runs each iteration: ``dags.local`` (default; ``posttrain run``:
    the Airflow DAG under ``dag.test()``) or ``pipelines.local`` (``posttrain kfp-local``:
    the Kubeflow pipeline under ``kfp.local``); each has ``NAME``, ``prepare``,
    ``run_iteration`` and ``final_errors``. With ``stage_host`` (``posttrain run`` as its
    own process; ``POSTTRAIN_STAGE_HOST=0`` says no), the DAG's stages run in a forked
    child that imported their libraries while this process started Airflow
    (``dags/stagehost.py``); a caller inside a larger process (a test) keeps them
    in-process."""
    conf = settings.resolve(recipe_arg, run_root_arg)
    recipe = load_recipe(conf.recipe)
    if iterations < 1:
        raise UserError("--iterations", iterations, "must be at least 1", "pass --iterations 1 or more")
    check_not_past_max("--iterations", iterations)
    from dags import local as dag_driver

    if driver is None:
        driver = dag_driver
    if driver.STAGES_IN_PROCESS:
        # The stages run one after the other in this process: each may use every core
        # (settings.torch_threads; an explicit POSTTRAIN_TORCH_THREADS wins).
        os.environ["POSTTRAIN_TORCH_THREADS"] = os.environ.get("POSTTRAIN_TORCH_THREADS") or "auto"
    # Checked here, so a bad value stops the run before any work (and before the home is
    # made) instead of failing a stage's task, or the DAG's import after Airflow started.
    settings.torch_threads()
    settings.gc_policy()
    runner.code_version()  # every stage's manifest records it (a container's tasks check their own)
    if stage_host and driver.STAGES_IN_PROCESS:
        stagehost.enabled()
    if recipe.rollout.engine == "vllm":
        if driver is dag_driver and execution.mode() != "inprocess":
            raise UserError("rollout.engine", "vllm",
                            f"the stage images hold no vLLM, so the {execution.mode()} mode's rollout, bootstrap and "
                            "evaluation containers cannot start it",
                            "run the stages in this process (unset POSTTRAIN_EXECUTION; `make vllm` makes vLLM's venv), "
                            "or use rollout.engine: hf")
        settings.check_vllm()
        from components.rollout import vllm_engine

        vllm_engine.check_before_run()
    elif recipe.rollout.engine == "openai":
        from components.rollout import openai_engine

        openai_engine.check_before_run()  # the settings only: the server is the first request's
    preflight.tracking_uri()
    if driver is dag_driver:  # the Kubeflow driver reads none of the DAG's settings
        # The DAG's tasks take their time limits and cluster resources from POSTTRAIN_RECIPE
        # when the DAG is parsed (dags.wiring.recipe_at_parse), which happens later in this
        # process: this run's recipe is the one they must come from.
        os.environ["POSTTRAIN_RECIPE"] = conf.recipe
        execution.check_settings()
        execution.check_engine_here()
        if execution.mode() == "docker":
            from dags.execution import docker

            docker.check_run_root(conf.run_root)
        if execution.mode() == "inprocess" and recipe.trainer.device == "cuda":
            check_cuda()  # the trainer runs here: no GPU is refused now, not after rollout and reward
    sandbox_here = driver is not dag_driver or execution.mode() == "inprocess"  # kfp.local: subprocesses of this one
    if sandbox_here:
        check_sandbox_python(recipe)  # before the home is made (check_before_run finds it checked)
    home = settings.made_home()
    holder = f"local:{home}"
    # The home's lock first: a second run on this home stops here, before it touches the
    # home's SQLite MLflow (two runs migrating a fresh database at once collide).
    with home_lock(home), stagehost.hosting(stage_host and driver.STAGES_IN_PROCESS):  # the host dies with this process
        store = Store(conf.run_root, "--run-root")
        # The checks before the writer lease, so a refused run leaves nothing in the store (the
        # home's lock already keeps a second run on this home away from its SQLite MLflow).
        with removed_if_refused(store):
            check_before_run(recipe, store, sandbox_here=sandbox_here, iterations=iterations)
        with writer_lease(store, recipe.pipeline, home):
            return _iterate(store, recipe, conf.recipe, holder, iterations, driver, home)


def _iterate(store: Store, recipe: Recipe, recipe_path: str, holder: str, iterations: int, driver: ModuleType,
             home: Path) -> int:
    """The loop of ``run_local``, under the home's lock and the pipeline's writer lease."""
    driver.prepare(home, recipe.sandbox.concurrency)
    final_errors = driver.final_errors()  # after prepare: importing Airflow reads the home's settings

    while (last := max(finished(store, recipe.pipeline), default=0)) < iterations:
        k = plan(store, recipe, holder, stale=other_local_run)
        say(f"iter {k} | starting | run root {store.uri}" + (f" | {last} finished" if last else ""))
        final_errors.clear()  # only this iteration's tasks speak for its failure
        state = driver.run_iteration(recipe_path, store.uri, holder)
        if runner.stopping():  # SIGTERM or Ctrl-C: the command says so itself (no task of ours failed)
            raise tracking.Terminated(f"stopped by {runner.stop_signal().name}")
        if state != "success":
            if final_errors:  # a task's UserError or failed gate: its one line and exit 2 or 3, as for the checks above
                raise final_errors[0]
            say(f"iter {k} | {driver.NAME} run ended {state}; fix the failing task and run the same command again "
                "to resume")
            return 1
        if max(finished(store, recipe.pipeline), default=0) <= last:  # never expected: say so rather than loop
            say(f"iter {k} | the {driver.NAME} run ended {state} without finishing iteration {k}")
            return 1
        print_table(summary_rows(store, recipe, k), list(recipe.domains))
    # A process killed as it ended the last iteration left that iteration's MLflow run
    # RUNNING; nothing later would end it (finished iterations are skipped).
    runner.close_finished_iterations(store, recipe.pipeline)
    say(f"MLflow UI: {ui_hint(tracking.tracking_uri())}")
    return 0


def ui_hint(uri: str) -> str:
    """How to open the MLflow UI: a tracking server's own address, or the command that
    serves the embedded SQLite tracking."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri.rstrip('/')}"
    return f"mlflow ui --backend-store-uri {uri} --port 5000"
