"""The data-quality gate: each expectation catches its broken row, and a failed gate
stops the stage with exit status 3, a report, and no manifest."""

from __future__ import annotations

import dataclasses

import pytest

from components.cli import main
from components.core.facts import StartingPolicy
from components.core.manifest import MANIFEST, Shard
from components.core.recipe import parse_recipe
from components.core.records import Reward, Rollout, Turn
from components.core.storage import Store
from components.validation.suite import check
from tests.reward.builders import math_task, rollout, write_stage

RECIPE = parse_recipe({"pipeline": "gate", "domains": ["math"], "rollout": {"shards": 1, "max_new_tokens": 4},
                       "validation": {"min_ok_fraction": 0.5}})
TASK = math_task("What is 3 + 4?", "7")


def reward(ro: Rollout, raw: float = 1.0, **changes) -> Reward:
    base = Reward(rollout_id=ro.rollout_id, task_id=ro.task_id, domain=ro.domain, group_index=ro.group_index,
                  raw_reward=raw, components={"correct": raw}, normalized_reward=raw, weight=1.0, advantage=0.5,
                  status="ok")
    return dataclasses.replace(base, **changes)


def clean() -> tuple[list[Rollout], list[Reward]]:
    rollouts = [rollout(TASK, i, "7") for i in range(4)]
    return rollouts, [reward(r, raw=float(i % 2)) for i, r in enumerate(rollouts)]


def test_clean_batch_passes_every_expectation() -> None:
    report = check(*clean(), RECIPE)
    assert (report.success, report.failures, report.checked) == (True, [], 20)


def test_rewards_carry_the_recipes_loss_weight() -> None:
    """A weight above 1 passes when it is the domain's ``reward.domain_weights``, and not otherwise."""
    rollouts, rewards = clean()
    weighted = [dataclasses.replace(r, weight=3.0) for r in rewards]
    recipe = parse_recipe({**RECIPE.model_dump(), "reward": {"domain_weights": {"math": 3.0}}})
    assert (check(rollouts, weighted, recipe).success, check(rollouts, weighted, recipe).failures) == (True, [])
    failed = check(rollouts, weighted, RECIPE)
    assert len(failed.failures) == 1
    assert failed.failures[0].startswith("rewards: expect_column_values_to_be_in_set {'column': 'weight_is_domain_weight'")


def episode(i: int, actions: int = 3, action_tokens: int = 4, observation_tokens: int = 20) -> Rollout:
    """A multi-turn rollout: ``actions`` actions of ``action_tokens`` policy tokens, each followed by
    an observation of ``observation_tokens`` (mask 0, logprob 0.0)."""
    mask = ([1] * action_tokens + [0] * observation_tokens) * actions
    logprobs = [-0.5 if m else 0.0 for m in mask]
    turns = [Turn(action=f"cmd{k}", observation="\n[exit 0 ok]\n\n", tool_call="bash", duration_s=0.1)
             for k in range(actions)]
    return dataclasses.replace(rollout(TASK, i, "cmd0\ncmd1"), completion_token_ids=[7] * len(mask), logprobs=logprobs,
                               completion_tokens=len(mask), completion_mask=mask, turns=turns)


def test_observation_tokens_count_neither_for_the_cap_nor_the_logprobs() -> None:
    rollouts, rewards = clean()
    rollouts[0] = episode(0)  # 72 completion tokens, max_new_tokens 4: each action is within the cap
    report = check(rollouts, rewards, RECIPE)
    assert (report.success, report.failures) == (True, [])


@pytest.mark.parametrize(("broken", "expected"), [
    (episode(0, action_tokens=5), "{'column': 'completion_tokens'"),
    (dataclasses.replace(episode(0), logprobs=[-0.5] * 4 + [-1.0] + [0.0] * 67), "{'column': 'observation_logprobs_zero'"),
    (dataclasses.replace(episode(0), completion_mask=[1] * 4 + [0] * 20), "{'column': 'mask_matches_tokens'"),
    (episode(0, actions=5, observation_tokens=2), "{'column': 'actions'"),
])
def test_each_episode_expectation_catches_its_broken_row(broken: Rollout, expected: str) -> None:
    rollouts, rewards = clean()
    rollouts[0] = broken
    report = check(rollouts, rewards, RECIPE)
    assert report.success is False
    assert [f.split(" ", 2)[2][: len(expected)] for f in report.failures] == [expected]


