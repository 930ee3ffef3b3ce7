"""Airflow glue for ``post_training_iteration``: the schedule, the plan task, one task per
registered stage, and the failure callbacks. The DAG file itself stays a few lines.

Schedule (``POSTTRAIN_SCHEDULE``, else the Airflow Variable of that name, else manual):

| value | the DAG runs |
|---|---|
| empty, ``manual`` or ``none`` | only when triggered (the default) |
| a cron expression, e.g. ``0 2 * * *`` | at those times (no catch-up) |
| a preset: ``@hourly``, ``@daily``, ``@weekly``, ``@monthly``, ``@continuous``, ... | per the preset; ``@continuous`` starts the next run as soon as one ends |
| ``asset:champion`` | whenever an iteration promotes a new champion |
| ``asset:candidate`` | whenever the trainer registers a new candidate |
| ``asset:task-file`` | whenever a producer updates the asset ``posttrain-task-file`` (e.g. a new task file landed) |

Any other value fails the DAG's import with one ``UserError`` line naming the variable
and the allowed values, as does a bad ``POSTTRAIN_EXECUTION`` or
``POSTTRAIN_RETRY_DELAY_S`` (the first retry's delay, 0 to 600 s, default 10; the checks
are ``dags/execution``'s, which ``posttrain run`` makes before any work).

Each run's first task plans the iteration (``components.core.planner``): k is the last
finished iteration + 1 (or the half-done one), leased to the run (``airflow:<run_id>``),
and handed to every task through XCom. Clearing a run replays its k while no later
iteration has started; a stage task checks that k is still its run's to work on
(``planner.check_current``: no later iteration started, no other run's live lease; a
lease handed back by a failure is taken again, so clearing a failed run's failed tasks
resumes it) and fails at once when not; a whole run cleared after its failure handed k
back replays k, unless another run took k and finished it since (then it is over too). A
``holder`` in the conf is ``posttrain run``'s alone (``posttrain_run_holder``). An outage (``InfraError``, or
another run holding the lease) is retried with backoff; a user's mistake, a failed
data-quality gate and a stage past its time limit (a ``UserError`` naming ``timeouts.<stage>``,
in-process or in a container or pod, whose operator stops what it started) fail at once (``AirflowFailException``). A DAG paused after
``MAX_FAILED_RUNS`` failed runs in a row stops ``@continuous`` (or a tight cron) from
failing the same iteration forever.

MLflow: a task that fails for good (``stage_failed``, its ``on_failure_callback``, which
Airflow calls once no retry is left) tags the iteration's parent run with the reason,
ends it FAILED and ends that task's stage runs still RUNNING as KILLED; a failed DAG run
(``run_failed``) does the same for every stage run of its iteration. The next run that
takes the iteration sets the same parent run RUNNING again. An in-process stage task
turns SIGTERM into ``tracking.Terminated`` (its stage run ends KILLED) and then into
Airflow's ``AirflowTaskTerminated`` (the task fails without a retry: it was stopped).
Not covered: more than one active run (``max_active_runs=1``: iteration k+1 needs k);
a container or pod stage run that Airflow SIGKILLs stays RUNNING until the failure
callback or the stage's next attempt ends it.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from functools import cache
from typing import Any

from airflow.sdk import Asset, task

from components.core.settings import FLAG_VARIABLES, env_text
from components.core.stages import StageSpec
from dags import stagehost
from dags.execution import (
    MAX_RETRY_DELAY_S,
    SCHEDULE_VAR,
    container_task,
    mode,
    retry_delay_s,
    schedule_value,
    timed_out_error,
)

log = logging.getLogger("posttrain")

CANDIDATE = Asset(name="posttrain-policy-candidate", uri="posttrain://policy/candidate")
CHAMPION = Asset(name="posttrain-policy-champion", uri="posttrain://policy/champion")
TASK_FILE = Asset(name="posttrain-task-file", uri="posttrain://tasks/new")
ASSETS = {"asset:champion": CHAMPION, "asset:candidate": CANDIDATE, "asset:task-file": TASK_FILE}  # SCHEDULE_ASSETS
# The first retry's delay: POSTTRAIN_RETRY_DELAY_S (default 10 s; tests shorten it); a bad value is a UserError.
MAX_FAILED_RUNS = 3
"""Failed DAG runs in a row after which Airflow pauses the DAG (``max_consecutive_failed_dag_runs``),
unless the deployment's ``[core] max_consecutive_failed_dag_runs_per_dag`` sets another number."""


