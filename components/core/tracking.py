"""MLflow tracking and lineage: experiments, iteration and stage runs, datasets, registry.

- One experiment per pipeline; one parent run per iteration (tagged with the run root,
  iteration and orchestrator run id); one nested run per stage (and shard).
- A stage run ends FINISHED only after the stage's manifest is written (the runner writes
  it inside ``stage_run``); a run whose process was killed stays RUNNING until the next
  attempt of the same stage, iteration, shard and run root marks it KILLED.
- Stage inputs are logged as MLflow datasets: metadata only (source URI + digest), the
  data stays in the store.
- The model registry (versions, aliases) is :mod:`components.core.models`.

The embedded default is ``sqlite:///<POSTTRAIN_HOME>/mlflow.db`` with artifacts beside it;
``MLFLOW_TRACKING_URI`` selects a remote server. Everything goes through ``MlflowClient``
(no fluent global state), so in-process orchestrators can run stages side by side.
Not covered: MLflow authentication set-up (use MLflow's own environment variables).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from components.core import settings

TAG_PIPELINE = "posttrain.pipeline"
TAG_ITERATION = "posttrain.iteration"
TAG_RUN_ROOT = "posttrain.run_root"
TAG_STAGE = "posttrain.stage"
TAG_ORCH = "posttrain.orchestrator_run_id"
TAG_SHARD = "posttrain.shard"  # "i/n" on the runs of sharded stages


def tracking_uri() -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    settings.home().mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{settings.home() / 'mlflow.db'}"


_clients: dict[str, Any] = {}


def client():
    """A client for the configured tracking URI (cached per URI)."""
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("alembic").setLevel(logging.WARNING)
    uri = tracking_uri()
    if uri not in _clients:
        _clients[uri] = MlflowClient(tracking_uri=uri, registry_uri=uri)
    return _clients[uri]


def experiment_id(pipeline: str) -> str:
    c = client()
    exp = c.get_experiment_by_name(pipeline)
    if exp is not None:
        return exp.experiment_id
    artifacts = None
    if tracking_uri().startswith("sqlite:"):
        artifacts = (settings.home() / "mlartifacts" / pipeline).as_uri()
    try:
        return c.create_experiment(pipeline, artifact_location=artifacts)
    except Exception:  # created concurrently by another stage
        return c.get_experiment_by_name(pipeline).experiment_id


def iteration_run(pipeline: str, iteration: int, run_root: str, orchestrator_run_id: str = "") -> str:
    """The parent run of an iteration: found by tags, or created."""
    c = client()
    exp = experiment_id(pipeline)
    flt = f"tags.`{TAG_ITERATION}` = '{iteration}' and tags.`{TAG_RUN_ROOT}` = '{run_root}' and tags.`{TAG_STAGE}` = 'iteration'"
    found = c.search_runs([exp], filter_string=flt, max_results=1)
    if found:
        return found[0].info.run_id
    run = c.create_run(
        exp,
        run_name=f"iter-{iteration:06d}",
        tags={TAG_PIPELINE: pipeline, TAG_ITERATION: str(iteration), TAG_RUN_ROOT: run_root,
              TAG_STAGE: "iteration", TAG_ORCH: orchestrator_run_id},
    )
    return run.info.run_id


def end_if_running(run_id: str, status: str = "FINISHED") -> bool:
    """End ``run_id`` with ``status`` if it is still RUNNING (True when it was); a run id
    this tracking server does not know is left alone (the manifest came from elsewhere)."""
    from mlflow.exceptions import MlflowException

    if not run_id:
        return False
    try:
        run = client().get_run(run_id)
    except MlflowException as exc:
        if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    if run.info.status != "RUNNING":
        return False
    client().set_terminated(run_id, status)
    return True


def run_url(pipeline: str, run_id: str) -> str:
    """Where a run opens in the MLflow UI: the tracking server's, or a local ``mlflow ui``'s."""
    uri = tracking_uri()
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://localhost:5000"
    return f"{base}/#/experiments/{experiment_id(pipeline)}/runs/{run_id}"


def _flatten(prefix: str, obj: Any, out: dict[str, str]) -> dict[str, str]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = str(obj)[:500]
    return out


@contextmanager
def stage_run(pipeline: str, stage: str, run_name: str, parent_run_id: str | None, params: dict[str, Any],
              tags: dict[str, str] | None = None) -> Iterator[str]:
    """A (nested) run for one stage; ends FINISHED when the body returns (so put the
    manifest write inside it), FAILED if the body raises. Earlier attempts of the same
    stage run (same run name, stage, iteration and run root) still marked RUNNING, left so
    by a killed process, are marked KILLED first."""
    from mlflow.entities import Param

    c = client()
    all_tags = {TAG_PIPELINE: pipeline, TAG_STAGE: stage, **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    kill_stale_runs(pipeline, stage, run_name, all_tags.get(TAG_ITERATION, ""), all_tags.get(TAG_RUN_ROOT, ""))
    run = c.create_run(experiment_id(pipeline), run_name=run_name, tags=all_tags)
    run_id = run.info.run_id
    flat = _flatten("", params, {})
    items = [Param(k, v) for k, v in sorted(flat.items())]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i:i + 100])
    try:
        yield run_id
    except BaseException:
        c.set_terminated(run_id, "FAILED")
        raise
    c.set_terminated(run_id, "FINISHED")


def _quoted(value: str) -> str:
    return f"'{value}'"


def kill_stale_runs(pipeline: str, stage: str, run_name: str, iteration: str, run_root: str) -> list[str]:
    """Mark KILLED the RUNNING runs of this stage attempt (same run name, which carries
    the shard, stage, iteration and run root): runs whose process died without ending
    them. One writer per pipeline (the store lease) means none of them is still alive.
    Returns their ids."""
    if not iteration or not run_root or any("'" in v for v in (run_name, stage, iteration, run_root)):
        return []  # nothing to match on (or a value MLflow's filter syntax cannot quote)
    c = client()
    flt = (f"attributes.status = 'RUNNING' and attributes.run_name = {_quoted(run_name)} "
           f"and tags.`{TAG_STAGE}` = {_quoted(stage)} and tags.`{TAG_ITERATION}` = {_quoted(iteration)} "
           f"and tags.`{TAG_RUN_ROOT}` = {_quoted(run_root)}")
    killed = []
    for run in c.search_runs([experiment_id(pipeline)], filter_string=flt, max_results=1000):
        c.set_terminated(run.info.run_id, "KILLED")
        killed.append(run.info.run_id)
    return killed


def log_metrics(run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items())]
    for i in range(0, len(items), 500):
        client().log_batch(run_id, metrics=items[i:i + 500])


def log_datasets(run_id: str, datasets: dict[str, tuple[str, str]], context: str = "training") -> None:
    """Log inputs as MLflow datasets: {name: (source URI, digest)}; the data is not copied."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    inputs = []
    for name, (uri, digest) in datasets.items():
        with warnings.catch_warnings():  # "file" is registered twice by MLflow itself; either is right
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(uri)
        ds = MetaDataset(source=source, name=name, digest=digest[:36])
        inputs.append(DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]))
    try:
        client().log_inputs(run_id, datasets=inputs)
    except Exception as exc:
        # MLflow's SQL store checks for a dataset, then inserts it: two shards logging the
        # same input at once make the slower one hit the unique key. The dataset is there
        # now, so a second call links it instead of inserting it.
        if "UNIQUE constraint failed: datasets" not in str(exc) and "Duplicate entry" not in str(exc):
            raise
        client().log_inputs(run_id, datasets=inputs)


def log_artifact_text(run_id: str, text: str, artifact_file: str) -> None:
    client().log_text(run_id, text, artifact_file)
