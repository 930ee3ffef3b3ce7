"""The model registry: every checkpoint is a version of ``<pipeline>-policy``.

Each version is an MLflow model that loads and serves
(``mlflow.pyfunc.load_model("models:/<pipeline>-policy@champion")``; see
:mod:`components.core.policy_model`): a small pyfunc model logged as a LoggedModel of the
stage's run, holding the stored checkpoint's URI, not a copy of the weights. The
checkpoint URI is the version tag ``posttrain.checkpoint_uri`` (also a tag of the run
that registered it); everything that needs a version's checkpoint reads that tag
(``checkpoint_of``), falling back to the version's source for versions registered as a
bare checkpoint folder. Aliases: ``candidate`` (latest trained) and ``champion``
(set by bootstrap, then moved by evaluation's promotions). ``lineage_root`` follows a
version's ``posttrain.parent_version`` tags back to the version it was first trained from:
a re-run bootstrap whose version is the champion's root leaves the champion where it is.
A retried (or re-run) stage that finds its weights already registered at its checkpoint
place reuses that version; MLflow keeps the earlier attempt as the version's ``run_id``,
so the version's ``posttrain.source_run`` tag names the run that holds the checkpoint
(``attribute``) and the earlier run is tagged ``posttrain.superseded_by``.
``check_weights`` refuses a version whose checkpoint place no longer holds the weights it
was registered (and judged) with (``posttrain.weights_sha256`` against the manifest of the
stage that last wrote that place): a re-run that wrote other weights there, or one cut
short, never serves or trains from unjudged weights under the old version's name.

A registered model belongs to one run root (model tag ``posttrain.run_root``, set when it
is created; a model without it is claimed by its next registration). Registering a
version or moving an alias for another run root is refused (``UserError`` on
``run_root``): two run roots sharing a pipeline name on one tracking server would
otherwise move each other's champion. ``check_owner`` is the same check for the
preflight. Runs, experiments and datasets are :mod:`components.core.tracking`.

A registration costs a few tenths of a second and about 6 kB of artifacts (the model's
MLmodel, pickle and environment files; no weights).

Not covered: two run roots claiming an unowned model at the same instant (the last tag
write wins; the preflight of the other then refuses its next run); moving a model to
another run root (delete the tag ``posttrain.run_root`` in MLflow, and the next
registration claims it); deleting the checkpoints of deleted versions; a stage killed
between logging the model and creating the version leaves that LoggedModel unused (its
retry logs another).
"""

from __future__ import annotations

import os
import tempfile
import time

from components.core import tracking
from components.core.errors import InfraError, UserError, outage

POLICY_SUFFIX = "-policy"
TAG_CHECKPOINT = "posttrain.checkpoint_uri"
TAG_RUN_ROOT = tracking.TAG_RUN_ROOT
TAG_PARENT = "posttrain.parent_version"
TAG_SOURCE_RUN = "posttrain.source_run"
"""The run of the attempt that holds the version's checkpoint (the one its stage's
manifest records once written): the version's MLflow ``run_id`` when one attempt
registered it; the later attempt that found the version already registered when an
earlier one was killed, or re-run, after registering it (MLflow keeps the ``run_id`` a
version was created with)."""
TAG_WEIGHTS = "posttrain.weights_sha256"
"""The sha256 of the version's weights file when it was registered: a checkpoint URI
re-written with other weights is another version."""
MODEL_ARTIFACT = "policy"
"""Name of the LoggedModel each registration logs under the stage's run."""

last_registration_s = 0.0
"""Seconds the last ``register_checkpoint`` spent building and uploading its MLflow model."""


def model_name(pipeline: str) -> str:
    return pipeline + POLICY_SUFFIX


def checkpoint_of(mv) -> str:
    """The stored checkpoint URI of a model version: its tag, or (versions registered as
    a bare checkpoint folder) its source."""
    return dict(mv.tags).get(TAG_CHECKPOINT) or mv.source


def _refuse(name: str, run_root: str, owner: str) -> UserError:
    return UserError("run_root", run_root, f"registered model {name} belongs to run root {owner}",
                     "give this run root its own pipeline name (recipe `pipeline:`) or its own tracking server; a "
                     "POSTTRAIN_HOME copied or moved from elsewhere still tracks the run root it was made with: use it at "
                     "its original path")


