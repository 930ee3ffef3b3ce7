"""One post-training iteration as a Kubeflow pipeline: wiring only.

The same iteration as ``dags/post_training_iteration.py``: a ``plan`` component picks the
iteration (``components.core.planner``: the last finished one + 1, leased to this run,
``kfp:<job id>``, or the ``holder`` parameter: ``posttrain kfp-local`` passes its own, so
a resubmitted run replays its k), then one lightweight Python
component per stage (component name = stage id), each calling
``components.core.runner.run_stage`` -- the function behind ``posttrain stage <id>``.
Rollout, sandbox and reward each fan out with ``dsl.ParallelFor`` over the shard list a
small ``shards`` component returns for that stage (``components.core.stages.shard_list``;
the sandbox may be wider than rollout); the next stage waits for the whole loop. Every
stage task finds its iteration again through the lease its job holds, so nothing passes
between components but shard strings and manifest digests (kfp.local replaces a loop
task's task-output inputs with the loop item, so the iteration cannot be an input there);
the data is in the store under the run root. The stage order is checked against the
stage registry (``components/core/stages.py``) by ``tests/pipelines/test_kfp_pipeline.py``.
Not covered: plug-in stages (entry points ``posttrain.stages``), which the Airflow DAG
runs; with one registered, ``make_pipeline`` refuses to build (a ``UserError`` naming
them) rather than compile a pipeline that silently skips them.

Settings come from ``components.core.settings``: empty ``recipe`` / ``run_root``
parameters mean ``POSTTRAIN_RECIPE`` / ``POSTTRAIN_RUN_ROOT`` in the task's environment
(on a cluster, the ``posttrain-stage-env`` config map), else the absolute defaults.

Run it locally (each task is a subprocess of this interpreter, no containers) with
``posttrain kfp-local --recipe recipes/tiny.yaml --iterations 1`` (``pipelines/local.py``:
``posttrain run``'s checks, lock, leases and planner around ``kfp.local``), or by hand::

    import kfp.local
    from pipelines.post_training_iteration import post_training_iteration
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False))
    post_training_iteration(recipe="recipes/tiny.yaml", run_root="/tmp/store")

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
- Every stage task retries twice with exponential backoff (``plan`` and ``hand-back``
  are not retried; below). KFP cannot tell a user's mistake
  (exit 2 in the CLI) from a transient failure, so a bad recipe is retried too and
  fails the same way each time; ``posttrain kfp-local`` checks the recipe, task file and
  store before it starts the pipeline.
- The Airflow DAG's sandbox pool has no KFP equivalent; the loop's ``parallelism`` caps
  the whole rollout->sandbox->reward body instead (unlimited here; kfp.local itself
  runs at most two iterations at once).
- Cluster settings (``kfp-kubernetes``, in the compiled YAML's ``platforms.kubernetes``
  part; ``kfp.local`` ignores them): every task takes ``POSTTRAIN_RUN_ROOT``,
  ``MLFLOW_TRACKING_URI`` and ``AWS_REGION`` from the config map ``posttrain-stage-env``
  (``AWS_ENDPOINT_URL`` too where it has one, for S3-compatible stores), and
  ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` from the secret ``posttrain-s3`` when
  it exists (optional: on EKS the service account's IRSA role grants the store
  instead), and runs as uid/gid 10001, non-root. Each stage task asks for its registry
  ``cpu``/``memory`` (``components/core/stages.py``; a recipe's ``resources`` cannot
  reach a compiled pipeline), gets ``emptyDir`` volumes at ``/tmp`` and ``/home/posttrain``
  with the registry's ``scratch`` as their ``sizeLimit`` (``dags/execution/cluster.py``'s
  ``SCRATCH_MOUNTS``, as the DAG's pods), the registry's ``timeout_s`` as its pod's deadline and
  the label ``posttrain.io/stage``; GPU stages add ``nvidia.com/gpu`` (accelerator limit),
  a toleration for the ``nvidia.com/gpu`` NoSchedule taint and the node selector
  ``posttrain.io/pool=gpu``. Names are compile-time options of ``pipelines/compile.py``.
- What kfp-kubernetes 2.17 cannot set, of the DAG pods' hardening: ``readOnlyRootFilesystem``
  (``kubernetes.set_security_context`` takes only ``runAsUser``, ``runAsGroup`` and
  ``runAsNonRoot``) and an ``ephemeral-storage`` request or limit (``PipelineTask`` has
  setters for CPU, memory and accelerators only). So a stage task's root filesystem stays
  writable and unbounded: the ``sizeLimit`` of its two ``emptyDir`` volumes bounds what it
  writes under ``/tmp`` and its home (the kubelet evicts a pod past it), not what it
  writes elsewhere in its image; nothing here pretends otherwise. A cluster policy
  (Kyverno, Gatekeeper) mutating the pods, or the DAG's ``kubernetes`` mode, gives both.
- What kfp-kubernetes cannot set: the service account and namespace. Submit the run with
  ``kfp.Client().create_run_from_pipeline_package(..., namespace=<kfp_namespace>,
  service_account="posttrain-kfp")``, the account ``infra/terraform`` creates when its
  ``kfp_namespace`` is set: every pod of a KFP run (KFP's driver, Argo's executor, KFP's
  launcher around each task) runs as it and calls the API server, so its token is mounted
  and a Role lets it report step results (``workflowtaskresults``), get and patch pods
  and read KFP's ``kfp-launcher`` config map and artifact-store secret; the stage
  IAM role trusts it (IRSA). That namespace must be one KFP runs pipelines in: a
  Kubeflow Profile's namespace under multi-user KFP, or KFP's own (``kubeflow``) under
  standalone KFP, which ignores ``namespace``; not ``posttrain``, where Airflow runs
  (``infra/terraform/README.md``). Also not settable: the sandbox's
  seccomp and ``procMount`` (its AppArmor profile goes as the ``unconfined`` annotation on
  the ``main`` container of sandboxed stages). Pods without a seccomp profile run
  unconfined unless the kubelet sets ``seccompDefault``; without ``procMount: Unmasked``
  bubblewrap cannot mount its ``/proc`` and the sandbox refuses untrusted code unless the
  recipe allows weaker isolation. For full sandbox isolation on a cluster, run the
  iteration through the Airflow DAG's ``kubernetes`` mode (``dags/execution/kubernetes.py``).
- Retries: KFP retries every task but ``plan`` and ``hand-back`` twice (10 s, then 20 s), whatever its exit
  status, and so also a stage that ran past its time limit: the pod's deadline
  (``activeDeadlineSeconds``, the registry's ``timeout_s``) kills it, and KFP starts it
  again, up to three limits in all before the run fails (18 hours of GPU for the
  trainer's 6). The DAG fails a timed-out task at once (``dags/wiring.py``: the same
  work would take as long again); KFP's retry policy cannot tell a deadline from another
  failure; terminate such a run in the KFP UI to spare the GPU. A pod that never starts
  (no GPU node: ``infra/terraform/README.md``, "GPU pool") stays Pending with no deadline,
  which counts from the pod's start. ``plan`` makes the DAG's plan task's checks (``dags.orchestrate.check_before_run``)
  and waits out outages and an iteration another run holds itself (10 s, 20 s, 40 s, as
  the DAG's plan task retries), so a bad recipe, task file or run root fails the run
  once, at its first task; a mistake only a stage can see is still retried.
- One iteration per run, like the DAG; a KFP recurring run plans the next iteration
  itself (``max_concurrency=1`` on the recurring run: iteration k+1 needs checkpoint k).
- MLflow: a stage task stopped with SIGTERM ends its stage run KILLED (``_run`` installs
  ``runner.stop_on_sigterm``); a retried one marks its SIGKILLed attempt KILLED; the
  ``plan`` task ends iterations that finished while their parent run stayed RUNNING, and
  sets its own iteration's run RUNNING again where an earlier, failed run ended it FAILED.
  A run that fails for good ends the iteration's MLflow runs FAILED and hands its lease
  back in its exit task (``hand_back``, a ``dsl.ExitHandler`` around the stages, which
  ``kfp.local`` runs too), as the Airflow DAG's failure callbacks do.
"""

