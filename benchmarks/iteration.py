"""Iteration wall time by stage: a real Airflow scheduler, Airflow's in-process test
runner and direct stage calls, side by side, with each task's start-up overhead.

Bootstraps a pipeline once (not timed), then runs iteration 1 four
ways, each from a fresh copy of that state at the bootstrap's run root, in the same run of this script, one after the other:

- ``direct``: every stage called through ``run_stage`` in one Python process, shards one
  after the other (no orchestrator at all);
- ``dag.test``: ``posttrain run --iterations 1`` (the DAG through Airflow's in-process
  test runner on SQLite), as users run it: one process, tasks one after the other;
- ``scheduler``: a real ``airflow scheduler`` (LocalExecutor, one forked process per task,
  mapped shards in parallel), DAG processor and API server (``dags.local.LocalAirflow``),
  one run triggered through the REST API, with the stage libraries preloaded in the
  scheduler before its workers fork (``PreloadingLocalExecutor``, the default);
- ``scheduler, no preload``: the same with Airflow's plain LocalExecutor, so every task
  process imports torch, MLflow, transformers, ... itself.

Each way runs on its own default torch threads (``POSTTRAIN_TORCH_THREADS`` is not
passed on): ``posttrain run`` on every core, direct calls and the scheduler's task
processes on one (the scheduler runs shards side by side instead); in ``--baseline``
mode each side's ``posttrain run`` has its own commit's default.

Wall times: ``direct`` and ``dag.test`` are their processes' (``dag.test`` also gives its
DAG run's own span, without interpreter start, migration check and pool set-up); a
scheduler iteration is its DAG run's span, from queued to finished (the servers are
started before and their start-up is given apart: a deployment pays it once). The summary
line leads with the like-for-like ratio, ``real scheduler / dag.test(), DAG run span vs DAG
run span``: the scheduler's DAG run span over ``dag.test``'s, both queued -> end, so neither
side's start-up is in it; the ratio against the whole ``posttrain run`` process follows,
labelled as including its start-up (interpreter start, migration check, pool set-up).

A task's start-up overhead is the time from its task instance's ``start_date`` (Airflow
DB) to its stage's ``timings.start`` (manifest): process start, DAG parse, imports, the
stage context and its MLflow run. The scheduling gap is the time from the end of a
task's last upstream task instance to its own start. Before the scheduler runs, it
times the imports a task process pays when nothing is preloaded, one module after the
other in a fresh interpreter.

    python benchmarks/iteration.py [--recipe recipes/demo.yaml] [--sft-steps 50]
    python benchmarks/iteration.py --quick [--out PATH]

    python benchmarks/iteration.py --baseline REF [--repeats 2] [--sft-steps 0] [--quick] [--out PATH]

Writes ``benchmarks/results/iteration.json`` and ``.md`` (or ``--out`` .json/.md).

``--baseline REF`` instead compares this checkout (uncommitted changes included) with
commit REF, checked out in a temporary ``git worktree`` that is removed afterwards: each side
runs with its own code first on PYTHONPATH and this venv, its own copy of the recipe (SFT
shortened through its own schema), a private ``POSTTRAIN_HOME`` and run root; it is
bootstrapped once (not timed), then iteration 1 runs as ``posttrain run --iterations 1``,
baseline first, the order reversed on each further repeat. It reports each stage's seconds
(manifests, summed over shards), the DAG run's span, the process wall time and both sides'
iteration-1 eval pass rates, writes ``benchmarks/results/iteration_baseline.json``/``.md``
and ends with ``iteration vs baseline: N.NNx`` (current / baseline process wall time,
medians over repeats). A REF that names no commit is one error line and exit status 2.
``--quick`` is a smoke run through the first three ways (one real scheduler, preloading)
on ``recipes/tiny.yaml`` with 5 SFT steps: it prints the same tables and summary line and writes no results unless ``--out``
is given. Not covered: Postgres, Celery or
Kubernetes executors, and more than one iteration per server start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.provenance import provenance, provenance_line  # noqa: E402
from components.core.stages import registered  # noqa: E402
from dags.local import DAG_ID, PRELOAD, LocalAirflow  # noqa: E402

STAGES = ["taskgen", "rollout", "sandbox", "reward", "validation", "trainer", "evaluation"]
SHARDED = {"rollout", "sandbox", "reward"}
COLUMNS = ["direct", "dag.test", "scheduler", "scheduler, no preload"]
IMPORTS = ["airflow.sdk", "dags.wiring", "components.core.runner", *[m for m in PRELOAD if m != "dags.wiring"],
           *[s.module for s in registered()]]

DIRECT = """
import sys
from components.core.recipe import load_recipe
from components.core.runner import run_stage
recipe, root = sys.argv[1], sys.argv[2]
shards = load_recipe(recipe).rollout.shards
for stage in {stages!r}:
    if stage in {sharded!r}:
        for i in range(shards):
            run_stage(stage, recipe, root, 1, f"{{i}}/{{shards}}")
    else:
        run_stage(stage, recipe, root, 1)
