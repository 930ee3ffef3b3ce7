"""The shuffled-reward control and per-domain loss weights in the reward stage.

``reward.control: shuffled`` permutes the trained-on scores within each domain (same
multiset, another assignment, excluded samples untouched) while ``raw_reward`` keeps the
verifier's score; ``reward.domain_weights`` sets ``weight`` of a domain's ok samples."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from components.core.recipe import parse_recipe
from components.core.records import Reward, from_table
from components.core.storage import Store
from components.domains.base import make_task
from components.reward.advantages import group_advantages
from components.reward.replay import replay
from components.reward.stage import score
from tests.reward.builders import math_task, rollout, run_reward, write_iteration

# math: mostly wrong; arithmetic: mostly right, so a permutation across domains would show.
M1, M2, M3 = math_task("3*4-5=", "7"), math_task("2+3*4=", "14"), math_task("9-2*3=", "3")
BROKEN = make_task("math", "train", 1, "1+1=", {})  # no answer: its verifier raises -> verifier_error
A1 = make_task("arithmetic", "train", 1, "1+2=", {"answer": "3"})
A2 = make_task("arithmetic", "train", 1, "4+4=", {"answer": "8"})
TASKS = [M1, M2, M3, BROKEN, A1, A2]
COMPLETIONS = [(M1, ["7", "8", "0", "1"]), (M2, ["1", "14", "2", "3"]), (M3, ["3", "4", "5", "6"]),
               (BROKEN, ["2", "2", "3", "4"]), (A1, ["3", "3", "3", "4"]), (A2, ["8", "8", "7", "8"])]
ROLLOUTS = [rollout(t, i, c) for t, cs in COMPLETIONS for i, c in enumerate(cs)]
TRUE = [(M1, [1, 0, 0, 0]), (M2, [0, 1, 0, 0]), (M3, [1, 0, 0, 0]), (A1, [1, 1, 1, 0]), (A2, [1, 1, 0, 1])]


def cfg(**reward):
    return parse_recipe({"pipeline": "ctl", "domains": ["math", "arithmetic"], "rollout": {"shards": 2},
                         "reward": reward}).reward


def scored(seed: int = 11, **reward) -> dict[str, Reward]:
    rewards = score({t.task_id: t for t in TASKS}, ROLLOUTS, {}, cfg(**reward), None, seed)
    return {r.rollout_id: r for r in rewards}


def by_task(rewards: dict[str, Reward]) -> dict[str, list[Reward]]:
    out: dict[str, list[Reward]] = defaultdict(list)
    for r in sorted(rewards.values(), key=lambda r: (r.task_id, r.group_index)):
        out[r.task_id].append(r)
    return out


def test_off_trains_on_the_verifier_scores():
    rewards = by_task(scored())
    for task, truth in TRUE:
        group = rewards[task.task_id]
        assert [r.raw_reward for r in group] == truth
        assert [r.normalized_reward for r in group] == truth
        assert [r.advantage for r in group] == pytest.approx(group_advantages([float(x) for x in truth], 1e-6, True))
    assert {r.status for r in rewards[BROKEN.task_id]} == {"verifier_error"}


def test_shuffled_permutes_within_each_domain_and_keeps_the_true_raw_reward():
    off, on = scored(control="none"), scored(control="shuffled")
    for domain in ("math", "arithmetic"):
        ok_on = [r for r in on.values() if r.domain == domain and r.status == "ok"]
        ok_off = [r for r in off.values() if r.domain == domain and r.status == "ok"]
        # same multiset per domain: nothing moved from one domain to the other
        assert Counter(r.normalized_reward for r in ok_on) == Counter(r.raw_reward for r in ok_off)
    assert Counter(r.normalized_reward for r in on.values() if r.domain == "math" and r.status == "ok") == {0.0: 9, 1.0: 3}
    assert Counter(r.normalized_reward for r in on.values() if r.domain == "arithmetic") == {1.0: 6, 0.0: 2}
    # raw_reward stays the verifier's score; the trained-on score is another assignment
    assert all(on[i].raw_reward == off[i].raw_reward for i in off)
    moved = sorted(i for i in on if on[i].normalized_reward != on[i].raw_reward)
    # seed 11's permutation (the same in every process): 6 math and 2 arithmetic samples get another's score
    assert moved == sorted(f"{t.task_id}-{k}" for t, k in ((M1, 0), (M1, 2), (M1, 3), (M2, 1), (M3, 0), (M3, 2),
                                                             (A1, 3), (A2, 0)))
    assert {task_id: [r.normalized_reward for r in group] for task_id, group in by_task(on).items()} == {
        M1.task_id: [0.0, 0.0, 1.0, 1.0], M2.task_id: [0.0, 0.0, 0.0, 0.0], M3.task_id: [0.0, 0.0, 1.0, 0.0],
        BROKEN.task_id: [0.0, 0.0, 0.0, 0.0], A1.task_id: [1.0, 1.0, 1.0, 1.0], A2.task_id: [0.0, 1.0, 0.0, 1.0]}
    # advantages come from the shuffled scores, group by group
    for task_id, group in by_task(on).items():
        if task_id == BROKEN.task_id:
            continue
        assert [r.advantage for r in group] == pytest.approx(
            group_advantages([r.normalized_reward for r in group], 1e-6, True))
    # every advantage moved but M3's two losers (still losers of one winner) and the excluded group's
    unchanged = {f"{M3.task_id}-1", f"{M3.task_id}-3"} | {f"{BROKEN.task_id}-{k}" for k in range(4)}
    assert sorted(i for i in on if on[i].advantage != pytest.approx(off[i].advantage)) == sorted(set(on) - unchanged)


def test_shuffled_keeps_excluded_samples_excluded_and_is_seeded():
    on = scored(control="shuffled")
    broken = [r for r in on.values() if r.task_id == BROKEN.task_id]
    assert [(r.status, r.weight, r.advantage, r.normalized_reward) for r in broken] == [("verifier_error", 0.0, 0.0, 0.0)] * 4
    assert scored(control="shuffled") == on  # same seed, same permutation
    other = scored(seed=12, control="shuffled")
    assert [other[i].normalized_reward for i in sorted(on)] != [on[i].normalized_reward for i in sorted(on)]


def test_domain_weights_set_the_weight_of_ok_samples_only():
    plain, weighted = scored(), scored(domain_weights={"math": 2.5})
    for i, r in weighted.items():
        expected = 0.0 if r.status != "ok" else (2.5 if r.domain == "math" else 1.0)
        assert r.weight == expected
        assert r.advantage == plain[i].advantage and r.normalized_reward == plain[i].normalized_reward
    assert {r.weight for r in plain.values() if r.status == "ok"} == {1.0}
    zero = scored(domain_weights={"arithmetic": 0.0})
    assert {r.weight for r in zero.values() if r.domain == "arithmetic"} == {0.0}


def test_stage_reports_the_control_and_replay_reproduces_the_permutation(tmp_path):
    recipe = parse_recipe({"pipeline": "ctl", "domains": ["math", "arithmetic"], "rollout": {"shards": 2},
                           "reward": {"control": "shuffled"}})
    store = Store(str(tmp_path / "store"))
    half = len(ROLLOUTS) // 2
    write_iteration(store, "ctl", 1, [ROLLOUTS[:half], ROLLOUTS[half:]], TASKS)
    contexts = [run_reward(recipe, store, 1, shard) for shard in ("0/2", "1/2")]
    metrics = [store.read_json(f"{c.prefix}/_MANIFEST.json")["metrics"] for c in contexts]
    assert [m["control_shuffled"] for m in metrics] == [1.0, 1.0]
    assert metrics[1]["arithmetic/pass_rate"] == 0.75  # the verifier's pass rate, not the shuffled one
    stored = [r for c in contexts for r in from_table(Reward, store.read_table(c.outputs["rewards"].path))]
    # each shard has its own control_seed: another permutation than score(seed=11)'s
    assert sorted(r.rollout_id for r in stored if r.normalized_reward != r.raw_reward) == sorted(
        f"{t.task_id}-{k}" for t, k in ((M1, 0), (M2, 0), (M2, 1), (M3, 0), (M3, 1), (M3, 3)))
    report = replay(recipe, store, 1)  # same config: the same seeds, the same permutation
    assert report["changed"] == [] and report["advantage_changed"] == 0
    off = replay(parse_recipe({"pipeline": "ctl", "domains": ["math", "arithmetic"], "rollout": {"shards": 2}}), store, 1)
    assert off["changed"] == [] and off["advantage_changed"] > 0


def test_advantage_eps_and_scale_by_std_reach_the_advantages():
    """``reward.advantage_eps`` and ``scale_by_std`` act through the stage's scoring: for
    M1's group [1, 0, 0, 0] (mean 0.25, std sqrt(3)/4) the winner's advantage is
    0.75 / (std + eps), or 0.75 unscaled."""
    std = 3 ** 0.5 / 4
    for reward, expected in [({}, 0.75 / (std + 1e-6)), ({"advantage_eps": 0.5}, 0.75 / (std + 0.5)),
                             ({"scale_by_std": False}, 0.75)]:
        winner = by_task(scored(**reward))[M1.task_id][0]
        assert winner.raw_reward == 1 and winner.advantage == pytest.approx(expected, rel=1e-9), reward
