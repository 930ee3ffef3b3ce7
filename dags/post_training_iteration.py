"""
### post_training_iteration

One reinforcement-learning post-training iteration of the policy, as Airflow 3 wiring.

**plan** picks the iteration (last finished + 1, or the half-done one) and leases it to
this run; then **bootstrap** (once per pipeline) → **taskgen** → **rollout**[shards] →
**sandbox**[shards] → **reward**[shards] → **validation** → **trainer** →
**evaluation** → **announce_champion** (emits the `posttrain-policy-champion` asset
when the candidate was promoted). Each task calls the stage function behind
`posttrain stage <id>`; its log links to the iteration's MLflow run.

- Where tasks run: `POSTTRAIN_EXECUTION` = `inprocess` (default, on the worker),
  `docker` (each stage in its image through a Docker-compatible API) or `kubernetes`
  (each stage a pod); see `dags/execution/`.

- Settings: `POSTTRAIN_RECIPE`, `POSTTRAIN_RUN_ROOT`, `POSTTRAIN_HOME` (params
  `recipe` / `run_root` override them for one run).
- Schedule: `POSTTRAIN_SCHEDULE` (cron, a preset such as `@daily` or `@continuous`,
  `asset:champion`, `asset:task-file`; manual when unset). A cron runs on the clock of
  Airflow's `[core] default_timezone` (UTC unless set).
- Sandbox tasks run in the `posttrain_sandbox` pool; outages are retried with backoff;
  a bad recipe, a failed data-quality gate or a stage past its time limit fails at once.
  After 3 failed runs in a row (or `[core] max_consecutive_failed_dag_runs_per_dag`) Airflow
  pauses the DAG (unpause it once the cause is fixed).
- MLflow: the experiment is the pipeline; under its summary run `<pipeline> · timeline`
  (headline metrics per iteration, `timeline/pass_rates.png`, `timeline/rewards.png`) each iteration has a
  parent run `iter-000002` and one run per stage, `trainer · iter-000002`,
  `rollout[1/2] · iter-000002`. The parent ends FINISHED after evaluation, FAILED when a
  task or the run fails for good (its RUNNING stage runs KILLED); the next run of the
  same iteration reopens it.

The stages and their order come from `components/core/stages.py`; the glue is in
`dags/wiring.py`.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag
from airflow.settings import TIMEZONE

from components.core.stages import registered
from dags.wiring import RETRY, announce_champion, max_failed_runs, plan, run_failed, schedule, stage_node


# A fixed start date in the past: without one, Airflow 3.3's @continuous timetable gives the
# second run the first run's logical date, and the scheduler never creates it. Its time zone
# is the deployment's ([core] default_timezone): a cron schedule runs on that clock. No
# "holder" param: `posttrain run` puts its own in the conf of the run it drives itself
# (dags.wiring.posttrain_run_holder refuses any other).
@dag(dag_id="post_training_iteration", schedule=schedule(), start_date=datetime(2025, 1, 1, tzinfo=TIMEZONE),
     max_active_runs=1, max_consecutive_failed_dag_runs=max_failed_runs(), catchup=False, doc_md=__doc__,
     tags=["posttrain"], default_args=RETRY, on_failure_callback=run_failed,
     params={"recipe": Param("", type="string", description="recipe YAML; empty: $POSTTRAIN_RECIPE or the demo recipe"),
             "run_root": Param("", type="string", description="store URI; empty: $POSTTRAIN_RUN_ROOT or $POSTTRAIN_HOME/store")})
def post_training_iteration():
    planned = plan()
    tasks = {}
    for spec in registered():  # one task per registered stage, after its upstream stages
        tasks[spec.id] = stage_node(spec, planned)
        for up in spec.upstream:
            tasks[up] >> tasks[spec.id]
    tasks["evaluation"] >> announce_champion(planned)


iteration_dag = post_training_iteration()