# No ``from __future__ import annotations``: KFP reads the component signatures' real types.
from dataclasses import dataclass

from kfp import dsl, kubernetes

from components import STAGES, __version__
from components.core.errors import UserError
from components.core.stages import registered
from components.core.stages import spec as stage_spec
from dags import execution
from dags.execution import cluster

RETRIES = 2
BACKOFF = "10s"
CONFIG_MAP = "posttrain-stage-env"  # infra/terraform/kubernetes.tf
CONFIG_MAP_KEYS = ("POSTTRAIN_RUN_ROOT", "MLFLOW_TRACKING_URI", "AWS_REGION")  # required: a pod without them fails to start
CONFIG_MAP_OPTIONAL_KEYS = ("AWS_ENDPOINT_URL",)  # S3-compatible stores (MinIO, SeaweedFS) only
S3_SECRET = "posttrain-s3"
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
GPU_RESOURCE = "nvidia.com/gpu"
GPU_NODE_SELECTOR = "posttrain.io/pool=gpu"  # the GPU pool's node label (infra/terraform/node_pools.tf)
STAGE_UID = 10001  # the images' user (containers/base.Dockerfile)


def _run(stage: str, recipe: str, run_root: str, shard: str, run_id: str, holder: str) -> str:
    """Shared component body (copied into each component's source by KFP). The iteration is
    the one the ``plan`` task leased to this job (found again by its holder: ``holder``, or
    ``kfp:<job id>`` when empty), so no task takes it as an input."""
    from components.core import lease, planner, settings
    from components.core.errors import DataQualityError, UserError
    from components.core.recipe import load_recipe
    from components.core.runner import run_stage, stop_on_sigterm
    from components.core.storage import Store

    stop_on_sigterm()  # a stopped pod: the stage's MLflow run ends KILLED, not RUNNING
    try:
        conf = settings.resolve(recipe or None, run_root or None)
        if stage == "bootstrap":
            return run_stage(stage, conf.recipe, conf.run_root, 0, shard or None, orchestrator_run_id=run_id).content_digest
        store, loaded, who = Store(conf.run_root, "run_root"), load_recipe(conf.recipe), holder or f"kfp:{run_id}"
        k = planner.plan(store, loaded, who, replay=True)
        with lease.renewed(store, loaded.pipeline, k, who):  # a stage may outlive the lease's 6 hours
            return run_stage(stage, conf.recipe, conf.run_root, k, shard or None, orchestrator_run_id=run_id).content_digest
    except (UserError, DataQualityError) as exc:
        _tell_kfp_local(exc)
        raise