def owner(pipeline: str) -> str | None:
    """The run root that owns ``<pipeline>-policy``: '' when the model has no owner tag,
    None when there is no such registered model."""
    from mlflow.exceptions import MlflowException

    try:
        rm = tracking.client().get_registered_model(model_name(pipeline))
    except MlflowException as exc:
        if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return dict(rm.tags).get(TAG_RUN_ROOT, "")


def check_owner(pipeline: str, run_root: str) -> None:
    """A UserError unless ``run_root`` may write ``<pipeline>-policy`` (it owns it, or
    nobody does yet)."""
    found = owner(pipeline)
    if found and found != run_root:
        raise _refuse(model_name(pipeline), run_root, found)


def _claim(pipeline: str, run_root: str) -> None:
    """Create ``<pipeline>-policy`` owned by ``run_root``, or claim it when unowned, or
    refuse when another run root owns it."""
    from mlflow.exceptions import MlflowException

    c = tracking.client()
    name = model_name(pipeline)
    found = owner(pipeline)
    if found is None:
        try:
            c.create_registered_model(name, tags={TAG_RUN_ROOT: run_root},
                                      description=f"Policy checkpoints of pipeline {pipeline}")
            return
        except MlflowException:
            found = owner(pipeline)  # created concurrently: judge its owner
    if not found:
        c.set_registered_model_tag(name, TAG_RUN_ROOT, run_root)
    elif found != run_root:
        raise _refuse(name, run_root, found)


def register_checkpoint(pipeline: str, checkpoint_uri: str, run_id: str, tags: dict[str, str], *,
                        run_root: str | None = None, max_new_tokens: int = 24, batch_size: int = 64,
                        prompt_format: str = "auto", weights_sha256: str = "") -> str:
    """A new version of ``<pipeline>-policy`` serving the stored checkpoint; returns the version.

    ``run_root`` (default: ``tags["posttrain.run_root"]``) must own the registered model.
    Idempotent: a checkpoint URI that already has a version returns that version (a
    retried stage does not register twice), unless ``weights_sha256`` is given and that
    version was registered with other weights (``TAG_WEIGHTS``): a stage re-run that wrote
    other weights to the same place is a new version, so the old one's eval tags and
    aliases never describe weights they were not judged on. The old version still names
    the re-written place, and ``check_weights`` refuses it from then on. ``max_new_tokens`` and ``batch_size`` are the
    served model's defaults (a request may pass ``max_new_tokens``); ``prompt_format`` is how it
    encodes prompts (the recipe's ``rollout.prompt_format``, as the policy was trained)."""
    global last_registration_s
    from mlflow.exceptions import MlflowException

    from components.core.policy_model import build

    if tracking.tracking_uri().startswith(("http://", "https://")) and checkpoint_uri.startswith("file://"):
        # A model served through a tracking server would point at a folder only this
        # machine sees (and the server itself accepts no local path as a source).
        raise UserError("run_root", checkpoint_uri, f"the tracking server at {tracking.tracking_uri()} refuses this "
                        "checkpoint as a registry version source (it accepts no local paths)",
                        "put the run root where the server can read it (s3://bucket/prefix), or unset "
                        "MLFLOW_TRACKING_URI to use the embedded SQLite tracking")
    c = tracking.client()
    name = model_name(pipeline)
    root = run_root if run_root is not None else tags.get(TAG_RUN_ROOT, "")
    if root:
        _claim(pipeline, root)
    elif owner(pipeline) is None:
        try:
            c.create_registered_model(name, description=f"Policy checkpoints of pipeline {pipeline}")
        except MlflowException:
            pass  # created concurrently
    c.set_tag(run_id, TAG_CHECKPOINT, checkpoint_uri)
    same = [mv for mv in c.search_model_versions(f"name = '{name}'") if checkpoint_of(mv) == checkpoint_uri
            and (dict(mv.tags).get(TAG_WEIGHTS, "") in ("", weights_sha256) or not weights_sha256)]
    if same:
        mv = max(same, key=lambda v: int(v.version))  # the latest registration of these weights at this place
        attribute(pipeline, str(mv.version), run_id)
        return str(mv.version)
    started = time.perf_counter()
    run = c.get_run(run_id)
    model = c.create_logged_model(run.info.experiment_id, name=MODEL_ARTIFACT, source_run_id=run_id,
                                  tags={TAG_CHECKPOINT: checkpoint_uri})
    with tempfile.TemporaryDirectory(prefix="posttrain-model-") as tmp:
        build(checkpoint_uri, f"{tmp}/model", max_new_tokens, batch_size, prompt_format, weights_sha256)
        c.log_model_artifacts(model.model_id, f"{tmp}/model")
    c.finalize_logged_model(model.model_id, "READY")
    last_registration_s = time.perf_counter() - started
    # The logged model's own folder, not models:/<model_id>: a registry resolves that form
    # through the process's global tracking URI, which this client does not set.
    mv = c.create_model_version(name, source=model.artifact_location, run_id=run_id,
                                tags={**tags, TAG_CHECKPOINT: checkpoint_uri, TAG_SOURCE_RUN: run_id,
                                      **({TAG_WEIGHTS: weights_sha256} if weights_sha256 else {})},
                                model_id=model.model_id)
    return str(mv.version)


