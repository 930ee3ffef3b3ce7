"""``posttrain run`` refuses bad settings before any work, and a refused run leaves no
run root behind.

- ``POSTTRAIN_SCHEDULE``, ``POSTTRAIN_EXECUTION``, ``POSTTRAIN_RETRY_DELAY_S``: one line
  naming the variable, the value and the values allowed, exit 2, in about a second, with
  nothing made (before: a ValueError traceback and exit 1 from the DAG's import, after 5
  to 6 s in which the home, Airflow's and MLflow's databases and the run root were made).
  ``posttrain kfp-local`` reads none of them. Under Airflow each is still a DAG import
  error (a UserError's line).
- A run the preflight refuses (``model.source`` that is not there) leaves no run-root
  folder it made; one that existed before stays. ``<home>/run.lock`` stays (a lock file).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from components.core.errors import UserError
from components.core.storage import Store, removed_if_refused
from dags import execution
from tests.fixtures.runs import REPO, TINY, cli_env, run_posttrain

SCHEDULE_FIX = "use e.g. '0 2 * * *', '@daily' or 'asset:champion' (unset or 'manual': only when triggered)"
RETRY_FIX = "set it to e.g. '10' (retries then wait 10 s, 20 s, 40 s), or unset it for 10 s"
BAD_SETTINGS = [
    ("POSTTRAIN_SCHEDULE", "bogus",
     "POSTTRAIN_SCHEDULE='bogus': neither a cron expression, a preset nor one of asset:champion, asset:candidate, "
     f"asset:task-file; fix: {SCHEDULE_FIX}"),
    ("POSTTRAIN_SCHEDULE", "@nightly",
     "POSTTRAIN_SCHEDULE='@nightly': unknown preset; the presets are @once, @continuous, @hourly, @daily, @weekly, "
     "@monthly, @quarterly, @yearly; fix: use one of those presets, a cron expression such as '0 2 * * *', or unset "
     "it for manual"),
    ("POSTTRAIN_EXECUTION", "bogus",
     "POSTTRAIN_EXECUTION='bogus': unknown execution mode; fix: use one of inprocess, docker, kubernetes "
     "(unset: inprocess)"),
    ("POSTTRAIN_RETRY_DELAY_S", "abc", f"POSTTRAIN_RETRY_DELAY_S='abc': not a number of seconds from 0 to 600; fix: {RETRY_FIX}"),
    ("POSTTRAIN_RETRY_DELAY_S", "-1", f"POSTTRAIN_RETRY_DELAY_S='-1': not a number of seconds from 0 to 600; fix: {RETRY_FIX}"),
    ("POSTTRAIN_RETRY_DELAY_S", "nan", f"POSTTRAIN_RETRY_DELAY_S='nan': not a number of seconds from 0 to 600; fix: {RETRY_FIX}"),
    ("POSTTRAIN_SCHEDULE", "* * * * * *",  # croniter's seconds field: a run every second
     "POSTTRAIN_SCHEDULE='* * * * * *': has 6 fields; a cron expression here has 5 (minute hour day-of-month month "
     "day-of-week); fix: use e.g. '0 2 * * *' (02:00 every day)"),
    ("POSTTRAIN_SCHEDULE", "0 0 31 2 *",  # Airflow's timetable raised CroniterBadDateError when it scheduled
     "POSTTRAIN_SCHEDULE='0 0 31 2 *': names no date that exists (e.g. 31 February): the DAG would never run; fix: "
     "use a day of the month every month has, e.g. '0 2 28 * *'"),
]


@pytest.mark.parametrize(("var", "value", "line"), BAD_SETTINGS)
def test_a_bad_dag_setting_is_a_user_error(var: str, value: str, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (execution.MODE_VAR, execution.SCHEDULE_VAR, execution.RETRY_DELAY_VAR):
        monkeypatch.delenv(name, raising=False)
    execution.check_settings()  # unset: inprocess, manual, 10 s
    monkeypatch.setenv(var, value)
    with pytest.raises(UserError) as info:
        execution.check_settings()
    assert info.value.line() == line


@pytest.mark.parametrize("value", ["", "manual", "None", "0 2 * * *", "0 0 29 2 *", "*/15 1-5 * * mon-fri", "@daily",
                                   "@continuous", "asset:champion"])
def test_the_schedules_the_dag_takes_pass(value: str) -> None:
    assert execution.schedule_value(value) == (None if value.lower() in ("", "manual", "none") else value)


@pytest.mark.parametrize("mode", ["inprocess", "docker", "kubernetes"])
def test_the_checks_import_no_airflow(mode: str, tmp_path: Path) -> None:
    """``posttrain run`` makes them before Airflow is set up: importing Airflow without
    ``AIRFLOW_HOME`` would make ``~/airflow``."""
    code = ("import sys, dags.execution as e; e.check_settings(); "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'airflow'], 'airflow imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=cli_env(tmp_path / "home", POSTTRAIN_EXECUTION=mode))
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize(("mode", "var", "value", "line"), [
    ("kubernetes", "POSTTRAIN_POD_STARTUP_TIMEOUT_S", "5m",
     "POSTTRAIN_POD_STARTUP_TIMEOUT_S='5m': not a whole number of seconds from 1 to 86400 (a day); fix: set it to "
     "e.g. '600'"),
    ("kubernetes", "POSTTRAIN_POD_STARTUP_TIMEOUT_S", "99999999999999999999999",
     "POSTTRAIN_POD_STARTUP_TIMEOUT_S='99999999999999999999999': not a whole number of seconds from 1 to 86400 (a "
     "day); fix: set it to e.g. '600'"),
    ("kubernetes", "POSTTRAIN_NAMESPACE", "Post_Train",
     "POSTTRAIN_NAMESPACE='Post_Train': not a Kubernetes name (at most 63 lowercase letters, digits, '-'); fix: set it "
     "to e.g. 'posttrain'"),
    ("docker", "POSTTRAIN_CONTAINER_FLAGS", "/nonexistent/flags",
     "POSTTRAIN_CONTAINER_FLAGS='/nonexistent/flags': no such file; fix: point it at a file of podman run flags such "
     "as containers/podman-run-flags"),
])
def test_the_chosen_modes_own_settings_are_checked_too(mode: str, var: str, value: str, line: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad cluster setting or flags file is refused by ``posttrain run`` before any work,
    not first by the DAG's import after Airflow started (a ValueError traceback)."""
    from dags.execution import docker

    docker.container_flags.cache_clear()
    monkeypatch.setenv(execution.MODE_VAR, mode)
    monkeypatch.delenv(execution.SCHEDULE_VAR, raising=False)
    monkeypatch.setenv(var, value)
    with pytest.raises(UserError) as info:
        execution.check_settings()
    assert info.value.line() == line
    docker.container_flags.cache_clear()