def _tell_kfp_local(exc: Exception) -> None:
    """Under ``posttrain kfp-local`` (``pipelines/local.py``), hand a task's UserError or
    failed gate to the command, which ends with its line and exit status (copied into each
    component's source by KFP)."""
    import os

    if where := os.environ.get("POSTTRAIN_KFP_USER_ERROR"):
        with open(where, "w") as fh:
            fh.write(exc.to_json())


def plan(recipe: str, run_root: str, run_id: str, holder: str) -> int:
    """Pick and lease this job's iteration (``holder`` holds it, ``kfp:<job id>`` when empty:
    ``posttrain kfp-local`` passes one holder for all its runs, so a rerun after a failure
    resumes the iteration its earlier run leased); end the MLflow runs of iterations that
    finished while their parent run stayed RUNNING.

    KFP does not retry this task (``make_pipeline``): a bad recipe, task file or run root
    fails it once, at the start of the run, with the line the DAG's plan task and
    ``posttrain run`` give (the same checks: ``dags.orchestrate.check_before_run``). It
    rides out an outage of the store or the tracking server itself, and an iteration
    another run holds (``LeaseHeld``), waiting 10 s, 20 s and 40 s as the DAG's plan task
    retries (``POSTTRAIN_RETRY_DELAY_S`` sets the first), then fails naming the holder.
    Not covered: a pod lost while it plans fails the run (the next run plans again)."""
    import sys

    from components.core.errors import UserError, retry_outages
    from components.core.lease import LeaseHeld
    from dags.execution import retry_delay_s

    try:
        first = retry_delay_s()
        return retry_outages(lambda: _plan_once(recipe, run_root, run_id, holder), (first, 2 * first, 4 * first),
                             lambda line: print(f"plan: {line}", file=sys.stderr, flush=True), also=(LeaseHeld,))
    except UserError as exc:
        _tell_kfp_local(exc)
        raise