"""

IMPORT_TIMES = """
import importlib, json, sys, time
out = {}
for name in sys.argv[1:]:
    module, _, attr = name.partition(":")
    t = time.perf_counter()
    loaded = importlib.import_module(module)
    if attr:
        getattr(loaded, attr)
    out[name] = time.perf_counter() - t
print(json.dumps(out))
"""


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "POSTTRAIN_"))}
    return {**env, "POSTTRAIN_HOME": str(home), "PYTHONUNBUFFERED": "1"}


def stage_seconds(run_root: Path, pipeline: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for stage in STAGES:
        for m in (run_root / pipeline / "iter-000001" / stage).rglob("_MANIFEST.json"):
            out[stage] = out.get(stage, 0.0) + json.loads(m.read_text())["timings"]["duration_s"]
    return out


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"benchmark command failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - start


def stamp(value: str | None) -> float | None:
    if not value:
        return None
    t = datetime.fromisoformat(value)
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


def upstream_of(task_id: str) -> list[str]:
    """The task ids a task waits for in the DAG (see dags/post_training_iteration.py)."""
    if task_id in ("bootstrap",) or task_id.endswith("_shards"):
        return ["plan"]
    spec = next(s for s in registered() if s.id == task_id)
    return [*spec.upstream, *([f"{task_id}_shards"] if spec.sharded else [])] or ["plan"]


def task_timings(db_path: Path, run_root: Path, pipeline: str) -> dict:
    """The one DAG run's span and, per stage task instance, its start-up overhead and
    scheduling gap (seconds); cache hits (bootstrap) have no overhead."""
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    (run_start, run_end, queued), = db.execute(
        "select start_date, end_date, queued_at from dag_run where dag_id = ?", (DAG_ID,)).fetchall()
    rows = db.execute("select task_id, map_index, start_date, end_date, try_number from task_instance where dag_id = ?",
                      (DAG_ID,)).fetchall()
    ends: dict[str, float] = {}
    for task_id, _, _, end, _ in rows:
        ends[task_id] = max(ends.get(task_id, 0.0), stamp(end) or 0.0)
    tasks = {}
    for task_id, map_index, start, end, tries in rows:
        if task_id not in STAGES:
            continue
        folder = run_root / pipeline / "iter-000001" / task_id
        if map_index >= 0:
            folder = sorted(folder.glob("shard-*"))[map_index]
        timings = json.loads((folder / "_MANIFEST.json").read_text())["timings"]
        t0 = stamp(start)
        tasks[f"{task_id}[{map_index}]" if map_index >= 0 else task_id] = {
            "overhead_s": timings["start"] - t0, "stage_s": timings["duration_s"], "task_s": stamp(end) - t0,
            "gap_s": t0 - max(ends[u] for u in upstream_of(task_id)), "tries": tries,
        }
    return {"run_s": stamp(run_end) - stamp(run_start), "queued_to_end_s": stamp(run_end) - stamp(queued or run_start),
            "tasks": tasks}


def run_scheduler(home: Path, recipe: Path, preload: bool) -> dict:
    """Start a real Airflow on ``home``, trigger one run through the REST API, wait for it."""
    env = {**env_for(home), "POSTTRAIN_RECIPE": str(recipe), "POSTTRAIN_RUN_ROOT": str(home / "store")}
    started = time.perf_counter()
    with LocalAirflow.start(home, env, preload=preload) as af:
        startup = time.perf_counter() - started
        af.api("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})  # manual schedule: unpausing starts nothing
        t0 = time.perf_counter()
        run_id = af.api("POST", f"/dags/{DAG_ID}/dagRuns", {"logical_date": None})["dag_run_id"]
        while (state := af.api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]) not in ("success", "failed"):
            time.sleep(0.5)
        seen = time.perf_counter() - t0
        if state != "success":
            sys.exit(f"the scheduler's run ended {state}; logs in {af.airflow_home / 'logs'}")
        preload_log = [line for line in (af.airflow_home / "logs" / "scheduler.log").read_text().splitlines()
                       if "preloaded" in line]
    stopped = time.perf_counter() - started - startup - seen
    return {"startup_s": startup, "stop_s": stopped, "observed_s": seen, "preload_log": preload_log[-1:],
            **task_timings(af.db_path, home / "store", yaml.safe_load(recipe.read_text())["pipeline"])}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(result: dict) -> str:
    wall, timing = result["wall_s"], result["tasks"]
    cols = [c for c in COLUMNS if c in wall]  # --quick runs no "scheduler, no preload"
    lines = ["| stage | " + " | ".join(f"{c} (s)" for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for stage in STAGES:
        lines.append(f"| {stage} | " + " | ".join(f"{result['stage_s'][c].get(stage, 0):.2f}" for c in cols) + " |")
    lines.append("| **iteration wall time** | " + " | ".join(f"**{wall[c]:.1f}**" for c in cols) + " |")
    lines.append("| DAG run span (queued -> end) | - | " + " | ".join(
        f"{timing[c]['queued_to_end_s']:.1f}" for c in cols if c in timing) + " |")
    out = ["\n".join(lines), ""]
    tcols = [c for c in cols if c in timing]
    task_ids = sorted({t for c in tcols for t in timing[c]["tasks"]}, key=lambda t: (STAGES.index(t.split("[")[0]), t))
    lines = ["| task | " + " | ".join(f"{c}: overhead / gap (s)" for c in tcols) + " |", "|---|" + "---:|" * len(tcols)]
    for t in task_ids:
        cells = []
        for c in tcols:
            row = timing[c]["tasks"].get(t)
            retried = f" (try {row['tries']})" if row and row["tries"] > 1 else ""
            cells.append(f"{row['overhead_s']:.2f} / {row['gap_s']:.2f}{retried}" if row else "-")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines.append("| **median** | " + " | ".join(
        f"**{median([r['overhead_s'] for r in timing[c]['tasks'].values()]):.2f}** / "
        f"{median([r['gap_s'] for r in timing[c]['tasks'].values()]):.2f}" for c in tcols) + " |")
    out += ["Per task: start-up overhead (task instance start -> stage start) / scheduling gap "
            "(last upstream task's end -> task start).", "", "\n".join(lines), ""]
    lines = ["| import (fresh interpreter, in this order) | s |", "|---|---:|"]
    lines += [f"| `{name}` | {s:.2f} |" for name, s in result["imports_s"].items()]
    lines.append(f"| **all** | **{sum(result['imports_s'].values()):.2f}** |")
    out += ["What a task process imports when nothing is preloaded (each stage needs a part of it):", "",
            "\n".join(lines), ""]
    if "scheduler, no preload" not in wall:
        return "\n".join(out)
    stage_sum = {c: sum(result["stage_s"][c].values()) for c in ("scheduler", "scheduler, no preload")}
    out += [f"Preloading saves {wall['scheduler, no preload'] - wall['scheduler']:.1f} s of this iteration. Without it "
            "most of the start-up cost sits inside the stages, where transformers, MLflow's SQL store and Great "
            "Expectations are imported on first use, which the overhead column (up to the stage's start) does not see: "
            f"the stages' own seconds add up to {stage_sum['scheduler, no preload']:.1f} s without preloading and "
            f"{stage_sum['scheduler']:.1f} s with it. Shards run side by side under the scheduler, so its stage seconds "
            "(summed over shards) can exceed its wall time."]
    return "\n".join(out)


# --- ``--baseline REF``: this checkout against a baseline commit, side by side --------------

SCHEMA_PROBE = """
import json
from components.core.recipe import Recipe
import components
section = Recipe.model_fields["bootstrap"].annotation
print(json.dumps({"fields": sorted(section.model_fields), "package": components.__path__[0]}))
"""


@dataclass(frozen=True)
class Side:
    """One side of the comparison: the code folder put first on PYTHONPATH and its own recipe file."""

    name: str
    root: Path
    recipe: Path


def git(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def resolve_commit(ref: str) -> str:
    """The full sha of ``ref``; one error line and exit status 2 when it names no commit."""
    proc = git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if proc.returncode != 0:
        print(f"error: --baseline {ref!r} names no commit in {REPO}; give a commit sha, tag or branch "
              "(for example --baseline 9cebcb7)", file=sys.stderr)
        sys.exit(2)
    return proc.stdout.strip()


@contextmanager
def worktree(sha: str, parent: Path) -> Iterator[Path]:
    """A detached ``git worktree`` of ``sha`` under ``parent``, removed afterwards, also on failure or
    SIGTERM; after a SIGKILL, ``git worktree prune`` drops the stale entry once the folder is gone."""
    path = parent / f"baseline-{sha[:9]}"
    proc = git("worktree", "add", "--detach", "--quiet", str(path), sha)
    if proc.returncode != 0:
        sys.exit(f"git worktree add {path} {sha} failed: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        git("worktree", "remove", "--force", str(path))
        git("worktree", "prune")


def side_env(side: Side, home: Path) -> dict[str, str]:
    env = env_for(home)
    return {**env, "PYTHONPATH": os.pathsep.join([str(side.root), *filter(None, [env.get("PYTHONPATH")])])}


def sft_text(sft_steps: int) -> str:
    return f"{sft_steps} SFT steps" if sft_steps > 0 else "the recipe's own bootstrap (SFT to its target band)"


def side_recipe(side: Side, sft_steps: int, work: Path) -> tuple[Path, str]:
    """Write ``side``'s own recipe with its SFT shortened through that side's schema; returns (path, pipeline).

    Only ``max_steps`` and ``eval_every`` are known SFT-length keys; a schema with neither stops the run."""
    proc = subprocess.run([sys.executable, "-c", SCHEMA_PROBE], cwd=side.root, env=side_env(side, work / "probe"),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"reading the {side.name} recipe schema failed:\n{proc.stderr[-2000:]}")
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    if Path(probe["package"]).resolve() != (side.root / "components").resolve():
        sys.exit(f"the {side.name} side imported components from {probe['package']}, not {side.root}: "
                 "an install shadows PYTHONPATH; reinstall the venv's posttrain as editable (pip install -e .)")
    steps = [k for k in ("max_steps", "steps") if k in probe["fields"]]
    if not steps:
        sys.exit(f"the {side.name} recipe schema has no SFT step key in bootstrap ({', '.join(probe['fields'])}); "
                 "teach side_recipe() its name")
    data = yaml.safe_load(side.recipe.read_text())
    if sft_steps > 0:  # 0: the recipe's own SFT (to its target band), as `make demo` bootstraps
        data.setdefault("bootstrap", {}).update({steps[0]: sft_steps, **({"eval_every": sft_steps}
                                                                         if "eval_every" in probe["fields"] else {})})
    path = work / f"{side.name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, data["pipeline"]


def eval_rates(run_root: Path, pipeline: str) -> dict[str, float]:
    """Iteration 1's per-domain pass@1 from its evaluation manifest (``evaluation/<domain>/pass_at_1``)."""
    manifest = json.loads((run_root / pipeline / "iter-000001" / "evaluation" / "_MANIFEST.json").read_text())
    return {k.removeprefix("evaluation/").removesuffix("/pass_at_1"): v for k, v in manifest["metrics"].items()
            if k.endswith("/pass_at_1") and not k.startswith("evaluation/mean/")}


