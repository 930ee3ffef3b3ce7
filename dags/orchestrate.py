"""``posttrain run``: N iterations of the Airflow DAG on the embedded defaults.

Checks the recipe, the store and the starting checkpoint up front (each failure is one
UserError, exit 2), then drives ``dags/local.py`` (Airflow's in-process test runner on
SQLite), which lives beside it in this folder. Which iteration comes next is the
planner's choice (the same one the scheduled DAG makes), so a killed run started again
resumes where it stopped; one ``posttrain run`` at a time per home. After each iteration it prints a table of eval pass
rates by domain; at the end, the command that opens the MLflow UI on this run.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from components.core import settings, tracking
from components.core.context import read_manifest
from components.core.errors import UserError
from components.core.facts import Decision, Scored, Slice
from components.core.manifest import stage_prefix
from components.core.planner import finished, plan
from components.core.progress import say
from components.core.recipe import Recipe, load_recipe
from components.core.storage import Store, filesystem, join


def preflight_checkpoint(recipe: Recipe) -> None:
    """If the pipeline already has a champion, its checkpoint must be readable."""
    found = tracking.resolve_alias(recipe.pipeline, "champion")
    if found is None:
        return
    version, uri, _ = found
    fs, path = filesystem(uri)
    try:
        json.loads(fs.cat_file(join(path, "config.json")))
    except Exception as exc:
        raise UserError(f"champion (version {version})", uri, f"checkpoint is unreadable ({type(exc).__name__})",
                        "restore the checkpoint files, or move the 'champion' alias to a readable version in MLflow") from None


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


@contextmanager
def home_lock(home: Path) -> Iterator[None]:
    """One ``posttrain run`` per home: an exclusive lock on ``<home>/run.lock``. The lock
    dies with the process, so a killed run never blocks the next one."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "run.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError("POSTTRAIN_HOME", str(home), "another 'posttrain run' is using this home",
                            "wait for it to finish, or set POSTTRAIN_HOME to another folder") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_local(recipe_arg: str | None, run_root_arg: str | None, iterations: int) -> int:
    """Bring the pipeline to ``iterations`` finished iterations, one DAG run each.

    The planner (``components.core.planner``) picks each iteration and leases it for this
    home (``local:<home>``); the DAG run's own plan task, given the same holder, finds the
    same iteration. A killed run started again resumes the iteration it held."""
    conf = settings.resolve(recipe_arg, run_root_arg)
    recipe = load_recipe(conf.recipe)
    if iterations < 1:
        raise UserError("--iterations", iterations, "must be at least 1", "pass --iterations 1 or more")
    store = Store(conf.run_root, "--run-root")
    store.check_reachable()
    preflight_checkpoint(recipe)
    from dags.local import prepare, run_iteration

    home = settings.home()
    holder = f"local:{home}"
    with home_lock(home):
        prepare(home, recipe.sandbox.concurrency)
        while (last := max(finished(store, recipe.pipeline), default=0)) < iterations:
            k = plan(store, recipe, holder)
            say(f"iter {k} | starting | run root {store.uri}" + (f" | {last} finished" if last else ""))
            state = run_iteration(conf.recipe, store.uri, holder)
            if state != "success":
                say(f"iter {k} | DAG run ended {state}; fix the failing task and run the same command again to resume")
                return 1
            print_table(summary_rows(store, recipe, k), list(recipe.domains))
    say(f"MLflow UI: mlflow ui --backend-store-uri {tracking.tracking_uri()} --port 5000")
    return 0
