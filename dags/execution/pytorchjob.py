"""The trainer stage placed on several nodes: a Kubeflow Training Operator ``PyTorchJob``, rendered offline.

``render(recipe, recipe_uri, run_root, iteration, nodes)`` returns the ``kubeflow.org/v1``
``PyTorchJob`` (a dict, ready for ``yaml.safe_dump`` and ``kubectl apply -f -``) that runs
iteration ``iteration``'s trainer stage on ``nodes`` nodes::

    posttrain render pytorchjob --recipe recipes/demo.yaml --run-root s3://bucket/runs --nodes 2 --iteration 4

- ``spec.pytorchReplicaSpecs``: ``Master`` (1 replica) and, for ``nodes`` > 1, ``Worker``
  (``nodes - 1`` replicas), each with ``restartPolicy: Never``; ``spec.nprocPerNode`` is
  ``trainer.processes`` (the operator hands torchrun's settings to every replica as
  ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE``, ``PET_MASTER_ADDR`` and
  ``PET_MASTER_PORT``); ``runPolicy``: ``cleanPodPolicy: None`` (pods stay for their logs),
  ``backoffLimit: 0`` (a failed trainer is re-run as a stage, whose cache makes a finished
  one a no-op) and ``activeDeadlineSeconds``, the stage's time limit (``timeouts.trainer``,
  else the registry's);
- every replica's pod is the one the DAG's ``kubernetes`` mode gives the trainer
  (``dags/execution/kubernetes.py``, built from the same ``operator()`` arguments): the
  image ``posttrain-trainer`` (entrypoint ``posttrain stage trainer``) with the arguments
  ``--recipe <recipe_uri> --run-root <run_root> --iteration <k>``, the namespace, service
  account and config map of the deployment's settings, the recipe's ``resources.trainer``
  (CPU and memory requests, memory limit and, per node, the ``nvidia.com/gpu`` limit, the
  GPU toleration, node selector and ``/dev/shm`` in memory; ``scratch``: the
  ``ephemeral-storage`` request and limit and the size of the ``emptyDir`` volumes at
  ``/tmp`` and ``/home/posttrain``, where torchrun's work folders and the checkpoints
  before upload go), and the *restricted* security context with a read-only root
  filesystem. The container is named ``pytorch``, as the operator requires.

The pods must read the recipe from the store: a local recipe file is given to them as the
URI that ``components.core.recipe.publish_recipe`` gives it under the run root
(``recipe_uri``; the CLI writes it there only with ``--publish``). Bad input is a
``UserError``: ``--nodes`` outside 1 to ``MAX_NODES``, ``--iteration`` below 1, ``trainer.processes`` above the
GPUs a node is given (nccl needs one per process), ``trainer.device: cuda`` with no GPUs,
and a bad cluster setting (named by its variable).

Every replica runs ``posttrain stage trainer``: the operator's ``PET_*`` variables
(``components/core/nodes.py``) make the stage's torchrun join the job's static rendezvous
with ``trainer.processes`` workers per node, so the ``nodes`` x ``trainer.processes``
workers train one global batch. The Master replica (node 0) runs the stage as anywhere
else and stores, registers and logs its outputs; a Worker replica trains its share and
writes nothing (``runner``'s follower path). ``tests/trainer/test_stage_scaleout.py``
runs two such replicas on one machine.

Not covered: the Training Operator must be installed in the cluster (its CRD and
controller; nothing here installs or talks to it), and nothing in the pipeline submits
this job: the DAG's ``kubernetes`` mode still runs the trainer as one pod, and only
``posttrain render pytorchjob`` calls this module. A Worker replica that starts after the
Master has finished waits for a rendezvous that never comes, until torchrun's join
timeout. Elastic training (``elasticPolicy``), gang scheduling and the Training
Operator's v2 ``TrainJob`` API are not rendered.
"""

from __future__ import annotations

import copy
import hashlib
import os
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from components.core import manifest
from components.core.errors import UserError
from components.core.recipe import RECIPES_DIR, Recipe, is_uri
from components.core.stages import Resources, resources, spec
from dags.execution import kubernetes

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
CONTAINER = "pytorch"  # the container the operator gives torchrun's settings to
STAGE = "trainer"
MAX_NAME = 48  # job name + "-worker-<n>" must stay a DNS label (63) for the replicas' services
MAX_ITERATION = manifest.MAX_ITERATION  # a run root numbers no more; "-trainer-<k>" then leaves the name room


def job_name(pipeline: str, iteration: int) -> str:
    """``<pipeline>-trainer-<k>``, the pipeline cut so the name fits ``MAX_NAME``."""
    suffix = f"-{STAGE}-{iteration}"
    return pipeline[: MAX_NAME - len(suffix)].rstrip("-") + suffix


