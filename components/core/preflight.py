"""Refuse up front what would fail later: checks ``posttrain run`` and the DAG's plan task
make before any stage runs, each failure one ``UserError`` line (exit 2; under Airflow the
plan task fails at once, not after its retries).

``check_all(recipe, run_root)`` runs 0-4, cheapest first: 0, 1, 3, 4, then 2 (a champion
of another run root is not this run's to read); 5 runs on its own:

0. ``tracking_uri``: ``MLFLOW_TRACKING_URI``, when set, is one posttrain can use
   (``tracking.check_uri``: an MLflow server or a database whose driver is installed; not
   a bare path, ``file://``, ``databricks``, an in-memory ``sqlite:///``), checked without
   contacting or creating anything.
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
3. ``task_file``: ``taskgen.task_file``, when set, can be read: a local file (a path or
   ``file://``) must be a regular file after symbolic links are followed (a FIFO would
   block the read forever, ``/dev/zero`` never end it) of at most the task files' size
   limit (``taskfile.MAX_FILE_BYTES``), and only its first byte is read here; an
   ``s3://`` object must be within the limit too.
4. ``registry_owner``: the registered model ``<pipeline>-policy``, when it exists, belongs
   to this run root (model tag ``posttrain.run_root``), so this run cannot register
   versions into, or move the aliases of, another run root's pipeline. Fix: a pipeline
   name (recipe ``pipeline:``) or a tracking server of this run root's own.
5. ``registered_here`` (``posttrain run`` and the plan task, after the store's probe): a
   run root that was bootstrapped has its model in this tracking database. Fix: the home
   or tracking URI the run root was made with.

What is unreachable because a service is down (the store, the tracking server) is not
judged here: those calls raise ``InfraError`` and are retried. Not covered: checking
credentials beyond the reads above, or that the files' contents are valid (the stages
that read them say so, with the field to fix).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

from components.core import models, tracking
from components.core.checkpoint import MAX_CONFIG_BYTES
from components.core.errors import InfraError, UserError, outage
from components.core.recipe import Recipe
from components.core.storage import Store, filesystem, normalize_uri, s3_fix_or, scheme


def tracking_uri(uri: str | None = None) -> None:
    """``uri`` (default: ``MLFLOW_TRACKING_URI``; unset or empty is the embedded SQLite,
    always usable) is a tracking URI posttrain can use; a UserError naming the variable
    otherwise. Nothing is contacted or created."""
    uri = uri if uri is not None else os.environ.get(tracking.VARIABLE)
    if uri:
        tracking.check_uri(uri)


def tracking_vs_run_root(run_root: str, tracking_uri: str | None = None) -> None:
    uri = tracking_uri if tracking_uri is not None else tracking.tracking_uri()
    base = scheme(uri).split("+", 1)[0]  # not urlparse: it raises on what check_uri reports ("http://[x")
    if base in ("http", "https") and normalize_uri(run_root).startswith("file://"):
        raise UserError("run_root", run_root,
                        f"is a local folder, but the MLflow tracking server at {tracking.shown_uri(uri)} accepts no "
                        "local paths as "
                        "checkpoint sources", "use an s3:// run root (POSTTRAIN_RUN_ROOT or --run-root) the server "
                        "can read, or a local tracking URI (unset MLFLOW_TRACKING_URI for the embedded SQLite)")




def _readable(what: str, uri: str, fix: str) -> None:
    """``uri`` (a checkpoint folder) has a readable ``config.json``; else a UserError."""
    try:
        json.loads(Store(uri, what).read_small("config.json", MAX_CONFIG_BYTES))
    except Exception as exc:
        if (down := outage(exc)) is not None:
            raise InfraError("store", uri, down) from None
        raise UserError(what, uri, f"is not a readable checkpoint (no readable config.json: {type(exc).__name__})",
                        fix) from None


def _source_uri(value: str, field: str) -> str:
    return normalize_uri(models.resolve_model_uri(value, field), field)


def _plain(value: str) -> bool:
    """A path or store URI: neither a registry reference (``models:/``, read through
    MLflow) nor a GGUF file to convert (``gguf:``)."""
    return not value.startswith(("models:/", "gguf:"))


def policy_source(recipe: Recipe, registry: bool = True) -> None:
    """The policy the recipe starts from is there (see the module docstring). With
    ``registry=False`` only what needs neither MLflow nor a GGUF conversion: a
    ``model.source`` and a ``rollout.policy`` that are paths or store URIs
    (``posttrain run`` checks those before anything is made)."""
    source = recipe.model.source
    if source and source != "scratch" and (registry or _plain(source)):
        _readable("model.source", _source_uri(source, "model.source"),
                  "point model.source at a Hugging Face model folder or URI, or use 'scratch'")
    policy = recipe.rollout.policy
    if policy in ("champion", "candidate"):
        if not registry:
            return
        found = models.resolve_alias(recipe.pipeline, policy)
        if found is not None:
            version, uri, _ = found
            _readable(f"{policy} (version {version})", uri,
                      f"restore the checkpoint files, or move the '{policy}' alias to a readable version in MLflow")
    elif registry or _plain(policy):
        _readable("rollout.policy", _source_uri(policy, "rollout.policy"),
                  "use 'champion', 'candidate', or the URI of an existing checkpoint")


TASK_FILE_FIX = "pass an existing .parquet, .jsonl or .json file (local path, file:// or s3:// URI)"


def _too_large(size: int, limit: int) -> str:
    return f"is {size:,} bytes, larger than the {limit >> 20} MiB a task file may have"


def _check_local_task_file(path: str, limit: int) -> str | None:
    """Why the local file ``path`` cannot be a task file, or None: ``files.read_regular``
    refuses a FIFO, a device, a folder or a missing file before a byte is read (symbolic
    links followed); a regular file within ``limit`` has only its first byte read here."""
    from components.core.files import Unreadable, read_regular

    try:
        read_regular(path, 0)
        size = os.stat(path).st_size
    except Unreadable as exc:
        return exc.why
    except (OSError, ValueError) as exc:  # gone between the read and the stat
        return f"cannot be read ({type(exc).__name__})"
    return _too_large(size, limit) if size > limit else None


def task_file(recipe: Recipe) -> None:
    from fsspec.implementations.local import LocalFileSystem

    from components.core.files import MAX_TASK_FILE_BYTES as MAX_FILE_BYTES

    source = recipe.taskgen.task_file
    if not source:
        return
    refused = TASK_FILE_FIX
    if "://" not in source:  # a path as taskgen reads it (relative to the working folder)
        problem = _check_local_task_file(source, MAX_FILE_BYTES)
    else:
        try:
            fs, path = filesystem(source)
            if isinstance(fs, LocalFileSystem):  # file://: the same checks as a plain path
                problem = _check_local_task_file(path, MAX_FILE_BYTES)
            else:
                size = fs.size(path)
                problem = _too_large(size, MAX_FILE_BYTES) if size is not None and size > MAX_FILE_BYTES else None
                if problem is None and size:  # the size came from a HEAD; an empty object has no byte to read
                    fs.cat_file(path, start=0, end=1)
        except Exception as exc:
            if (down := outage(exc)) is not None:
                raise InfraError("store", source, down) from None
            problem = f"cannot be read ({type(exc).__name__})"
            refused = s3_fix_or(exc, TASK_FILE_FIX) if source.startswith("s3://") else TASK_FILE_FIX
    if problem is not None:
        fix = "split it into smaller files" if "larger than" in problem else refused
        raise UserError("taskgen.task_file", source, problem, fix)


@contextlib.contextmanager
def _asking_the_registry() -> Iterator[None]:
    """A tracking server that cannot be reached while the body asks the registry is an
    outage (InfraError); every other error passes as it is."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        if (down := outage(exc)) is not None:
            raise InfraError("tracking server", tracking.tracking_uri(), down) from None
        raise