def test_the_wiring_maps_every_asset_schedule() -> None:
    from dags import wiring

    assert set(wiring.ASSETS) == set(execution.SCHEDULE_ASSETS)
    assert wiring.parse_schedule("asset:champion") is wiring.CHAMPION


@pytest.mark.parametrize(("var", "value", "line"), [BAD_SETTINGS[0], BAD_SETTINGS[2], BAD_SETTINGS[3]])
def test_posttrain_run_refuses_a_bad_dag_setting_before_any_work(var: str, value: str, line: str, tmp_path: Path) -> None:
    proc = run_posttrain(["run", "--recipe", str(TINY), "--run-root", "rr", "--iterations", "1"], tmp_path,
                         cli_env(tmp_path / "home", **{var: value}), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [f"posttrain: error: {line}"]
    assert list(tmp_path.iterdir()) == []  # no home, no run root, no database


def test_a_bad_retry_delay_is_a_dag_import_error(tmp_path: Path) -> None:
    """Under Airflow the DAG file's import raises it (the DAG processor shows the line)."""
    env = cli_env(tmp_path / "home", POSTTRAIN_RETRY_DELAY_S="abc", POSTTRAIN_SCHEDULE="",
                  AIRFLOW_HOME=str(tmp_path / "airflow"))
    proc = subprocess.run([sys.executable, "-c", "import dags.post_training_iteration"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"components.core.errors.UserError: {BAD_SETTINGS[3][2]}"


def _recipe_without_model(tmp_path: Path) -> Path:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TINY.read_text().replace("model: {", "model: {source: /nonexistent, "))
    return recipe


NO_MODEL = ("posttrain: error: model.source='file:///nonexistent': is not a readable checkpoint (no readable "
            "config.json: FileNotFoundError); fix: point model.source at a Hugging Face model folder or URI, or use "
            "'scratch'")


@pytest.mark.parametrize("run_root", ["rr", "a/b/rr", None])
def test_a_refused_run_leaves_no_run_root(run_root: str | None, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    recipe = _recipe_without_model(tmp_path)
    args = ["run", "--recipe", str(recipe), "--iterations", "1"] + (["--run-root", run_root] if run_root else [])
    proc = run_posttrain(args, work, cli_env(work / "home"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [NO_MODEL]
    left = sorted(str(p.relative_to(work)) for p in work.rglob("*"))
    assert left == ["home", "home/run.lock"]  # the home and its lock file; no run root, no store, no MLflow database


def test_a_run_refused_after_the_store_probe_removes_the_run_root_it_made(tmp_path: Path) -> None:
    """A ``models:/`` source is read through MLflow, after the store's probe made the run
    root: the refusal removes it again (and the parents it made)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TINY.read_text().replace("model: {", "model: {source: 'models:/nosuch@champion', "))
    work = tmp_path / "work"
    work.mkdir()
    proc = run_posttrain(["run", "--recipe", str(recipe), "--run-root", "a/b/rr", "--iterations", "1"], work,
                         cli_env(work / "home"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1].startswith(
        "posttrain: error: model.source='models:/nosuch@champion': no such registered model version at sqlite:///")
    assert sorted(p.name for p in work.iterdir()) == ["home"]  # no a/b/rr


def test_a_refused_run_keeps_a_run_root_that_was_there(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "keep").write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    recipe = _recipe_without_model(tmp_path)
    for given in (root, empty):
        proc = run_posttrain(["run", "--recipe", str(recipe), "--run-root", str(given), "--iterations", "1"], tmp_path,
                             cli_env(tmp_path / "home"), timeout=120)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [NO_MODEL], proc.stderr[-2000:]
    assert (root / "keep").read_text() == "x" and empty.is_dir() and list(empty.iterdir()) == []


def test_kfp_local_reads_no_dag_setting(tmp_path: Path) -> None:
    """``posttrain kfp-local`` runs the Kubeflow pipeline: a bad ``POSTTRAIN_SCHEDULE`` is
    not its to refuse (its preflight then refuses the recipe, as it would anyway)."""
    proc = run_posttrain(["kfp-local", "--recipe", str(_recipe_without_model(tmp_path)), "--run-root", "rr",
                          "--iterations", "1"], tmp_path, cli_env(tmp_path / "home", POSTTRAIN_SCHEDULE="bogus"),
                         timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [NO_MODEL]


def test_removed_if_refused_removes_only_the_folders_it_found_missing(tmp_path: Path) -> None:
    """The guard around ``check_before_run``: a refusal after the store's probe made the
    run root (a probe that then fails to write) removes the folders that were missing,
    deepest first, each only if empty."""
    store = Store(str(tmp_path / "a" / "b" / "rr"))
    with pytest.raises(UserError), removed_if_refused(store):
        (tmp_path / "a" / "b" / "rr").mkdir(parents=True)
        raise UserError("run_root", store.uri, "refused", "fix")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "a").mkdir()
    with pytest.raises(UserError), removed_if_refused(store):
        (tmp_path / "a" / "b" / "rr").mkdir(parents=True)
        (tmp_path / "a" / "b" / "other").write_text("someone else's")
        raise UserError("run_root", store.uri, "refused", "fix")
    assert sorted(p.name for p in (tmp_path / "a").rglob("*")) == ["b", "other"]  # rr removed; b holds a file; a was there
    with removed_if_refused(store):  # not refused: what was made stays
        (tmp_path / "a" / "b" / "rr").mkdir()
    assert (tmp_path / "a" / "b" / "rr").is_dir()


def test_a_trainer_on_cuda_without_a_gpu_is_refused_before_any_work(tmp_path: Path) -> None:
    """In-process, the trainer runs on this machine: ``trainer.device: cuda`` where torch
    sees no GPU is one line and exit 2 at once (it was the trainer task's failure, after
    bootstrap, rollout, sandbox, reward and validation, with Airflow's traceback)."""
    import torch
    import yaml

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    recipe = yaml.safe_load(TINY.read_text())
    recipe["trainer"] = {**recipe.get("trainer", {}), "device": "cuda"}
    path = tmp_path / "cuda.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_posttrain(["run", "--recipe", str(path), "--iterations", "1"], tmp_path, cli_env(tmp_path / "home"),
                         timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == ["posttrain: error: trainer.device='cuda': torch sees no CUDA device on this "
                                        "machine; fix: set trainer.device: auto or cpu, or run the trainer on a GPU node"]
    assert not (tmp_path / "home").exists()


LOCK_FIX = "remove it: posttrain run makes it again (it holds only the running command's host and pid)"


@pytest.mark.parametrize(("make", "problem"), [
    (lambda p: p.mkdir(), "is a folder, not a regular file"),
    (lambda p: __import__("os").mkfifo(p), "is not a regular file (a FIFO, a device or a socket)"),
    (lambda p: p.symlink_to("/dev/zero"), "is a symbolic link, not a regular file"),
], ids=["folder", "fifo", "link-to-dev-zero"])
def test_a_home_lock_that_is_no_regular_file_is_one_line(make, problem: str, tmp_path: Path) -> None:
    """Each was a traceback (IsADirectoryError; a FIFO's "not seekable"; EINVAL from
    truncating /dev/zero) out of the home's lock."""
    from dags.orchestrate import home_lock

    make(tmp_path / "run.lock")
    with pytest.raises(UserError) as err, home_lock(tmp_path):
        pass
    assert (err.value.field, err.value.value, err.value.problem, err.value.fix) == (
        "POSTTRAIN_HOME", str(tmp_path / "run.lock"), problem, LOCK_FIX)


def test_the_home_lock_holds_the_runs_host_and_pid_and_is_empty_after(tmp_path: Path) -> None:
    import os

    from dags.orchestrate import home_lock

    with home_lock(tmp_path):
        assert f"pid {os.getpid()}" in (tmp_path / "run.lock").read_text()
    assert (tmp_path / "run.lock").read_text() == ""


def test_only_the_process_holding_a_homes_lock_drives_runs_as_its_holder(tmp_path: Path) -> None:
    """A ``local:`` holder in a DAG run's conf is ``posttrain run``'s only while that run
    holds the home's lock in this process (it runs the DAG here, under ``dag.test()``); a
    copy of it, typed into another run's conf, drove that run as the command's own."""
    from dags import wiring
    from dags.orchestrate import drives_here, home_lock, in_posttrain_run

    holder = f"local:{tmp_path}"
    assert not drives_here(holder) and not in_posttrain_run()
    with home_lock(tmp_path):
        assert drives_here(holder) and in_posttrain_run()
        assert wiring.posttrain_run_holder({"holder": holder}) == holder
        assert not drives_here(f"local:{tmp_path}/other") and not drives_here(f"airflow:{tmp_path}")
        assert wiring.posttrain_run_holder({"holder": "local:/not/running"}) == ""
        assert wiring.posttrain_run_holder({"holder": 5}) == "" and wiring.posttrain_run_holder(None) == ""
    assert not drives_here(holder) and wiring.posttrain_run_holder({"holder": holder}) == ""
    with pytest.raises(UserError), home_lock(tmp_path):
        raise UserError("x", 1, "a run that fails", "none")
    assert not drives_here(holder)  # let go with the lock, however the run ended


def test_an_engine_this_machine_cannot_reach_is_refused_before_any_work(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage task failed on it and was retried as an outage: minutes of tracebacks,
    then exit 1 (no kubeconfig: 137 s)."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.setenv("POSTTRAIN_EXECUTION", "kubernetes")
    with pytest.raises(UserError) as info:
        execution.check_engine_here()
    assert info.value.field == "POSTTRAIN_EXECUTION" and info.value.problem.startswith("no Kubernetes configuration here")

    monkeypatch.setenv("POSTTRAIN_EXECUTION", "docker")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/docker.sock")
    with pytest.raises(UserError) as info:
        execution.check_engine_here()
    assert info.value.line() == (f"DOCKER_HOST='unix://{tmp_path}/docker.sock': no Docker engine socket at "
                                 f"{tmp_path}/docker.sock; fix: start the engine (dockerd, or `podman system service`) "
                                 "or point DOCKER_HOST at its socket, or unset POSTTRAIN_EXECUTION to run the stages "
                                 "in this process")
    (tmp_path / "docker.sock").touch()  # there: whether it answers is an outage, found (and retried) by the task
    execution.check_engine_here()


def test_docker_mode_refuses_a_local_run_root_its_containers_cannot_write(tmp_path: Path) -> None:
    """The stage containers run as the images' uid 10001; the run root's folders this
    process makes are its own, mode 0755: every stage failed to write (exit 2 naming no
    cause). Refused before any work; an ``s3://`` run root passes this check."""
    import os

    from dags.execution import docker

    if os.geteuid() == docker.IMAGE_UID:
        pytest.skip("this process runs as the images' uid")
    (tmp_path / "docker.sock").touch()  # an engine socket is there: the run root is what is refused
    env = cli_env(tmp_path / "home", POSTTRAIN_EXECUTION="docker", DOCKER_HOST=f"unix://{tmp_path}/docker.sock")
    proc = run_posttrain(["run", "--recipe", str(TINY), "--run-root", str(tmp_path / "rr"), "--iterations", "1"],
                         tmp_path, env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"posttrain: error: --run-root='file://{tmp_path}/rr': docker-mode stage containers run as uid 10001 (the images' "
        f"user) and cannot write the folders this process (uid {os.geteuid()}) makes in a local run root; fix: give "
        "an s3:// run root (POSTTRAIN_RUN_ROOT or --run-root), or run posttrain as uid 10001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docker.sock"]
    docker.check_run_root("s3://bucket/runs")


@pytest.mark.parametrize("mode", ["docker", "kubernetes"])
def test_the_vllm_engine_is_refused_where_the_stages_run_in_images(mode: str, tmp_path: Path) -> None:
    """The stage images hold no vLLM: a container's rollout failed after the host's check of
    its own vLLM venv passed."""
    env = cli_env(tmp_path / "home", POSTTRAIN_EXECUTION=mode)
    proc = run_posttrain(["run", "--recipe", str(REPO / "recipes" / "tiny-vllm.yaml"), "--iterations", "1"],
                         tmp_path, env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"posttrain: error: rollout.engine='vllm': the stage images hold no vLLM, so the {mode} mode's rollout, "
        "bootstrap and evaluation containers cannot start it; fix: run the stages in this process (unset "
        "POSTTRAIN_EXECUTION; `make vllm` makes vLLM's venv), or use rollout.engine: hf"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("env", "line"), [
    ({}, "POSTTRAIN_OPENAI_BASE_URL='': rollout.engine 'openai' needs the server's base URL; fix: export "
         "POSTTRAIN_OPENAI_BASE_URL=http://host:port (deployment settings come from the environment)"),
    ({"POSTTRAIN_OPENAI_BASE_URL": "http://127.0.0.1:9", "POSTTRAIN_OPENAI_MODEL": " m "},
     "POSTTRAIN_OPENAI_MODEL=' m ': has white space around it; fix: remove the spaces around it"),
])
def test_the_openai_engines_settings_are_checked_before_any_work(env: dict[str, str], line: str,
                                                                 tmp_path: Path) -> None:
    """Before, the run planned and leased iteration 1 and wrote its recipe, then failed in
    the bootstrap task; a padded model name was sent to the server as it was."""
    import yaml

    recipe = yaml.safe_load(TINY.read_text())
    recipe["rollout"] = {**recipe.get("rollout", {}), "engine": "openai"}
    path = tmp_path / "openai.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_posttrain(["run", "--recipe", str(path), "--run-root", str(tmp_path / "rr"), "--iterations", "1"],
                         tmp_path, cli_env(tmp_path / "home", **env), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [f"posttrain: error: {line}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["openai.yaml"]


def test_a_sandbox_interpreter_that_is_not_there_is_refused_before_any_work(tmp_path: Path) -> None:
    """A typo in ``sandbox.python`` under /usr was found by the sandbox stage, after
    bootstrap, as "this host lacks user/pid/net/mount namespaces" with the advice to allow
    weak isolation, leaving the home, MLflow's database and the run root behind."""
    import yaml

    recipe = yaml.safe_load(TINY.read_text())
    recipe["sandbox"] = {**recipe.get("sandbox", {}), "python": "/usr/bin/nope"}
    path = tmp_path / "nope.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_posttrain(["run", "--recipe", str(path), "--run-root", str(tmp_path / "rr"), "--iterations", "1"],
                         tmp_path, cli_env(tmp_path / "home"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        "posttrain: error: sandbox.python='/usr/bin/nope': no such file on this host; fix: name a Python 3 interpreter "
        "under /usr (e.g. /usr/bin/python3.11), or leave sandbox.python empty to use /usr/bin/python3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nope.yaml"]  # no home, no run root


def test_the_interpreter_check_is_the_bwrap_backends() -> None:
    """The subprocess backend mounts nothing: its interpreter is not held to /usr."""
    from components.core.recipe import parse_recipe
    from dags.orchestrate import check_sandbox_python

    recipe = parse_recipe({"pipeline": "demo", "sandbox": {"python": "/usr/bin/nope"}})
    with pytest.raises(UserError) as err:
        check_sandbox_python(recipe)
    assert (err.value.field, err.value.problem) == ("sandbox.python", "no such file on this host")
    check_sandbox_python(parse_recipe({"pipeline": "demo", "sandbox": {"backend": "subprocess", "python": "/usr/bin/nope"}}))
