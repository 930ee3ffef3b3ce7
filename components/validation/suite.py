"""The data-quality gate: a Great Expectations suite over what the trainer will read.

``check(rollouts, rewards, recipe)`` builds one table per record type, validates each
against its expectation suite in an ephemeral GX context (no files, no progress bars)
and returns a ``Report``. Expectations cover ranges (rewards in [0, 1], logprobs <= 0,
finite advantages), shapes (one logprob per completion token), allowed values
(statuses, domains), uniqueness of ids, and that enough rewards survived infrastructure
failures to train on.

Not covered: distribution drift across iterations (compare reward metrics in MLflow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from components.core.records import REWARD_STATUSES, Reward, Rollout


@dataclass
class Report:
    success: bool
    failures: list[str] = field(default_factory=list)
    checked: int = 0

    def to_json(self) -> dict:
        return {"success": self.success, "failures": self.failures, "checked": self.checked}


def _frames(rollouts: list[Rollout], rewards: list[Reward]) -> tuple[pd.DataFrame, pd.DataFrame]:
    ro = pd.DataFrame({
        "rollout_id": [r.rollout_id for r in rollouts],
        "domain": [r.domain for r in rollouts],
        "completion_tokens": [r.completion_tokens for r in rollouts],
        "logprob_max": [max(r.logprobs) if r.logprobs else 0.0 for r in rollouts],
        "logprobs_match_tokens": [len(r.logprobs) == len(r.completion_token_ids) == r.completion_tokens for r in rollouts],
    })
    rw = pd.DataFrame({
        "rollout_id": [r.rollout_id for r in rewards],
        "domain": [r.domain for r in rewards],
        "status": [r.status for r in rewards],
        "raw_reward": [r.raw_reward for r in rewards],
        "weight": [r.weight for r in rewards],
        "advantage_finite": [math.isfinite(r.advantage) for r in rewards],
        "is_ok": [1.0 if r.status == "ok" else 0.0 for r in rewards],
    })
    return ro, rw


def _suites(gx, recipe, max_new_tokens: int):
    E = gx.expectations
    domains = list(recipe.domains)
    rollouts = [
        E.ExpectColumnValuesToBeUnique(column="rollout_id"),
        E.ExpectColumnValuesToNotBeNull(column="rollout_id"),
        E.ExpectColumnValuesToBeInSet(column="domain", value_set=domains),
        E.ExpectColumnValuesToBeBetween(column="completion_tokens", min_value=1, max_value=max_new_tokens),
        E.ExpectColumnValuesToBeBetween(column="logprob_max", max_value=1e-6),
        E.ExpectColumnValuesToBeInSet(column="logprobs_match_tokens", value_set=[True]),
    ]
    rewards = [
        E.ExpectColumnValuesToBeUnique(column="rollout_id"),
        E.ExpectColumnValuesToBeInSet(column="status", value_set=list(REWARD_STATUSES)),
        E.ExpectColumnValuesToBeInSet(column="domain", value_set=domains),
        E.ExpectColumnValuesToBeBetween(column="raw_reward", min_value=0.0, max_value=1.0),
        E.ExpectColumnValuesToBeBetween(column="weight", min_value=0.0, max_value=1.0),
        E.ExpectColumnValuesToBeInSet(column="advantage_finite", value_set=[True]),
        E.ExpectColumnMeanToBeBetween(column="is_ok", min_value=recipe.validation.min_ok_fraction, max_value=1.0),
    ]
    return {"rollouts": rollouts, "rewards": rewards}


def check(rollouts: list[Rollout], rewards: list[Reward], recipe) -> Report:
    import logging

    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas("posttrain")
    frames = dict(zip(("rollouts", "rewards"), _frames(rollouts, rewards)))
    report = Report(success=True)
    if len(rewards) != len(rollouts):
        report.success = False
        report.failures.append(f"rewards has {len(rewards)} rows but rollouts has {len(rollouts)}: every rollout needs a reward")
    for name, expectations in _suites(gx, recipe, recipe.rollout.max_new_tokens).items():
        if frames[name].empty:
            report.success = False
            report.failures.append(f"{name}: no rows to train on")
            continue
        batch_def = source.add_dataframe_asset(name).add_batch_definition_whole_dataframe(name)
        batch = batch_def.get_batch(batch_parameters={"dataframe": frames[name]})
        suite = context.suites.add(gx.ExpectationSuite(name=name, expectations=expectations))
        result = batch.validate(suite)
        for r in result.results:
            report.checked += 1
            if not r.success:
                cfg = r.expectation_config
                kwargs = {k: v for k, v in cfg.kwargs.items() if k not in ("batch_id",)}
                observed = r.result.get("observed_value", r.result.get("partial_unexpected_list", ""))
                report.failures.append(f"{name}: {cfg.type} {kwargs} failed (observed {str(observed)[:120]})")
                report.success = False
    return report
