"""Refuse up front what would fail later: checks ``posttrain run`` and the DAG's plan task
make before any stage runs, each failure one ``UserError`` line (exit 2; under Airflow the
plan task fails at once, not after its retries).

``check_all(recipe, run_root)`` runs, in order:

1. ``tracking_vs_run_root``: an HTTP(S) MLflow tracking server cannot register a
   checkpoint stored under a ``file://`` run root (the server accepts no local paths as a
   model version's source; bootstrap would end in a long traceback). Fix: an ``s3://``
   run root the server can read, or a local tracking URI (``sqlite:///...``, or unset
   ``MLFLOW_TRACKING_URI`` for the embedded SQLite).
2. ``policy_source``: the policy the recipe starts from is there. ``model.source`` (a
   folder, store URI or ``models:/`` URI; ``scratch`` needs nothing) must have a
   ``config.json``; a ``rollout.policy`` that is a URI likewise; for ``champion`` and
   ``candidate`` the alias, when set, must point at a readable checkpoint (unset is fine:
   bootstrap sets it).
3. ``task_file``: ``taskgen.task_file``, when set, can be read.
4. ``registry_owner``: the registered model ``<pipeline>-policy``, when it exists, belongs
   to this run root (model tag ``posttrain.run_root``), so this run cannot register
   versions into, or move the aliases of, another run root's pipeline. Fix: a pipeline
   name (recipe ``pipeline:``) or a tracking server of this run root's own.

What is unreachable because a service is down (the store, the tracking server) is not
judged here: those calls raise ``InfraError`` and are retried. Not covered: checking
credentials beyond the reads above, or that the files' contents are valid (the stages
that read them say so, with the field to fix).
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

from components.core import models, tracking
from components.core.errors import InfraError, UserError, outage
from components.core.recipe import Recipe
from components.core.storage import filesystem, join, normalize_uri

LOCAL_SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql")
"""Tracking URI schemes that need no server between the client and the registry."""


def tracking_vs_run_root(run_root: str, tracking_uri: str | None = None) -> None:
    uri = tracking_uri if tracking_uri is not None else tracking.tracking_uri()
    scheme = urlparse(uri).scheme.split("+", 1)[0]
    if scheme in ("http", "https") and normalize_uri(run_root).startswith("file://"):
        raise UserError("run_root", run_root,
                        f"is a local folder, but the MLflow tracking server at {uri} accepts no local paths as "
                        "checkpoint sources", "use an s3:// run root (POSTTRAIN_RUN_ROOT or --run-root) the server "
                        "can read, or a local tracking URI (unset MLFLOW_TRACKING_URI for the embedded SQLite)")


def _readable(what: str, uri: str, fix: str) -> None:
    """``uri`` (a checkpoint folder) has a readable ``config.json``; else a UserError."""
    fs, path = filesystem(uri)
    try:
        json.loads(fs.cat_file(join(path, "config.json")))
    except Exception as exc:
        if (down := outage(exc)) is not None:
            raise InfraError("store", uri, down) from None
        raise UserError(what, uri, f"is not a readable checkpoint (no readable config.json: {type(exc).__name__})",
                        fix) from None


def _source_uri(value: str, field: str) -> str:
    return normalize_uri(models.resolve_model_uri(value, field), field)


def policy_source(recipe: Recipe) -> None:
    source = recipe.model.source
    if source and source != "scratch":
        _readable("model.source", _source_uri(source, "model.source"),
                  "point model.source at a Hugging Face model folder or URI, or use 'scratch'")
    policy = recipe.rollout.policy
    if policy in ("champion", "candidate"):
        found = models.resolve_alias(recipe.pipeline, policy)
        if found is not None:
            version, uri, _ = found
            _readable(f"{policy} (version {version})", uri,
                      f"restore the checkpoint files, or move the '{policy}' alias to a readable version in MLflow")
    else:
        _readable("rollout.policy", _source_uri(policy, "rollout.policy"),
                  "use 'champion', 'candidate', or the URI of an existing checkpoint")


def task_file(recipe: Recipe) -> None:
    source = recipe.taskgen.task_file
    if not source:
        return
    try:
        if "://" not in source:
            Path(source).read_bytes()
        else:
            fs, path = filesystem(source)
            fs.cat_file(path)
    except Exception as exc:
        if "://" in source and (down := outage(exc)) is not None:
            raise InfraError("store", source, down) from None
        raise UserError("taskgen.task_file", source, f"cannot be read ({type(exc).__name__})",
                        "pass an existing .parquet, .jsonl or .json file (local path, file:// or s3:// URI)") from None


def registry_owner(recipe: Recipe, run_root: str) -> None:
    """``<pipeline>-policy`` is this run root's, or nobody's yet (the first registration claims it)."""
    try:
        models.check_owner(recipe.pipeline, normalize_uri(run_root, "run_root"))
    except UserError:
        raise
    except Exception as exc:
        if (down := outage(exc)) is not None:
            raise InfraError("tracking server", tracking.tracking_uri(), down) from None
        raise


def check_all(recipe: Recipe, run_root: str) -> None:
    """Every check above, cheapest first (the registry's owner before the policy: a
    champion of another run root is not this run's to read)."""
    tracking_vs_run_root(run_root)
    task_file(recipe)
    registry_owner(recipe, run_root)
    policy_source(recipe)