def max_failed_runs() -> int:
    """The deployment's ``[core] max_consecutive_failed_dag_runs_per_dag`` where it sets one
    (Airflow's default, 0, never pauses), else ``MAX_FAILED_RUNS``."""
    from airflow.configuration import conf

    return conf.getint("core", "max_consecutive_failed_dag_runs_per_dag", fallback=0) or MAX_FAILED_RUNS
RETRY = {"retries": 3, "retry_delay": timedelta(seconds=retry_delay_s()),
         "retry_exponential_backoff": 2.0, "max_retry_delay": timedelta(seconds=MAX_RETRY_DELAY_S)}  # 10 s, 20 s, 40 s


def parse_schedule(value: str) -> str | Asset | None:
    """The DAG's ``schedule`` for a ``POSTTRAIN_SCHEDULE`` value; a UserError naming the
    allowed values (``dags.execution.schedule_value``)."""
    checked = schedule_value(value)
    return ASSETS[checked] if checked in ASSETS else checked


def schedule() -> str | Asset | None:
    value = env_text(SCHEDULE_VAR) or None  # empty: unset, as for every setting
    if value is None:
        try:  # an Airflow Variable (or AIRFLOW_VAR_POSTTRAIN_SCHEDULE); absent or unreadable: manual
            from airflow.sdk import Variable

            value = Variable.get(SCHEDULE_VAR, default=None)
        except Exception:
            value = None
    return parse_schedule(value or "")


FINAL_ERRORS: list[BaseException] = []
"""The UserErrors and DataQualityErrors tasks of this process failed on, first first:
``posttrain run`` runs its tasks in-process (``dag.test()``) and ends with the first one's
line and its exit status (2, or 3 for a failed data-quality gate), as if its own check
had found it."""


FAILED_TASKS: list[str] = []
"""The tasks of this process that failed for good (``stage_failed``), first first."""


def _fail_now(exc: BaseException) -> BaseException:
    """Retrying cannot fix a user's mistake or bad data: fail the task at once."""
    from airflow.sdk.exceptions import AirflowFailException

    from components.core.errors import DataQualityError, UserError

    if isinstance(exc, UserError):
        FINAL_ERRORS.append(exc)
        return AirflowFailException(exc.line())
    if isinstance(exc, DataQualityError):
        FINAL_ERRORS.append(exc)
        return AirflowFailException(str(exc))
    return exc


def _named_as_given(exc: BaseException, conf: dict[str, Any]) -> BaseException:
    """``exc`` naming the run conf's key or the environment variable a value came from,
    where it names the CLI's ``--recipe``/``--run-root`` (which a DAG run has none of). A
    run ``posttrain run`` drives (``posttrain_run_holder``) keeps the flag its user typed."""
    from components.core.errors import UserError

    if not isinstance(exc, UserError) or exc.field not in FLAG_VARIABLES or posttrain_run_holder(conf):
        return exc
    key, variable = FLAG_VARIABLES[exc.field]
    return UserError(key if conf.get(key) else variable, exc.value, exc.problem, exc.fix)


def posttrain_run_holder(conf: dict[str, Any] | None) -> str:
    """The run conf's ``holder`` when ``posttrain run`` drives this DAG run in this very
    process (``dag.test()``) and holds that home's run lock now (``orchestrate.drives_here``),
    else "". Only that command passes a holder (it resumes the iteration itself, so its run
    keeps the lease when it fails); one typed into a conf by hand, even a copy of that
    command's own, is never its: a scheduler's worker is not that process."""
    holder = (conf or {}).get("holder") or ""
    if not isinstance(holder, str) or not holder:
        return ""
    from dags.orchestrate import drives_here

    return holder if drives_here(holder) else ""


def _settings(params: dict[str, Any]):
    from components.core import settings

    return settings.resolve(params.get("recipe") or None, params.get("run_root") or None)


