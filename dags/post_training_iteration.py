"""One post-training iteration as an Airflow 3 DAG: wiring only.

Every task calls the same stage function as ``posttrain stage <id>``; the logic lives in
``components/``. Rollout, sandbox and reward fan out over shards by dynamic task
mapping; sandbox tasks run in the ``posttrain_sandbox`` pool, which caps how many
sandboxes run at once. ``max_active_runs=1`` because iteration k+1 needs checkpoint k.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Asset, Param, dag, task

POLICY = Asset(name="posttrain-policy-candidate", uri="posttrain://policy/candidate")
SANDBOX_POOL = "posttrain_sandbox"


def _run(stage: str, shard: str | None = None) -> dict:
    from airflow.sdk import get_current_context
    from airflow.sdk.exceptions import AirflowFailException

    from components.core.errors import DataQualityError, UserError
    from components.core.runner import run_stage

    ctx = get_current_context()
    p = ctx["params"]
    try:
        m = run_stage(stage, p["recipe"], p["run_root"], int(p["iteration"]), shard, orchestrator_run_id=ctx["run_id"])
    except UserError as exc:  # a user's mistake: retrying cannot help
        raise AirflowFailException(exc.line()) from None
    except DataQualityError as exc:  # the data will be just as bad on a retry
        raise AirflowFailException(str(exc)) from None
    return {"stage": stage, "shard": m.shard, "digest": m.content_digest}


@dag(
    dag_id="post_training_iteration",
    schedule=None,
    max_active_runs=1,
    catchup=False,
    tags=["posttrain"],
    default_args={"retries": 2, "retry_delay": timedelta(seconds=5), "retry_exponential_backoff": True},
    params={
        "recipe": Param("recipes/demo.yaml", type="string", description="recipe YAML"),
        "run_root": Param(".posttrain/store", type="string", description="store URI: file://... or s3://..."),
        "iteration": Param(1, type="integer", minimum=1, description="iteration number k"),
    },
)
def post_training_iteration():
    @task
    def bootstrap() -> dict:
        return _run("bootstrap")

    @task
    def taskgen(_: dict) -> list[str]:
        from airflow.sdk import get_current_context

        from components.core.recipe import load_recipe

        _run("taskgen")
        n = load_recipe(get_current_context()["params"]["recipe"]).rollout.shards
        return [f"{i}/{n}" for i in range(n)]

    @task(map_index_template="{{ task.op_kwargs['shard'] }}")
    def rollout(shard: str) -> str:
        _run("rollout", shard)
        return shard

    @task(pool=SANDBOX_POOL, map_index_template="{{ task.op_kwargs['shard'] }}")
    def sandbox(shard: str) -> str:
        _run("sandbox", shard)
        return shard

    @task(map_index_template="{{ task.op_kwargs['shard'] }}")
    def reward(shard: str) -> str:
        _run("reward", shard)
        return shard

    @task
    def validation(_: list[str]) -> dict:
        return _run("validation")

    @task(outlets=[POLICY])
    def trainer(_: dict) -> dict:
        return _run("trainer")

    @task
    def evaluation(_: dict) -> dict:
        return _run("evaluation")

    shards = taskgen(bootstrap())
    rewarded = reward.expand(shard=sandbox.expand(shard=rollout.expand(shard=shards)))
    evaluation(trainer(validation(rewarded)))


iteration_dag = post_training_iteration()
