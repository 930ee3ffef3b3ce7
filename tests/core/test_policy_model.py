"""Every registered version is an MLflow model that loads and serves the checkpoint's
greedy completions (``components.core.policy_model``), registered once per checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from components.core import models, tracking
from components.core.policy import build_model, build_tokenizer, load_policy, save_policy
from components.core.recipe import load_recipe
from components.core.storage import Store
from components.rollout.engines import get_engine
from tests.fixtures.mlflow_server import MlflowServer, mlflow_server  # noqa: F401
from tests.fixtures.runs import TINY
from tests.fixtures.s3 import free_ports, new_store_uri

PROMPTS = ["What is 2 + 3?", "def f(x):", "Reverse 'abc'."]
MAX_NEW_TOKENS = 8  # recipes/tiny.yaml's evaluation.max_new_tokens


def write_checkpoint(root: str, seed: int = 0) -> str:
    """A real tiny checkpoint (random weights of the tiny recipe's model) under the run root ``root``; its URI."""
    import torch

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    store = Store(root)
    save_policy(build_model(load_recipe(str(TINY)).model, len(tokenizer)), tokenizer, store, "tiny/bootstrap/checkpoint")
    return store.url("tiny/bootstrap/checkpoint")


def engine_greedy(uri: str, prompts: list[str], max_new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    return [g.text for g in get_engine("hf").generate(load_policy(uri), prompts, max_new_tokens, 1.0, 0, 64, greedy=True)]


def register(uri: str, run_root: str) -> tuple[str, str]:
    """Register ``uri`` as a version of tiny-policy aliased champion; (version, run id)."""
    run_id = tracking.client().create_run(tracking.experiment_id("tiny")).info.run_id
    version = models.register_checkpoint("tiny", uri, run_id, {"posttrain.iteration": "0"}, run_root=run_root,
                                         max_new_tokens=MAX_NEW_TOKENS)
    models.set_alias("tiny", "champion", version, run_root=run_root)
    return version, run_id


@pytest.fixture()
def champion(posttrain_home: Path, tmp_path: Path) -> tuple[str, str, str]:
    """(checkpoint URI, version, run id) of a registered tiny checkpoint."""
    root = (tmp_path / "store").as_uri()
    uri = write_checkpoint(root)
    version, run_id = register(uri, root)
    return uri, version, run_id


def test_champion_loads_as_pyfunc_and_generates_the_engines_greedy_completions(
        champion, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow.pyfunc
    import pandas as pd

    uri, version, _ = champion
    expected = engine_greedy(uri, PROMPTS)
    assert len(set(expected)) > 1 and all(expected)  # distinct, non-empty completions: a real comparison
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.tracking_uri())  # pyfunc resolves models:/ through it
    model = mlflow.pyfunc.load_model("models:/tiny-policy@champion")
    assert model.predict(PROMPTS) == expected
    assert model.predict(pd.DataFrame({"prompt": PROMPTS})) == expected
    assert model.predict({"prompt": PROMPTS}) == expected
    assert model.predict(PROMPTS[:1], params={"max_new_tokens": 2}) == engine_greedy(uri, PROMPTS[:1], 2)
    with pytest.raises(ValueError, match=r"^max_new_tokens=0 is out of range: send an integer of at least 1"):
        model.predict(PROMPTS[:1], params={"max_new_tokens": 0})  # it was the model's default, silently


@pytest.mark.parametrize("value", [-3, 0, 2.5, True, "8", None])
def test_a_max_new_tokens_below_1_or_not_an_integer_is_refused_before_generation(value) -> None:
    """``-3`` gave a one-token completion; a served model takes any ``long``. ``None`` (not
    sent) is the model's own value."""
    from components.core.policy_model import PolicyModel, new_tokens

    if value is None:
        assert new_tokens({"max_new_tokens": None}, 24) == new_tokens(None, 24) == 24
        return
    model = PolicyModel()
    model.config, model.policy = {"max_new_tokens": 24}, None  # no policy: the refusal comes before generation
    with pytest.raises(ValueError) as err:
        model.predict(None, PROMPTS[:1], params={"max_new_tokens": value})
    assert str(err.value) == (f"max_new_tokens={value!r} is out of range: send an integer of at least 1, or leave it "
                              "out for 24")


def test_version_and_run_carry_the_checkpoint_uri_and_the_model_holds_no_weights(champion) -> None:
    uri, version, run_id = champion
    c = tracking.client()
    mv = c.get_model_version("tiny-policy", version)
    assert mv.tags[models.TAG_CHECKPOINT] == uri
    assert c.get_run(run_id).data.tags[models.TAG_CHECKPOINT] == uri
    assert models.resolve_alias("tiny", "champion") == (version, uri, dict(mv.tags))
    assert models.resolve_model_uri(f"models:/tiny-policy/{version}", "model.source") == uri
    [logged] = c.search_logged_models([c.get_run(run_id).info.experiment_id])
    assert logged.artifact_location == mv.source and logged.source_run_id == run_id
    assert logged.tags[models.TAG_CHECKPOINT] == uri
    files = {Path(f.path).name for f in c.list_logged_model_artifacts(logged.model_id)}
    assert {"MLmodel", "python_model.pkl", "requirements.txt"} <= files
    assert not any(name.endswith(".safetensors") for name in files)
    import mlflow.artifacts

    requirements = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"{mv.source}/requirements.txt")).read_text()
    assert "torch==" in requirements and "+cpu" not in requirements


