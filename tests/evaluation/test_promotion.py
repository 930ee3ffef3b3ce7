"""Promotion's baseline: a candidate is measured against the champion (real MLflow
registry), fixed before the alias moves; the strict rule holds it when any domain drops
by more than the tolerance (the statistical rule: test_statistical_promotion.py)."""

from __future__ import annotations

import pytest

from components.core import models, tracking
from components.evalsuite.decision import strict_rule
from components.evalsuite.score import eval_tags, tagged_rates
from components.evaluation.stage import BASELINE_TAG, baseline_for, baseline_rates, fixed_baseline, settle_champion


@pytest.mark.parametrize(("candidate", "promoted", "reason"), [
    ({"code": 0.30, "math": 0.10}, True, "no domain regressed beyond tolerance"),
    ({"code": 0.28, "math": 0.10}, True, "no domain regressed beyond tolerance"),  # exactly the tolerance
    ({"code": 0.27, "math": 0.50}, False, "regressed beyond tolerance: code 0.300->0.270"),  # the mean rose; code fell
    # a baseline domain the candidate (the recipe) no longer has is left out, not counted as 0
    ({"math": 0.10}, True, "no domain regressed beyond tolerance; left out (not in the recipe): code"),
    ({"math": 0.10, "arithmetic": 0.0}, True, "no domain regressed beyond tolerance; left out (not in the recipe): code; "
                                              "new (no baseline): arithmetic"),
    ({"code": float("nan"), "math": 0.10}, False, "regressed beyond tolerance: code 0.300->nan"),  # not a rate: held
])
def test_strict_rule(candidate, promoted, reason):
    assert strict_rule(candidate, {"code": 0.30, "math": 0.10}, tolerance=0.02) == (promoted, reason)


def test_strict_rule_counts_a_recipe_domain_the_candidate_has_no_rate_for_as_0():
    assert strict_rule({"math": 0.10}, {"code": 0.30, "math": 0.10}, 0.02, domains=["code", "math"]) == \
        (False, "regressed beyond tolerance: code 0.300->0.000")


def test_a_baseline_rate_that_is_not_finite_is_held_in_strict():
    assert strict_rule({"code": 0.9}, {"code": float("nan")}, 0.02) == (False, "regressed beyond tolerance: code nan->0.900")
    assert strict_rule({"code": 0.9}, {"code": float("inf")}, 0.02) == (False, "regressed beyond tolerance: code inf->0.900")


@pytest.mark.parametrize("n", [3, 7, 300])
def test_a_drop_of_exactly_the_tolerance_against_a_tagged_baseline_promotes(n):
    """The baseline's rates come back from 6-decimal tags (206/300 is 0.686667): a drop of
    exactly the tolerance, and an unchanged rate under tolerance 0, were held."""
    for steps, tolerance in sorted({(0, 0.0), (1, 1 / n), (0.02 * n, 0.02)} if n == 300 else {(0, 0.0), (1, 1 / n)}):
        steps = int(steps)
        for k in range(steps, n + 1):
            base = tagged_rates(eval_tags({"a": k / n}))
            assert strict_rule({"a": (k - steps) / n}, base, tolerance)[0], (n, k, steps)
            if k > steps:
                assert not strict_rule({"a": (k - steps - 1) / n}, base, tolerance)[0], (n, k, steps)


def test_a_drop_of_exactly_the_tolerance_promotes_whatever_the_rounding():
    """0.50 - 0.48 is 0.020000000000000018 in floats: it was held past a tolerance of 0.02."""
    held = [(b, b - 4 / 200) for b in (k / 200 for k in range(4, 201)) if not strict_rule({"a": b - 4 / 200}, {"a": b}, 0.02)[0]]
    assert held == []
    assert strict_rule({"a": 0.475}, {"a": 0.5}, 0.02) == (False, "regressed beyond tolerance: a 0.500->0.475")


def test_an_unchanged_mean_is_no_drop_whatever_the_summation_order():
    """The means of [0.3, 0.2, 0.1] and [0.1, 0.2, 0.3] differ in the last bit: it was held as
    "mean pass rate dropped 0.200->0.200"."""
    from components.evalsuite.decision import Comparison, statistical_rule

    def row(domain, base, cand):
        return Comparison(domain=domain, tasks=200, candidate=cand, baseline=base, difference=cand - base,
                          ci_low=-0.05, ci_high=0.05)

    rows = [row("a", 0.1, 0.3), row("b", 0.2, 0.2), row("c", 0.3, 0.1)]
    assert statistical_rule(rows, 0.95) == (True, "no domain regressed significantly at 95%; mean pass rate 0.200->0.200")
    rows[0] = row("a", 0.1, 0.295)
    assert statistical_rule(rows, 0.95) == (False, "mean pass rate dropped 0.200->0.198 (no domain regressed "
                                                   "significantly at 95%)")


