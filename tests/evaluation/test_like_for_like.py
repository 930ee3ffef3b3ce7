"""Promotion compares like for like: a baseline scored under other eval settings is re-scored.

The champion (version 1, bootstrap's scoring in iteration 0) was scored with
``evaluation.max_new_tokens`` 4, where every answer was cut short and failed; the
candidate is evaluated under 16. Paired with those stale results the candidate "wins"
by the setting alone. The evaluation stage re-scores the baseline under the recipe's
settings now and judges against that. Generation is a counting fake engine that answers
every task with its reference completion (the baseline passes everything once it may
answer in full), and the policy load a fake that records what it was asked to load; the
registry is a real MLflow one, the store a real one, the verifiers the domain's own.
"""

from __future__ import annotations

import types

import pytest

from components.core import models, tracking
from components.core.context import RecipeView, StageContext
from components.core.facts import Scored, StartingPolicy, to_json
from components.core.manifest import MANIFEST, Manifest, Shard
from components.core.recipe import parse_recipe
from components.core.records import EvalResult
from components.core.storage import Store
from components.domains import registry
from components.evalsuite import score, suite
from components.evalsuite.score import RESCORED, RESCORED_RECORD, scoring_of, settings_changes
from components.evalsuite.suite import eval_settings, eval_tasks, pass_rates
from components.evaluation.stage import SECTIONS, comparisons, decide, promotion
from components.rollout.engines import Generation

STALE, NOW = 4, 16
NOTE = "baseline version 1 re-scored under this recipe's eval settings (evaluation.max_new_tokens 4->16)"


def recipe(max_new_tokens: int, promotion_rule: str = "statistical", **rollout):
    return parse_recipe({"pipeline": "like", "domains": ["arithmetic"], "rollout": rollout,
                         "evaluation": {"tasks_per_domain": 20, "max_new_tokens": max_new_tokens,
                                        "promotion": promotion_rule}})


def context(store: Store, stage: str, iteration: int, max_new_tokens: int = NOW, rule: str = "statistical") -> StageContext:
    return StageContext(stage=stage, recipe=RecipeView(recipe(max_new_tokens, rule), stage, SECTIONS), store=store,
                        iteration=iteration, shard=Shard(0, 1))


def write_manifest(store: Store, ctx: StageContext, info: dict) -> None:
    m = Manifest(stage=ctx.stage, pipeline=ctx.pipeline, iteration=ctx.iteration, shard=None, inputs={},
                 config_digest="", code_version="", outputs=dict(ctx.outputs), info=info)
    store.write_json(f"{ctx.prefix}/{MANIFEST}", m.to_json())


