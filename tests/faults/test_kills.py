"""The kill suite: ``posttrain run`` SIGKILLed at every failpoint and at seeded random
times of a two-iteration tiny run, each kill followed by a rerun, ends exactly where an
uninterrupted run ends: the same manifested outputs (rows and digests, the sandbox's
executions but for the measured columns), rollout ids, registry versions and aliases,
and evaluation reports (so the same baselines); and in MLflow, no run left RUNNING (a
SIGKILLed and resumed iteration leaves none behind) and one parent run per iteration,
ended FINISHED, under one summary run (a resumed iteration reuses its parent run).

Kill points (29):

- ``FAILPOINTS``: the runner's ``POSTTRAIN_FAILPOINT=before-manifest:<label>`` for every
  stage label of the tiny recipe (bootstrap once; the other ten in iteration 1 and in
  iteration 2): the stage's data files are written, its manifest is not (21 points).
- ``KILL_AFTER_S``: SIGKILL after t seconds of a run, t drawn with
  ``random.Random(20261201).uniform(3, 40)`` seven times (7 points), starting on a fresh
  home (so a kill can also land in the start-up: database migrations, the plan).
- One more on that fresh home before them: SIGKILL while MLflow creates the tracking
  database's schema (``components.core.trackdb``; a half-created database used to fail
  every later run).

To keep the suite a few minutes on 2 cores, each group is one chain in one home: kill,
rerun (which is itself killed at the next point), ..., and a last rerun to the end. The
two shards of a stage run in either order, so when a shard's failpoint comes up its
stage may already be done (the kill at the other shard came after it): that point is
skipped, at most one per sharded stage and iteration (so at least 15 failpoint kills).
One uninterrupted run is shared by the module. File store and the home's SQLite MLflow.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from components.core.recipe import load_recipe
from components.core.stages import registered, shard_list
from components.core.storage import Store
from tests.fixtures.runs import TINY, cli_env, manifests, outputs_by_stage, posttrain, rollout_ids, run_posttrain

pytestmark = pytest.mark.slow

ITERATIONS = 2
LABELS = ["bootstrap", "taskgen", "rollout[0/2]", "rollout[1/2]", "sandbox[0/2]", "sandbox[1/2]", "reward[0/2]",
          "reward[1/2]", "validation", "trainer", "evaluation"]
FAILPOINTS = [(1, label) for label in LABELS] + [(2, label) for label in LABELS if label != "bootstrap"]
KILL_AFTER_S = [8.2, 38.8, 8.5, 10.1, 39.8, 5.5, 37.4]  # random.Random(20261201).uniform(3, 40), 7 draws
RUN_TIMEOUT_S = 600


def runner_labels() -> list[str]:
    """The failpoint labels the runner uses for the tiny recipe (``runner._failpoint``)."""
    recipe = load_recipe(str(TINY))
    return [f"{s.id}[{shard}]" if s.sharded else s.id for s in registered() for shard in shard_list(recipe, s.id)]


@dataclass(frozen=True)
class Outcome:
    outputs: dict[int, dict]
    rollout_ids: dict[int, list[str]]
    versions: dict[int, str]
    aliases: dict[str, str]
    reports: dict[int, bytes]
    running: list[str]  # MLflow runs still RUNNING after the run ended (stage or iteration runs)
    parents: dict[str, list[str]]  # {iteration: statuses of its parent runs}: one FINISHED each
    summaries: list[str]  # the pipeline's summary runs' statuses


def source_text(source: str, root: str, home: Path) -> str:
    """A registry version's source without what differs between two homes: the run root,
    the home, and the id MLflow draws for a logged model (``m-<hex>``)."""
    return re.sub(r"/m-[0-9a-f]+/", "/m-<id>/", source.replace(root, "<root>").replace(f"file://{home}", "<home>"))


def outcome(home: Path) -> Outcome:
    """What a finished run left, with its home's paths taken out; also checks that every
    manifested output is in the store with its manifest's digest (nothing partial)."""
    from mlflow.tracking import MlflowClient

    root = f"file://{home / 'store'}"
    store = Store(root)
    for rel, data in manifests(store).items():
        for name, meta in json.loads(data)["outputs"].items():
            if name != "checkpoint":
                assert hashlib.sha256(store.read_bytes(meta["path"])).hexdigest() == meta["sha256"], f"{rel}: {name}"
    uri = f"sqlite:///{home / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    versions = {int(v.version): source_text(v.source, root, home)
                for v in client.search_model_versions("name = 'tiny-policy'")}
    aliases = {k: str(v) for k, v in client.get_registered_model("tiny-policy").aliases.items()}
    ks = range(1, ITERATIONS + 1)
    experiment = client.get_experiment_by_name("tiny").experiment_id
    running = sorted(r.info.run_name for r in client.search_runs([experiment], "attributes.status = 'RUNNING'"))
    parents: dict[str, list[str]] = {}
    for r in client.search_runs([experiment], "tags.`posttrain.stage` = 'iteration'"):
        parents.setdefault(r.data.tags["posttrain.iteration"], []).append(r.info.status)
    summaries = [r.info.status for r in client.search_runs([experiment], "tags.`posttrain.stage` = 'pipeline'")]
    return Outcome(outputs={k: outputs_by_stage(store, k) for k in ks}, rollout_ids={k: rollout_ids(store, k) for k in ks},
                   versions=versions, aliases=aliases,
                   reports={k: store.read_bytes(f"tiny/iter-{k:06d}/evaluation/report.json") for k in ks}, running=running,
                   parents=parents, summaries=summaries)


