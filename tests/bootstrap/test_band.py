"""Bootstrap SFT stops as soon as the held-out check's mean enters the recipe's band
(``bootstrap.target_low``..``target_high``); a check that overshoots the band keeps the
previous snapshot when that one was nearer the band; ``max_steps`` ends it otherwise.
The check's pass rates are scripted here (the real check runs the eval suite in the
sandbox); the SFT steps are real, on a tiny policy."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from components.bootstrap import stage
from components.core.recipe import parse_recipe
from components.core.seeds import derive_seed
from tests.rollout.helpers import tiny_policy


def run_sft(monkeypatch, rates: list[float], low: float = 0.3, high: float = 0.5, max_steps: int = 12):
    """``sft`` with a check every 2 steps whose mean pass rates are ``rates`` in turn;
    returns its metrics, the policy and the weights at each check."""
    recipe = parse_recipe({"pipeline": "band", "domains": ["arithmetic"], "bootstrap": {
        "max_steps": max_steps, "eval_every": 2, "batch_size": 4, "target_low": low, "target_high": high,
        "eval_tasks_per_domain": 2}})
    ctx = SimpleNamespace(recipe=recipe, seed=lambda *extra: derive_seed(recipe.seed, "band", 0, "bootstrap", 0, *extra))
    policy = tiny_policy()
    checked: list[dict] = []
    script = iter(rates)

    def scripted(results) -> dict[str, float]:
        checked.append(copy.deepcopy(policy.model.state_dict()))
        return {"arithmetic": next(script)}

    monkeypatch.setattr(stage, "run_suite", lambda *args, **kwargs: [])
    monkeypatch.setattr(stage, "pass_rates", scripted)
    return stage.sft(ctx, policy, executor=None), policy, checked


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_it_stops_at_the_first_check_inside_the_band(monkeypatch) -> None:
    metrics, policy, checked = run_sft(monkeypatch, [0.0, 0.1, 0.35, 0.4])
    assert metrics == {"sft_steps": 6.0, "sft_check_mean": 0.35}
    assert len(checked) == 3 and same_weights(policy.model.state_dict(), checked[-1])


def test_an_overshoot_keeps_the_previous_snapshot_when_it_was_nearer(monkeypatch) -> None:
    metrics, policy, checked = run_sft(monkeypatch, [0.1, 0.25, 0.9])  # 0.05 below the band against 0.4 above
    assert metrics == {"sft_steps": 6.0, "sft_check_mean": 0.25}
    assert same_weights(policy.model.state_dict(), checked[1])
    assert not same_weights(checked[1], checked[2])  # the two steps after it did change the weights


def test_an_overshoot_nearer_the_band_than_the_snapshot_is_kept(monkeypatch) -> None:
    metrics, policy, checked = run_sft(monkeypatch, [0.1, 0.55])  # 0.2 below against 0.05 above
    assert metrics == {"sft_steps": 4.0, "sft_check_mean": 0.55}
    assert same_weights(policy.model.state_dict(), checked[1])


def test_a_band_never_reached_runs_every_step(monkeypatch) -> None:
    metrics, _, checked = run_sft(monkeypatch, [0.0] * 6, max_steps=12)
    assert metrics == {"sft_steps": 12.0, "sft_check_mean": 0.0}
    assert len(checked) == 6


@pytest.mark.parametrize(("low", "high", "stop"), [(0.1, 0.2, 2.0), (0.5, 0.9, 8.0)])
def test_the_band_is_the_recipes(monkeypatch, low: float, high: float, stop: float) -> None:
    metrics, _, _ = run_sft(monkeypatch, [0.15, 0.2, 0.3, 0.6], low=low, high=high)
    assert metrics["sft_steps"] == stop