def dag_run_span(db_path: Path) -> float | None:
    """The one DAG run's start -> end (seconds) from the Airflow DB ``posttrain run`` left; None if it has none."""
    if not db_path.exists():
        return None
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = db.execute("select start_date, end_date from dag_run").fetchall()
    finally:
        db.close()
    return stamp(rows[-1][1]) - stamp(rows[-1][0]) if len(rows) == 1 and all(rows[0]) else None


def bootstrap_rates(run_root: Path, pipeline: str) -> dict[str, float]:
    """The bootstrap policy's eval pass@1 per domain (``bootstrap/<domain>/pass_at_1`` in its
    manifest), the row iteration 1 is scored against; {} when that side records none."""
    path = run_root / pipeline / "bootstrap" / "_MANIFEST.json"
    metrics = json.loads(path.read_text())["metrics"] if path.exists() else {}
    return {k.removeprefix("bootstrap/").removesuffix("/pass_at_1"): v for k, v in metrics.items()
            if k.startswith("bootstrap/") and k.endswith("/pass_at_1") and k.count("/") == 2}


def run_side_once(side: Side, recipe: Path, pipeline: str, base: Path, active: Path) -> dict:
    """Iteration 1 (``posttrain run --iterations 1``) from a fresh copy of ``side``'s bootstrapped state."""
    shutil.copytree(base, active)
    load = os.getloadavg()
    wall = timed([sys.executable, "-m", "components.cli", "run", "--recipe", str(recipe), "--run-root",
                  str(active / "store"), "--iterations", "1"], side.root, side_env(side, active))
    out = {"wall_s": wall, "dag_run_s": dag_run_span(active / "airflow" / "airflow.db"),
           "stage_s": stage_seconds(active / "store", pipeline),
           "eval": eval_rates(active / "store", pipeline), "bootstrap_eval": bootstrap_rates(active / "store", pipeline),
           "load_avg_before": load, "load_avg_after": os.getloadavg()}
    shutil.rmtree(active, ignore_errors=True)
    return out


