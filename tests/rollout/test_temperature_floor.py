"""``rollout.temperature`` has the floor ``posttrain serve`` has: 1e-39 passed the recipe
(``gt=0``) and crashed hf sampling mid-rollout with a RuntimeError traceback (logits /
1e-39 overflow to inf, the softmax to nan)."""

from __future__ import annotations

import math

import pytest

from components.core.errors import UserError
from components.core.recipe import RolloutConfig, parse_recipe
from components.rollout.hf_engine import HFEngine
from components.rollout.serve import MIN_TEMPERATURE
from tests.rollout.helpers import tiny_policy


@pytest.mark.parametrize("temperature", [1e-39, 0.0099])
def test_a_temperature_below_the_floor_is_one_line_naming_the_field(temperature: float) -> None:
    with pytest.raises(UserError) as caught:
        parse_recipe({"pipeline": "p", "rollout": {"temperature": temperature}})
    line = str(caught.value)
    assert "\n" not in line and f"rollout.temperature={temperature}: " in line
    assert "greater than or equal to 0.01" in line


def test_the_floor_is_serves_and_samples_at_it() -> None:
    assert RolloutConfig.model_fields["temperature"].metadata[0].ge == MIN_TEMPERATURE == 0.01
    assert parse_recipe({"pipeline": "p", "rollout": {"temperature": 0.01}}).rollout.temperature == 0.01
    gens = HFEngine().generate_groups(tiny_policy(), ["1+2="], 2, 4, MIN_TEMPERATURE, 0, 8)
    assert [len(g.completion_ids) for g in gens] == [4, 4]
    assert all(math.isfinite(lp) and lp <= 0 for g in gens for lp in g.logprobs)
