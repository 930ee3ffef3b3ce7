"""Stage ``validation``: stop the iteration when the trainer's input is malformed.

Reads every shard's rollouts and rewards, runs the Great Expectations gate
(``components.validation.suite``), writes the report, and raises ``DataQualityError``
(exit status 3) listing the failed expectations when the gate fails. No manifest is
written on failure, so the trainer cannot start from bad data.
"""

from __future__ import annotations

from components.core.context import StageContext
from components.core.errors import DataQualityError
from components.core.records import Reward, Rollout
from components.validation.suite import check

SECTIONS = ("validation", "rollout")
"""Recipe sections read: the gate's thresholds, and the completion cap rows must respect."""


def inputs(ctx: StageContext) -> None:
    ctx.depend_on("rollout")
    ctx.depend_on("reward")


def run(ctx: StageContext) -> dict[str, float]:
    rollouts = ctx.read_records("rollout", "rollouts", Rollout)
    rewards = ctx.read_records("reward", "rewards", Reward)
    report = check(rollouts, rewards, ctx.recipe)
    uri = ctx.write_json("report", report.to_json())
    if not report.success:
        raise DataQualityError(f"validation failed for iteration {ctx.iteration} ({uri}): " + "; ".join(report.failures))
    return {"expectations": float(report.checked), "rows": float(len(rewards))}