def compare_baseline(ref: str, recipe_rel: Path, sft_steps: int, repeats: int) -> dict:
    """Bootstrap each side once (not timed), then time iteration 1 of each, baseline first and the order
    reversed on every repeat (ABBA) so that a drifting machine load falls on both sides.

    Not covered: a baseline whose CLI lacks ``stage bootstrap`` / ``run --iterations`` or whose
    dependencies differ from this venv's (it runs with this venv's packages)."""
    sha = resolve_commit(ref)
    load = os.getloadavg()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM; the baseline worktree is removed"))
    head = git("rev-parse", "HEAD").stdout.strip()
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").stdout.splitlines() if line]
    work = Path(tempfile.mkdtemp(prefix="posttrain-baseline-"))
    try:
        with worktree(sha, work) as tree:
            sides = [Side("baseline", tree, tree / recipe_rel), Side("current", REPO, REPO / recipe_rel)]
            for side in sides:
                if not side.recipe.exists():
                    sys.exit(f"{side.name} has no recipe {recipe_rel} (at {side.recipe}); pick one both commits have")
            prepared = {}
            for side in sides:
                recipe, pipeline = side_recipe(side, sft_steps, work)
                active, base = work / side.name / "active", work / side.name / "base"
                print(f"{side.name}: bootstrapping {pipeline} ({sft_text(sft_steps)}, not timed)", flush=True)
                timed([sys.executable, "-m", "components.cli", "stage", "bootstrap", "--recipe", str(recipe),
                       "--run-root", str(active / "store")], side.root, side_env(side, active))
                shutil.move(active, base)
                prepared[side.name] = (side, recipe, pipeline, base, active)
            runs: dict[str, list[dict]] = {"baseline": [], "current": []}
            for r in range(repeats):
                for name in (["baseline", "current"] if r % 2 == 0 else ["current", "baseline"]):
                    print(f"{name}: iteration 1, repeat {r + 1}/{repeats} ...", flush=True)
                    runs[name].append(run_side_once(*prepared[name]))
                    print(f"{name}: {runs[name][-1]['wall_s']:.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = {name: median([r["wall_s"] for r in rs]) for name, rs in runs.items()}
    spans = {name: [r["dag_run_s"] for r in rs if r["dag_run_s"] is not None] for name, rs in runs.items()}
    return {
        "baseline_ref": ref, "baseline_sha": sha, "current_sha": head, "current_uncommitted_files": len(dirty), "current_uncommitted": dirty,
        "recipe": str(recipe_rel), "sft_steps": sft_steps, "repeats": repeats,
        "machine": f"{platform.machine()} {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "runs": runs, "wall_s": wall,
        "stage_s": {name: {s: median([r["stage_s"].get(s, 0.0) for r in rs]) for s in STAGES} for name, rs in runs.items()},
        "dag_run_s": {name: median(v) for name, v in spans.items()},
        "ratio": wall["current"] / wall["baseline"],
        "provenance": provenance(load_start=load, load_end=os.getloadavg()),  # each side's torch threads: its own default
    }


def baseline_report(result: dict) -> str:
    """The per-stage table (medians over repeats) and both sides' eval tables (every repeat)."""
    st, wall = result["stage_s"], result["wall_s"]
    lines = ["| stage | baseline (s) | current (s) | current / baseline |", "|---|---:|---:|---:|"]
    for s in STAGES:
        b, c = st["baseline"][s], st["current"][s]
        lines.append(f"| {s} | {b:.2f} | {c:.2f} | {c / b:.2f}x |" if b else f"| {s} | {b:.2f} | {c:.2f} | - |")
    sums = {n: sum(st[n].values()) for n in ("baseline", "current")}
    lines.append(f"| stages summed | {sums['baseline']:.2f} | {sums['current']:.2f} | {sums['current'] / sums['baseline']:.2f}x |")
    lines.append(f"| outside stages (process start, Airflow DB set-up, task glue) | {wall['baseline'] - sums['baseline']:.2f} | "
                 f"{wall['current'] - sums['current']:.2f} | - |")
    span = result["dag_run_s"]
    lines.append(f"| DAG run span (Airflow's start -> end, inside the process) | {span['baseline']:.1f} | {span['current']:.1f} | "
                 f"{span['current'] / span['baseline']:.2f}x |")
    lines.append(f"| **iteration wall time** | **{wall['baseline']:.1f}** | **{wall['current']:.1f}** | **{result['ratio']:.2f}x** |")
    out = ["\n".join(lines), ""]
    domains = sorted({d for rs in result["runs"].values() for r in rs for d in r["eval"]})
    lines = ["| side, repeat | " + " | ".join(domains) + " | mean | wall (s) | load avg (1 min) before |",
             "|---|" + "---:|" * (len(domains) + 3)]
    for name, rs in result["runs"].items():
        if boot := rs[0].get("bootstrap_eval"):  # the same bootstrap for every repeat of a side
            lines.append(f"| {name} bootstrap (iteration 0) | " + " | ".join(f"{boot[d]:.3f}" if d in boot else "-" for d in domains)
                         + f" | {sum(boot.values()) / max(1, len(boot)):.3f} | - | - |")
        for i, r in enumerate(rs, 1):
            ev = r["eval"]
            lines.append(f"| {name} {i} | " + " | ".join(f"{ev[d]:.3f}" if d in ev else "-" for d in domains)
                         + f" | {sum(ev.values()) / max(1, len(ev)):.3f} | {r['wall_s']:.1f} | {r['load_avg_before'][0]:.2f} |")
    out += ["Iteration 1 eval pass@1 per domain (the fixed held-out suite) and wall time, every run, below each "
            "side's bootstrap policy (each side bootstraps with its own recipe and code, so the two sides start from "
            "different policies: compare each side's change from its own bootstrap):", "", "\n".join(lines)]
    return "\n".join(out)


def write_baseline(out: Path | None, result: dict) -> None:
    """Print the tables and the ratio line (last); write ``out``.json and ``.md`` unless ``out`` is None."""
    table = baseline_report(result)
    line = f"iteration vs baseline: {result['ratio']:.2f}x"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        loads = [r["load_avg_before"] for rs in result["runs"].values() for r in rs]
        out.with_suffix(".md").write_text(
            f"# Iteration against baseline {result['baseline_sha'][:7]} ({result['date']}, {result['machine']})\n\n"
            f"`python benchmarks/iteration.py --baseline {result['baseline_ref']} --repeats {result['repeats']} "
            f"--sft-steps {result['sft_steps']}` on `{result['recipe']}` "
            f"(each side's own copy) with {sft_text(result['sft_steps'])}, {result['repeats']} repeat(s) per side "
            f"(median shown). Current = HEAD {result['current_sha'][:7]} plus {result['current_uncommitted_files']} "
            "uncommitted tracked file(s) in the working tree. Each side: its code first on PYTHONPATH, the same venv, "
            "a private POSTTRAIN_HOME and run root, `posttrain run --iterations 1` after an untimed bootstrap. "
            "Stage seconds come from the manifests (summed over shards; shards run one after the other). "
            f"Load average (1/5/15 min) before each run: {', '.join('/'.join(f'{x:.2f}' for x in lo) for lo in loads)}.\n\n"
            f"{provenance_line(result.get('provenance'))}\n\n{table}\n\n{line}\n")
    print(table)
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "demo.yaml"))
    parser.add_argument("--sft-steps", type=int, default=50, help="bootstrap SFT steps (quality is not measured here); "
                        "0: each recipe's own bootstrap, so the iteration samples, runs and trains what a trained policy does")
    parser.add_argument("--out", default=None, help="results path without suffix (default: benchmarks/results/iteration; "
                        "with --quick: none written unless given)")
    parser.add_argument("--render", action="store_true", help="only rewrite the .md from the .json (no runs; with "
                        "--baseline, the comparison's)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: recipes/tiny.yaml, 5 SFT steps; writes results only with --out")
    parser.add_argument("--baseline", default=None, metavar="REF",
                        help="compare this checkout with commit REF instead (results: iteration_baseline.json/.md)")
    parser.add_argument("--repeats", type=int, default=1, help="with --baseline: timed iterations per side (ABBA order)")
    args = parser.parse_args()
    if args.quick:
        args.recipe, args.sft_steps = str(REPO / "recipes" / "tiny.yaml"), 5
    if args.baseline is not None:
        recipe_rel = Path(args.recipe).resolve().relative_to(REPO)
        out = Path(args.out) if args.out else (None if args.quick else REPO / "benchmarks" / "results" / "iteration_baseline")
        if args.render:  # only the .md again, from the .json a comparison wrote
            out = out or REPO / "benchmarks" / "results" / "iteration_baseline"
            write_baseline(out, json.loads(out.with_suffix(".json").read_text()))
            return
        write_baseline(out, compare_baseline(args.baseline, recipe_rel, args.sft_steps, max(1, args.repeats)))
        return
    out = Path(args.out) if args.out else (None if args.quick else REPO / "benchmarks" / "results" / "iteration")
    if args.render:
        out = out or REPO / "benchmarks" / "results" / "iteration"
        result = json.loads(out.with_suffix(".json").read_text())
        write(out, result, result["load_avg_before"])
        return

    work = Path(tempfile.mkdtemp(prefix="posttrain-bench-"))
    data = yaml.safe_load(Path(args.recipe).read_text())
    if args.sft_steps > 0:
        data.setdefault("bootstrap", {}).update({"max_steps": args.sft_steps, "eval_every": args.sft_steps})
    recipe = work / "bench.yaml"
    recipe.write_text(yaml.safe_dump(data))
    pipeline = data["pipeline"]
    posttrain = [sys.executable, "-m", "components.cli"]
    load = os.getloadavg()

    # Every way runs in the same folder (``active``, a fresh copy of the bootstrapped state
    # each time) and is moved aside afterwards: the registered model belongs to the run root
    # that bootstrapped it, and a run from any other run root is refused.
    active, base = work / "active", work / "base"
    print(f"bootstrapping {pipeline} once (not timed) in {work}", flush=True)
    timed([*posttrain, "stage", "bootstrap", "--recipe", str(recipe), "--run-root", str(active / "store")], work,
          env_for(active))
    shutil.move(active, base)
    ways = COLUMNS[:3] if args.quick else COLUMNS  # --quick: one real scheduler (its start-up is most of the run)
    homes = {name: work / name.replace(", ", "-").replace(" ", "-").replace(".", "-") for name in ways}

    def fresh() -> Path:
        shutil.copytree(base, active)
        return active

    print("imports a task process pays without preloading ...", flush=True)
    proc = subprocess.run([sys.executable, "-c", IMPORT_TIMES, *IMPORTS], cwd=REPO, env=env_for(work / "imports"),
                          capture_output=True, text=True, check=True)
    imports = json.loads(proc.stdout.strip().splitlines()[-1])

    wall, timing = {}, {}
    print("iteration 1 with stages called directly ...", flush=True)
    script = DIRECT.format(stages=STAGES, sharded=sorted(SHARDED))
    home = fresh()
    wall["direct"] = timed([sys.executable, "-c", script, str(recipe), str(home / "store")], work, env_for(home))
    shutil.move(home, homes["direct"])
    print("iteration 1 through dag.test() (posttrain run) ...", flush=True)
    home = fresh()
    process_s = timed([*posttrain, "run", "--recipe", str(recipe), "--run-root", str(home / "store"),
                       "--iterations", "1"], work, env_for(home))
    timing["dag.test"] = {"process_s": process_s, **task_timings(home / "airflow" / "airflow.db", home / "store", pipeline)}
    wall["dag.test"] = process_s
    shutil.move(home, homes["dag.test"])
    for name, preload in (("scheduler", True), ("scheduler, no preload", False))[:len(ways) - 2]:
        print(f"iteration 1 through a real scheduler ({'preloading' if preload else 'plain'} LocalExecutor) ...", flush=True)
        home = fresh()
        timing[name] = run_scheduler(home, recipe, preload)
        wall[name] = timing[name]["queued_to_end_s"]
        shutil.move(home, homes[name])

    result = {
        "recipe": args.recipe, "sft_steps": args.sft_steps, "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"), "load_avg_before": load, "load_avg_after": os.getloadavg(),
        "wall_s": wall, "stage_s": {name: stage_seconds(home / "store", pipeline) for name, home in homes.items()},
        "tasks": timing, "imports_s": imports,
        "scheduler_over_dag_test_span": span_ratio(wall, timing),
        "scheduler_over_dag_test": wall["scheduler"] / wall["dag.test"],
        "dag_test_over_direct": wall["dag.test"] / wall["direct"],
        "median_overhead_s": {c: median([r["overhead_s"] for r in timing[c]["tasks"].values()]) for c in timing},
        # torch threads: each way its own default (see the docstring), none set here
        "provenance": provenance(load_start=load, load_end=os.getloadavg()),
    }
    write(out, result, load)
    shutil.rmtree(work, ignore_errors=True)


