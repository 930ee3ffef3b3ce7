"""Promotion tells signal from noise: the same candidates under both rules.

Each case is a candidate and a baseline on the same 200 eval tasks per domain, built from
how many tasks both pass, only the candidate passes, and only the baseline passes. The
store holds the baseline's per-task results where the stage looks for them (bootstrap's
eval_results for version 1, registered in iteration 0) and taskgen's manifest fixing
version 1 as the baseline; the registry is a real MLflow one.
"""

from __future__ import annotations

import pytest

from components.core import models, tracking
from components.core.context import RecipeView, StageContext
from components.core.facts import StartingPolicy, to_json
from components.core.manifest import MANIFEST, Manifest, Shard, stage_prefix
from components.core.recipe import parse_recipe
from components.core.records import EvalResult
from components.core.storage import Store
from components.evalsuite.suite import pass_rates
from components.evaluation.stage import SECTIONS, comparisons, decide, inputs

N = 200


def outcomes(domain: str, both: int, only_candidate: int, only_baseline: int) -> tuple[list[EvalResult], list[EvalResult]]:
    """(candidate, baseline) results on N tasks of ``domain``."""
    cand, base = [], []
    for i in range(N):
        c = i < both + only_candidate
        b = i < both or both + only_candidate <= i < both + only_candidate + only_baseline
        for out, version, passed in ((cand, "2", c), (base, "1", b)):
            out.append(EvalResult(task_id=f"{domain}-{i}", domain=domain, difficulty=1, context_bucket="<=32",
                                  policy_version=version, score=float(passed), passed=passed))
    return cand, base


def write_manifest(store: Store, ctx: StageContext, facts=None) -> None:
    m = Manifest(stage=ctx.stage, pipeline=ctx.pipeline, iteration=ctx.iteration, shard=None, inputs={},
                 config_digest="", code_version="", outputs=dict(ctx.outputs), info=to_json(facts) if facts else {})
    store.write_json(f"{ctx.prefix}/{MANIFEST}", m.to_json())


def register(source: str, run_root: str) -> None:
    """Version 1 of promo-policy, as bootstrap registers it (iteration 0)."""
    with tracking.stage_run("promo", "bootstrap", "bootstrap", None, {}) as run_id:
        models.register_checkpoint("promo", source, run_id, {"posttrain.iteration": "0", "posttrain.run_root": run_root})


def context(store: Store, stage: str, iteration: int, promotion: str = "statistical",
            domains: tuple[str, ...] = ("code", "math")) -> StageContext:
    recipe = parse_recipe({"pipeline": "promo", "domains": list(domains), "evaluation": {"promotion": promotion}})
    return StageContext(stage=stage, recipe=RecipeView(recipe, stage, SECTIONS), store=store, iteration=iteration,
                        shard=Shard(0, 1))


def decision(tmp_path, cases: dict[str, tuple[int, int, int]], promotion: str, baseline_stored: bool = True):
    """(rule, why, promoted, reason, rows) for the evaluation of candidate version 2."""
    cand, base = [], []
    for domain, counts in sorted(cases.items()):
        c, b = outcomes(domain, *counts)
        cand += c
        base += b
    return decide_on(tmp_path, cand, base, promotion, baseline_stored=baseline_stored)


def decide_on(tmp_path, cand: list[EvalResult], base: list[EvalResult], promotion: str,
              domains: tuple[str, ...] = ("code", "math"), baseline_stored: bool = True):
    """(rule, why, promoted, reason, rows): candidate version 2 (results ``cand``, of a
    recipe of ``domains``) against version 1 (bootstrap's results ``base``)."""
    store = Store(f"file://{tmp_path / 'store'}")
    register(store.url("promo/bootstrap/checkpoint"), store.uri)
    if baseline_stored:
        boot = context(store, "bootstrap", 0)
        boot.write_records("eval_results", base, EvalResult)
        write_manifest(store, boot)
    write_manifest(store, context(store, "taskgen", 1),
                   StartingPolicy("1", "", baseline_version="1", baseline_pass_rates=pass_rates(base)))
    ctx = context(store, "evaluation", 1, promotion, domains)
    rates = pass_rates(cand)
    rows, missing = comparisons(ctx, cand, rates, pass_rates(base))
    return (*decide(ctx, rows, missing, rates, pass_rates(base)), rows)