@task(task_id="plan", multiple_outputs=True, **RETRY)
def plan() -> dict[str, Any]:
    """Pick and lease this run's iteration; hand it, the settings and the shard lists on."""
    from airflow.sdk import get_current_context

    from components.core import planner, settings, tracking
    from components.core.errors import UserError
    from components.core.recipe import load_recipe, publish_recipe
    from components.core.runner import close_finished_iterations
    from components.core.stages import registered, shard_list
    from components.core.storage import Store, removed_if_refused
    from dags.orchestrate import check_before_run

    ctx = get_current_context()
    params = ctx["params"]
    given = ctx["dag_run"].conf or {}
    try:
        settings.check_run_params(params, given.keys())
        driven = posttrain_run_holder(given)
        if given.get("holder") and not driven:  # before anything is made or leased
            raise UserError("holder", given["holder"], "is posttrain run's own, for the DAG run it drives in its own "
                            "process, and no posttrain run of that home drives this one (a copied holder would work "
                            "on the iteration that run holds)",
                            "leave holder empty: the run then holds its own lease and hands it back if it fails")
        conf = _settings(params)
        recipe = load_recipe(conf.recipe)
        parsed = recipe_at_parse()
        if parsed is not None and (parsed.timeouts, parsed.resources) != (recipe.timeouts, recipe.resources):
            log.warning("the recipe %s sets other stage timeouts or resources than POSTTRAIN_RECIPE's, which the "
                        "DAG's tasks were made with: those apply; set POSTTRAIN_RECIPE to this recipe for its own",
                        conf.recipe)
        elif parsed is None and (recipe.timeouts or recipe.resources):
            log.warning("the recipe %s sets stage timeouts or resources, which the DAG's tasks were made without "
                        "(POSTTRAIN_RECIPE was not read when the DAG was parsed: it is in a store, or unreadable): the "
                        "stage registry's apply; set POSTTRAIN_RECIPE to a local copy of this recipe for its own",
                        conf.recipe)
        store = Store(conf.run_root, "run_root")
        # posttrain run's checks, in its order: one line, failed at once (a local run root for an
        # HTTP tracking server, a bad task file row, ...), and a refused run makes no run root
        with removed_if_refused(store):
            check_before_run(recipe, store, sandbox_here=mode() == "inprocess")  # else the images' own /usr
        holder = driven or f"airflow:{ctx['run_id']}"
        # a cleared run (Airflow counts clears) looks for the iteration its failure handed back
        k = planner.plan(store, recipe, holder, replay=not driven, cleared=bool(getattr(ctx["dag_run"], "clear_number", 0)))
        for done in close_finished_iterations(store, recipe.pipeline):  # a run killed as it ended them
            log.info("iteration %d had finished; its MLflow run is now ended FINISHED too", done)
        parent = tracking.iteration_run(recipe.pipeline, k, store.uri, ctx["run_id"])
        # A stage in a container or pod cannot see this worker's files: it reads the recipe from the store.
        recipe_uri = conf.recipe if mode() == "inprocess" else publish_recipe(conf.recipe, store.uri)
    except Exception as exc:
        raise _fail_now(_named_as_given(exc, given)) from None  # one traceback, not two
    log.info("iteration %d of %s | holder %s | MLflow iteration run: %s", k, recipe.pipeline, holder,
             tracking.run_url(recipe.pipeline, parent))
    return {"iteration": k, "recipe": conf.recipe, "recipe_uri": recipe_uri, "run_root": store.uri, "holder": holder, "pipeline": recipe.pipeline,
            "mlflow_run_id": parent, "mlflow_url": tracking.run_url(recipe.pipeline, parent),
            **{f"shards_{s.id}": shard_list(recipe, s.id) for s in registered() if s.sharded}}


def run_stage_task(stage: str, plan: dict[str, Any], shard: str = "") -> dict[str, Any]:
    from airflow.sdk import get_current_context
    from airflow.sdk.exceptions import AirflowTaskTerminated, AirflowTaskTimeout

    from components.core import tracking
    from components.core.runner import run_stage, stop_signals_raised, stopping

    # Airflow's task runner puts its own SIGTERM handler in before the task runs (it only
    # calls on_kill, which a TaskFlow task does not have): ours raises inside the stage.
    # Under `posttrain run` the signals are only recorded between tasks (dags/local.py).
    args = (stage, plan["recipe"], plan["run_root"], int(plan["iteration"]), shard or None, get_current_context()["run_id"])
    try:
        # The plan's lease on the iteration lasts 6 hours; a stage may run longer (the
        # trainer's limit is 6 hours by itself): it is renewed while the stage runs.
        _check_current(plan)
        with stop_signals_raised(), _lease_renewed(plan):
            if stopping():  # told to stop before this task started (`posttrain run` got SIGTERM)
                raise AirflowTaskTerminated(f"{stage}: not started, the process was told to stop")
            if (host := stagehost.current()) is not None:  # posttrain run: the stage host runs it (dags/stagehost.py)
                return host.run(*args)
            m = run_stage(*args[:5], orchestrator_run_id=args[5])
    except tracking.Terminated as exc:
        raise AirflowTaskTerminated(f"{stage}: {exc}") from None  # a signal: where it landed is noise
    except AirflowTaskTimeout:  # the same work would run as long again: three retries cost four limits
        raise _fail_now(timed_out_error(stage, get_current_context()["task"].execution_timeout)) from None
    except Exception as exc:
        raise _fail_now(exc) from None  # the error's own traceback, not a chain of two
    return stagehost.task_result(stage, m)