def _bad_rollout(i: int, **changes):
    def edit(rollouts, rewards):
        rollouts[i] = dataclasses.replace(rollouts[i], **changes)
        return rollouts, rewards
    return edit


def _bad_reward(i: int, **changes):
    def edit(rollouts, rewards):
        rewards[i] = dataclasses.replace(rewards[i], **changes)
        return rollouts, rewards
    return edit


@pytest.mark.parametrize(("breakage", "expected"), [
    (_bad_rollout(1, logprobs=[0.3]), "rollouts: expect_column_values_to_be_between {'column': 'logprob_max'"),
    # a NaN passed the range check (GX reads it as missing), and -inf is <= 0
    (_bad_rollout(1, logprobs=[float("nan")]), "rollouts: expect_column_values_to_be_in_set {'column': 'logprobs_finite'"),
    (_bad_rollout(1, logprobs=[float("-inf")]), "rollouts: expect_column_values_to_be_in_set {'column': 'logprobs_finite'"),
    (_bad_rollout(2, logprobs=[-0.1, -0.2]), "rollouts: expect_column_values_to_be_in_set {'column': 'logprobs_match_tokens'"),
    (_bad_rollout(0, completion_tokens=0, completion_token_ids=[], logprobs=[]),
     "rollouts: expect_column_values_to_be_between {'column': 'completion_tokens'"),
    (_bad_rollout(3, domain="poetry"), ["rewards: posttrain.every_rollout_has_a_reward failed",  # its reward's domain differs
                                        "rollouts: expect_column_values_to_be_in_set {'column': 'domain'"]),
    (_bad_reward(0, raw_reward=1.5), "rewards: expect_column_values_to_be_between {'column': 'raw_reward'"),
    # GX's range check skips NaN (read as missing): one NaN raw reward passed it, and nothing checked normalized_reward
    (_bad_reward(1, raw_reward=float("nan")), "rewards: expect_column_values_to_be_in_set {'column': 'raw_reward_finite'"),
    (_bad_reward(1, normalized_reward=float("nan")),
     "rewards: expect_column_values_to_be_in_set {'column': 'normalized_reward_finite'"),
    (_bad_reward(3, normalized_reward=float("-inf")),
     "rewards: expect_column_values_to_be_in_set {'column': 'normalized_reward_finite'"),
    (_bad_reward(1, advantage=float("nan")), "rewards: expect_column_values_to_be_in_set {'column': 'advantage_finite'"),
    (_bad_reward(2, rollout_id=clean()[0][0].rollout_id),
     ["rewards: posttrain.every_rollout_has_a_reward failed", "rewards: expect_column_values_to_be_unique {'column': 'rollout_id'"]),
    (_bad_reward(2, weight=0.5), "rewards: expect_column_values_to_be_in_set {'column': 'weight_is_domain_weight'"),
    # a trained reward that carries no weight, and a left-out one that carries its domain's: each passed as "0 or the weight"
    (_bad_reward(2, weight=0.0), "rewards: expect_column_values_to_be_in_set {'column': 'weight_is_domain_weight'"),
    (_bad_reward(2, status="excluded"), "rewards: expect_column_values_to_be_in_set {'column': 'weight_is_domain_weight'"),
])
def test_each_expectation_catches_its_broken_row(breakage, expected: str | list[str]) -> None:
    report = check(*breakage(*clean()), RECIPE)
    expected = [expected] if isinstance(expected, str) else expected
    assert report.success is False
    assert [f[: len(e)] for f, e in zip(report.failures, expected)] == expected and len(report.failures) == len(expected)


def test_too_many_infra_failures_and_missing_rewards_fail() -> None:
    rollouts, rewards = clean()
    excluded = [dataclasses.replace(r, status="excluded", weight=0.0) for r in rewards[:3]] + rewards[3:]
    report = check(rollouts, excluded, RECIPE)
    assert report.failures == ["rewards: expect_column_mean_to_be_between {'column': 'is_ok', 'min_value': 0.5, "
                               "'max_value': 1.0} failed (observed 0.25): too few rewards have status ok for "
                               "validation.min_ok_fraction: the reward stage's reward/excluded counts sandbox infrastructure "
                               "errors (see sandbox/<status>), reward/verifier_errors verifier bugs (fix what made them, or "
                               "lower validation.min_ok_fraction)"]
    report = check(rollouts, rewards[:3], RECIPE)
    assert report.failures == ["rewards: posttrain.every_rollout_has_a_reward failed: every rollout needs exactly one "
                               f"reward with its task_id and domain (3 rewards for 4 rollouts; rollouts without a reward: "
                               f"{rollouts[3].rollout_id})"]
    assert check([], [], RECIPE).failures == ["rollouts: no rows to train on", "rewards: no rows to train on"]