def _plan_once(recipe: str, run_root: str, run_id: str, holder: str) -> int:
    """One attempt of ``plan`` (copied into its component's source by KFP): the DAG's plan
    task's steps (``dags/wiring.py``), in its order."""
    from components.core import planner, settings, tracking
    from components.core.recipe import load_recipe
    from components.core.runner import close_finished_iterations
    from components.core.storage import Store, removed_if_refused
    from dags.orchestrate import check_before_run

    settings.check_run_params({"recipe": recipe, "run_root": run_root, "holder": holder})
    conf = settings.resolve(recipe or None, run_root or None)
    loaded = load_recipe(conf.recipe)  # first: a bad recipe leaves no run root behind
    store = Store(conf.run_root, "run_root")
    # posttrain run's checks (task file, policy source, tracking URI vs run root, the store's
    # probe, the registry's owner): one line, and a refused run makes no run root
    with removed_if_refused(store):
        check_before_run(loaded, store)
    k = planner.plan(store, loaded, holder or f"kfp:{run_id}", replay=True)
    close_finished_iterations(store, loaded.pipeline)
    # a resubmitted run's iteration: hand_back ended its MLflow run FAILED; RUNNING again,
    # so the iteration's end (the evaluation stage's, or a later plan's) ends it FINISHED
    tracking.iteration_run(loaded.pipeline, k, store.uri, run_id)
    return k


def shards(recipe: str, stage: str) -> list:
    """The shard list of one sharded stage (a loop iterates over one task's output)."""
    from components.core import settings
    from components.core.recipe import load_recipe
    from components.core.stages import shard_list

    return shard_list(load_recipe(settings.resolve(recipe or None).recipe), stage)


def bootstrap(recipe: str, run_root: str, run_id: str, holder: str) -> str:
    return _run("bootstrap", recipe, run_root, "", run_id, holder)


def taskgen(recipe: str, run_root: str, run_id: str, holder: str) -> str:
    return _run("taskgen", recipe, run_root, "", run_id, holder)


def rollout(recipe: str, run_root: str, shard: str, run_id: str, holder: str) -> str:
    return _run("rollout", recipe, run_root, shard, run_id, holder)


def sandbox(recipe: str, run_root: str, shard: str, run_id: str, holder: str) -> str:
    return _run("sandbox", recipe, run_root, shard, run_id, holder)


def reward(recipe: str, run_root: str, shard: str, run_id: str, holder: str) -> str:
    return _run("reward", recipe, run_root, shard, run_id, holder)


def validation(recipe: str, run_root: str, run_id: str, holder: str) -> str:
    return _run("validation", recipe, run_root, "", run_id, holder)


def trainer(recipe: str, run_root: str, run_id: str, holder: str) -> str:
    return _run("trainer", recipe, run_root, "", run_id, holder)


def evaluation(recipe: str, run_root: str, run_id: str, holder: str) -> str:
    return _run("evaluation", recipe, run_root, "", run_id, holder)


def hand_back(recipe: str, run_root: str, run_id: str, holder: str, status: dsl.PipelineTaskFinalStatus) -> None:
    """The pipeline's exit task: after a run that did not succeed, the MLflow runs of the
    iteration it leased end FAILED and its lease is handed back (``kfp:<job id>``'s; a
    given ``holder`` keeps it for the command that passed it), so a resubmitted run
    resumes the iteration at once instead of waiting out the lease's 6 hours, as the DAG's
    failure callback does. Never fails the run itself."""
    from components.core.runner import end_failed_run

    if status.state == "SUCCEEDED":
        return
    for line in end_failed_run(recipe, run_root, holder or f"kfp:{run_id}", given_holder=bool(holder)):
        print(f"run failed: {line}", flush=True)


