"""A registered model belongs to one run root: another run root with the same pipeline
name on the same tracking store can neither register versions nor move its aliases,
and the preflight refuses it before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core import models, preflight, tracking
from components.core.errors import UserError
from components.core.recipe import load_recipe
from tests.core.test_policy_model import write_checkpoint
from tests.fixtures.runs import TINY

FIX = ("give this run root its own pipeline name (recipe `pipeline:`) or its own tracking server; a POSTTRAIN_HOME "
       "copied or moved from elsewhere still tracks the run root it was made with: use it at its original path")


def _register(root: str, rel: str) -> str:
    run_id = tracking.client().create_run(tracking.experiment_id("tiny")).info.run_id
    return models.register_checkpoint("tiny", f"{root}/{rel}", run_id, {models.TAG_RUN_ROOT: root}, run_root=root)


@pytest.fixture()
def two_roots(posttrain_home: Path, tmp_path: Path) -> tuple[str, str]:
    """Run root A owns tiny-policy (versions 1 and 2, champion on 1); run root B is new."""
    a, b = (tmp_path / "a").as_uri(), (tmp_path / "b").as_uri()
    write_checkpoint(a)
    assert _register(a, "tiny/bootstrap/checkpoint") == "1"
    assert _register(a, "tiny/iter-000001/trainer/checkpoint") == "2"
    models.set_alias("tiny", "champion", "1", run_root=a)
    return a, b


def _assert_refused(err: pytest.ExceptionInfo[UserError], b: str, a: str) -> None:
    assert (err.value.field, err.value.value) == ("run_root", b)
    assert err.value.problem == f"registered model tiny-policy belongs to run root {a}"
    assert err.value.fix == FIX


def test_the_first_registration_records_its_run_root_on_the_model(two_roots) -> None:
    a, _ = two_roots
    assert tracking.client().get_registered_model("tiny-policy").tags[models.TAG_RUN_ROOT] == a
    assert models.owner("tiny") == a


def test_another_run_root_cannot_move_the_champion(two_roots) -> None:
    a, b = two_roots
    with pytest.raises(UserError) as err:
        models.set_alias("tiny", "champion", "2", run_root=b)
    _assert_refused(err, b, a)
    assert models.resolve_alias("tiny", "champion")[:2] == ("1", f"{a}/tiny/bootstrap/checkpoint")
    models.set_alias("tiny", "champion", "2", run_root=a)  # the owner still can
    assert models.resolve_alias("tiny", "champion")[0] == "2"


def test_another_run_root_cannot_register_a_version(two_roots) -> None:
    a, b = two_roots
    with pytest.raises(UserError) as err:
        _register(b, "tiny/bootstrap/checkpoint")
    _assert_refused(err, b, a)
    assert sorted(mv.version for mv in tracking.client().search_model_versions("name = 'tiny-policy'")) == [1, 2]


def test_an_alias_moved_without_a_run_root_is_judged_by_the_versions_run_root(two_roots) -> None:
    """evaluation moves the champion by version; the version's own run root tag must be the owner's."""
    a, b = two_roots
    tracking.client().set_model_version_tag("tiny-policy", "2", models.TAG_RUN_ROOT, b)
    with pytest.raises(UserError) as err:
        models.set_alias("tiny", "champion", "2")
    _assert_refused(err, b, a)
    assert models.resolve_alias("tiny", "champion")[0] == "1"


def test_preflight_refuses_the_other_run_root_and_passes_the_owner(two_roots) -> None:
    a, b = two_roots
    recipe = load_recipe(str(TINY))
    with pytest.raises(UserError) as err:
        preflight.check_all(recipe, b)
    _assert_refused(err, b, a)
    preflight.check_all(recipe, a)  # the owner's champion is a readable checkpoint


def test_a_model_without_an_owner_is_claimed_by_its_next_registration(posttrain_home: Path, tmp_path: Path) -> None:
    a, b = (tmp_path / "a").as_uri(), (tmp_path / "b").as_uri()
    tracking.client().create_registered_model("tiny-policy")  # as registered before models had owners
    assert models.owner("tiny") == ""
    preflight.registry_owner(load_recipe(str(TINY)), b)  # unowned: any run root may claim it
    assert _register(a, "tiny/bootstrap/checkpoint") == "1"
    assert models.owner("tiny") == a
    with pytest.raises(UserError) as err:
        preflight.registry_owner(load_recipe(str(TINY)), b)
    _assert_refused(err, b, a)



def test_preflight_names_an_unreachable_tracking_server_as_an_outage(posttrain_home: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from components.core.errors import InfraError
    from tests.fixtures.home import reset_tracking_clients
    from tests.fixtures.s3 import closed_port

    uri = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    reset_tracking_clients()
    with pytest.raises(InfraError) as err:
        preflight.registry_owner(load_recipe(str(TINY)), "s3://bucket/runs")
    assert (err.value.what, err.value.where) == ("tracking server", uri)


@pytest.mark.slow
def test_a_second_run_roots_bootstrap_exits_2_and_the_first_champion_serves(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ``posttrain stage bootstrap`` runs of the tiny recipe on one home (one SQLite
    tracking store), from run roots A and B: B's registration is refused in one line, and
    A's champion loads as an MLflow model that generates what the engine generates."""
    import mlflow.pyfunc
    from mlflow.tracking import MlflowClient

    from components.core.policy import load_policy
    from components.rollout.engines import get_engine
    from tests.fixtures.runs import cli_env, run_posttrain

    home = tmp_path / ".posttrain"
    a, b = (tmp_path / "a").as_uri(), (tmp_path / "b").as_uri()
    first = run_posttrain(["stage", "bootstrap", "--recipe", str(TINY), "--run-root", a], tmp_path, cli_env(home))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_posttrain(["stage", "bootstrap", "--recipe", str(TINY), "--run-root", b], tmp_path, cli_env(home))
    assert second.returncode == 2, second.stderr[-3000:]
    assert [line for line in second.stderr.splitlines() if line.startswith("posttrain")] == [
        f"posttrain: error: run_root='{b}': registered model tiny-policy belongs to run root {a}; fix: {FIX}"]
    assert not (tmp_path / "b" / "tiny").exists()  # refused before the SFT wrote a checkpoint there

    tracking_uri = f"sqlite:///{home / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)  # where models:/ URIs resolve
    champion = MlflowClient(tracking_uri=tracking_uri).get_model_version_by_alias("tiny-policy", "champion")
    assert (str(champion.version), champion.tags[models.TAG_CHECKPOINT]) == ("1", f"{a}/tiny/bootstrap/checkpoint")
    model = mlflow.pyfunc.load_model("models:/tiny-policy@champion")
    prompts = ["What is 12 + 30?", "Write a function add(a, b)."]
    policy = load_policy(f"{a}/tiny/bootstrap/checkpoint")
    expected = [g.text for g in get_engine("hf").generate(policy, prompts, 8, 1.0, 0, 64, greedy=True)]
    assert model.predict(prompts) == expected and all(expected)
