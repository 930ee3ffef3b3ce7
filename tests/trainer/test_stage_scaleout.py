"""The trainer stage with ``trainer.processes: 2`` (DDP and FSDP2 under torchrun), on two
nodes (two ``posttrain stage trainer`` processes given the ``PET_*`` variables a PyTorchJob
gives its replicas) and with ``trainer.lora.rank: 4``, on one real iteration (a bootstrap
policy that solves some tasks, so groups carry signal): the registered checkpoint of 2
processes or 2 nodes is the 1-process one within tolerance, with the same metrics in
MLflow, and a follower node writes nothing; under LoRA only the adapted attention
projections move and no optimizer state is carried in."""

from __future__ import annotations

import os
import subprocess
import sys

import mlflow
import pytest
import torch
import yaml

from components.core import tracking
from components.core.context import read_manifest
from components.core.manifest import MANIFEST, stage_prefix
from components.core.policy import load_policy
from components.core.recipe import parse_recipe
from components.core.runner import run_stage
from components.core.storage import Store
from tests.fixtures.home import REPO_ROOT, TINY_RECIPE, reset_tracking_clients, use_home
from tests.fixtures.s3 import free_ports

UPSTREAM = [("taskgen", None), ("rollout", "0/2"), ("rollout", "1/2"), ("sandbox", "0/2"), ("sandbox", "1/2"),
            ("reward", "0/2"), ("reward", "1/2"), ("validation", None)]


def recipe_data(**trainer) -> dict:
    """recipes/tiny.yaml with a policy that solves some tasks sometimes (as in
    test_dynamic_sampling), 8 samples per task, one group per step."""
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["model"] = {**data["model"], "hidden_size": 64, "num_layers": 2, "intermediate_size": 128, "max_positions": 96}
    data["bootstrap"] = {**data["bootstrap"], "max_steps": 400, "eval_every": 100}
    data["rollout"] = {**data["rollout"], "group_size": 8}
    data["trainer"] = {**data["trainer"], "prompts_per_step": 1, "learning_rate": 1e-3, **trainer}
    return data


def recipe(**trainer):
    return parse_recipe(recipe_data(**trainer))


@pytest.fixture(scope="module")
def iteration(tmp_path_factory):
    """An iteration up to validation; yields a function running the trainer stage on it
    that returns (manifest, checkpoint state dict, starting state dict, MLflow client)."""
    tmp = tmp_path_factory.mktemp("scaleout")
    root = f"file://{tmp / 'store'}"
    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, tmp / ".posttrain")
        run_stage("bootstrap", recipe(), root, 0)
        for stage, shard in UPSTREAM:
            run_stage(stage, recipe(), root, 1, shard)
        client = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri())

        def trainer(**overrides):
            manifest = run_stage("trainer", recipe(**overrides), root, 1)
            weights = load_policy(Store(root).url(manifest.outputs["checkpoint"].path)).model.state_dict()
            parent = client.get_run(manifest.mlflow_run_id).data.tags["posttrain.parent_policy_uri"]
            return manifest, weights, load_policy(parent).model.state_dict(), client

        trainer.root = root
        yield trainer
        reset_tracking_clients()


def test_two_processes_register_the_one_process_checkpoint(iteration) -> None:
    one, expected, start, client = iteration()
    assert one.metrics["trainer/steps"] >= 2 and one.metrics["trainer/carried_optimizer_state"] == 0.0
    assert one.metrics["trainer/torchrun_processes"] == 0.0  # one process, ddp: the steps ran in the stage
    history = {k: [m.value for m in client.get_metric_history(one.mlflow_run_id, f"trainer/step/{k}")] for k in ("loss", "grad_norm")}
    # FSDP2 with one process still runs under torchrun (a process group of one): the path a one-GPU FSDP recipe takes
    for processes, parallelism in ((2, "ddp"), (2, "fsdp"), (1, "fsdp")):
        two, weights, _, _ = iteration(processes=processes, parallelism=parallelism)
        assert sorted(weights) == sorted(expected)
        assert any(not torch.equal(expected[k], start[k]) for k in expected)  # the step moved the policy
        for name in expected:
            assert torch.allclose(weights[name], expected[name], atol=1e-5, rtol=0), (parallelism, name)
        for key in ("trainer/steps", "trainer/groups", "trainer/global_step", "trainer/groups_kept"):
            assert two.metrics[key] == one.metrics[key], key
        for key in ("trainer/loss", "trainer/grad_norm", "trainer/entropy"):
            assert two.metrics[key] == pytest.approx(one.metrics[key], rel=1e-4, abs=1e-6), key
        for k, values in history.items():
            logged = [m.value for m in client.get_metric_history(two.mlflow_run_id, f"trainer/step/{k}")]
            assert logged == pytest.approx(values, rel=1e-4, abs=1e-6), (parallelism, k)  # a step loss can be ~1e-8
        assert two.outputs["trainer_state"].rows == one.outputs["trainer_state"].rows == int(one.metrics["trainer/steps"])
        assert two.metrics["trainer/torchrun_processes"] == processes


