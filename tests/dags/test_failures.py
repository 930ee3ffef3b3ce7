"""A DAG run that fails: the reason reaches the task log and the iteration's MLflow run,
which ends FAILED (no run left RUNNING), the run hands its iteration lease back, and the
next run resumes the same iteration in the same MLflow run, which then ends FINISHED.

The runs are real ``dag.test()`` runs in a subprocess with no conf, as a scheduled run
has: the plan task leases the iteration to ``airflow:<run_id>``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny.yaml"

ONE_RUN = """
import json, os
from components.core import settings
from dags.local import prepare
prepare(settings.home(), 2)
from dags.post_training_iteration import iteration_dag
dr = iteration_dag.test(run_conf=json.loads(os.environ.get("TEST_RUN_CONF") or "null"))
print(json.dumps({"state": str(dr.state), "run_id": dr.run_id}))
"""


def dag_run(home: Path, recipe: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "POSTTRAIN_"))}
    env.update(POSTTRAIN_HOME=str(home), POSTTRAIN_RECIPE=str(recipe), PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
               AIRFLOW_HOME=str(home / "airflow"), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"), **extra)
    proc = subprocess.run([sys.executable, "-c", ONE_RUN], env=env, capture_output=True, text=True, timeout=600,
                          cwd=home.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"log": proc.stdout + proc.stderr}


def eval_suite_as_task_file(tmp_path: Path) -> Path:
    """The tiny recipe's eval suite as a task file: every row is valid, and taskgen skips
    them all (never train on an eval task), so only taskgen can find the mistake."""
    from components.core.recipe import load_recipe
    from components.evalsuite.suite import eval_tasks

    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"domain": t.domain, "prompt": t.prompt, "reference": t.reference}) + "\n"
                            for t in eval_tasks(load_recipe(str(TINY)))))
    return path


def test_a_tasks_user_error_ends_posttrain_run_with_its_line_and_exit_2(tmp_path: Path) -> None:
    """``posttrain run`` runs the tasks in-process: a task's UserError is the command's one
    error line and exit 2, as a preflight check's is (it was exit 1, "DAG run ended failed")."""
    from tests.fixtures.runs import cli_env, run_posttrain

    recipe = yaml.safe_load(TINY.read_text())
    tasks = eval_suite_as_task_file(tmp_path)
    recipe["taskgen"]["task_file"] = str(tasks)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(recipe))
    proc = run_posttrain(["run", "--recipe", str(bad), "--iterations", "1"], tmp_path, cli_env(tmp_path / ".posttrain"))
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"posttrain: error: taskgen.task_file='{tasks}': has no train tasks for the weighted domains "
        "['arithmetic', 'code']; fix: add tasks of those domains (rows marked split 'eval' and tasks equal to eval "
        "tasks are skipped) or change the weights")
    # dag.test()'s warnings while it marks taskgen's downstream tasks upstream_failed, a pass a second
    assert "No tasks to run" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr  # the task runner's, through Airflow's own frames
    # said once: the task's "posttrain task taskgen failed: ..." error line said it first
    assert (proc.stdout + proc.stderr).count("has no train tasks for the weighted domains") == 1


@pytest.mark.parametrize(("holder", "message", "level"), [
    ("local:/home", "LINE", "INFO"),  # posttrain run prints the line itself
    ("local:/home", "stage taskgen exited 2: posttrain: error: LINE", "INFO"),  # a stage container's
    ("", "LINE", "ERROR"),  # a DAG run of a scheduler: the task log is where it is said
    ("local:/home", "another shard's other mistake", "ERROR"),
    ("local:/elsewhere", "LINE", "ERROR"),  # a holder typed into a conf: no posttrain run here prints it
])
def test_a_task_failure_posttrain_run_prints_is_logged_below_error(holder: str, message: str, level: str,
                                                                    monkeypatch) -> None:
    """``posttrain run`` logs at WARNING and up: an INFO line is the task log's alone."""
    from types import SimpleNamespace

    from airflow.sdk.exceptions import AirflowFailException

    from components.core.errors import UserError
    from dags import orchestrate, wiring

    monkeypatch.setattr(orchestrate, "_LOCKED_HOMES", {"/home"})  # posttrain run of /home, in this process
    said: list[tuple[str, str]] = []

    class Log:
        def info(self, fmt: str, *args: object) -> None:
            said.append(("INFO", fmt % args))

        def error(self, fmt: str, *args: object) -> None:
            said.append(("ERROR", fmt % args))

    monkeypatch.setattr(wiring, "log", Log())
    error = UserError("taskgen.task_file", "t.jsonl", "has no train tasks", "add some")
    monkeypatch.setattr(wiring, "FINAL_ERRORS", [error])
    monkeypatch.setattr(wiring, "FAILED_TASKS", [])
    ti = SimpleNamespace(task_id="taskgen", xcom_pull=lambda task_ids: {})
    exception = AirflowFailException(message.replace("LINE", error.line()))
    wiring.stage_failed({"ti": ti, "exception": exception, "dag_run": SimpleNamespace(conf={"holder": holder})})
    assert said == [(level, f"posttrain task taskgen failed: AirflowFailException: {exception}")]


