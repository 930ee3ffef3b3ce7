"""Recipe checks for the learning settings, refused at parse time with the field, the
value and the fix: ``reward.domain_weights`` (loss weights: at least one domain above 0,
none above ``MAX_REWARD_WEIGHT``, a fix that does not call them ratios) and dynamic
sampling's ``trainer.prompts_per_step`` against ``taskgen.tasks_per_iteration`` (before,
refused only when the trainer stage started). Not covered: whether an accepted weight is
a useful one."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core.errors import UserError
from components.core.recipe import MAX_REWARD_WEIGHT, load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[2]
REWARD_FIX = ("use a loss weight from 0 to 1e+06: it multiplies that domain's advantages as it is (2 doubles the "
              "domain's policy-gradient term against the KL term; 1, the default, leaves it as scored)")


def refusal(data: dict) -> UserError:
    with pytest.raises(UserError) as info:
        parse_recipe({"pipeline": "w", **data}, "r.yaml")
    return info.value


def test_reward_weights_all_zero_are_refused() -> None:
    err = refusal({"domains": ["math", "arithmetic"], "reward": {"domain_weights": {"math": 0, "arithmetic": 0.0}}})
    assert (err.field, err.value) == ("r.yaml: reward.domain_weights", "{...}")
    assert err.problem == "no domain has a positive loss weight, so no group would ever train"
    assert err.fix == "give at least one domain a weight > 0 (a domain left out of reward.domain_weights weighs 1)"


def test_a_domain_left_out_weighs_one_so_the_others_may_be_zero() -> None:
    recipe = parse_recipe({"pipeline": "w", "domains": ["math", "arithmetic", "code"],
                           "reward": {"domain_weights": {"math": 0, "arithmetic": 0}}})
    assert recipe.reward.domain_weights == {"math": 0.0, "arithmetic": 0.0}


def test_a_huge_reward_weight_is_refused() -> None:
    """1e300 passed before: it overflowed float32 and every step was skipped (NaN gradient)."""
    err = refusal({"domains": ["math", "arithmetic"], "reward": {"domain_weights": {"arithmetic": 1e300}}})
    assert (err.field, err.value) == ("r.yaml: reward.domain_weights.arithmetic", 1e300)
    assert err.problem == "more than 1e+06"
    assert err.fix == REWARD_FIX and "ratio" not in err.fix


def test_the_cap_itself_is_accepted() -> None:
    recipe = parse_recipe({"pipeline": "w", "domains": ["math"], "reward": {"domain_weights": {"math": MAX_REWARD_WEIGHT}}})
    assert recipe.reward.domain_weights == {"math": 1e6}


def test_a_negative_reward_weight_gets_the_loss_weight_fix() -> None:
    err = refusal({"domains": ["math"], "reward": {"domain_weights": {"math": -1.0}}})
    assert (err.field, err.value) == ("r.yaml: reward.domain_weights.math", -1.0)
    assert (err.problem, err.fix) == ("negative or not a finite weight", REWARD_FIX)


def test_dynamic_prompts_per_step_beyond_the_iteration_is_refused_at_parse() -> None:
    err = refusal({"taskgen": {"tasks_per_iteration": 128}, "trainer": {"dynamic_sampling": True, "prompts_per_step": 500}})
    assert (err.field, err.value) == ("r.yaml: trainer.prompts_per_step", 500)
    assert err.problem == "is more than taskgen.tasks_per_iteration (128), so dynamic sampling would never fill a step"
    assert err.fix == "set trainer.prompts_per_step to at most 128, or trainer.dynamic_sampling to false"


def test_prompts_per_step_up_to_the_iteration_or_without_dynamic_sampling_parses() -> None:
    at = parse_recipe({"pipeline": "w", "taskgen": {"tasks_per_iteration": 128},
                       "trainer": {"dynamic_sampling": True, "prompts_per_step": 128}})
    off = parse_recipe({"pipeline": "w", "taskgen": {"tasks_per_iteration": 128}, "trainer": {"prompts_per_step": 500}})
    assert (at.trainer.prompts_per_step, off.trainer.prompts_per_step) == (128, 500)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_the_shipped_recipes_still_load(name: str) -> None:
    recipe = load_recipe(REPO / "recipes" / name)
    assert recipe.pipeline
