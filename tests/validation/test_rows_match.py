"""``posttrain.every_rollout_has_a_reward`` matches rewards to rollouts by ``rollout_id``,
``task_id`` and ``domain``: the check once compared only the counts, so as many rewards
belonging to other rollouts (or carrying another rollout's domain) passed the gate."""

from __future__ import annotations

import dataclasses
import json

from components.core.recipe import parse_recipe
from components.validation.suite import CHECK_ROWS_MATCH, check
from tests.validation.test_gate import RECIPE, clean

TWO_DOMAINS = parse_recipe({**RECIPE.model_dump(), "domains": ["math", "code"]})
PREFIX = f"rewards: {CHECK_ROWS_MATCH} failed: every rollout needs exactly one reward with its task_id and domain ("


def _row(report) -> dict:
    [row] = [r for r in report.expectations if r["expectation"] == CHECK_ROWS_MATCH]
    return row


def test_matching_rewards_pass_the_check() -> None:
    report = check(*clean(), RECIPE)
    row = _row(report)
    assert (report.success, row["success"], row["unexpected_count"], row["unexpected_values"]) == (True, True, 0, "")
    assert json.loads(row["observed"]) == {"rewards": 4, "rollouts_without_reward": 0, "rewards_without_rollout": 0,
                                           "task_or_domain_differs": 0}


def test_as_many_rewards_for_other_rollouts_fail() -> None:
    rollouts, rewards = clean()
    others = [dataclasses.replace(r, rollout_id=f"other-{i}") for i, r in enumerate(rewards)]

    report = check(rollouts, others, RECIPE)

    ids = [r.rollout_id for r in rollouts]
    assert report.success is False
    assert report.failures == [PREFIX + f"4 rewards for 4 rollouts; rollouts without a reward: {ids[0]}, {ids[1]}, "
                               f"{ids[2]}, ... 1 more; rewards for no rollout: other-0, other-1, other-2, ... 1 more)"]
    row = _row(report)
    assert (row["table"], row["success"], row["element_count"], row["unexpected_count"]) == ("rewards", False, 4, 8)
    assert json.loads(row["observed"]) == {"rewards": 4, "rollouts_without_reward": 4, "rewards_without_rollout": 4,
                                           "task_or_domain_differs": 0}
    assert json.loads(row["unexpected_values"]) == ids + ["other-0"]  # SAMPLE_VALUES of them
    assert json.loads(row["kwargs"]) == {"match": ["rollout_id", "task_id", "domain"], "rollouts": 4}


def test_one_swapped_id_fails() -> None:
    rollouts, rewards = clean()
    rewards[2] = dataclasses.replace(rewards[2], rollout_id="stray")

    report = check(rollouts, rewards, RECIPE)

    assert report.failures == [PREFIX + f"4 rewards for 4 rollouts; rollouts without a reward: {rollouts[2].rollout_id}; "
                               "rewards for no rollout: stray)"]


def test_a_reward_with_another_domain_or_task_fails() -> None:
    rollouts, rewards = clean()
    rewards[1] = dataclasses.replace(rewards[1], domain="code")  # a listed domain: only the match catches it
    rewards[3] = dataclasses.replace(rewards[3], task_id="math-other")

    report = check(rollouts, rewards, TWO_DOMAINS)

    task = rollouts[0].task_id
    assert report.failures == [PREFIX + "4 rewards for 4 rollouts; rewards whose task_id or domain differs from their "
                               f"rollout's: {rollouts[1].rollout_id} domain 'code' != 'math', "
                               f"{rollouts[3].rollout_id} task_id 'math-other' != '{task}')"]
    row = _row(report)
    assert (row["success"], row["unexpected_count"]) == (False, 2)
    assert json.loads(row["unexpected_values"]) == [rollouts[1].rollout_id, rollouts[3].rollout_id]
    assert check(rollouts, clean()[1], TWO_DOMAINS).success is True