def _check_current(plan: dict[str, Any]) -> None:
    """``planner.check_current`` for the plan's iteration and holder (a plan from before
    holders were handed on checks nothing): a cleared task of an old run, whose plan task
    did not run again, is refused at once. The store is probed first (``reachable_store``,
    as ``posttrain stage`` does): wrong keys or a missing bucket are one UserError naming
    ``run_root`` (the task fails at once), a store that does not answer, then or during the
    check, one InfraError (retried); never a botocore traceback."""
    from components.core import planner
    from components.core.storage import reachable_store

    if plan.get("holder") and plan.get("pipeline"):
        with reachable_store(plan["run_root"], "run_root") as store:
            planner.check_current(store, plan["pipeline"], int(plan["iteration"]), plan["holder"])


def _lease_renewed(plan: dict[str, Any]):
    """``lease.renewed`` for the plan's iteration and holder (a plan from before holders
    were handed on renews nothing)."""
    from components.core import lease
    from components.core.storage import Store

    if not plan.get("holder") or not plan.get("pipeline"):
        return contextlib.nullcontext()
    return lease.renewed(Store(plan["run_root"], "run_root"), plan["pipeline"], int(plan["iteration"]), plan["holder"])


def stage_failed(context: dict[str, Any]) -> None:
    """Task failure (no retry left): the reason to the task log, and to the iteration's
    MLflow run as a tag; that run ends FAILED and the task's stage runs still RUNNING
    (a process killed under it) end KILLED."""
    ti = context["ti"]
    FAILED_TASKS.append(ti.task_id)
    reason = f"{type(context.get('exception')).__name__}: {context.get('exception')}"[:4000]
    # posttrain run ends with this error's own line: an error-level line as well said it twice
    (log.info if printed_by_posttrain_run(context) else log.error)("posttrain task %s failed: %s", ti.task_id, reason)
    try:
        from components.core import tracking

        planned = ti.xcom_pull(task_ids="plan") or {}
        if planned.get("mlflow_run_id"):
            tracking.client().set_tag(planned["mlflow_run_id"], f"posttrain.failed.{ti.task_id}", reason)
            index = getattr(ti, "map_index", -1)
            tracking.fail_iteration(planned["mlflow_run_id"], ti.task_id, index if isinstance(index, int) else -1)
    except Exception as exc:  # the tracking server may be what failed; the task log has the reason
        log.warning("could not record the failure in MLflow: %s", exc)


def printed_by_posttrain_run(context: dict[str, Any]) -> bool:
    """Whether the failed task's error is the UserError whose line ``posttrain run`` ends
    with: a run it drives (its ``holder`` param is set, as only ``posttrain run`` sets it)
    whose first ``FINAL_ERRORS`` entry is a UserError the task's message ends with (its
    line, or a stage container's "exited 2: posttrain: error: <its line>"). Any other
    failure (an outage, a bug, a failed gate, another shard's other mistake) is not."""
    from components.core.errors import UserError

    exc = context.get("exception")
    driven = posttrain_run_holder(getattr(context.get("dag_run"), "conf", None))
    if not driven or not FINAL_ERRORS or type(exc).__name__ != "AirflowFailException":
        return False
    return isinstance(FINAL_ERRORS[0], UserError) and str(exc).endswith(FINAL_ERRORS[0].line())


def run_failed(context: dict[str, Any]) -> None:
    """DAG run failure: the iteration's MLflow run ends FAILED (its RUNNING stage runs
    KILLED), and the run's iteration lease is handed back, so the next run resumes it at
    once (a run driven by ``posttrain run`` keeps its lease: that command resumes it).
    Airflow's DAG processor may call it with ``{"dag", "run_id", "reason"}`` alone (no
    ``dag_run``: a deadlocked run with no task to blame, a task removed since): without
    the run's conf, its recipe and run root are the environment's, as for an empty conf."""
    from components.core.runner import end_failed_run

    dag_run = context.get("dag_run")
    params = (context.get("params") or {}) if dag_run is not None else {}
    given = posttrain_run_holder(dag_run.conf if dag_run is not None else None)
    if dag_run is None:
        log.warning("run failed (%s) with no run conf at hand: its lease is looked for under POSTTRAIN_RECIPE's "
                    "pipeline in POSTTRAIN_RUN_ROOT", context.get("reason"))
    holder = given or f"airflow:{context['run_id']}"
    for line in end_failed_run(params.get("recipe") or "", params.get("run_root") or "", holder,
                               given_holder=bool(given)):
        (log.warning if line.startswith(("no lease", "could not")) else log.info)("run failed: %s", line)


