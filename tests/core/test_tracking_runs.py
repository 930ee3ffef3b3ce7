"""MLflow runs a reviewer can read and that always end (``components.core.tracking``).

- The experiment carries ``mlflow.experimentKind=custom_model_development`` (the training
  view of MLflow 3's UI), also when it existed without it; a kind set by hand is kept.
- Run names say stage and iteration; a retry under the new names still kills the stale
  RUNNING attempt.
- A stage run ends KILLED when the stage is told to stop (``Terminated``, Airflow's
  ``AirflowTaskTerminated``, and for real: SIGTERM to ``posttrain stage``), FAILED on an
  error.
- The Airflow task failure callback ends the iteration's parent FAILED and that task's
  RUNNING stage runs KILLED; the next attempt at the iteration reopens the same parent.

The DAG-level callback in a real ``dag.test()`` run is ``tests/dags/test_failures.py``.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from components.core import tracking
from tests.fixtures.home import TINY_RECIPE
from tests.fixtures.runs import cli_env, posttrain, read_until

ROOT = "file:///runs/root"


def status(run_id: str) -> str:
    return tracking.client().get_run(run_id).info.status


def test_the_experiment_opens_on_the_training_view(posttrain_home: Path) -> None:
    c = tracking.client()
    new = tracking.experiment_id("fresh")
    assert c.get_experiment(new).tags["mlflow.experimentKind"] == "custom_model_development"
    old = c.create_experiment("old")  # made before the tag existed
    assert "mlflow.experimentKind" not in c.get_experiment(old).tags
    assert tracking.experiment_id("old") == old
    assert c.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"
    chosen = c.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    assert tracking.experiment_id("chosen") == chosen
    assert c.get_experiment(chosen).tags["mlflow.experimentKind"] == "genai_development"


def test_run_names_say_stage_and_iteration(posttrain_home: Path) -> None:
    assert tracking.stage_run_name("trainer", 2) == "trainer · iter-000002"
    assert tracking.stage_run_name("rollout[1/2]", 2) == "rollout[1/2] · iter-000002"
    assert tracking.stage_run_name("bootstrap", 0) == "bootstrap"
    c = tracking.client()
    parent = tracking.iteration_run("names", 2, ROOT, "manual__1")
    run = c.get_run(parent)
    assert run.info.run_name == "iter-000002" and run.info.status == "RUNNING"
    summary = c.get_run(run.data.tags["mlflow.parentRunId"])
    assert summary.info.run_name == "names · timeline"
    assert summary.info.status == "FINISHED"  # never left RUNNING: it only collects the timeline
    assert (summary.data.tags[tracking.TAG_STAGE], summary.data.tags[tracking.TAG_RUN_ROOT]) == ("pipeline", ROOT)
    assert tracking.iteration_run("names", 2, ROOT) == parent  # found by tags
    assert c.get_run(tracking.iteration_run("names", 3, ROOT)).data.tags["mlflow.parentRunId"] == summary.info.run_id
    assert tracking.pipeline_run("names", "file:///other") != summary.info.run_id  # one per run root


def test_a_retry_under_the_new_names_kills_the_stale_attempt(posttrain_home: Path) -> None:
    tags = {tracking.TAG_ITERATION: "2", tracking.TAG_RUN_ROOT: ROOT, tracking.TAG_SHARD: "1/2"}
    name = tracking.stage_run_name("rollout[1/2]", 2)
    stale = tracking.client().create_run(tracking.experiment_id("retry"), run_name=name,
                                         tags={tracking.TAG_STAGE: "rollout", **tags}).info.run_id
    other = tracking.client().create_run(tracking.experiment_id("retry"), run_name=tracking.stage_run_name("rollout[0/2]", 2),
                                         tags={tracking.TAG_STAGE: "rollout", **tags}).info.run_id
    with tracking.stage_run("retry", "rollout", name, None, {}, tags=tags) as new:
        assert (status(stale), status(new), status(other)) == ("KILLED", "RUNNING", "RUNNING")
    assert tracking.client().get_run(new).info.run_name == "rollout[1/2] · iter-000002"
    assert status(new) == "FINISHED"


def _airflow_terminated() -> BaseException:
    from airflow.sdk.exceptions import AirflowTaskTerminated

    return AirflowTaskTerminated("stopped by Airflow")


@pytest.mark.parametrize(("make", "ended"), [
    (lambda: tracking.Terminated("stopped by SIGTERM"), "KILLED"),
    (_airflow_terminated, "KILLED"),
    (KeyboardInterrupt, "KILLED"),
    (lambda: ValueError("a bug in the stage"), "FAILED"),
    (lambda: OSError("disk full"), "FAILED"),
])
def test_a_stage_run_ends_killed_when_stopped_and_failed_on_an_error(posttrain_home: Path, make, ended: str) -> None:
    exc = make()
    seen = []
    with pytest.raises(type(exc)):
        with tracking.stage_run("ends", "trainer", "trainer · iter-000001", None, {}) as run_id:
            seen.append(run_id)
            raise exc
    assert status(seen[0]) == ended


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_sigterm_to_posttrain_stage_ends_its_run_killed(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    """A container or pod stop (SIGTERM), or Ctrl-C (SIGINT), to ``posttrain stage`` mid-stage."""
    from mlflow.tracking import MlflowClient

    home = tmp_path / ".posttrain"
    root = f"file://{tmp_path / 'store'}"
    env = cli_env(home, POSTTRAIN_FAILPOINT="before-manifest:bootstrap")
    proc = subprocess.Popen(posttrain("stage", "bootstrap", "--recipe", str(TINY_RECIPE), "--run-root", root),
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen: list[str] = []
    try:
        read_until(proc.stdout, "failpoint before-manifest:bootstrap reached", seen)
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, "".join(seen) + rest
    assert f"posttrain: stopped by {sig.name}" in rest and "Traceback" not in rest
    uri = f"sqlite:///{home / 'mlflow.db'}"
    c = MlflowClient(tracking_uri=uri)
    [run] = c.search_runs([c.get_experiment_by_name("tiny").experiment_id])
    assert (run.info.run_name, run.info.status) == ("bootstrap", "KILLED")
    assert not (tmp_path / "store" / "tiny" / "bootstrap" / "_MANIFEST.json").exists()


def _failed_task(task_id: str, parent: str, map_index: int = -1) -> dict:
    ti = SimpleNamespace(task_id=task_id, map_index=map_index,
                         xcom_pull=lambda task_ids: {"mlflow_run_id": parent} if task_ids == "plan" else None)
    return {"ti": ti, "exception": RuntimeError("worker lost")}


def test_the_task_failure_callback_ends_the_iteration_failed_and_a_resume_reopens_it(posttrain_home: Path) -> None:
    from dags.wiring import stage_failed

    c = tracking.client()
    parent = tracking.iteration_run("cb", 1, ROOT, "manual__1")
    exp = tracking.experiment_id("cb")

    def stage(name: str, stage_id: str, shard: str = "") -> str:
        tags = {tracking.TAG_STAGE: stage_id, tracking.TAG_ITERATION: "1", tracking.TAG_RUN_ROOT: ROOT,
                "mlflow.parentRunId": parent, **({tracking.TAG_SHARD: shard} if shard else {})}
        return c.create_run(exp, run_name=name, tags=tags).info.run_id

    done = stage("taskgen · iter-000001", "taskgen")
    c.set_terminated(done, "FINISHED")
    shard0 = stage("rollout[0/2] · iter-000001", "rollout", "0/2")  # its worker was SIGKILLed
    shard1 = stage("rollout[1/2] · iter-000001", "rollout", "1/2")  # still going elsewhere
    stage_failed(_failed_task("rollout", parent, map_index=0))
    assert c.get_run(parent).data.tags["posttrain.failed.rollout"] == "RuntimeError: worker lost"
    assert {r: status(r) for r in (parent, done, shard0, shard1)} == {
        parent: "FAILED", done: "FINISHED", shard0: "KILLED", shard1: "RUNNING"}

    assert tracking.fail_iteration(parent) == [shard1]  # the DAG run failed: every stage run left ends
    assert status(shard1) == "KILLED" and status(parent) == "FAILED"

    assert tracking.iteration_run("cb", 1, ROOT, "manual__2") == parent  # resumed: the same parent run again
    assert status(parent) == "RUNNING"
    assert len(c.search_runs([exp], f"tags.`{tracking.TAG_STAGE}` = 'iteration'")) == 1
    assert tracking.end_if_running(parent) and status(parent) == "FINISHED"
    assert tracking.iteration_run("cb", 1, ROOT) == parent and status(parent) == "FINISHED"  # a finished one stays so


@pytest.mark.parametrize("root", ["file:///runs/it's", 'file:///runs/say "hi"', "file:///runs/a\\b%_"])
def test_runs_are_found_by_a_run_root_with_quotes(posttrain_home: Path, root: str) -> None:
    """MLflow's filters have no escapes: a run root holding ``'`` made every search by run
    root a syntax error (a traceback and exit 1 from ``posttrain run``)."""
    parent = tracking.iteration_run("q", 1, root, "manual__1")
    assert tracking.find_iteration_run("q", 1, root).info.run_id == parent
    assert tracking.running_iteration_runs("q", root) == {1: parent}
    assert tracking.running_iteration_runs("q", ROOT) == {}
    assert tracking.pipeline_run("q", root) == tracking.pipeline_run("q", root)


def test_a_run_root_with_both_quote_characters_is_refused() -> None:
    from components.core import settings
    from components.core.errors import UserError

    with pytest.raises(UserError) as err:
        settings.resolve(str(TINY_RECIPE), "file:///runs/it's \"x\"")
    assert err.value.field == "--run-root" and err.value.fix == "use a run root without one of the two quote characters"
