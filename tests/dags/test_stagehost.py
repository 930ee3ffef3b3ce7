"""The stage host of ``posttrain run`` (``dags/stagehost.py``), as a user starts it: a
process of its own.

- With it on (the default), the stage runs in a forked child of ``posttrain run``; with
  ``POSTTRAIN_STAGE_HOST=0`` there is no such child.
- SIGTERM to ``posttrain run`` alone (not its process group) reaches the stage in the
  host: exit 143, the stage's MLflow run KILLED, no manifest, no process left.
- Ctrl-C (SIGINT to the process group) does the same, with exit 130.
- SIGTERM to the process group between two iterations stops the run too (exit 143).
- SIGKILL to ``posttrain run`` alone takes the host with it, and the next run on the same
  home finishes the iteration.
- A bad ``POSTTRAIN_STAGE_HOST`` is one line and exit 2; the project's errors cross the
  pipe as themselves.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.core.errors import InfraError, UserError
from tests.fixtures.runs import REPO, TINY, cli_env, posttrain, read_until, run_posttrain

FAILPOINT = "before-manifest:bootstrap"


def children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def start_at_failpoint(tmp_path: Path, command: str = "run", **extra: str) -> tuple[subprocess.Popen, list[str], Path]:
    """``posttrain <command>`` (``run`` or ``kfp-local``) on the tiny recipe, read until its
    bootstrap blocks at the failpoint."""
    home = tmp_path / ".posttrain"
    env = cli_env(home, POSTTRAIN_FAILPOINT=FAILPOINT, **extra)
    proc = subprocess.Popen(posttrain(command, "--recipe", str(TINY), "--iterations", "1"), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    read_until(proc.stdout, f"failpoint {FAILPOINT} reached", seen)
    return proc, seen, home


def end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("setting, hosts", [("1", 1), ("0", 0)])
def test_sigterm_to_posttrain_run_alone_stops_the_stage_where_it_runs(tmp_path: Path, setting: str, hosts: int) -> None:
    from mlflow.tracking import MlflowClient

    proc, seen, home = start_at_failpoint(tmp_path, POSTTRAIN_STAGE_HOST=setting)
    try:
        host = children(proc.pid)
        assert len(host) == hosts, f"children of posttrain run: {host}"
        proc.send_signal(signal.SIGTERM)  # the parent only: the host hears of it through its parent
        rest, _ = proc.communicate(timeout=120)
    finally:
        end(proc)
    assert proc.returncode == 143, "".join(seen) + rest
    assert rest.splitlines()[-1] == "posttrain: stopped by SIGTERM; run the same command again to resume"
    assert "Traceback (most recent call last)" not in rest, rest
    assert not any(alive(pid) for pid in host)
    c = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name("tiny").experiment_id], "attributes.run_name = 'bootstrap'")
    assert [r.info.status for r in runs] == ["KILLED"]
    assert not list((home / "store" / "tiny").glob("bootstrap/_MANIFEST.json"))


def test_ctrl_c_stops_posttrain_run_and_its_host(tmp_path: Path) -> None:
    """SIGINT to the whole process group, as a terminal sends Ctrl-C. Before, Airflow's task
    runner caught the KeyboardInterrupt as a task failure, retried the stage and finished the
    iteration with exit 0."""
    from mlflow.tracking import MlflowClient

    proc, seen, home = start_at_failpoint(tmp_path)
    try:
        host = children(proc.pid)
        assert len(host) == 1
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        end(proc)
    assert proc.returncode == 130, "".join(seen) + rest
    assert rest.splitlines()[-1] == "posttrain: stopped by SIGINT; run the same command again to resume"
    assert "KeyboardInterrupt" not in rest
    # Neither Airflow's task runner nor the signal (where it landed in the stage host's
    # wait) prints a traceback: the task's one error line and the command's last line say it.
    assert "Traceback (most recent call last)" not in rest, rest
    assert "posttrain task bootstrap failed: AirflowTaskTerminated: bootstrap: stopped by SIGINT" in rest, rest
    assert not any(alive(pid) for pid in host)
    c = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    runs = c.search_runs([c.get_experiment_by_name("tiny").experiment_id], "attributes.run_name = 'bootstrap'")
    assert [r.info.status for r in runs] == ["KILLED"]
    assert not list((home / "store" / "tiny").glob("bootstrap/_MANIFEST.json"))


def test_sigterm_to_the_process_group_between_two_iterations_stops_posttrain_run(tmp_path: Path) -> None:
    """``timeout`` and a container runtime signal the whole process group. Airflow's task
    runner installed its own SIGTERM handler at every task's start (it only calls the
    operator's ``on_kill``) and never put posttrain's back, so a SIGTERM that came while
    the next iteration was planned was lost in ``posttrain run``, and the stage host it
    also ended was taken for an outage: the run went on through every iteration."""
    home = tmp_path / ".posttrain"
    proc = subprocess.Popen(posttrain("run", "--recipe", str(TINY), "--iterations", "3"), cwd=tmp_path,
                            env=cli_env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen: list[str] = []
    try:
        read_until(proc.stdout, "iter 2 | starting", seen)
        os.killpg(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        end(proc)
    assert proc.returncode == 143, "".join(seen) + rest
    assert rest.splitlines()[-1] == "posttrain: stopped by SIGTERM; run the same command again to resume", rest
    assert "Traceback (most recent call last)" not in rest and "unreachable" not in rest, rest
    assert not list((home / "store" / "tiny").glob("iter-000002/evaluation/_MANIFEST.json"))
    assert not list((home / "store" / "tiny").glob("iter-000003"))


def test_sigkill_to_posttrain_run_alone_takes_the_host_and_a_rerun_finishes(tmp_path: Path) -> None:
    proc, seen, home = start_at_failpoint(tmp_path)
    try:
        [host] = children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while alive(host) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(host), "the stage host outlived its parent"
    finally:
        end(proc)
    again = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "1"], tmp_path, cli_env(home))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert (home / "store" / "tiny" / "iter-000001" / "evaluation" / "_MANIFEST.json").exists()


def test_a_bad_setting_is_one_line_and_exit_2(tmp_path: Path) -> None:
    home = tmp_path / ".posttrain"
    r = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "1"], tmp_path,
                      cli_env(home, POSTTRAIN_STAGE_HOST="maybe"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "posttrain: error: POSTTRAIN_STAGE_HOST='maybe': is neither on (1) nor off (0); "
        "fix: export POSTTRAIN_STAGE_HOST=1 (the default) or POSTTRAIN_STAGE_HOST=0, or unset it"]
    assert not home.exists()  # checked with the other settings, before the home is made (it was left with its lock)


def test_the_projects_errors_cross_the_pipe_as_themselves() -> None:
    user = pickle.loads(pickle.dumps(UserError("taskgen.file", Path("/x.jsonl"), "not found", "give a file")))
    assert (type(user), user.line()) == (UserError, "taskgen.file='/x.jsonl': not found; fix: give a file")
    infra = pickle.loads(pickle.dumps(InfraError("store", "s3://b/r", "503")))
    assert (type(infra), infra.line()) == (InfraError, "store unreachable at 's3://b/r': 503; retry once it is back")


def test_any_other_exception_keeps_its_type_and_the_hosts_traceback() -> None:
    from dags.stagehost import StageHostError, _dumps

    try:
        {}["missing"]
    except KeyError as exc:
        bug = pickle.loads(_dumps(exc))
    assert type(bug) is KeyError and bug.args == ("missing",)
    assert "in the stage host:" in bug.__notes__[0] and "KeyError: 'missing'" in bug.__notes__[0]

    class Local(Exception):  # defined in a function: pickle cannot find it by name
        pass

    odd = pickle.loads(_dumps(Local("no way across")))
    assert type(odd) is StageHostError
    assert str(odd).startswith("Local: no way across\nin the stage host:\n")


DEAD_HOST = """
import os, signal
from components.core.errors import InfraError
from dags import stagehost

with stagehost.hosting() as host:
    os.kill(host.pid, signal.SIGKILL)
    os.waitpid(host.pid, 0)
    try:
        host.run("taskgen", "recipe.yaml", "file:///nowhere", 1, None, "run-1")
    except InfraError as exc:
        print("InfraError:", exc.line())
    print("current:", stagehost.current())
"""


def test_a_host_that_died_is_an_outage_and_later_stages_run_in_process(tmp_path: Path) -> None:
    env = cli_env(tmp_path / ".posttrain")
    r = subprocess.run([sys.executable, "-c", DEAD_HOST], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = r.stdout.strip().splitlines()
    assert first.startswith("InfraError: the stage host unreachable at 'pid ")
    assert "it ended while running taskgen" in first and first.endswith("; retry once it is back")
    assert second == "current: None"