NOISE_DIP = {"math": (80, 12, 20), "code": (60, 30, 10)}  # math 0.50 -> 0.46, code 0.35 -> 0.45
REAL_REGRESSION = {"math": (60, 0, 60), "code": (60, 100, 0)}  # math 0.60 -> 0.30, code 0.30 -> 0.80
MEAN_DROP = {"math": (90, 0, 2), "code": (90, 0, 2)}  # both 0.46 -> 0.45: within noise, and within tolerance


@pytest.mark.parametrize(("cases", "promotion", "promoted", "reason"), [
    (NOISE_DIP, "statistical", True, "no domain regressed significantly at 95%; mean pass rate 0.425->0.455"),
    (NOISE_DIP, "strict", False, "regressed beyond tolerance: math 0.500->0.460"),
    (REAL_REGRESSION, "statistical", False,
     "significant regression at 95%: math 0.600->0.300 (diff -0.300, CI [-0.370, -0.235])"),
    (REAL_REGRESSION, "strict", False, "regressed beyond tolerance: math 0.600->0.300"),
    (MEAN_DROP, "statistical", False, "mean pass rate dropped 0.460->0.450 (no domain regressed significantly at 95%)"),
    (MEAN_DROP, "strict", True, "no domain regressed beyond tolerance"),
], ids=["dip-statistical", "dip-strict", "regression-statistical", "regression-strict", "mean-statistical", "mean-strict"])
def test_promotion_table(tmp_path, posttrain_home, cases, promotion, promoted, reason):
    rule, why, got_promoted, got_reason, _ = decision(tmp_path, cases, promotion)
    assert (rule, got_promoted, got_reason) == (promotion, promoted, reason)
    if promotion == "statistical":
        assert why == f"paired bootstrap over {2 * N} eval tasks both versions answered"


def test_the_dip_is_within_its_interval_and_the_rows_carry_it(tmp_path, posttrain_home):
    *_, rows = decision(tmp_path, NOISE_DIP, "statistical")
    code, math = rows
    assert (math.domain, math.tasks, math.candidate, math.baseline) == ("math", N, 0.46, 0.5)
    assert math.difference == pytest.approx(-0.04)
    assert math.ci_low < -0.04 < 0 < math.ci_high  # the dip is noise: 0 lies inside
    assert code.ci_low > 0  # code's gain is real


def test_without_the_baselines_results_it_falls_back_to_strict_and_says_so(tmp_path, posttrain_home):
    rule, why, promoted, reason, rows = decision(tmp_path, NOISE_DIP, "statistical", baseline_stored=False)
    where = f"file://{tmp_path / 'store'}/promo/bootstrap"
    assert (rule, promoted) == ("strict", False)
    assert why == f"fallback: no eval_results of version 1 under {where}"
    assert reason == f"strict rule (no eval_results of version 1 under {where}): regressed beyond tolerance: math 0.500->0.460"
    assert [(r.domain, r.tasks, r.candidate, r.baseline, r.ci_low) for r in rows] == [
        ("code", N, 0.45, 0.35, None), ("math", N, 0.46, 0.5, None)]


def test_a_baseline_registered_elsewhere_falls_back_too(tmp_path, posttrain_home):
    store = Store(f"file://{tmp_path / 'store'}")
    register("file:///elsewhere/ckpt", "file:///elsewhere")
    write_manifest(store, context(store, "taskgen", 1), StartingPolicy("1", "", baseline_version="1"))
    cand, _ = outcomes("math", 10, 0, 0)
    rows, missing = comparisons(context(store, "evaluation", 1), cand, pass_rates(cand), {"math": 0.05})
    assert missing == "version 1 was scored under another run root (file:///elsewhere)"


def test_the_baselines_results_are_an_input_of_the_stage(tmp_path, posttrain_home):
    """A re-scored baseline changes evaluation's cache key."""
    decision(tmp_path, NOISE_DIP, "statistical")
    store = Store(f"file://{tmp_path / 'store'}")
    ctx = context(store, "evaluation", 1)
    ctx.depend_on = lambda stage: []  # no trainer manifest in this store
    inputs(ctx)
    boot = stage_prefix("promo", 0, "bootstrap")
    assert ctx.inputs["baseline_eval"].uri == store.url(f"{boot}/{MANIFEST}")
    assert ctx.inputs["baseline_eval"].digest == Manifest.from_json(store.read_json(f"{boot}/{MANIFEST}")).content_digest