def span_ratio(wall: dict, timing: dict) -> float:
    """The real scheduler's DAG run span over dag.test's, both queued -> end: like for like, neither
    side's start-up in it (the scheduler's servers start before, ``posttrain run``'s interpreter
    start, migration check and pool set-up come before its DAG run)."""
    return wall["scheduler"] / timing["dag.test"]["queued_to_end_s"]


def write(out: Path | None, result: dict, load: list[float]) -> None:
    """Print the tables and write ``out``.json and ``out``.md (nothing written when ``out`` is None)."""
    timing, wall = result["tasks"], result["wall_s"]
    table = report(result)
    span = result.get("scheduler_over_dag_test_span", span_ratio(wall, timing))  # results from before it was kept
    plain = timing.get("scheduler, no preload")  # not run by --quick
    no_preload = f"no preload: {result['median_overhead_s']['scheduler, no preload']:.2f} s, " if plain else ""
    plain_startup = f" ({plain['startup_s']:.1f} s without preload)" if plain else ""
    summary = (f"real scheduler / dag.test(), DAG run span vs DAG run span (queued -> end, start-up excluded on both "
               f"sides): {span:.2f}x ({wall['scheduler']:.1f} s vs {timing['dag.test']['queued_to_end_s']:.1f} s); "
               f"against the whole `posttrain run` process, its start-up included ({wall['dag.test']:.1f} s): "
               f"{result['scheduler_over_dag_test']:.2f}x; "
               f"median task start-up overhead {result['median_overhead_s']['scheduler']:.2f} s "
               f"({no_preload}dag.test: {result['median_overhead_s']['dag.test']:.2f} s); "
               f"dag.test / direct: {result['dag_test_over_direct']:.2f}x. Scheduler start-up (not in its wall time): "
               f"{timing['scheduler']['startup_s']:.1f} s{plain_startup}")
    print(table)
    print(summary)
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        f"# Iteration benchmark ({result['date']}, {result['machine']})\n\n"
        f"Recipe `{Path(result['recipe']).name}` with {sft_text(result['sft_steps'])}; load average "
        f"{load[0]:.2f} before, {result['load_avg_after'][0]:.2f} after. `python benchmarks/iteration.py`; "
        f"what each column means is in the script's docstring.\n\n{provenance_line(result.get('provenance'))}\n\n"
        f"{table}\n\n{summary}\n")


if __name__ == "__main__":
    main()