@pytest.mark.parametrize(("breakage", "failed", "named"), [
    # the likeliest failure in operation: an outage's excluded rewards (or a verifier's bug) leave too few to train on
    (lambda ro, rw: (ro, [dataclasses.replace(r, status="verifier_error", weight=0.0, raw_reward=0.0) for r in rw[:3]]
                     + rw[3:]), 1, ["validation.min_ok_fraction", "reward/excluded", "reward/verifier_errors"]),
    (_bad_rollout(0, completion_tokens=0, completion_token_ids=[], logprobs=[]), 1,
     ["rollout.max_new_tokens", "empty completion"]),
    (lambda ro, rw: ([episode(0, action_tokens=5)] + ro[1:], rw), 1, ["rollout.max_new_tokens"]),
    (lambda ro, rw: ([episode(0, actions=5, observation_tokens=2)] + ro[1:], rw), 1, ["rollout.max_turns"]),
    (_bad_reward(2, weight=0.5), 1, ["reward.domain_weights"]),
    (_bad_reward(2, status="excluded"), 1, ["reward.domain_weights"]),
    (lambda ro, rw: ([dataclasses.replace(r, domain="poetry") for r in ro], [dataclasses.replace(r, domain="poetry") for r in rw]),
     2, ["the recipe's domains"]),  # rollouts and rewards
], ids=["ok-share", "empty", "long-action", "turns", "weight", "excluded-weight", "domains"])
def test_a_failure_names_the_recipe_setting_behind_it(breakage, failed: int, named: list[str]) -> None:
    """The gate's line was the GX expectation and its kwargs alone: a low ok share read
    ``... {'column': 'is_ok', 'min_value': 0.5, ...} failed (observed 0.25)``, naming
    neither validation.min_ok_fraction nor where the unusable rewards are counted."""
    report = check(*breakage(*clean()), RECIPE)
    assert report.success is False and len(report.failures) == failed
    for failure in report.failures:
        hint = failure.partition(" failed (observed ")[2].partition("): ")[2]
        assert all(name in hint for name in named), failure


def test_a_failure_no_setting_is_behind_has_no_hint() -> None:
    report = check(*_bad_reward(1, raw_reward=float("nan"))(*clean()), RECIPE)
    assert report.failures == ["rewards: expect_column_values_to_be_in_set {'column': 'raw_reward_finite', "
                               "'value_set': [True]} failed (observed [False])"]


def test_failed_gate_exits_3_with_a_report_and_no_manifest(tmp_path, posttrain_home, capsys) -> None:
    rollouts, rewards = clean()
    rewards[0] = dataclasses.replace(rewards[0], raw_reward=7.0)
    store = Store(str(tmp_path / "store"))
    recipe_file = tmp_path / "gate.yaml"
    recipe_file.write_text("pipeline: gate\ndomains: [math]\nrollout: {shards: 1, max_new_tokens: 4}\n")
    write_stage(store, "gate", 1, "taskgen", None, {"tasks": ([TASK], type(TASK))},
                StartingPolicy("1", "file:///x"))
    write_stage(store, "gate", 1, "rollout", Shard(0, 1), {"rollouts": (rollouts, Rollout)})
    write_stage(store, "gate", 1, "reward", Shard(0, 1), {"rewards": (rewards, Reward)})

    code = main(["stage", "validation", "--recipe", str(recipe_file), "--run-root", store.uri, "--iteration", "1"])

    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("posttrain")]
    assert code == 3
    report_uri = store.url("gate/iter-000001/validation/report.json")
    assert len(err) == 1 and err[0].startswith(f"posttrain: validation failed for iteration 1 ({report_uri}): rewards: "
                                               "expect_column_values_to_be_between {'column': 'raw_reward'")
    assert not store.exists(f"gate/iter-000001/validation/{MANIFEST}")
    report = store.read_json("gate/iter-000001/validation/report.json")
    assert report["success"] is False and report["checked"] == 20 and len(report["failures"]) == 1