CODE_UP = outcomes("code", 60, 40, 0)  # code 0.30 -> 0.50: 40 tasks gained, none lost
MATH = outcomes("math", 100, 0, 0)  # the baseline's math 0.50 (the candidate's only where the recipe has math)


@pytest.mark.parametrize(("promotion", "why", "reason"), [
    ("statistical", f"paired bootstrap over {N} eval tasks both versions answered",
     "no domain regressed significantly at 95%; mean pass rate 0.300->0.500; left out (not in the recipe): math"),
    ("strict", "evaluation.promotion is strict",
     "no domain regressed beyond tolerance; left out (not in the recipe): math"),
    ("no-results", "fallback: no eval_results of version 1 under {where}",
     "strict rule (no eval_results of version 1 under {where}): no domain regressed beyond tolerance; "
     "left out (not in the recipe): math"),
])
def test_a_domain_the_recipe_dropped_is_left_out_not_counted_as_zero(tmp_path, posttrain_home, promotion, why, reason):
    """The champion was scored on code and math; the recipe now has code only (bootstrap
    keeps a trained champion when only the domains change). Math counted as 0 held every
    candidate from then on."""
    where = f"file://{tmp_path / 'store'}/promo/bootstrap"
    rule, got_why, promoted, got_reason, rows = decide_on(
        tmp_path, CODE_UP[0], CODE_UP[1] + MATH[1], "strict" if promotion == "strict" else "statistical",
        domains=("code",), baseline_stored=promotion != "no-results")
    assert (rule, got_why, promoted, got_reason) == ("statistical" if promotion == "statistical" else "strict",
                                                     why.format(where=where), True, reason.format(where=where))
    assert [(r.domain, r.candidate, r.baseline) for r in rows] == [("code", 0.5, 0.3)]


def test_a_dropped_domain_does_not_hide_a_regression_in_the_recipes_domains(tmp_path, posttrain_home):
    cand, base = outcomes("code", 60, 0, 60)  # code 0.60 -> 0.30
    rule, _, promoted, reason, _ = decide_on(tmp_path, cand, base + MATH[1], "statistical", domains=("code",))
    assert (rule, promoted) == ("statistical", False)
    assert reason == ("significant regression at 95%: code 0.600->0.300 (diff -0.300, CI [-0.365, -0.235]); "
                      "left out (not in the recipe): math")


@pytest.mark.parametrize(("promotion", "why", "reason"), [
    ("statistical", f"paired bootstrap over {N} eval tasks both versions answered",
     "no domain regressed significantly at 95%; mean pass rate 0.300->0.500; new (no baseline): arithmetic"),
    ("strict", "evaluation.promotion is strict", "no domain regressed beyond tolerance; new (no baseline): arithmetic"),
])
def test_a_domain_only_the_candidate_has_is_new_and_the_others_stay_paired(tmp_path, posttrain_home, promotion, why,
                                                                          reason):
    """One new domain turned the statistical rule into the strict fallback for every domain."""
    arithmetic, _ = outcomes("arithmetic", 100, 0, 0)  # 0.50, never scored on the baseline
    rule, got_why, promoted, got_reason, rows = decide_on(
        tmp_path, CODE_UP[0] + arithmetic, CODE_UP[1], promotion, domains=("arithmetic", "code"))
    assert (rule, got_why, promoted, got_reason) == (promotion, why, True, reason)
    assert [(r.domain, r.tasks, r.candidate, r.baseline, r.difference) for r in rows][0] == \
        ("arithmetic", N, 0.5, None, None)
    if promotion == "statistical":
        code = rows[1]
        assert (code.domain, code.tasks, code.baseline, code.difference) == ("code", N, 0.3, pytest.approx(0.2))
        assert code.ci_low > 0


def test_a_new_domain_does_not_hide_a_regression_of_a_paired_one(tmp_path, posttrain_home):
    arithmetic, _ = outcomes("arithmetic", 200, 0, 0)  # 1.00, new: it does not lift the mean
    cand, base = outcomes("code", 60, 0, 60)
    rule, _, promoted, reason, _ = decide_on(tmp_path, cand + arithmetic, base, "statistical",
                                             domains=("arithmetic", "code"))
    assert (rule, promoted) == ("statistical", False)
    assert reason == ("significant regression at 95%: code 0.600->0.300 (diff -0.300, CI [-0.365, -0.235]); "
                      "new (no baseline): arithmetic")