FAILING_GATE = """
import sys
from components.validation import stage
real = stage.check
def check(rollouts, rewards, recipe):  # the gate as it finds duplicated rows
    report = real(rollouts, rewards, recipe)
    report.success = False
    report.failures.append("rollouts: expect_column_values_to_be_unique {'column': 'rollout_id'} failed")
    return report
stage.check = check
from components.cli import main
sys.exit(main())
"""


def test_a_failed_gate_ends_posttrain_run_with_its_line_and_exit_3(tmp_path: Path) -> None:
    """It was exit 1, the status of an outage worth retrying, with only Airflow's traceback
    to say why. The gate is made to fail in the command's process, before the stage host
    forks from it."""
    from tests.fixtures.runs import cli_env

    proc = subprocess.run([sys.executable, "-c", FAILING_GATE, "run", "--recipe", str(TINY), "--iterations", "1"],
                          cwd=tmp_path, env=cli_env(tmp_path / ".posttrain", PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("posttrain: validation failed for iteration 1 (file://"), last
    assert last.endswith("/tiny/iter-000001/validation/report.json): rollouts: expect_column_values_to_be_unique "
                         "{'column': 'rollout_id'} failed"), last
    # the task runner's traceback through Airflow's own frames is dropped; the task's line stays
    assert "Traceback" not in proc.stdout + proc.stderr and "posttrain task validation failed" in proc.stdout


def test_a_failed_run_records_why_releases_its_lease_and_the_next_run_resumes(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from components.core import lease
    from components.core.storage import Store

    home = tmp_path / ".posttrain"
    recipe = yaml.safe_load(TINY.read_text())
    tasks = eval_suite_as_task_file(tmp_path)  # valid rows (the plan's preflight passes), but none to train on
    recipe["taskgen"]["task_file"] = str(tasks)  # taskgen fails: the user's mistake
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(recipe))

    first = dag_run(home, bad)
    assert first["state"] == "failed"
    reason = (f"AirflowFailException: taskgen.task_file='{tasks}': has no train tasks for the weighted domains "
              "['arithmetic', 'code']")
    assert f"posttrain task taskgen failed: {reason}" in first["log"]  # the task log says why
    db = sqlite3.connect(home / "airflow" / "airflow.db")
    tries = db.execute("select state, try_number from task_instance where task_id = 'taskgen' and run_id = ?",
                       (first["run_id"],)).fetchall()
    assert tries == [("failed", 1)]  # a user's mistake is not retried
    store = Store(str(home / "store"))
    released = lease.current(store, "tiny", 1)
    assert released is not None and released.holder == "" and released.generation == 1  # taken, then handed back
    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny").experiment_id
    [parent] = client.search_runs([experiment], "tags.`posttrain.stage` = 'iteration'")
    assert parent.data.tags["posttrain.iteration"] == "1"
    assert parent.data.tags["posttrain.failed.taskgen"].startswith(reason)
    # the failure callbacks ended the iteration: nothing is left RUNNING
    statuses = {r.info.run_name: r.info.status for r in client.search_runs([experiment])}
    assert statuses == {"tiny · timeline": "FINISHED", "bootstrap": "FINISHED", "iter-000001": "FAILED",
                        "taskgen · iter-000001": "FAILED"}
    assert json.loads(store.read_bytes("tiny/iter-000001/recipe.json"))["taskgen"]["task_file"] == str(tasks)

    second = dag_run(home, TINY)  # the recipe fixed: the next run takes iteration 1 again
    assert second["state"] == "success" and second["run_id"] != first["run_id"]
    now = lease.current(store, "tiny", 1)
    assert now is not None and now.holder == f"airflow:{second['run_id']}" and now.generation == 2
    assert store.exists("tiny/iter-000001/evaluation/_MANIFEST.json")
    assert json.loads(store.read_bytes("tiny/iter-000001/recipe.json"))["taskgen"]["task_file"] == ""
    [again] = client.search_runs([experiment], "tags.`posttrain.stage` = 'iteration'")
    assert again.info.run_id == parent.info.run_id and again.info.status == "FINISHED"  # reopened, then finished
    assert client.search_runs([experiment], "attributes.status = 'RUNNING'") == []


GOOD_ROW = '{"domain": "arithmetic", "prompt": "1+1=", "reference": {"answer": "2"}}\n'


@pytest.mark.parametrize(("content", "needles"), [
    (GOOD_ROW + "{bad json\n", ["line 2='{bad json'", "not valid JSON"]),
    ('{"domain": "arithmetic", "prompt": "1+1="}\n', ["line 1", "reference"]),
    ('{"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}}\n',
     ["has tasks of domain 'math', which is not in 'domains'", "fix: add 'math' to 'domains'"]),
])
def test_a_task_file_with_a_bad_row_stops_posttrain_run_before_any_work(content: str, needles: list[str],
                                                                        tmp_path: Path) -> None:
    """Every row is read before the bootstrap, as taskgen reads it (before, only a missing
    file was refused up front, and a bad row failed taskgen after the bootstrap, exit 1)."""
    from tests.fixtures.runs import cli_env, run_posttrain

    path = tmp_path / "tasks.jsonl"
    path.write_text(content)
    recipe = yaml.safe_load(TINY.read_text())
    recipe["taskgen"]["task_file"] = str(path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(recipe))
    home = tmp_path / ".posttrain"
    proc = run_posttrain(["run", "--recipe", str(bad), "--iterations", "1"], tmp_path, cli_env(home), timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    [line] = proc.stderr.strip().splitlines()
    assert all(n in line for n in needles), line
    assert not (home / "store").exists()  # nothing ran, and no run root was made


def test_a_refused_plan_task_makes_no_run_root(tmp_path: Path) -> None:
    """The DAG's plan task checks what ``posttrain run`` checks, in its order: a task file
    that is not there is refused before the store's probe, which would make a missing
    local run root (before, the plan task probed first and left an empty one behind)."""
    recipe = yaml.safe_load(TINY.read_text())
    recipe["taskgen"]["task_file"] = str(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(recipe))
    root = tmp_path / "new" / "root"
    run = dag_run(tmp_path / ".posttrain", bad, POSTTRAIN_RUN_ROOT=str(root))
    assert run["state"] == "failed"
    assert (f"AirflowFailException: taskgen.task_file='{tmp_path / 'missing.jsonl'}': no such file; "
            "fix: pass an existing .parquet, .jsonl or .json file") in run["log"]
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(("conf", "line"), [
    ({"recipie": "/x.yaml"}, "params='recipie': is not a parameter of this pipeline"),
    ({"run_root": "relrr"}, "run_root='relrr': is a relative path"),
    ({"holder": " "}, "holder=' ': is set by posttrain run and posttrain kfp-local only"),
    # a posttrain run's holder, copied from a "busy" line: the run worked on that command's iteration
    ({"holder": "local:/not/running"}, "holder='local:/not/running': is posttrain run's own, for the DAG run it "
     "drives in its own process, and no posttrain run of that home drives this one"),
    ({"recipe": "/no/such.yaml"}, "recipe='/no/such.yaml': no such recipe file"),  # it said --recipe=
])
def test_a_run_conf_the_dag_cannot_use_fails_the_plan_with_one_line(conf: dict, line: str, tmp_path: Path) -> None:
    """Before: a typo ran the default recipe; a relative run root was resolved against
    each process's own folder (the failure callback missed the lease); a hand-typed holder
    kept its lease for 6 hours. The failure callback says one line, not a traceback. Nothing
    is leased: no run root is made."""
    run = dag_run(tmp_path / ".posttrain", TINY, TEST_RUN_CONF=json.dumps(conf))
    assert run["state"] == "failed"
    assert f"AirflowFailException: {line}" in run["log"]
    assert "Callback failed" not in run["log"]
    if "relrr" in line:  # the callback cannot resolve it either: it says so in one line
        assert "run failed: no lease to hand back (run_root='relrr': is a relative path" in run["log"]
    assert not (tmp_path / ".posttrain" / "store").exists() and not (tmp_path / "relrr").exists()


def test_a_conf_recipe_whose_timeouts_the_dag_does_not_apply_is_warned_of(tmp_path: Path) -> None:
    """The tasks' time limits were made at parse time from POSTTRAIN_RECIPE: a conf recipe
    with other ones runs under those, and the plan says so (before: in silence; a one-off
    recipe's `timeouts: {bootstrap: 1}` did nothing, POSTTRAIN_RECIPE's did)."""
    parsed = yaml.safe_load(TINY.read_text())
    parsed["timeouts"] = {"trainer": 7200}
    at_parse = tmp_path / "at_parse.yaml"
    at_parse.write_text(yaml.safe_dump(parsed))
    conf_recipe = yaml.safe_load(TINY.read_text())
    conf_recipe["taskgen"]["task_file"] = str(tmp_path / "missing.jsonl")  # the plan stops after the warning
    given = tmp_path / "given.yaml"
    given.write_text(yaml.safe_dump(conf_recipe))
    run = dag_run(tmp_path / ".posttrain", at_parse, TEST_RUN_CONF=json.dumps({"recipe": str(given)}))
    assert run["state"] == "failed"
    assert (f"the recipe {given} sets other stage timeouts or resources than POSTTRAIN_RECIPE's, which the DAG's "
            "tasks were made with") in run["log"]


@pytest.mark.slow
def test_posttrain_runs_recipe_sets_the_tasks_time_limits(tmp_path: Path) -> None:
    """``posttrain run --recipe X`` applies X's ``timeouts`` (before, the DAG's tasks took
    theirs from POSTTRAIN_RECIPE or the demo recipe, and X's did nothing): a bootstrap that
    cannot reach its band within 1 s times out, and the run fails at once, naming the limit
    (before, each of three retries ran as long again)."""
    from tests.fixtures.runs import cli_env, run_posttrain

    parsed = yaml.safe_load(TINY.read_text())
    parsed["timeouts"] = {"bootstrap": 1}
    parsed["bootstrap"].update(max_steps=100_000, eval_every=50_000)  # minutes of SFT without the limit
    recipe = tmp_path / "timed.yaml"
    recipe.write_text(yaml.safe_dump(parsed))
    env = cli_env(tmp_path / "home", POSTTRAIN_RETRY_DELAY_S="1")
    proc = run_posttrain(["run", "--recipe", str(recipe), "--iterations", "1"], tmp_path, env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert out.count("Process timed out") == 1, out[-3000:]  # one attempt, no retry
    assert proc.stderr.strip().splitlines()[-1] == (
        "posttrain: error: timeouts.bootstrap=1: the stage ran past its time limit, and a retry would run as long "
        "again; fix: raise timeouts.bootstrap in the recipe (seconds), or give the stage less work"), proc.stderr[-3000:]
    assert "iter 0 | bootstrap |" not in out  # no attempt finished


def test_the_failure_callback_with_airflows_minimal_context_hands_the_lease_back(tmp_path: Path, posttrain_home: Path,
                                                                                 monkeypatch) -> None:
    """Airflow's DAG processor calls the DAG's failure callback with ``{"dag", "run_id",
    "reason"}`` alone when no task is to blame (a deadlocked run): it was ``KeyError:
    'dag_run'``, the lease held for 6 hours and the iteration's MLflow run left RUNNING.
    A conf holder no ``posttrain run`` of this process drives is the run's own: its
    callback leaves that command's iteration alone."""
    from types import SimpleNamespace

    from components.core import lease, planner, tracking
    from components.core.recipe import load_recipe
    from components.core.storage import Store
    from dags import wiring

    said: list[str] = []

    class Log:
        def info(self, fmt: str, *args: object) -> None:
            said.append(fmt % args)

        warning = info

    monkeypatch.setattr(wiring, "log", Log())
    monkeypatch.setenv("POSTTRAIN_RECIPE", str(TINY))
    monkeypatch.setenv("POSTTRAIN_RUN_ROOT", str(tmp_path / "store"))
    store = Store(str(tmp_path / "store"))
    recipe = load_recipe(str(TINY))
    assert planner.plan(store, recipe, "local:/home/u/.posttrain") == 1  # a posttrain run's iteration
    parent = tracking.iteration_run("tiny", 1, store.uri, "posttrain-run")
    copied = SimpleNamespace(conf={"holder": "local:/home/u/.posttrain"}, run_id="manual__y")
    wiring.run_failed({"dag": None, "run_id": "manual__y", "dag_run": copied, "params": {}})
    assert lease.current(store, "tiny", 1).holder == "local:/home/u/.posttrain"  # that command's: untouched
    assert tracking.client().get_run(parent).info.status == "RUNNING"  # before: ended FAILED under that command
    assert said == []

    assert lease.release(store, "tiny", 1, "local:/home/u/.posttrain")
    assert planner.plan(store, recipe, "airflow:scheduled__x", replay=True) == 1
    assert tracking.iteration_run("tiny", 1, store.uri, "scheduled__x") == parent
    wiring.run_failed({"dag": None, "run_id": "scheduled__x", "reason": "all_tasks_deadlocked"})
    cur = lease.current(store, "tiny", 1)
    assert cur.holder == "" and cur.generation == 3  # handed back: the next run resumes iteration 1 at once
    assert tracking.client().get_run(parent).info.status == "FAILED"
    assert said[0] == ("run failed (all_tasks_deadlocked) with no run conf at hand: its lease is looked for under "
                       "POSTTRAIN_RECIPE's pipeline in POSTTRAIN_RUN_ROOT")
    assert "run failed: released the lease on iteration 1 of tiny: True" in said