def stage_image(stage: str, image_prefix: str = "") -> str:
    """The stage's container image, as ``containers/build.sh`` tags it; a UserError naming
    ``image_prefix`` when the prefix makes no image reference (the DAG's own check,
    ``dags.execution.check_image_prefix``: a pod with such an image fails only on the cluster)."""
    return f"{execution.check_image_prefix('image_prefix', image_prefix, stage)}:{__version__}"


@dataclass(frozen=True)
class ClusterNames:
    config_map: str
    secret: str  # "" = none
    gpu_node_selector: dict[str, str]


def cluster_names(config_map: str = CONFIG_MAP, s3_secret: str = S3_SECRET,
                  gpu_node_selector: str = GPU_NODE_SELECTOR) -> ClusterNames:
    """The pipeline's cluster names checked as the DAG's kubernetes mode checks its
    ``POSTTRAIN_STAGE_CONFIGMAP``, ``POSTTRAIN_STAGE_SECRET`` and
    ``POSTTRAIN_GPU_NODE_SELECTOR`` (the same functions of ``dags/execution/cluster.py``):
    the config map a Kubernetes name, the secret one or '' (none), the selector node labels
    ``key=value[,key=value]`` or '' (none). A UserError naming ``config_map``, ``s3_secret``
    or ``gpu_node_selector``."""
    return ClusterNames(config_map=cluster.check_config_map("config_map", config_map),
                        gpu_node_selector=parse_node_selector(gpu_node_selector),
                        secret=cluster.check_secret("s3_secret", s3_secret))


def parse_node_selector(value: str) -> dict[str, str]:
    """``"key=value[,key=value]"`` (empty: none) as {key: value}; a UserError naming
    ``gpu_node_selector`` where a pair is not a node label (``cluster.parse_node_selector``)."""
    return cluster.parse_node_selector("gpu_node_selector", value)


GPU_NODE_SELECTOR_DEFAULT = parse_node_selector(GPU_NODE_SELECTOR)


def on_cluster(task: dsl.PipelineTask, stage: str = "", config_map: str = CONFIG_MAP, s3_secret: str = S3_SECRET,
               gpu_node_selector: dict[str, str] | None = None) -> dsl.PipelineTask:
    """What a task's pod needs on a cluster (see the module docstring); ``stage`` adds the
    stage's resources, GPU placement, sandbox annotation and deadline."""
    kubernetes.use_config_map_as_env(task, config_map, {k: k for k in CONFIG_MAP_KEYS})
    kubernetes.use_config_map_as_env(task, config_map, {k: k for k in CONFIG_MAP_OPTIONAL_KEYS}, optional=True)
    if s3_secret:
        kubernetes.use_secret_as_env(task, s3_secret, {k: k for k in S3_SECRET_KEYS}, optional=True)
    kubernetes.set_security_context(task, run_as_user=STAGE_UID, run_as_group=STAGE_UID, run_as_non_root=True)
    if not stage:
        return task
    spec = stage_spec(stage)
    task.set_cpu_request(spec.cpu).set_memory_request(spec.memory).set_memory_limit(spec.memory)
    for volume, path in cluster.SCRATCH_MOUNTS:  # sized scratch; the root stays writable (see the module docstring)
        kubernetes.empty_dir_mount(task, volume, path, size_limit=spec.scratch)
    kubernetes.add_pod_label(task, "posttrain.io/stage", stage)
    kubernetes.set_timeout(task, spec.timeout_s)
    if spec.gpus:
        task.set_accelerator_type(GPU_RESOURCE).set_accelerator_limit(spec.gpus)
        kubernetes.add_toleration(task, key=GPU_RESOURCE, operator="Exists", effect="NoSchedule")
        for key, value in (GPU_NODE_SELECTOR_DEFAULT if gpu_node_selector is None else gpu_node_selector).items():
            kubernetes.add_node_selector(task, key, value)
    if spec.sandboxed:  # bubblewrap's user namespaces; kfp-kubernetes has no appArmorProfile field
        kubernetes.add_pod_annotation(task, "container.apparmor.security.beta.kubernetes.io/main", "unconfined")
    return task


