"""Registry URIs (models:/name@alias, models:/name/version) resolve to stored checkpoints:
a version's ``posttrain.checkpoint_uri`` tag, not its source (the MLflow model's folder)."""

from __future__ import annotations

import pytest

from components.core import models, tracking
from components.core.errors import UserError


@pytest.fixture()
def registered(posttrain_home, tmp_path):
    run = tracking.client().create_run(tracking.experiment_id("reg"))
    v1 = models.register_checkpoint("reg", "file:///store/reg/bootstrap/checkpoint", run.info.run_id, {})
    v2 = models.register_checkpoint("reg", "file:///store/reg/iter-000001/trainer/checkpoint", run.info.run_id, {})
    models.set_alias("reg", "champion", v1)
    return v1, v2


def test_alias_and_version_resolve_to_the_versions_checkpoint(registered):
    assert models.resolve_model_uri("models:/reg-policy@champion", "model.source") == "file:///store/reg/bootstrap/checkpoint"
    assert models.resolve_model_uri("models:/reg-policy/2", "model.source") == "file:///store/reg/iter-000001/trainer/checkpoint"
    mv = tracking.client().get_model_version("reg-policy", "2")
    assert mv.tags[models.TAG_CHECKPOINT] == "file:///store/reg/iter-000001/trainer/checkpoint"
    assert mv.source != mv.tags[models.TAG_CHECKPOINT] and mv.source.endswith("/artifacts")  # the MLflow model's folder


def test_plain_uris_pass_through(registered):
    assert models.resolve_model_uri("s3://bucket/ckpt", "model.source") == "s3://bucket/ckpt"


@pytest.mark.parametrize("uri", ["models:/reg-policy@nope", "models:/reg-policy/9", "models:/missing@champion", "models:/bare"])
def test_unknown_registry_references_are_user_errors(registered, uri):
    with pytest.raises(UserError) as err:
        models.resolve_model_uri(uri, "model.source")
    assert "model.source" in err.value.line() and uri in err.value.line() and "fix:" in err.value.line()


def test_a_starting_policy_of_the_pipelines_own_model_keeps_its_version(registered):
    """``rollout.policy: models:/<this pipeline's model>/<v>`` (or ``@alias``) starts from
    version v: the trainer's parent_version and taskgen's baseline follow it (it was
    recorded as "external", as another model's version is)."""
    from components.core.lineage import resolve_policy
    from components.core.recipe import parse_recipe

    def start(pipeline: str, policy: str) -> tuple[str, str]:
        return resolve_policy(parse_recipe({"pipeline": pipeline, "rollout": {"policy": policy}}))

    assert start("reg", "models:/reg-policy/2") == ("2", "file:///store/reg/iter-000001/trainer/checkpoint")
    assert start("reg", "models:/reg-policy@champion") == ("1", "file:///store/reg/bootstrap/checkpoint")
    assert start("other", "models:/reg-policy/2") == ("external", "file:///store/reg/iter-000001/trainer/checkpoint")
    assert start("reg", "champion") == ("1", "file:///store/reg/bootstrap/checkpoint")


def test_a_checkpoint_rewritten_with_other_weights_is_a_new_version(posttrain_home):
    """Registration is idempotent per checkpoint URI (a retried stage), but a re-run that
    wrote other weights to the same place got the old version back, with its eval tags
    and aliases describing weights they were never judged on."""
    run = tracking.client().create_run(tracking.experiment_id("rw"))
    uri = "file:///store/rw/iter-000001/trainer/checkpoint"
    first = models.register_checkpoint("rw", uri, run.info.run_id, {}, weights_sha256="a" * 64)
    assert models.register_checkpoint("rw", uri, run.info.run_id, {}, weights_sha256="a" * 64) == first  # a retry
    second = models.register_checkpoint("rw", uri, run.info.run_id, {}, weights_sha256="b" * 64)
    assert (first, second) == ("1", "2")
    assert models.register_checkpoint("rw", uri, run.info.run_id, {}, weights_sha256="b" * 64) == "2"
    assert tracking.client().get_model_version("rw-policy", "2").tags[models.TAG_WEIGHTS] == "b" * 64
    assert models.register_checkpoint("rw", uri, run.info.run_id, {}) == "2"  # no digest given: the latest by URI
