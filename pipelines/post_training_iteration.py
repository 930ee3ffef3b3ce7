"""One post-training iteration as a Kubeflow pipeline: wiring only.

The same iteration as ``dags/post_training_iteration.py``: one lightweight Python
component per stage (component name = stage id), each calling
``components.core.runner.run_stage`` -- the function behind ``posttrain stage <id>``.
Rollout -> sandbox -> reward fan out with ``dsl.ParallelFor`` over the shard list that
taskgen returns (``["0/n", ..., "n-1/n"]``, n = ``recipe.rollout.shards``), and
validation fans back in through ``dsl.Collected`` of the reward digests. Nothing passes
between components but the manifests' content digests (and the shard strings); the data
is in the store under ``run_root``.

Run it locally (each task is a subprocess of this interpreter, no containers)::

    import kfp.local
    from pipelines.post_training_iteration import post_training_iteration
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False))
    post_training_iteration(recipe="recipes/tiny.yaml", run_root=".posttrain/store", iteration=1)

On a cluster, compile with ``python pipelines/compile.py [--image-prefix REGISTRY/]``
and submit ``pipelines/post_training_iteration.yaml``; each task then runs in its stage
image ``posttrain-<stage>:<version>`` (``containers/``), whose ``command`` KFP sets,
overriding the image's ``posttrain stage <id>`` entrypoint.

Choices, and what this does not do:

- Lightweight components (not ``dsl.container_component`` calling ``posttrain stage``)
  because ``kfp.local.SubprocessRunner`` only runs Python components; the stage images
  carry ``kfp`` (a project dependency) so ``install_kfp_package=False`` works there.
- KFP caching is off on every task: the stage manifests are the cache (a re-run with
  the same inputs and config is a no-op), and KFP's own cache would wrongly skip a
  stage whose store was wiped.
- Every task retries twice with exponential backoff. KFP cannot tell a user's mistake
  (exit 2 in the CLI) from a transient failure, so a bad recipe is retried too and
  fails the same way each time.
- The Airflow DAG's sandbox pool has no KFP equivalent; the loop's ``parallelism`` caps
  the whole rollout->sandbox->reward body instead (unlimited here; kfp.local itself
  runs at most two iterations at once).
- No resource requests, node selectors, accelerators, service account or environment
  are set here: on a cluster the pods need ``POSTTRAIN_RUN_ROOT``/``MLFLOW_TRACKING_URI``
  (the ``posttrain-stage-env`` config map) and the ``posttrain-stage`` service account
  from ``infra/terraform/``; add them with ``kfp-kubernetes``
  (``use_config_map_as_env``, ``add_toleration``) or submit the run with that service
  account. kfp.local ignores such platform settings, so they are left out of the wiring.
- One iteration per run, like the DAG; a recurring run (KFP "recurring run") supplies
  the next ``iteration``.
"""

# No ``from __future__ import annotations``: KFP reads the component signatures' real types.
from kfp import dsl

from components import STAGES, __version__

RETRIES = 2
BACKOFF = "10s"


def _run(stage: str, recipe: str, run_root: str, iteration: int, shard: str, run_id: str) -> str:
    """Shared component body (copied into each component's source by KFP)."""
    from components.core.runner import run_stage

    return run_stage(stage, recipe, run_root, iteration, shard or None, orchestrator_run_id=run_id).content_digest


def bootstrap(recipe: str, run_root: str, iteration: int, run_id: str) -> str:
    return _run("bootstrap", recipe, run_root, iteration, "", run_id)


def taskgen(recipe: str, run_root: str, iteration: int, run_id: str) -> list:
    from components.core.recipe import load_recipe

    _run("taskgen", recipe, run_root, iteration, "", run_id)
    n = load_recipe(recipe).rollout.shards
    return [f"{i}/{n}" for i in range(n)]


def rollout(recipe: str, run_root: str, iteration: int, shard: str, run_id: str) -> str:
    return _run("rollout", recipe, run_root, iteration, shard, run_id)


def sandbox(recipe: str, run_root: str, iteration: int, shard: str, run_id: str) -> str:
    return _run("sandbox", recipe, run_root, iteration, shard, run_id)


def reward(recipe: str, run_root: str, iteration: int, shard: str, run_id: str) -> str:
    return _run("reward", recipe, run_root, iteration, shard, run_id)


def validation(recipe: str, run_root: str, iteration: int, rewards: list, run_id: str) -> str:
    return _run("validation", recipe, run_root, iteration, "", run_id)


def trainer(recipe: str, run_root: str, iteration: int, run_id: str) -> str:
    return _run("trainer", recipe, run_root, iteration, "", run_id)


def evaluation(recipe: str, run_root: str, iteration: int, run_id: str) -> str:
    return _run("evaluation", recipe, run_root, iteration, "", run_id)


def stage_image(stage: str, image_prefix: str = "") -> str:
    """The stage's container image, as ``containers/build.sh`` tags it."""
    return f"{image_prefix}posttrain-{stage}:{__version__}"


def make_pipeline(image_prefix: str = ""):
    """Build the pipeline with stage images under ``image_prefix`` (e.g. ``registry.example.com/ml/``)."""
    bodies = {f.__name__: f for f in (bootstrap, taskgen, rollout, sandbox, reward, validation, trainer, evaluation)}
    assert tuple(bodies) == STAGES, "one component per stage, in stage order"
    comp = {name: dsl.component(f, base_image=stage_image(name, image_prefix), install_kfp_package=False,
                                additional_funcs=[_run])
            for name, f in bodies.items()}

    def step(task: dsl.PipelineTask) -> dsl.PipelineTask:
        task.set_caching_options(False)
        return task.set_retry(num_retries=RETRIES, backoff_duration=BACKOFF, backoff_factor=2.0)

    @dsl.pipeline(name="post-training-iteration",
                  description="One RL post-training iteration: bootstrap, taskgen, sharded rollout/sandbox/reward, "
                              "validation, trainer, evaluation.")
    def post_training_iteration(recipe: str = "recipes/demo.yaml", run_root: str = ".posttrain/store",
                                iteration: int = 1) -> str:
        common = dict(recipe=recipe, run_root=run_root, iteration=iteration, run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        boot = step(comp["bootstrap"](**common))
        shards = step(comp["taskgen"](**common).after(boot))
        with dsl.ParallelFor(shards.output) as shard:
            rolled = step(comp["rollout"](shard=shard, **common))
            executed = step(comp["sandbox"](shard=shard, **common).after(rolled))
            rewarded = step(comp["reward"](shard=shard, **common).after(executed))
        validated = step(comp["validation"](rewards=dsl.Collected(rewarded.output), **common))
        trained = step(comp["trainer"](**common).after(validated))
        return step(comp["evaluation"](**common).after(trained)).output

    return post_training_iteration


post_training_iteration = make_pipeline()