def make_pipeline(image_prefix: str = "", config_map: str = CONFIG_MAP, s3_secret: str = S3_SECRET,
                  gpu_node_selector: str = GPU_NODE_SELECTOR):
    """Build the pipeline with stage images under ``image_prefix`` (e.g. ``registry.example.com/ml/``),
    the stages' environment from the config map ``config_map``, S3 keys from the optional
    secret ``s3_secret`` ("" for none) and GPU stages on nodes matching ``gpu_node_selector``."""
    plugins = [s.id for s in registered() if s.id not in STAGES]
    if plugins:
        raise UserError("entry point posttrain.stages", ", ".join(plugins), "the Kubeflow pipeline runs only the "
                        f"built-in stages {list(STAGES)}, so it would skip these plug-in stages",
                        "run this pipeline with the Airflow DAG (which runs plug-in stages), or uninstall the plug-in "
                        "before compiling")
    names = cluster_names(config_map, s3_secret, gpu_node_selector)
    placement = dict(config_map=names.config_map, s3_secret=names.secret, gpu_node_selector=names.gpu_node_selector)
    bodies = {f.__name__: f for f in (bootstrap, taskgen, rollout, sandbox, reward, validation, trainer, evaluation)}
    assert tuple(bodies) == STAGES, "one component per stage, in stage order"
    comp = {name: dsl.component(f, base_image=stage_image(name, image_prefix), install_kfp_package=False,
                                additional_funcs=[_run, _tell_kfp_local])
            for name, f in bodies.items()}
    planner = dsl.component(plan, base_image=stage_image("taskgen", image_prefix), install_kfp_package=False,
                            additional_funcs=[_plan_once, _tell_kfp_local])
    lister = dsl.component(shards, base_image=stage_image("taskgen", image_prefix), install_kfp_package=False)
    exit_component = dsl.component(hand_back, base_image=stage_image("taskgen", image_prefix), install_kfp_package=False)

    def step(task: dsl.PipelineTask, retried: bool = True) -> dsl.PipelineTask:
        task.set_caching_options(False)
        stage = task.component_spec.name if task.component_spec.name in STAGES else ""
        on_cluster(task, stage, **placement)
        return task.set_retry(num_retries=RETRIES, backoff_duration=BACKOFF, backoff_factor=2.0) if retried else task

    @dsl.pipeline(name="post-training-iteration",
                  description="One RL post-training iteration: plan, bootstrap, taskgen, sharded rollout/sandbox/reward, "
                              "validation, trainer, evaluation.")
    def post_training_iteration(recipe: str = "", run_root: str = "", holder: str = ""):
        common = dict(recipe=recipe, run_root=run_root, run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, holder=holder)
        handed_back = step(exit_component(**common).set_display_name("hand-back"), retried=False)
        with dsl.ExitHandler(handed_back, name="iteration"):
            planned = step(planner(**common), retried=False)  # it retries outages itself; a mistake fails once
            fanout = {s: step(lister(recipe=recipe, stage=s).set_display_name(f"{s}-shards").after(planned))
                      for s in ("rollout", "sandbox", "reward")}
            boot = step(comp["bootstrap"](**common).after(planned))
            tasks = step(comp["taskgen"](**common).after(boot))
            with dsl.ParallelFor(fanout["rollout"].output) as shard:
                rolled = step(comp["rollout"](shard=shard, **common).after(tasks))
            with dsl.ParallelFor(fanout["sandbox"].output) as shard:
                executed = step(comp["sandbox"](shard=shard, **common).after(rolled))
            with dsl.ParallelFor(fanout["reward"].output) as shard:
                rewarded = step(comp["reward"](shard=shard, **common).after(executed))
            validated = step(comp["validation"](**common).after(rewarded))
            trained = step(comp["trainer"](**common).after(validated))
            step(comp["evaluation"](**common).after(trained))

    return post_training_iteration


post_training_iteration = make_pipeline()