def test_registering_a_checkpoint_again_returns_its_version(champion) -> None:
    uri, version, run_id = champion
    again = models.register_checkpoint("tiny", uri, run_id, {}, run_root=uri.removesuffix("/tiny/bootstrap/checkpoint"))
    assert again == version
    assert [mv.version for mv in tracking.client().search_model_versions("name = 'tiny-policy'")] == [int(version)]


def test_versions_registered_as_a_bare_checkpoint_folder_still_resolve(posttrain_home: Path) -> None:
    """Versions registered before the pyfunc model: no tag, the source is the checkpoint."""
    c = tracking.client()
    c.create_registered_model("old-policy")
    c.create_model_version("old-policy", source="file:///store/old/bootstrap/checkpoint")
    c.set_registered_model_alias("old-policy", "champion", "1")
    assert models.resolve_alias("old", "champion")[1] == "file:///store/old/bootstrap/checkpoint"
    assert models.resolve_model_uri("models:/old-policy/1", "model.source") == "file:///store/old/bootstrap/checkpoint"


def test_registration_through_a_tracking_server_loads_with_proxied_artifacts(
        mlflow_server: MlflowServer, s3_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The model's files go through the server (``mlflow-artifacts:``); the checkpoint
    stays in the store (S3), where the loading client reads it."""
    import mlflow.pyfunc

    from tests.fixtures.home import reset_tracking_clients

    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path / ".posttrain"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    reset_tracking_clients()
    try:
        root = new_store_uri("s3", tmp_path, s3_env, "policy-model")
        uri = write_checkpoint(root, seed=1)
        run_id = tracking.client().create_run(tracking.experiment_id("served")).info.run_id
        version = models.register_checkpoint("served", uri, run_id, {}, run_root=root, max_new_tokens=MAX_NEW_TOKENS)
        mv = tracking.client().get_model_version("served-policy", version)
        assert mv.source.startswith("mlflow-artifacts:/") and mv.tags[models.TAG_CHECKPOINT] == uri
        model = mlflow.pyfunc.load_model(f"models:/served-policy/{version}")
        assert model.predict(PROMPTS) == engine_greedy(uri, PROMPTS)
    finally:
        reset_tracking_clients()


@pytest.mark.slow
def test_mlflow_models_serve_answers_invocations_with_the_same_completions(champion, tmp_path: Path) -> None:
    uri, _, _ = champion
    expected = engine_greedy(uri, PROMPTS)
    port = free_ports(1)[0]
    # mlflow starts ``uvicorn`` by name: this interpreter's scripts folder must be on PATH
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking.tracking_uri(),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/tiny-policy@champion",
                                 "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).resolve().parents[2],
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        for body in ({"inputs": PROMPTS}, {"dataframe_split": {"columns": ["prompt"], "data": [[p] for p in PROMPTS]}}):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as reply:
                assert json.loads(reply.read())["predictions"] == expected
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"inputs": PROMPTS[:1], "params": {"max_new_tokens": -3}}).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:  # it answered a one-token completion
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 400
        assert "max_new_tokens=-3 is out of range: send an integer of at least 1" in refused.value.read().decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
