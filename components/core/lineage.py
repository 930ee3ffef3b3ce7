"""Which policy an iteration starts from.

``resolve_policy(recipe)`` turns ``rollout.policy`` into (version, checkpoint URI):
``champion`` or ``candidate`` through the MLflow registry aliases, anything else as a
checkpoint URI or folder, or a registry URI (``models:/<name>@<alias>``,
``models:/<name>/<version>``: a version of the pipeline's own model keeps its number,
any other is ``external``); a registry version's checkpoint is its
``posttrain.checkpoint_uri`` tag (``models.checkpoint_of``). taskgen resolves it once per iteration and records it in
its manifest (``facts.StartingPolicy``), so every later stage of the iteration uses the
same policy. A registry version whose checkpoint now holds other weights than it was
registered with is refused (``models.check_weights``).
"""

from __future__ import annotations

import shlex

from components.core import models
from components.core.errors import UserError
from components.core.recipe import Recipe
from components.core.storage import normalize_uri

ALIASES = ("champion", "candidate")


def resolve_policy(recipe: Recipe, run_root: str = "") -> tuple[str, str]:
    """(version, checkpoint URI) of ``rollout.policy``; an alias not set yet is a UserError
    whose fix is the bootstrap command (under ``run_root``, when given)."""
    ref = recipe.rollout.policy
    if ref in ALIASES:
        found = models.resolve_alias(recipe.pipeline, ref)
        if found is None:
            where = f" --run-root {shlex.quote(run_root)}', with this run's --recipe," if run_root else "'"
            raise UserError("rollout.policy", ref, f"registered model '{models.model_name(recipe.pipeline)}' has no {ref} yet",
                            f"run 'posttrain stage bootstrap{where} first ('posttrain run' does it for you)")
        version, uri, tags = found
        models.check_weights(version, uri, tags, "rollout.policy")
        return version, uri
    if ref.startswith("models:/"):
        mv = models.registry_version(ref, "rollout.policy")
        models.check_weights(str(mv.version), models.checkpoint_of(mv), dict(mv.tags), "rollout.policy")
        uri = normalize_uri(models.checkpoint_of(mv), "rollout.policy")
        # A version of this pipeline's own model keeps its number: the trainer's parent_version
        # and taskgen's paired baseline follow it as they do an alias.
        return (str(mv.version) if mv.name == models.model_name(recipe.pipeline) else "external"), uri
    return "external", normalize_uri(models.resolve_model_uri(ref, "rollout.policy"), "rollout.policy")