class Engine:
    """Greedy answers: each task's reference completion. Counts its calls."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.calls: list[int] = []  # max_new_tokens of each call
        self.workers = 1

    def generate(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy=False, progress=None):
        self.calls.append(max_new_tokens)
        if progress:
            progress(len(prompts))
        return [Generation([], [], [], self.answers[p], "stop") for p in prompts]


@pytest.fixture
def fakes(monkeypatch):
    tasks = eval_tasks(recipe(NOW))
    engine = Engine({t.prompt: registry.get(t.domain).reference_completion(t) for t in tasks})
    loaded: list[tuple[str, str, str]] = []

    def load(uri, version="", field="policy", prompt_format="raw"):
        loaded.append((uri, version, prompt_format))
        return types.SimpleNamespace(version=version, encode_prompt=lambda prompt: list(prompt.encode()))

    monkeypatch.setattr(suite, "engine_of", lambda _recipe: engine)
    monkeypatch.setattr(score, "load_policy", load)
    return types.SimpleNamespace(engine=engine, loaded=loaded, tasks=tasks)


def scene(tmp_path, tasks, recorded: int | None):
    """Version 1 registered and scored by bootstrap (all tasks failed) under
    ``max_new_tokens`` ``recorded`` (None: a manifest from before settings were recorded);
    taskgen fixing it as iteration 1's baseline. Returns (store, candidate's results: half
    passed, the stale baseline rates)."""
    store = Store(f"file://{tmp_path / 'store'}")
    with tracking.stage_run("like", "bootstrap", "bootstrap", None, {}) as run_id:
        models.register_checkpoint("like", store.url("like/bootstrap/checkpoint"), run_id,
                                   {"posttrain.iteration": "0", "posttrain.run_root": store.uri})
    stale = [EvalResult(task_id=t.task_id, domain=t.domain, difficulty=t.difficulty, context_bucket="<=32",
                        policy_version="1", score=0.0, passed=False) for t in tasks]
    boot = context(store, "bootstrap", 0, recorded or STALE)
    boot.write_records("eval_results", stale, EvalResult)
    facts = to_json(Scored("", "1", pass_rates(stale), None, eval_settings=eval_settings(boot.recipe)))
    if recorded is None:
        del facts["eval_settings"]
    write_manifest(store, boot, facts)
    write_manifest(store, context(store, "taskgen", 1),
                   to_json(StartingPolicy("1", "", baseline_version="1", baseline_pass_rates=pass_rates(stale))))
    cand = [EvalResult(task_id=t.task_id, domain=t.domain, difficulty=t.difficulty, context_bucket="<=32",
                       policy_version="2", score=float(i % 2), passed=bool(i % 2)) for i, t in enumerate(tasks)]
    return store, cand, pass_rates(stale)


@pytest.mark.parametrize(("rule", "held"), [
    ("statistical", "significant regression at 95%: arithmetic 1.000->0.500 (diff -0.500, CI ["),
    ("strict", "regressed beyond tolerance: arithmetic 1.000->0.500"),
], ids=["statistical", "strict"])
def test_a_baseline_scored_under_another_max_new_tokens_is_rescored_and_holds(tmp_path, posttrain_home, fakes, rule, held):
    store, cand, stale = scene(tmp_path, fakes.tasks, recorded=STALE)
    ctx = context(store, "evaluation", 1, rule=rule)
    rates = pass_rates(cand)
    # the stale pairing: 0.00 -> 0.50, promoted by the setting alone
    rows, missing = comparisons(ctx, cand, rates, stale, "1")
    assert decide(ctx, rows, missing, rates, stale)[2] is True

    judged = promotion(ctx, cand, rates, "1", stale)
    assert fakes.engine.calls == [NOW]  # the baseline, generated once, under the recipe's cap
    checkpoint = models.checkpoint_of(tracking.client().get_model_version("like-policy", "1"))
    assert fakes.loaded == [(checkpoint, "1", "auto")]  # its registry checkpoint, in the recipe's prompt format
    assert judged.rule == rule and judged.promoted is False
    assert judged.reason.startswith(held) and judged.reason.endswith(f"; {NOTE}")
    assert judged.why.endswith(f"; {NOTE}")
    assert judged.baseline == {"arithmetic": 1.0}
    assert (judged.rescored.version, judged.rescored.why) == ("1", "evaluation.max_new_tokens 4->16")
    if rule == "statistical":
        (row,) = judged.rows
        assert (row.tasks, row.candidate, row.baseline) == (20, 0.5, 1.0) and row.ci_high < 0
    # this stage's outputs: the re-scored results and the record a retry checks
    written = Manifest(stage="evaluation", pipeline="like", iteration=1, shard=None, inputs={}, config_digest="",
                       code_version="", outputs=dict(ctx.outputs))
    from components.core.context import read_output_records

    again = read_output_records(store, written, RESCORED, EvalResult)
    assert [(r.task_id, r.policy_version, r.passed) for r in again] == [(t.task_id, "1", True) for t in fakes.tasks]
    record = store.read_json(ctx.outputs[RESCORED_RECORD].path)
    assert (record["version"], record["why"], record["settings"]) == ("1", "evaluation.max_new_tokens 4->16",
                                                                      eval_settings(ctx.recipe))


def test_same_settings_generate_nothing(tmp_path, posttrain_home, fakes):
    store, cand, stale = scene(tmp_path, fakes.tasks, recorded=NOW)
    assert scoring_of(store, "like", "1").settings == eval_settings(recipe(NOW))
    ctx = context(store, "evaluation", 1)
    judged = promotion(ctx, cand, pass_rates(cand), "1", stale)
    assert fakes.engine.calls == [] and fakes.loaded == []
    assert RESCORED not in ctx.outputs and RESCORED_RECORD not in ctx.outputs
    assert judged.rescored is None
    assert (judged.rule, judged.promoted) == ("statistical", True)
    assert judged.reason == "no domain regressed significantly at 95%; mean pass rate 0.000->0.500"
    assert judged.why == "paired bootstrap over 20 eval tasks both versions answered"


def test_a_scoring_that_recorded_no_settings_counts_as_unknown_and_is_rescored(tmp_path, posttrain_home, fakes):
    store, cand, stale = scene(tmp_path, fakes.tasks, recorded=None)
    assert scoring_of(store, "like", "1").settings == {}
    judged = promotion(context(store, "evaluation", 1), cand, pass_rates(cand), "1", stale)
    assert fakes.engine.calls == [NOW]
    assert judged.promoted is False
    assert judged.reason.endswith("; baseline version 1 re-scored under this recipe's eval settings (its scoring "
                                  "recorded no eval settings)")


def test_a_retried_evaluation_reuses_the_rescored_baseline(tmp_path, posttrain_home, fakes):
    """An attempt killed after it re-scored (its outputs written, no manifest), then run
    again: the same decision without generating again; results that no longer match
    their record are scored again."""
    store, cand, stale = scene(tmp_path, fakes.tasks, recorded=STALE)
    first_ctx = context(store, "evaluation", 1)
    first = promotion(first_ctx, cand, pass_rates(cand), "1", stale)
    retry_ctx = context(store, "evaluation", 1)
    retry = promotion(retry_ctx, cand, pass_rates(cand), "1", stale)
    assert fakes.engine.calls == [NOW]
    assert retry == first
    assert retry_ctx.outputs == first_ctx.outputs
    store.write_bytes(first_ctx.outputs[RESCORED].path, b"not the results")
    assert promotion(context(store, "evaluation", 1), cand, pass_rates(cand), "1", stale) == first
    assert fakes.engine.calls == [NOW, NOW]
    # another cap than the one the earlier attempt scored under is not reused either
    other = context(store, "evaluation", 1, max_new_tokens=12)
    assert promotion(other, cand, pass_rates(cand), "1", stale).rescored.why == "evaluation.max_new_tokens 4->12"
    assert fakes.engine.calls == [NOW, NOW, 12]


def test_a_rescore_by_other_code_is_not_reused(tmp_path, posttrain_home, fakes, monkeypatch):
    """An evaluation re-run after a code (or plug-in) upgrade: the earlier attempt's
    re-scored baseline came from the old code, and the candidate is scored by the new."""
    store, cand, stale = scene(tmp_path, fakes.tasks, recorded=STALE)
    monkeypatch.setenv("POSTTRAIN_CODE_VERSION", "1.0.0")
    promotion(context(store, "evaluation", 1), cand, pass_rates(cand), "1", stale)
    monkeypatch.setenv("POSTTRAIN_CODE_VERSION", "2.0.0")
    promotion(context(store, "evaluation", 1), cand, pass_rates(cand), "1", stale)
    assert fakes.engine.calls == [NOW, NOW]


def test_a_baseline_whose_checkpoint_is_gone_falls_back_to_the_strict_rule(tmp_path, posttrain_home, fakes,
                                                                           monkeypatch):
    """Its checkpoint deleted (or rewritten) since it was scored under other settings: not
    exit 2 for every later evaluation, but the strict rule on its recorded rates, the
    reason naming the settings and why it could not be re-scored; nothing written."""
    from components.core.errors import UserError

    def gone(uri, version="", field="policy", prompt_format="raw"):
        raise UserError(field, uri, "no such folder", "re-run the stage that writes it")

    monkeypatch.setattr(score, "load_policy", gone)
    store, cand, stale = scene(tmp_path, fakes.tasks, recorded=STALE)
    ctx = context(store, "evaluation", 1)
    judged = promotion(ctx, cand, pass_rates(cand), "1", stale)
    assert (judged.rule, judged.promoted) == ("strict", True)  # 0.000 -> 0.500 on the recorded rates
    assert judged.reason.startswith("strict rule (baseline version 1 was scored under other eval settings "
                                    "(evaluation.max_new_tokens 4->16) and could not be re-scored (baseline version "
                                    "1='")
    assert judged.reason.count("could not be re-scored") == 1
    assert judged.baseline == stale and judged.rescored.results is None
    assert RESCORED not in ctx.outputs and fakes.engine.calls == []


def test_settings_changes_name_each_setting_and_both_values():
    old = eval_settings(recipe(STALE, prompt_format="raw"))
    new = eval_settings(recipe(NOW, prompt_format="chat"))
    assert settings_changes(old, new) == 'evaluation.max_new_tokens 4->16, rollout.prompt_format "raw"->"chat"'
    assert settings_changes(new, new) == ""
    assert settings_changes({}, new) == "its scoring recorded no eval settings"
    assert settings_changes({k: v for k, v in new.items() if k != "sandbox.output_cap_bytes"}, new) == \
        "sandbox.output_cap_bytes unrecorded->8192"
    sandbox = parse_recipe({"pipeline": "like", "sandbox": {"output_cap_bytes": 512, "timeout_s": 2.5}})
    assert settings_changes(eval_settings(parse_recipe({"pipeline": "like"})), eval_settings(sandbox)) == \
        "sandbox.timeout_s 5.0->2.5, sandbox.output_cap_bytes 8192->512"
