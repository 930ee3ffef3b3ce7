"""Where the DAG's stage tasks run: one switch, ``POSTTRAIN_EXECUTION``, read at DAG parse.

| mode | a stage task | the deployment provides |
|---|---|---|
| ``inprocess`` (default) | a TaskFlow task calls the stage function on the worker | the project installed on the workers |
| ``docker`` | the stage's image runs through a Docker-compatible API (Docker, or podman's socket) | ``DOCKER_HOST``, the images (``make images``) |
| ``kubernetes`` | a pod in the stage's image (``KubernetesPodOperator``) | images in a registry; namespace, service account, config map |

The wiring is shared: the same plan task, the same registry of stages, shard mapping,
retries, pools, time limits and failure callbacks. In the container modes the plan task
publishes the recipe into the store (a container cannot see the scheduler's files), and
a ``<stage>_args`` task hands each task its argument list (one per shard), the
command line of ``posttrain stage <id>`` that the image's entrypoint runs. A container
that exits 2 (a user's mistake) or 3 (a failed data-quality gate) fails at once;
any other failure is retried like an outage.

Images are ``<POSTTRAIN_IMAGE_PREFIX>posttrain-<stage>:<POSTTRAIN_IMAGE_TAG>`` (tag:
the package version by default). Not covered: mixing modes per stage.
"""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import task

from components import __version__
from components.core.stages import StageSpec, resources

MODE_VAR = "POSTTRAIN_EXECUTION"
MODES = ("inprocess", "docker", "kubernetes")
FAIL_NOW_EXIT_CODES = (2, 3)  # UserError, DataQualityError: retrying cannot help


def mode() -> str:
    """The execution mode; ValueError (a DAG import error) naming the fix for a bad value."""
    value = (os.environ.get(MODE_VAR) or "inprocess").strip().lower()
    if value not in MODES:
        raise ValueError(f"{MODE_VAR}={value!r}: unknown execution mode; use one of {list(MODES)}")
    return value


def image_for(stage: str) -> str:
    """The image a stage runs in: ``<prefix>posttrain-<stage>:<tag>``."""
    prefix = os.environ.get("POSTTRAIN_IMAGE_PREFIX", "")
    tag = os.environ.get("POSTTRAIN_IMAGE_TAG") or __version__
    return f"{prefix}posttrain-{stage}:{tag}"


def stage_arguments(plan: dict[str, Any], run_id: str, shard: str = "") -> list[str]:
    """The arguments of ``posttrain stage <id>`` for one task (the shard last, so a mapped
    task's map index can show it)."""
    args = ["--recipe", plan["recipe_uri"], "--run-root", plan["run_root"], "--iteration", str(plan["iteration"]),
            "--orchestrator-run-id", run_id]
    return [*args, "--shard", shard] if shard else args


def args_task(spec: StageSpec):
    """The argument list(s) of one stage's container task(s): one list, or one per shard."""

    @task(task_id=f"{spec.id}_args")
    def stage_args(plan: dict[str, Any]) -> list[str] | list[list[str]]:
        from airflow.sdk import get_current_context

        run_id = get_current_context()["run_id"]
        if spec.sharded:
            return [stage_arguments(plan, run_id, shard) for shard in plan[f"shards_{spec.id}"]]
        return stage_arguments(plan, run_id)

    return stage_args


def _module(name: str):
    if name == "docker":
        from dags.execution import docker as module
    else:
        from dags.execution import kubernetes as module
    return module


def container_task(spec: StageSpec, planned, airflow_kwargs: dict[str, Any], recipe=None):
    """The stage's operator in a container mode, mapped over shards when it fans out."""
    module = _module(mode())
    cls, kwargs = module.operator(spec, resources(spec.id, recipe))
    field = module.ARGS_FIELD
    arguments = args_task(spec)(planned)
    if spec.sharded:
        return cls.partial(task_id=spec.id, map_index_template="{{ task." + field + "[-1] }}", **airflow_kwargs,
                           **kwargs).expand(**{field: arguments})
    return cls(task_id=spec.id, **airflow_kwargs, **kwargs, **{field: arguments})