def attribute(pipeline: str, version: str, run_id: str) -> str:
    """Make ``run_id`` the source run of ``version``: its tag ``TAG_SOURCE_RUN``, and, when
    MLflow records another run as the version's ``run_id`` (an earlier attempt of the same
    stage that registered these weights at this place, then was killed or re-run), that
    run's tag ``posttrain.superseded_by`` = ``run_id``. Returns that other run's id ('' when
    none). MLflow allows no change of a version's ``run_id`` (nor of its LoggedModel's
    source run), so those still name the earlier attempt."""
    mv = tracking.client().get_model_version(model_name(pipeline), str(version))
    if dict(mv.tags).get(TAG_SOURCE_RUN) != run_id:
        tracking.client().set_model_version_tag(model_name(pipeline), str(version), TAG_SOURCE_RUN, run_id)
    earlier = mv.run_id or ""
    if not earlier or earlier == run_id:
        return ""
    tracking.mark_superseded(earlier, run_id)
    return earlier


def set_alias(pipeline: str, alias: str, version: str, run_root: str | None = None) -> None:
    """Point ``alias`` at ``version``; refused when the model belongs to another run root
    than ``run_root`` (default: the version's own ``posttrain.run_root`` tag)."""
    c = tracking.client()
    name = model_name(pipeline)
    owned_by = owner(pipeline)
    if owned_by:
        actor = run_root
        if actor is None:
            actor = dict(c.get_model_version(name, str(version)).tags).get(TAG_RUN_ROOT, "")
        if actor and actor != owned_by:
            raise _refuse(name, actor, owned_by)
    c.set_registered_model_alias(name, alias, str(version))