def assert_same(got: Outcome, want: Outcome) -> None:
    assert got.running == want.running == [], "runs left RUNNING (a killed attempt, or an iteration never ended)"
    assert got.parents == want.parents == {"1": ["FINISHED"], "2": ["FINISHED"]}, "one parent run per iteration"
    assert got.summaries == want.summaries == ["FINISHED"]
    for k in want.outputs:
        assert got.outputs[k] == want.outputs[k], f"iteration {k}: outputs differ"
        assert got.rollout_ids[k] == want.rollout_ids[k] and len(set(got.rollout_ids[k])) == len(got.rollout_ids[k])
        assert json.loads(got.reports[k]) == json.loads(want.reports[k]), f"iteration {k}: report.json differs"
    assert got.versions == want.versions, "registry versions differ (a second registration?)"
    assert got.aliases == want.aliases


def args() -> list[str]:
    return ["run", "--recipe", str(TINY), "--iterations", str(ITERATIONS)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    tmp = tmp_path_factory.mktemp("kills-uninterrupted")
    proc = run_posttrain(args(), tmp, cli_env(tmp / ".posttrain"), timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = outcome(tmp / ".posttrain")
    assert json.loads(found.reports[1])["baseline"] == "1" and json.loads(found.reports[2])["baseline"] == "2"
    return found


def start(cwd: Path, home: Path, log: IO[str] | None = None, **extra: str) -> subprocess.Popen:
    """``posttrain run`` in its own session; its output to ``log``, else to a pipe to read."""
    return subprocess.Popen(posttrain(*args()), cwd=cwd, env=cli_env(home, **extra),
                            stdout=log if log is not None else subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def folder_of(k: int, label: str) -> str:
    """The store folder of the stage (shard) a failpoint label names, in iteration ``k``."""
    stage, _, shard = label.partition("[")
    folder = "tiny/bootstrap" if stage == "bootstrap" else f"tiny/iter-{k:06d}/{stage}"
    if shard:
        i, n = shard.rstrip("]").split("/")
        folder += f"/shard-{int(i):05d}-of-{int(n):05d}"
    return folder


def wait_for_failpoint(proc: subprocess.Popen, label: str) -> tuple[bool, str]:
    """(reached, output): read until the failpoint's line, or the end of the run."""
    timer = threading.Timer(RUN_TIMEOUT_S, kill, args=(proc,))
    timer.start()
    seen: list[str] = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if f"failpoint before-manifest:{label} reached" in line:
                return True, "".join(seen)
        return False, "".join(seen)
    finally:
        timer.cancel()


def finish(cwd: Path, home: Path) -> None:
    proc = run_posttrain(args(), cwd, cli_env(home), timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_the_failpoints_are_the_runners_labels() -> None:
    assert runner_labels() == LABELS
    assert len(FAILPOINTS) + len(KILL_AFTER_S) >= 20


def test_killed_at_every_failpoint_then_rerun_ends_as_an_uninterrupted_run(uninterrupted: Outcome, tmp_path: Path) -> None:
    home = tmp_path / ".posttrain"
    store = Store(f"file://{home / 'store'}")
    killed, done_first = [], []
    for k, label in FAILPOINTS:
        manifest = f"{folder_of(k, label)}/_MANIFEST.json"
        if store.exists(manifest):  # the other shard's run got here first (Airflow orders mapped tasks freely)
            done_first.append((k, label))
            continue
        proc = start(tmp_path, home, POSTTRAIN_FAILPOINT=f"before-manifest:{label}")
        try:
            reached, out = wait_for_failpoint(proc, label)
        finally:
            kill(proc)
        assert reached, f"{label} of iteration {k}: failpoint not reached:\n{out[-3000:]}"
        assert not store.exists(manifest), f"{label} of iteration {k}: killed before its manifest"
        killed.append((k, label))
    assert len(killed) >= len(FAILPOINTS) - 6, f"killed at {killed}; done before their turn: {done_first}"
    finish(tmp_path, home)
    assert_same(outcome(home), uninterrupted)


def kill_while_creating_the_tracking_db(cwd: Path, home: Path) -> None:
    """SIGKILL a first run in a fresh home while MLflow creates its SQLite schema (seconds of
    migrations, in a temporary file beside ``mlflow.db``); the database must not exist after."""
    with open(cwd / "run-tracking-db.log", "w") as log:
        proc = start(cwd, home, log)
        deadline = time.monotonic() + 120
        try:
            while not list(home.glob(".mlflow.db.creating-*")):
                assert proc.poll() is None and time.monotonic() < deadline, (cwd / "run-tracking-db.log").read_text()[-3000:]
                time.sleep(0.01)
            time.sleep(0.3)
        finally:
            kill(proc)
    assert not (home / "mlflow.db").exists()


def test_killed_at_random_times_then_rerun_ends_as_an_uninterrupted_run(uninterrupted: Outcome, tmp_path: Path) -> None:
    home = tmp_path / ".posttrain"
    kill_while_creating_the_tracking_db(tmp_path, home)
    killed = 0
    for i, after in enumerate(KILL_AFTER_S):
        log_path = tmp_path / f"run-{i}.log"
        with open(log_path, "w") as log:
            proc = start(tmp_path, home, log)
            try:
                proc.wait(timeout=after)
            except subprocess.TimeoutExpired:
                pass
            finally:
                kill(proc)
        killed += proc.returncode == -signal.SIGKILL
        if proc.returncode != -signal.SIGKILL:  # it ended before its kill: it must have finished, and the chain is done
            assert proc.returncode == 0, log_path.read_text()[-3000:]
            break
    assert killed >= 1  # at least one run was cut short: the rerun below resumes something
    finish(tmp_path, home)
    assert_same(outcome(home), uninterrupted)