@cache
def recipe_at_parse():
    """The recipe named by POSTTRAIN_RECIPE, read once per DAG parse for what the DAG's shape
    takes from it (time limits, cluster resources); None when it cannot be read (the plan
    task then fails with its one-line message). One in a store (``s3://``) is not read
    while the DAG is parsed, where a store that accepts connections and never answers
    stalled the parse for minutes: the registry's limits apply, with a warning. ``posttrain
    run`` (this process holds its home's run lock) has just read it itself, and does."""
    from components.core import settings
    from components.core.errors import InfraError, UserError
    from components.core.recipe import load_recipe
    from components.core.storage import scheme

    try:
        given = settings.default_recipe()
        if scheme(given) not in ("", "file"):
            from dags.orchestrate import in_posttrain_run

            if not in_posttrain_run():
                log.warning("POSTTRAIN_RECIPE=%s is in a store, which the DAG's parse does not read: the stage "
                            "registry's time limits and resources apply; set POSTTRAIN_RECIPE to a local copy for "
                            "the recipe's own", given)
                return None
        return load_recipe(given)
    except (UserError, InfraError):
        return None


def timeout_for(spec: StageSpec) -> timedelta:
    """The stage's time limit: the recipe named by POSTTRAIN_RECIPE may override the registry's."""
    recipe = recipe_at_parse()
    return timedelta(seconds=(recipe.timeouts if recipe else {}).get(spec.id, spec.timeout_s))


def _airflow_kwargs(spec: StageSpec) -> dict[str, Any]:
    """What every mode's task of ``spec`` shares: time limit, retries, pool, callbacks, outlets."""
    extra: dict[str, Any] = {"execution_timeout": timeout_for(spec), "on_failure_callback": stage_failed, **RETRY}
    if spec.pool:
        extra["pool"] = spec.pool
    if spec.id == "trainer":
        extra["outlets"] = [CANDIDATE]
    return extra


def stage_task(spec: StageSpec):
    """The TaskFlow task of one registered stage, in-process (mapped over shards when it fans out)."""
    extra = {"map_index_template": "{{ task.op_kwargs['shard'] }}"} if spec.sharded else {}

    @task(task_id=spec.id, **_airflow_kwargs(spec), **extra)
    def run(plan: dict[str, Any], shard: str = "") -> dict[str, Any]:
        return run_stage_task(spec.id, plan, shard)

    return run


def stage_node(spec: StageSpec, planned):
    """One registered stage's task (or mapped tasks) in the deployment's execution mode."""
    if mode() != "inprocess":
        return container_task(spec, planned, _airflow_kwargs(spec), recipe_at_parse())
    run = stage_task(spec)
    return run.partial(plan=planned).expand(shard=shard_list_task(spec)(planned)) if spec.sharded else run(plan=planned)


def shard_list_task(spec: StageSpec):
    """A stage's shard list as its own XCom (Airflow maps only over a task's return value).
    It depends on the plan alone, so it runs beside bootstrap, off the critical path."""

    @task(task_id=f"{spec.id}_shards")
    def shards(plan: dict[str, Any]) -> list[str]:
        return plan[f"shards_{spec.id}"]

    return shards


@task(task_id="announce_champion", outlets=[CHAMPION], **RETRY)
def announce_champion(plan: dict[str, Any]) -> None:
    """Emits the champion asset only when this iteration promoted its candidate (read from
    the evaluation's manifest in the store, whichever mode ran the stage)."""
    from airflow.sdk.exceptions import AirflowSkipException

    from components.core.context import read_manifest
    from components.core.facts import Decision
    from components.core.manifest import stage_prefix
    from components.core.storage import Store

    try:
        manifest = read_manifest(Store(plan["run_root"], "run_root"), stage_prefix(plan["pipeline"], int(plan["iteration"]), "evaluation"))
        promoted = manifest is not None and manifest.facts(Decision).promoted
    except Exception as exc:
        raise _fail_now(exc) from None  # the error's own traceback, not a chain of two
    if not promoted:
        raise AirflowSkipException("the candidate was held; no new champion")