def registry_owner(recipe: Recipe, run_root: str) -> None:
    """``<pipeline>-policy`` is this run root's, or nobody's yet (the first registration claims it)."""
    with _asking_the_registry():
        models.check_owner(recipe.pipeline, normalize_uri(run_root, "run_root"))


def registered_here(recipe: Recipe, store: Store) -> None:
    """A run root whose bootstrap finished has its policy registered in the tracking
    database it ran with. When this one has no ``<pipeline>-policy`` at all, the run root
    was made under another (another ``POSTTRAIN_HOME`` or ``MLFLOW_TRACKING_URI``): its
    bootstrap would be a cache hit that registers nothing, and the first stage to read the
    champion would fail after minutes of work."""
    from components.core.manifest import MANIFEST, stage_prefix

    with _asking_the_registry():
        if models.owner(recipe.pipeline) is not None:
            return
    if store.exists(f"{stage_prefix(recipe.pipeline, 0, 'bootstrap')}/{MANIFEST}"):
        raise UserError("run_root", store.uri, f"was bootstrapped under another MLflow tracking database: the one in use "
                        f"({tracking.shown_uri(tracking.tracking_uri())}) has no '{models.model_name(recipe.pipeline)}'",
                        "run with the POSTTRAIN_HOME (or MLFLOW_TRACKING_URI) this run root was made with, or use a new "
                        "run root")


def check_all(recipe: Recipe, run_root: str) -> None:
    """Every check above, cheapest first (the registry's owner before the policy: a
    champion of another run root is not this run's to read)."""
    tracking_uri()
    tracking_vs_run_root(run_root)
    task_file(recipe)
    registry_owner(recipe, run_root)
    policy_source(recipe)