def test_baseline_is_the_champion_not_a_weaker_held_parent(tmp_path, posttrain_home):
    rates = {"1": {"code": 0.30}, "2": {"code": 0.20}}  # version 2 was held: worse than the champion
    with tracking.stage_run("promo", "trainer", "trainer", None, {}) as run_id:
        for version in ("1", "2"):
            got = models.register_checkpoint("promo", f"file://{tmp_path}/ckpt-{version}", run_id, {})
            assert got == version
            models.set_version_tags("promo", version, eval_tags(rates[version]))
    assert baseline_for("promo", parent_version="2") == ("2", {"code": 0.20})  # no champion yet: the parent
    models.set_alias("promo", "champion", "1")
    # Version 3 trained on from held version 2 (rollout.policy: candidate): its bar is still version 1.
    assert baseline_for("promo", parent_version="2") == ("1", {"code": 0.30})
    assert strict_rule({"code": 0.25}, baseline_for("promo", "2")[1], 0.02) == (False, "regressed beyond tolerance: code 0.300->0.250")


def test_the_baseline_is_fixed_before_the_alias_moves(tmp_path, posttrain_home):
    """A retried evaluation (the first attempt promoted, then died) keeps its baseline."""
    with tracking.stage_run("fixed", "trainer", "trainer", None, {}) as run_id:
        for version, code in (("1", 0.30), ("2", 0.35)):
            models.register_checkpoint("fixed", f"file://{tmp_path}/ckpt-{version}", run_id, {})
            models.set_version_tags("fixed", version, eval_tags({"code": code}))
    models.set_alias("fixed", "champion", "1")
    assert fixed_baseline("fixed", candidate="2", parent_version="1") == ("1", {"code": 0.30})
    models.set_alias("fixed", "champion", "2")  # the first attempt promoted version 2, then was killed
    assert baseline_for("fixed", parent_version="1") == ("2", {"code": 0.35})  # what a naive retry would compare with
    assert fixed_baseline("fixed", candidate="2", parent_version="1") == ("1", {"code": 0.30})
    assert tracking.client().get_model_version("fixed-policy", "2").tags[BASELINE_TAG] == "1"


@pytest.mark.parametrize(("promotion", "missing", "tolerance", "expected"), [
    ("strict", "", 0.05, ("strict", "evaluation.promotion is strict", True, "no domain regressed beyond tolerance")),
    ("strict", "", 0.01, ("strict", "evaluation.promotion is strict", False, "regressed beyond tolerance: code 0.300->0.270")),
    ("statistical", "no results", 0.05, ("strict", "fallback: no results", True,
                                        "strict rule (no results): no domain regressed beyond tolerance")),
    ("statistical", "no results", 0.01, ("strict", "fallback: no results", False,
                                        "strict rule (no results): regressed beyond tolerance: code 0.300->0.270")),
])
def test_the_recipes_regression_tolerance_decides_through_the_stage(promotion, missing, tolerance, expected):
    """``evaluation.regression_tolerance`` reaches the stage's decision, in strict mode and in
    the statistical rule's fallback (it was tested only as strict_rule's argument)."""
    from types import SimpleNamespace

    from components.core.recipe import parse_recipe
    from components.evaluation.stage import decide

    recipe = parse_recipe({"pipeline": "tol", "domains": ["code", "math"],
                           "evaluation": {"promotion": promotion, "regression_tolerance": tolerance}})
    rates, baseline = {"code": 0.27, "math": 0.10}, {"code": 0.30, "math": 0.10}
    assert decide(SimpleNamespace(recipe=recipe), [], missing, rates, baseline) == expected


