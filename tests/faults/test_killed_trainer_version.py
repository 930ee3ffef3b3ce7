"""A trainer SIGKILLed after it registered its version and before its manifest, then run
again: the retry finds the version already registered (the same weights at the same
place) and reuses it. MLflow keeps the killed attempt as the version's ``run_id`` (it lets
no one change it), so what MLflow shows must say which run is which: the version is
tagged ``posttrain.source_run`` = the run the trainer's manifest records, the killed run
``posttrain.superseded_by`` = that run, and evaluation's description links it as the
source run and the killed one as the registering run.

Bootstrap and iteration 1 of recipes/tiny.yaml up to validation run in this process; the
trainer runs as ``posttrain stage trainer`` with ``POSTTRAIN_FAILPOINT`` (``runner._failpoint``)
and is SIGKILLed at it; the retry and evaluation run in this process. The home's SQLite
MLflow, a file store. The same without a real kill: ``tests/core/test_source_run.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from components.core import models, tracking
from components.core.facts import Checkpoint
from components.core.runner import run_stage
from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients, use_home
from tests.fixtures.runs import cli_env, posttrain

BEFORE = [("taskgen", None), ("rollout", "0/2"), ("rollout", "1/2"), ("sandbox", "0/2"), ("sandbox", "1/2"),
          ("reward", "0/2"), ("reward", "1/2"), ("validation", None)]
TIMEOUT_S = 300


def killed_at_the_failpoint(root: str, home: Path, cwd: Path) -> str:
    """Run iteration 1's trainer until its failpoint, SIGKILL it; its output."""
    proc = subprocess.Popen(posttrain("stage", "trainer", "--recipe", str(TINY_RECIPE), "--run-root", root,
                                      "--iteration", "1"),
                            cwd=cwd, env=cli_env(home, POSTTRAIN_FAILPOINT="before-manifest:trainer"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timer = threading.Timer(TIMEOUT_S, os.killpg, args=(proc.pid, signal.SIGKILL))
    timer.start()
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "failpoint before-manifest:trainer reached" in line:
                break
    finally:
        timer.cancel()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
    out = "".join(seen)
    assert "failpoint before-manifest:trainer reached" in out, out[-3000:]
    return out


def test_the_retried_trainers_reused_version_names_the_run_of_its_manifest(tmp_path: Path) -> None:
    root = f"file://{tmp_path / 'store'}"
    home = tmp_path / ".posttrain"
    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, home)
        mp.setenv("POSTTRAIN_TORCH_THREADS", "1")
        try:
            run_stage("bootstrap", TINY_RECIPE, root, 0)
            for stage, shard in BEFORE:
                run_stage(stage, TINY_RECIPE, root, 1, shard)
            out = killed_at_the_failpoint(root, home, tmp_path)
            assert "registered version 2" in out, out[-3000:]
            c = tracking.client()
            exp = tracking.experiment_id("tiny")
            [killed] = c.search_runs([exp], filter_string="attributes.run_name = 'trainer · iter-000001'")
            assert killed.info.status == "RUNNING"  # SIGKILLed: nothing ended it

            trainer = run_stage("trainer", TINY_RECIPE, root, 1)  # the retry
            assert trainer.facts(Checkpoint).version == "2"  # the version the killed attempt registered
            evaluation = run_stage("evaluation", TINY_RECIPE, root, 1)

            retry = trainer.mlflow_run_id
            assert retry != killed.info.run_id
            assert c.get_run(killed.info.run_id).info.status == "KILLED"
            assert c.get_run(killed.info.run_id).data.tags[tracking.TAG_SUPERSEDED_BY] == retry
            assert tracking.TAG_SUPERSEDED_BY not in c.get_run(retry).data.tags
            mv = c.get_model_version("tiny-policy", "2")
            assert mv.run_id == killed.info.run_id  # MLflow's, unchangeable
            assert mv.tags[models.TAG_SOURCE_RUN] == retry
            assert [int(v.version) for v in c.search_model_versions("name = 'tiny-policy'")] == [2, 1]
            source = f"- [source run]({tracking.run_url('tiny', retry)})\n"
            registering = (f"- [registering run (an earlier attempt, superseded by the source run)]"
                           f"({tracking.run_url('tiny', killed.info.run_id)})\n")
            assert source + registering in mv.description
            assert c.get_run(evaluation.mlflow_run_id).data.tags["mlflow.note.content"] == mv.description
        finally:
            reset_tracking_clients()
