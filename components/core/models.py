"""The model registry: every checkpoint is a version of ``<pipeline>-policy``.

A version's source is the stored checkpoint URI (no second copy). Aliases: ``candidate``
(latest trained) and ``champion`` (promoted by evaluation). Runs, experiments and
datasets are :mod:`components.core.tracking`.
"""

from __future__ import annotations

from components.core import tracking

POLICY_SUFFIX = "-policy"


def model_name(pipeline: str) -> str:
    return pipeline + POLICY_SUFFIX


def register_checkpoint(pipeline: str, checkpoint_uri: str, run_id: str, tags: dict[str, str]) -> str:
    """A new version of ``<pipeline>-policy`` pointing at the stored checkpoint; returns the version."""
    from mlflow.exceptions import MlflowException

    c = tracking.client()
    name = model_name(pipeline)
    try:
        c.get_registered_model(name)
    except MlflowException:
        try:
            c.create_registered_model(name, description=f"Policy checkpoints of pipeline {pipeline}")
        except MlflowException:
            pass  # created concurrently
    existing = c.search_model_versions(f"name = '{name}'")
    for mv in existing:  # idempotent: a retried trainer does not register twice
        if mv.source == checkpoint_uri:
            return str(mv.version)
    try:
        mv = c.create_model_version(name, source=checkpoint_uri, run_id=run_id, tags=tags)
    except MlflowException as exc:
        if exc.error_code != "INVALID_PARAMETER_VALUE" or "model version source" not in exc.message:
            raise
        from components.core.errors import UserError

        # A tracking server accepts no local path as a source (a security rule of MLflow's):
        # a file:// run root only works with the embedded SQLite tracking.
        raise UserError("run_root", checkpoint_uri, f"the tracking server at {tracking.tracking_uri()} refuses this checkpoint "
                        "as a registry version source (it accepts no local paths)",
                        "put the run root where the server can read it (s3://bucket/prefix), or unset "
                        "MLFLOW_TRACKING_URI to use the embedded SQLite tracking") from None
    return str(mv.version)


def set_alias(pipeline: str, alias: str, version: str) -> None:
    tracking.client().set_registered_model_alias(model_name(pipeline), alias, str(version))


def resolve_alias(pipeline: str, alias: str) -> tuple[str, str, dict[str, str]] | None:
    """(version, checkpoint URI, tags) for an alias, or None when it is unset."""
    from mlflow.exceptions import MlflowException

    try:
        mv = tracking.client().get_model_version_by_alias(model_name(pipeline), alias)
    except MlflowException:
        return None
    return str(mv.version), mv.source, dict(mv.tags)


def resolve_model_uri(uri: str, field: str) -> str:
    """``models:/<name>@<alias>`` or ``models:/<name>/<version>`` -> the stored checkpoint URI
    that registry version points at; any other URI is returned unchanged."""
    from mlflow.exceptions import MlflowException

    from components.core.errors import UserError

    if not uri.startswith("models:/"):
        return uri
    ref = uri[len("models:/"):]
    try:
        if "@" in ref:
            name, alias = ref.split("@", 1)
            mv = tracking.client().get_model_version_by_alias(name, alias)
        else:
            name, version = ref.rsplit("/", 1)
            mv = tracking.client().get_model_version(name, version)
    except (MlflowException, ValueError):
        raise UserError(field, uri, f"no such registered model version at {tracking.tracking_uri()}",
                        "use models:/<name>@<alias> or models:/<name>/<version> of an existing version") from None
    return mv.source


def set_version_tags(pipeline: str, version: str, tags: dict[str, str]) -> None:
    for k, v in tags.items():
        tracking.client().set_model_version_tag(model_name(pipeline), str(version), k, v)