@pytest.mark.parametrize("promotion", ["statistical", "strict"])
def test_an_external_start_with_no_champion_promotes_every_domain_as_new(tmp_path, posttrain_home, promotion):
    """taskgen fixes no baseline for an external policy while no champion is set; the stage
    passed "external" to the registry as a version and died with an ``MlflowException``."""
    from components.core.facts import Checkpoint
    from components.evaluation.stage import NO_BASELINE, iteration_baseline, settle_champion

    store = Store(f"file://{tmp_path / 'store'}")
    with tracking.stage_run("promo", "trainer", "trainer", None, {}) as run_id:  # the candidate: version 1
        models.register_checkpoint("promo", store.url("promo/trainer/checkpoint"), run_id,
                                   {"posttrain.iteration": "1", "posttrain.run_root": store.uri})
    write_manifest(store, context(store, "taskgen", 1), StartingPolicy("external", "hf://org/model"))
    ctx = context(store, "evaluation", 1, promotion)
    cand = outcomes("code", 50, 0, 0)[0] + outcomes("math", 20, 0, 0)[0]
    rates = pass_rates(cand)
    version, baseline = iteration_baseline(ctx, Checkpoint("file:///ckpt", "1", "external"))
    assert (version, baseline) == ("", {})
    rows, missing = comparisons(ctx, cand, rates, baseline, version)
    assert missing == NO_BASELINE
    assert [(r.domain, r.tasks, r.candidate, r.baseline) for r in rows] == [("code", N, 0.25, None), ("math", N, 0.1, None)]
    rule, why, promoted, reason = decide(ctx, rows, missing, rates, baseline)
    assert (rule, promoted) == ("strict", True)
    if promotion == "strict":
        assert reason == "no domain regressed beyond tolerance; new (no baseline): code, math"
    else:
        assert why == f"fallback: {NO_BASELINE}"
        assert reason == f"strict rule ({NO_BASELINE}): no domain regressed beyond tolerance; new (no baseline): code, math"
    settle_champion("promo", "1", promoted, version)
    assert models.resolve_alias("promo", "champion")[0] == "1"
    assert iteration_baseline(ctx, Checkpoint("file:///ckpt", "1", "external")) == ("", {})  # a retry: still none


@pytest.mark.parametrize("value", ["three", "1e3", "-1", "1.0", " 1", "", "٣", "9" * 5000])
def test_an_iteration_tag_that_is_not_an_iteration_falls_back_to_strict(tmp_path, posttrain_home, value):
    """An edited ``posttrain.iteration`` tag was ``int()``-ed: a ``ValueError`` traceback in
    both ``inputs`` and ``run`` (a negative one reached ``stage_prefix``). Like a bad
    ``posttrain.eval.<domain>`` tag it is hostile input; it finds no results, so the
    statistical rule falls back to strict and the reason names the tag."""
    from components.evalsuite.score import scoring_of

    store = Store(f"file://{tmp_path / 'store'}")
    register(store.url("promo/bootstrap/checkpoint"), store.uri)
    models.set_version_tags("promo", "1", {"posttrain.iteration": value})
    scoring = scoring_of(store, "promo", "1")
    missing = f"version 1's posttrain.iteration tag {value!r:.60} is not an iteration (a non-negative integer)"
    assert (scoring.version, scoring.manifest, scoring.missing) == ("1", None, missing)

    write_manifest(store, context(store, "taskgen", 1), StartingPolicy("1", "", baseline_version="1"))
    ctx = context(store, "evaluation", 1)
    inputs_seen = ctx.inputs
    ctx.depend_on = lambda stage: []  # no trainer manifest in this store
    inputs(ctx)
    assert "baseline_eval" not in inputs_seen
    cand, _ = outcomes("math", 10, 0, 0)
    rows, got = comparisons(ctx, cand, pass_rates(cand), {"math": 0.05})
    assert got == missing
    rule, why, promoted, reason = decide(ctx, rows, got, pass_rates(cand), {"math": 0.05})
    assert (rule, why, promoted) == ("strict", f"fallback: {missing}", True)


def test_a_large_iteration_tag_is_still_an_iteration(tmp_path, posttrain_home):
    from components.evalsuite.score import scoring_of

    store = Store(f"file://{tmp_path / 'store'}")
    register(store.url("promo/bootstrap/checkpoint"), store.uri)
    models.set_version_tags("promo", "1", {"posttrain.iteration": "007"})
    assert scoring_of(store, "promo", "1").missing == f"no eval_results of version 1 under {store.url(stage_prefix('promo', 7, 'evaluation'))}"