def recipe_uri(path: str, run_root: str) -> str:
    """Where pods read the recipe: a URI as it is, a local file as the URI
    ``publish_recipe(path, run_root)`` writes it to (content-addressed), computed without writing."""
    if is_uri(path):
        return path
    from components.core.recipe import _read_text
    from components.core.storage import Store

    text = _read_text(path)
    return Store(run_root, "--run-root").url(f"{RECIPES_DIR}/{hashlib.sha256(text.encode()).hexdigest()[:32]}.yaml")


def _cluster() -> kubernetes.ClusterSettings:
    """The deployment's cluster settings; a bad variable is a UserError naming it."""
    try:
        return kubernetes.cluster_settings()
    except ValueError as exc:
        text = str(exc)
        var = text.split("=", 1)[0]
        problem, _, fix = text.split(": ", 1)[-1].partition("; ")
        raise UserError(var, os.environ.get(var, ""), problem, fix or "unset it to use the default") from None


MAX_NODES = 4096
"""More nodes than any one training job uses (a typo such as 100000000 renders a job no
operator could schedule)."""


def check(recipe: Recipe, iteration: int, nodes: int, res: Resources) -> None:
    """UserErrors for a job that could not run as asked."""
    if not 1 <= nodes <= MAX_NODES:
        raise UserError("--nodes", nodes, f"a job needs 1 to {MAX_NODES} nodes", f"pass --nodes from 1 to {MAX_NODES}")
    if iteration < 1:
        raise UserError("--iteration", iteration, "the trainer runs in iterations 1 and up", "pass --iteration 1 or more")
    manifest.check_not_past_max("--iteration", iteration)  # the job's pods would fail `posttrain stage --iteration` on it
    processes = recipe.trainer.processes
    if res.gpus > 0 and processes > res.gpus:
        raise UserError("trainer.processes", processes, f"needs one GPU per process (nccl) but each node gets "
                        f"resources.trainer.gpus={res.gpus}", f"set trainer.processes to at most {res.gpus}, or "
                        f"resources.trainer.gpus to {processes}")
    if recipe.trainer.device == "cuda" and res.gpus == 0:
        raise UserError("trainer.device", "cuda", "the trainer's pods get no GPU (resources.trainer.gpus is 0)",
                        "set resources.trainer.gpus, or trainer.device: cpu")


def pod_template(args: list[str], res: Resources, iteration: int) -> dict[str, Any]:
    """The trainer's pod as the ``kubernetes`` mode builds it, as a ``PodTemplateSpec`` dict."""
    _cluster()  # a bad setting as a UserError, before operator() reads them
    _, kw = kubernetes.operator(spec(STAGE), res)
    container = k8s.V1Container(
        name=CONTAINER, image=kw["image"], image_pull_policy=kw["image_pull_policy"], args=list(args),
        env_from=kw["env_from"], resources=kw["container_resources"], security_context=kw["container_security_context"],
        volume_mounts=kw.get("volume_mounts"), termination_message_policy=kw["termination_message_policy"])
    base = kw["full_pod_spec"].spec if "full_pod_spec" in kw else k8s.V1PodSpec(containers=[])
    pod = k8s.V1PodSpec(
        containers=[container], restart_policy="Never", service_account_name=kw["service_account_name"],
        automount_service_account_token=kw["automount_service_account_token"], security_context=kw["security_context"],
        tolerations=kw.get("tolerations"), node_selector=kw.get("node_selector") or None, volumes=kw.get("volumes"),
        host_users=base.host_users, runtime_class_name=base.runtime_class_name)
    labels = {**kw["labels"], "posttrain.io/iteration": str(iteration)}
    template = k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=labels), spec=pod)
    return ApiClient().sanitize_for_serialization(template)


def render(recipe: Recipe, recipe_uri: str, run_root: str, iteration: int, nodes: int) -> dict[str, Any]:
    """The ``PyTorchJob`` running iteration ``iteration``'s trainer stage on ``nodes`` nodes."""
    res = resources(STAGE, recipe)
    check(recipe, iteration, nodes, res)
    conf = _cluster()
    args = ["--recipe", recipe_uri, "--run-root", run_root, "--iteration", str(iteration)]
    template = pod_template(args, res, iteration)
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if nodes > 1:
        replicas["Worker"] = {"replicas": nodes - 1, "restartPolicy": "Never", "template": copy.deepcopy(template)}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": job_name(recipe.pipeline, iteration), "namespace": conf.namespace,
                     "labels": {"app.kubernetes.io/part-of": "posttrain", "posttrain.io/stage": STAGE,
                                "posttrain.io/pipeline": recipe.pipeline, "posttrain.io/iteration": str(iteration)}},
        "spec": {
            "nprocPerNode": str(recipe.trainer.processes),
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 0,
                          "activeDeadlineSeconds": int(recipe.timeouts.get(STAGE, spec(STAGE).timeout_s))},
            "pytorchReplicaSpecs": replicas,
        },
    }
