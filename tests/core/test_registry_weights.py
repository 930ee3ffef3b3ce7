"""A registry version is refused once its checkpoint's place holds other weights than it
was registered (and judged) with, or no manifest describes it any more.

Bootstrap is run for real twice under one run root, the second time with a shorter SFT:
it writes other weights to the same ``bootstrap/checkpoint`` and registers version 2,
while version 1 still names that place. Every way a version reaches weights (a
``models:/`` URI, ``rollout.policy``, the registered MLflow model) refuses version 1;
version 2 loads. Before, version 1 served version 2's weights under its own eval tags.
"""

from __future__ import annotations

import json

import pytest
import yaml

from components.core import models, storage
from components.core.errors import UserError
from components.core.lineage import resolve_policy
from components.core.recipe import parse_recipe
from components.core.runner import run_stage
from tests.fixtures.runs import TINY


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("rewritten")
    with pytest.MonkeyPatch.context() as mp:
        from tests.fixtures.home import use_home

        use_home(mp, tmp / ".posttrain")
        root = (tmp / "root").as_uri()
        recipe = yaml.safe_load(TINY.read_text())
        run_stage("bootstrap", parse_recipe(recipe), root, 0)
        recipe["bootstrap"]["max_steps"] = 10
        run_stage("bootstrap", parse_recipe(recipe), root, 0)
        yield tmp / "root", recipe


def refusal(call) -> str:
    with pytest.raises(UserError) as err:
        call()
    return err.value.line()


def test_both_versions_name_the_same_place(rewritten) -> None:
    v1, v2 = (models.registry_version(f"models:/tiny-policy/{v}", "x") for v in (1, 2))
    assert models.checkpoint_of(v1) == models.checkpoint_of(v2) == (rewritten[0] / "tiny/bootstrap/checkpoint").as_uri()
    assert v1.tags[models.TAG_WEIGHTS] != v2.tags[models.TAG_WEIGHTS]


def test_the_overwritten_version_is_refused_everywhere_and_the_new_one_loads(rewritten) -> None:
    root, recipe = rewritten
    place = (root / "tiny/bootstrap/checkpoint").as_uri()
    line = refusal(lambda: models.resolve_model_uri("models:/tiny-policy/1", "model.source"))
    assert line.startswith(f"model.source='version 1': its checkpoint {place} now holds other weights (sha256 ")
    assert line.endswith("a stage re-run wrote over it; fix: use the version registered with the weights there "
                         "now (the latest for that checkpoint), or point the alias at it")
    assert models.resolve_model_uri("models:/tiny-policy/2", "model.source") == place
    pinned = parse_recipe(recipe | {"rollout": recipe["rollout"] | {"policy": "models:/tiny-policy/1"}})
    assert refusal(lambda: resolve_policy(pinned)).startswith("rollout.policy='version 1': its checkpoint ")
    assert resolve_policy(parse_recipe(recipe)) == ("2", place)  # champion: the new version


def test_the_registered_mlflow_model_refuses_to_load_other_weights(rewritten, monkeypatch) -> None:
    import mlflow.pyfunc

    from components.core import tracking

    # pyfunc resolves models:/ through it (not mlflow.set_*_uri: that is global state, and the
    # next test of this process would find its models in this test's database)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.tracking_uri())
    with pytest.raises(Exception) as err:
        mlflow.pyfunc.load_model("models:/tiny-policy/1")
    assert "now holds other weights" in str(err.value)
    assert mlflow.pyfunc.load_model("models:/tiny-policy/2").predict(["1+1="]) is not None


def test_a_checkpoint_no_manifest_describes_is_refused(rewritten) -> None:
    root, _ = rewritten
    manifest = root / "tiny/bootstrap/_MANIFEST.json"
    kept = manifest.read_bytes()
    manifest.unlink()  # what a stage's re-run does first, and what a cut-short one leaves
    storage._EXPECTED.clear()
    try:
        line = refusal(lambda: models.resolve_model_uri("models:/tiny-policy/2", "rollout.policy"))
        assert line == (f"rollout.policy='version 2': its checkpoint {(root / 'tiny/bootstrap/checkpoint').as_uri()} "
                        "is described by no stage manifest: the stage that wrote it was cut short or is running "
                        "again; fix: let that stage finish (or re-run it), then use the version it registers")
    finally:
        manifest.write_bytes(kept)
    assert json.loads(kept)["stage"] == "bootstrap"
