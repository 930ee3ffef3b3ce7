"""The decision on the registry version, the report and pass@k after a real evaluation.

``record_decision`` alone on a registered version (the exact tags and markdown), then
bootstrap + one iteration of recipes/tiny.yaml with ``evaluation.pass_k: 4`` run in this
process (as tests/core/test_lineage.py does): the candidate's version carries the
decision, reason, baseline and parent, and a description linking the runs, the
checkpoint and the trainer's inputs; report.json carries the rule and the per-domain
intervals; pass@k is logged beside pass@1, and the same evaluation with ``pass_k: 0``
logs none of it. Both scorings record their eval settings, so the evaluation re-scores
nothing; under another ``evaluation.max_new_tokens`` it re-scores the baseline, and a
retry after a kill reuses those results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import yaml

from components.core import models, tracking
from components.core.context import read_output_records
from components.core.facts import Checkpoint, Decision, Scored, StartingPolicy
from components.core.manifest import MANIFEST, Manifest
from components.core.recipe import Recipe, parse_recipe
from components.core.records import EvalResult
from components.core.runner import run_stage
from components.core.storage import Store
from components.evalsuite.decision import Comparison, record_decision, unpaired
from components.evalsuite.suite import eval_settings, pass_rates
from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients, use_home

ITERATION = [("taskgen", None), ("rollout", "0/2"), ("rollout", "1/2"), ("sandbox", "0/2"), ("sandbox", "1/2"),
             ("reward", "0/2"), ("reward", "1/2"), ("validation", None), ("trainer", None), ("evaluation", None)]


def tiny(**evaluation) -> Recipe:
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["evaluation"] = {**data["evaluation"], **evaluation}
    return parse_recipe(data)


def test_record_decision_writes_tags_and_markdown(tmp_path, posttrain_home):
    with tracking.stage_run("rec", "trainer", "trainer", None, {}) as run_id:
        for v in ("1", "2"):
            models.register_checkpoint("rec", f"file://{tmp_path}/ckpt-{v}", run_id, {})
    rows = [Comparison("code", 200, 0.45, 0.35, 0.10, 0.04, 0.16), Comparison("math", 200, 0.46, 0.50, -0.04, -0.095, 0.015)]
    text = record_decision("rec", "2", promoted=True, reason="no domain regressed significantly at 95%", rows=rows,
                           baseline_version="1", parent_version="1", run_id=run_id, checkpoint_uri=f"file://{tmp_path}/ckpt-2",
                           datasets={"rollout[0/2]": "file:///s/rollout/_MANIFEST.json"})
    url = tracking.run_url("rec", run_id)
    assert text == (
        "**Promoted** against version 1\n\nReason: no domain regressed significantly at 95%\n\n"
        "Trained from version 1\n\n"
        "| domain | tasks | candidate | baseline | difference | interval |\n|---|---|---|---|---|---|\n"
        "| code | 200 | 0.450 | 0.350 | +0.100 | [+0.040, +0.160] |\n"
        "| math | 200 | 0.460 | 0.500 | -0.040 | [-0.095, +0.015] |\n\n"
        f"Links:\n\n- [source run]({url})\n- checkpoint: `file://{tmp_path}/ckpt-2`\n"
        "- trained on rollout[0/2]: `file:///s/rollout/_MANIFEST.json`\n")
    mv = tracking.client().get_model_version("rec-policy", "2")
    assert mv.description == text
    mine = ("posttrain.decision", "posttrain.reason", "posttrain.baseline_version", "posttrain.parent_version")
    assert {k: mv.tags.get(k) for k in mine} == {
        "posttrain.decision": "promoted", "posttrain.reason": "no domain regressed significantly at 95%",
        "posttrain.baseline_version": "1", "posttrain.parent_version": "1"}
    # bootstrap's call: no baseline, no parent
    first = record_decision("rec", "1", promoted=True, reason="bootstrap: the first policy",
                            rows=unpaired({"code": 0.35}, {}, {"code": 200}), run_id=run_id)
    assert first.startswith("**Promoted**\n\nReason: bootstrap: the first policy\n")
    assert "| code | 200 | 0.350 | – | – | – |" in first
    tags = tracking.client().get_model_version("rec-policy", "1").tags
    assert (tags["posttrain.decision"], "posttrain.baseline_version" in tags) == ("promoted", False)


@dataclass
class Iteration:
    store: Store
    manifests: dict[str, Manifest]


@pytest.fixture(scope="module")
def iteration(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("decision")
    root = f"file://{base / 'store'}"
    recipe = tiny(pass_k=4)
    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, base / ".posttrain")
        manifests = {"bootstrap": run_stage("bootstrap", recipe, root, 0)}
        for stage, shard in ITERATION:
            manifests[f"{stage}[{shard}]" if shard else stage] = run_stage(stage, recipe, root, 1, shard)
        yield Iteration(store=Store(root), manifests=manifests)
        reset_tracking_clients()


def test_the_candidate_version_carries_the_decision(iteration: Iteration) -> None:
    evaluation, trainer = iteration.manifests["evaluation"], iteration.manifests["trainer"]
    decision = evaluation.facts(Decision)
    assert decision.rule == "statistical"  # bootstrap's eval_results are in the store
    # this seeded iteration's decision (the expected tags came from the decision itself, so a wrong one passed)
    assert (decision.promoted, decision.reason) == (True, "no domain regressed significantly at 95%; mean pass rate "
                                                          "0.000->0.000")
    mv = tracking.client().get_model_version("tiny-policy", "2")
    assert mv.tags["posttrain.decision"] == "promoted"
    assert mv.tags["posttrain.reason"] == decision.reason
    assert (mv.tags["posttrain.baseline_version"], mv.tags["posttrain.parent_version"]) == ("1", "1")
    report = json.loads(iteration.store.read_bytes("tiny/iter-000001/evaluation/report.json"))
    text = mv.description
    head = f"**Promoted** against version 1\n\nReason: {decision.reason}\n"
    assert text.startswith(head)
    for domain, row in report["domains"].items():
        assert (f"| {domain} | 8 | {row['candidate']:.3f} | {row['baseline']:.3f} | {row['difference']:+.3f} | "
                f"[{row['ci_low']:+.3f}, {row['ci_high']:+.3f}] |") in text
    parent = iteration.manifests["taskgen"].facts(StartingPolicy).parent_run_id
    assert "Trained from version 1\n" in text
    assert f"- [source run]({tracking.run_url('tiny', trainer.mlflow_run_id)})\n" in text  # the run that registered it
    assert f"- [evaluation run]({tracking.run_url('tiny', evaluation.mlflow_run_id)})\n" in text
    assert f"- [iteration run]({tracking.run_url('tiny', parent)})\n" in text
    assert f"- checkpoint: `{trainer.facts(Checkpoint).checkpoint_uri}`\n" in text
    for key, ref in trainer.inputs.items():
        assert f"- trained on {key}: `{ref.uri}`\n" in text
    assert set(trainer.inputs) >= {"rollout[0/2]", "reward[1/2]", "validation"}


def test_the_report_carries_rule_intervals_and_the_baseline_input(iteration: Iteration) -> None:
    evaluation = iteration.manifests["evaluation"]
    report = json.loads(iteration.store.read_bytes("tiny/iter-000001/evaluation/report.json"))
    assert (report["rule"], report["confidence"]) == ("statistical", 0.95)
    assert report["rule_why"] == "paired bootstrap over 16 eval tasks both versions answered"
    assert sorted(report["domains"]) == ["arithmetic", "code"]
    for domain, row in report["domains"].items():
        assert row["tasks"] == 8 and row["candidate"] == report["pass_rates"][domain]
        assert row["baseline"] == pytest.approx(report["baseline_pass_rates"][domain])
        assert row["ci_low"] <= row["difference"] <= row["ci_high"]
    boot = iteration.manifests["bootstrap"]
    assert evaluation.inputs["baseline_eval"].digest == boot.content_digest
    layered = iteration.store.read_json("tiny/iter-000001/evaluation/layered.json")
    # this seeded iteration: 8 slices (domain, difficulty, trap), the 8 tasks of each domain, none passed; the
    # interval of 0 passed of n is Wilson's [0, z^2 / (n + z^2)]
    assert [(r["domain"], r["difficulty"], r["trap"], r["context_bucket"], r["tasks"], r["passed"]) for r in layered] == [
        ("arithmetic", 1, False, "<=32", 1, 0), ("arithmetic", 2, False, "<=32", 2, 0),
        ("arithmetic", 2, True, "<=32", 3, 0), ("arithmetic", 3, False, "<=32", 2, 0),
        ("code", 1, False, "<=32", 3, 0), ("code", 1, True, "<=32", 1, 0),
        ("code", 2, False, "<=32", 3, 0), ("code", 3, False, "<=32", 1, 0)]
    assert [(r["pass_rate"], r["mean_score"], r["ci_low"]) for r in layered] == [(0.0, 0.0, 0.0)] * 8
    wilson = {1: 0.7934506856227626, 2: 0.6576197724933468, 3: 0.5614970317550454}
    assert [r["ci_high"] for r in layered] == [pytest.approx(wilson[r["tasks"]]) for r in layered]


def test_both_scorings_record_their_settings_and_the_same_settings_rescore_nothing(iteration: Iteration) -> None:
    settings = eval_settings(tiny())
    assert settings["evaluation.max_new_tokens"] == "8" and settings["rollout.prompt_format"] == '"auto"'
    assert iteration.manifests["bootstrap"].facts(Scored).eval_settings == settings
    evaluation = iteration.manifests["evaluation"]
    assert (evaluation.facts(Decision).eval_settings, evaluation.facts(Decision).baseline_rescored) == (settings, "")
    assert "baseline_eval_results" not in evaluation.outputs and "baseline_eval" not in evaluation.outputs
    report = json.loads(iteration.store.read_bytes("tiny/iter-000001/evaluation/report.json"))
    assert report["baseline_rescored"] is None and "re-scored" not in report["reason"]


def test_pass_at_k_is_logged_beside_pass_at_1_and_only_when_asked(iteration: Iteration) -> None:
    evaluation = iteration.manifests["evaluation"]
    with_k = {k: v for k, v in evaluation.metrics.items() if "pass_at" in k}
    assert set(with_k) == {f"evaluation/{d}/pass_at_{n}" for d in ("arithmetic", "code", "mean") for n in ("1", "k")}
    assert with_k == {k: 0.0 for k in with_k}  # this seeded iteration: no task solved, greedy or in 4 samples
    for d in ("arithmetic", "code", "mean"):
        assert with_k[f"evaluation/{d}/pass_at_k"] >= with_k[f"evaluation/{d}/pass_at_1"]
    stored = iteration.store.read_json(evaluation.outputs["pass_at_k"].path)
    assert stored["k"] == 4 and stored["pass_at_k"] == {d: with_k[f"evaluation/{d}/pass_at_k"] for d in ("arithmetic", "code")}
    report = json.loads(iteration.store.read_bytes("tiny/iter-000001/evaluation/report.json"))
    assert report["pass_at_k"] == {"k": 4, "rates": stored["pass_at_k"]}
    # The same evaluation without pass@k (a new config digest, so it runs again): greedy
    # pass@1 and the decision are unchanged, and no pass@k is logged.
    off = run_stage("evaluation", tiny(pass_k=0), iteration.store.uri, 1)
    assert not any(k.endswith("pass_at_k") for k in off.metrics) and "pass_at_k" not in off.outputs
    assert {k: v for k, v in off.metrics.items() if k.endswith("pass_at_1")} == \
        {k: v for k, v in with_k.items() if k.endswith("pass_at_1")}
    assert off.facts(Decision).promoted == evaluation.facts(Decision).promoted
    again = run_stage("evaluation", tiny(pass_k=4), iteration.store.uri, 1)  # seeded: the same pass@k
    assert {k: v for k, v in again.metrics.items() if "pass_at" in k} == with_k


def test_another_cap_rescores_the_baseline_and_a_retry_reuses_it(iteration: Iteration, monkeypatch) -> None:
    """Last of the module's iteration tests: it re-runs evaluation under another recipe."""
    from components.evaluation import stage

    calls = []
    real = stage.rescore
    monkeypatch.setattr(stage, "rescore", lambda ctx, version, tasks: calls.append(version) or real(ctx, version, tasks))
    shorter = tiny(max_new_tokens=4)
    why = "evaluation.max_new_tokens 8->4"
    m = run_stage("evaluation", shorter, iteration.store.uri, 1)
    decision = m.facts(Decision)
    assert calls == ["1"]
    assert (decision.baseline_rescored, decision.eval_settings) == (why, eval_settings(shorter))
    assert decision.reason.endswith(f"; baseline version 1 re-scored under this recipe's eval settings ({why})")
    rescored = read_output_records(iteration.store, m, "baseline_eval_results", EvalResult)
    assert len(rescored) == 16 and {r.policy_version for r in rescored} == {"1"}
    rel = "tiny/iter-000001/evaluation/report.json"
    report = json.loads(iteration.store.read_bytes(rel))
    assert report["baseline_rescored"] == {"version": "1", "why": why, "failed": "", "settings": eval_settings(shorter)}
    assert report["baseline_pass_rates"] == pass_rates(rescored) == decision.baseline
    assert report["rule_why"].endswith(f"; baseline version 1 re-scored under this recipe's eval settings ({why})")
    # killed before its manifest, then run again: the same decision and report, nothing generated again
    written = iteration.store.read_bytes(rel)
    iteration.store.delete(f"tiny/iter-000001/evaluation/{MANIFEST}")
    again = run_stage("evaluation", shorter, iteration.store.uri, 1)
    assert calls == ["1"]
    assert again.facts(Decision) == decision and iteration.store.read_bytes(rel) == written
    assert again.outputs["baseline_eval_results"] == m.outputs["baseline_eval_results"]


def test_a_description_fits_the_registry_however_many_inputs():
    from components.evalsuite.decision import MAX_DESCRIPTION_CHARS, describe

    links = {f"trained on rollout[{i}/64]": f"s3://bucket/{'x' * 100}/rollout/shard-{i:05d}/_MANIFEST.json" for i in range(64)}
    text = describe(False, "held", unpaired({"code": 0.3}, {"code": 0.4}), "1", links)
    assert len(text) <= MAX_DESCRIPTION_CHARS
    kept = text.count("- trained on rollout[")
    assert 20 < kept < 64 and text.endswith(f"- and {64 - kept} more (see the trainer's manifest inputs)\n")
    assert "| code | 0 | 0.300 | 0.400 | -0.100 | – |" in text