def test_recipe_domains_decide_through_the_stage():
    """The stage judges the recipe's domains: a dropped one is left out, in strict mode
    and in the fallback."""
    from types import SimpleNamespace

    from components.core.recipe import parse_recipe
    from components.evaluation.stage import decide

    recipe = parse_recipe({"pipeline": "dom", "domains": ["code"], "evaluation": {"promotion": "strict"}})
    assert decide(SimpleNamespace(recipe=recipe), [], "", {"code": 0.5}, {"code": 0.3, "math": 0.5}) == (
        "strict", "evaluation.promotion is strict", True, "no domain regressed beyond tolerance; left out (not in the recipe): math")


@pytest.mark.parametrize("value", ["nan", "n/a", "inf", "-0.1", "1.5", ""])
def test_a_tag_that_is_not_a_pass_rate_is_a_user_error(value):
    from components.core.errors import UserError

    with pytest.raises(UserError) as err:
        tagged_rates({"posttrain.eval.math": value, "posttrain.eval.code": "0.5"})
    assert (err.value.field, err.value.value) == ("registry tag posttrain.eval.math", value)
    assert err.value.problem == "the tag is not a pass rate (a finite number in [0, 1])"


def test_tagged_rates_reads_good_tags_and_ignores_others():
    assert tagged_rates({"posttrain.eval.math": "0.686667", "posttrain.eval.code": "1.000000", "other": "n/a"}) == \
        {"math": 0.686667, "code": 1.0}


def test_a_bad_baseline_tag_names_the_version_and_model(tmp_path, posttrain_home):
    from components.core.errors import UserError

    with tracking.stage_run("bad", "trainer", "trainer", None, {}) as run_id:
        models.register_checkpoint("bad", f"file://{tmp_path}/ckpt-1", run_id, {})
    models.set_version_tags("bad", "1", {"posttrain.eval.math": "n/a"})
    with pytest.raises(UserError) as err:
        baseline_rates("bad", "1")
    assert err.value.line() == ("registry tag posttrain.eval.math='n/a': the tag of version 1 of bad-policy is not a pass "
                                "rate (a finite number in [0, 1]); fix: set it to the version's pass rate on that domain, "
                                "as the manifest facts (pass_rates) of the stage that scored it record it")


def test_a_held_candidate_gives_the_champion_back_to_the_baseline(tmp_path, posttrain_home):
    """A re-run of evaluation holds a candidate that an earlier attempt promoted: the
    alias stayed on the held candidate."""
    with tracking.stage_run("settle", "trainer", "trainer", None, {}) as run_id:
        for version in ("1", "2", "3"):
            models.register_checkpoint("settle", f"file://{tmp_path}/ckpt-{version}", run_id, {})

    def champion():
        return models.resolve_alias("settle", "champion")[0]

    models.set_alias("settle", "champion", "1")
    settle_champion("settle", "2", True, "1")
    assert champion() == "2"
    settle_champion("settle", "2", False, "1")  # the re-run holds it
    assert champion() == "1"
    settle_champion("settle", "3", False, "1")  # held, the alias elsewhere: left alone
    assert champion() == "1"
    models.set_alias("settle", "champion", "2")
    settle_champion("settle", "3", False, "1")  # another version's alias is not this candidate's to move
    assert champion() == "2"


def test_the_statistical_rule_with_only_new_domains_says_nothing_was_compared():
    from components.evalsuite.decision import Comparison, statistical_rule

    rows = [Comparison("arithmetic", 200, 0.4, None, None, None, None)]
    assert statistical_rule(rows, 0.95, left_out=["code"]) == (
        True, "no domain both versions were scored on; left out (not in the recipe): code; new (no baseline): arithmetic")


def test_an_external_parent_with_no_champion_has_no_baseline(tmp_path, posttrain_home):
    """``rollout.policy: hf://...`` (or ``models:/other/...``) with no champion: taskgen fixes
    no baseline, and ``"external"`` reached the registry as a version number (an
    ``MlflowException`` traceback). No baseline is fixed too, so a retry after the first
    attempt promoted the candidate does not compare it with itself."""
    with tracking.stage_run("ext", "trainer", "trainer", None, {}) as run_id:
        models.register_checkpoint("ext", f"file://{tmp_path}/ckpt-1", run_id, {})
    assert baseline_for("ext", parent_version="external") == ("", {})
    assert fixed_baseline("ext", candidate="1", parent_version="external") == ("", {})
    assert tracking.client().get_model_version("ext-policy", "1").tags[BASELINE_TAG] == ""
    models.set_alias("ext", "champion", "1")  # the first attempt promoted version 1, then was killed
    assert fixed_baseline("ext", candidate="1", parent_version="external") == ("", {})