def resolve_alias(pipeline: str, alias: str) -> tuple[str, str, dict[str, str]] | None:
    """(version, checkpoint URI, tags) for an alias, or None when it is unset (or the
    registered model does not exist); an unreachable tracking server is an InfraError, not
    an unset alias. With the embedded database not made yet, nothing is registered: None,
    and a stage refused for it makes no home."""
    from mlflow.exceptions import MlflowException

    if not os.environ.get(tracking.VARIABLE) and not tracking.embedded_db().exists():
        return None
    try:
        mv = tracking.client().get_model_version_by_alias(model_name(pipeline), alias)
    except MlflowException as exc:
        if getattr(exc, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        if (down := outage(exc)) is not None:
            raise InfraError("tracking server", tracking.tracking_uri(), down) from None
        raise
    return str(mv.version), checkpoint_of(mv), dict(mv.tags)


def resolve_model_uri(uri: str, field: str) -> str:
    """``models:/<name>@<alias>`` or ``models:/<name>/<version>`` -> the stored checkpoint URI
    of that registry version; ``gguf:<package>/<file>.gguf`` -> the local Hugging Face folder
    converted from that GGUF file of an installed package (once per file digest, see
    :mod:`components.core.gguf`); any other URI is returned unchanged. A version or alias
    that does not exist, or whose checkpoint holds other weights now (``check_weights``),
    is a UserError; an unreachable tracking server an InfraError."""
    from components.core import gguf

    if gguf.is_gguf(uri):
        return gguf.checkpoint(uri, field)
    if not uri.startswith("models:/"):
        return uri
    mv = registry_version(uri, field)
    check_weights(str(mv.version), checkpoint_of(mv), dict(mv.tags), field)
    return checkpoint_of(mv)


def registry_version(uri: str, field: str):
    """The MLflow ``ModelVersion`` that ``models:/<name>@<alias>`` or ``models:/<name>/<version>``
    names; a version or alias that does not exist is a UserError naming ``field``, an
    unreachable tracking server an InfraError."""
    from mlflow.exceptions import MlflowException

    ref = uri[len("models:/"):]
    try:
        if "@" in ref:
            name, alias = ref.split("@", 1)
            mv = tracking.client().get_model_version_by_alias(name, alias)
        else:
            name, version = ref.rsplit("/", 1)
            mv = tracking.client().get_model_version(name, version)
    except (MlflowException, ValueError) as exc:
        if (down := outage(exc)) is not None:  # the server, not the name: retried, never "no such version"
            raise InfraError("tracking server", tracking.tracking_uri(), down) from None
        if isinstance(exc, MlflowException) and \
                getattr(exc, "error_code", "") not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise  # neither missing nor an outage (a refused permission): as it is
        raise UserError(field, uri, f"no such registered model version at {tracking.tracking_uri()}",
                        "use models:/<name>@<alias> or models:/<name>/<version> of an existing version") from None
    return mv


def check_weights(version: str, uri: str, tags: dict[str, str], field: str) -> None:
    """UserError naming ``field`` when registry version ``version`` (its ``tags``) was
    registered with other weights than the checkpoint at ``uri`` holds now by its stage's
    manifest, or when no manifest describes that checkpoint any more; nothing for a version
    registered without a weights digest. Not covered: a manifest and weights both replaced
    by hand (their digests checked against each other when the files are read)."""
    want = tags.get(TAG_WEIGHTS, "")
    if not want:
        return
    from components.core.manifest import WEIGHTS
    from components.core.policy import checkpoint_expectations

    found = checkpoint_expectations(uri).get(WEIGHTS)
    if found is None:
        raise UserError(field, f"version {version}", f"its checkpoint {uri} is described by no stage manifest: the "
                        "stage that wrote it was cut short or is running again",
                        "let that stage finish (or re-run it), then use the version it registers")
    if found.sha256 != want:
        raise UserError(field, f"version {version}", f"its checkpoint {uri} now holds other weights (sha256 "
                        f"{found.sha256[:12]}) than the version was registered and judged with ({want[:12]}): a "
                        "stage re-run wrote over it",
                        "use the version registered with the weights there now (the latest for that checkpoint), "
                        "or point the alias at it")


def lineage_root(pipeline: str, version: str) -> str:
    """The version ``version`` descends from through ``posttrain.parent_version`` tags (itself
    when it has none): the bootstrap version a trained line started from. A parent that is
    not a version of the model (an external ``rollout.policy``), or a loop in hand-edited
    tags, ends the walk at the last version found."""
    from mlflow.exceptions import MlflowException

    name, seen = model_name(pipeline), {str(version)}
    current = str(version)
    while True:
        parent = version_tags(pipeline, current).get(TAG_PARENT, "")
        if not parent or parent in seen:
            return current
        try:
            tracking.client().get_model_version(name, parent)
        except MlflowException as exc:
            if (down := outage(exc)) is not None:
                raise InfraError("tracking server", tracking.tracking_uri(), down) from None
            return current
        seen.add(parent)
        current = parent


def version_tags(pipeline: str, version: str) -> dict[str, str]:
    return dict(tracking.client().get_model_version(model_name(pipeline), str(version)).tags)


def set_version_tags(pipeline: str, version: str, tags: dict[str, str]) -> None:
    for k, v in tags.items():
        tracking.client().set_model_version_tag(model_name(pipeline), str(version), k, v)