def test_lora_moves_only_the_adapted_projections(iteration) -> None:
    manifest, weights, start, _ = iteration(lora={"rank": 4})
    changed = {k for k in weights if not torch.equal(weights[k], start[k])}
    assert changed and all(k.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for k in changed)
    assert "model.layers.0.self_attn.q_proj.weight" in changed
    assert torch.equal(weights["model.layers.0.mlp.down_proj.weight"], start["model.layers.0.mlp.down_proj.weight"])
    assert sorted(weights) == sorted(start)  # a plain model: the adapters merged in
    assert manifest.metrics["trainer/carried_optimizer_state"] == 0.0


def trainer_runs(client, run_id: str) -> list:
    """The trainer stage's runs in the experiment of ``run_id``."""
    experiment = client.get_run(run_id).info.experiment_id
    return client.search_runs([experiment], filter_string="tags.`posttrain.stage` = 'trainer'", max_results=1000)


def test_two_nodes_store_the_one_process_checkpoint(iteration, tmp_path) -> None:
    """Two replicas of ``posttrain stage trainer`` with one process each, as a 2-node
    PyTorchJob starts them (``PET_*``; static rendezvous on loopback): node 0 registers the
    1-process checkpoint within tolerance; node 1 trains its share and writes nothing."""
    one, expected, _, client = iteration()
    store = Store(iteration.root)
    prefix = stage_prefix(recipe().pipeline, 1, "trainer")
    store.delete(f"{prefix}/{MANIFEST}")  # the same settings again, now on two nodes
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_data()))
    runs = len(trainer_runs(client, one.mlflow_run_id))
    port = free_ports(1)[0]
    procs = {rank: subprocess.Popen(
        [sys.executable, "-m", "components.cli", "stage", "trainer", "--recipe", str(path), "--run-root",
         iteration.root, "--iteration", "1"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PET_NNODES": "2", "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "127.0.0.1",
             "PET_MASTER_PORT": str(port)}) for rank in (1, 0)}
    out = {}
    try:
        out = {rank: p.communicate(timeout=600)[0] for rank, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    assert procs[0].returncode == 0 and procs[1].returncode == 0, out
    assert "node 1 of 2 | done; node 0 stores the checkpoint" in out[1]
    assert "1 process(es) x 2 nodes" in out[0]
    two = read_manifest(store, prefix)
    assert two is not None and two.mlflow_run_id != one.mlflow_run_id
    assert two.metrics["trainer/torchrun_processes"] == 2.0
    for key in ("trainer/steps", "trainer/groups", "trainer/global_step"):
        assert two.metrics[key] == one.metrics[key], key
    assert two.metrics["trainer/loss"] == pytest.approx(one.metrics["trainer/loss"], rel=1e-4, abs=1e-6)
    weights = load_policy(store.url(two.outputs["checkpoint"].path)).model.state_dict()
    assert sorted(weights) == sorted(expected)
    for name in expected:
        assert torch.allclose(weights[name], expected[name], atol=1e-5, rtol=0), name
    # node 1 started no MLflow run (one new trainer run: node 0's) and registered nothing
    assert len(trainer_runs(client, one.mlflow_run_id)) == runs + 1
    assert "registered version" in out[0] and "registered version" not in out[1]


def test_a_follower_of_a_finished_stage_does_nothing(iteration, monkeypatch, capsys) -> None:
    """A Worker replica started after the stage is stored finds the cache hit and returns
    node 0's manifest: no torchrun, no rendezvous to wait for."""
    iteration()
    store = Store(iteration.root)
    stored = read_manifest(store, stage_prefix(recipe().pipeline, 1, "trainer"))
    for name, value in {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "127.0.0.1",
                        "PET_MASTER_PORT": str(free_ports(1)[0])}.items():
        monkeypatch.setenv(name, value)
    followed = run_stage("trainer", recipe(), iteration.root, 1)
    assert followed is not None and followed.to_json() == stored.to_json()
    assert "node 1 of 2 | cache hit, nothing to follow" in capsys.readouterr().out
