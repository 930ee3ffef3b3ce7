"""Per-domain z-score normalisation with running stats persisted across iterations and shards."""

from __future__ import annotations

import math

import pytest

from components.core.recipe import parse_recipe
from components.core.records import Reward, from_table
from components.core.storage import Store
from components.reward.normalize import RunningStats, merge_all
from tests.reward.builders import math_task, rollout, run_reward, write_iteration

A = math_task("3*4-5=", "7")
B = math_task("2+3*4=", "14")


def recipe(normalize: str = "domain_zscore"):
    return parse_recipe({"pipeline": "norm", "domains": ["math"], "rollout": {"shards": 2},
                         "reward": {"normalize": normalize}})


def rewards_of(ctx) -> list[Reward]:
    return from_table(Reward, ctx.store.read_table(ctx.outputs["rewards"].path))


def test_running_stats_merge_exactly():
    left, right = RunningStats.of([1.0, 0.0, 1.0]), RunningStats.of([1.0, 0.0, 0.0, 0.0, 1.0])
    both = RunningStats.of([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    merged = left.merge(right)
    assert merged.count == 8 and merged.mean == pytest.approx(both.mean) and merged.m2 == pytest.approx(both.m2)
    assert merge_all({"m": left}, {}, {"m": right})["m"] == merged


def test_stats_survive_a_restart_and_next_iteration_reads_them(tmp_path):
    r = recipe()
    root = str(tmp_path / "store")
    store = Store(root)
    # iteration 1: shard 0 scores [1,0,1,1], shard 1 scores [0,0,1,0] (math, raw 0/1)
    write_iteration(store, "norm", 1, [[rollout(A, i, c) for i, c in enumerate(["7", "8", "7", "7"])],
                                       [rollout(B, i, c) for i, c in enumerate(["20", "20", "14", "x"])]], [A, B])
    first = run_reward(r, store, 1, "0/2")
    run_reward(r, store, 1, "1/2")
    assert first.facts.norm_prior_iteration == 0
    # shard 0 of iteration 1 normalises with its own batch only: mean .75, std sqrt(.1875)
    assert [x.normalized_reward for x in rewards_of(first)] == pytest.approx(
        [(v - 0.75) / (math.sqrt(0.1875) + 1e-6) for v in (1, 0, 1, 1)])

    # "restart": a new process would hold nothing but the store; build everything afresh from the URI
    store2 = Store(root)
    write_iteration(store2, "norm", 2, [[rollout(A, i, "7") for i in range(4)], [rollout(B, i, "14") for i in range(4)]],
                    [A, B])
    second = run_reward(recipe(), store2, 2, "0/2")
    stats = store2.read_json(second.outputs["norm_stats"].path)
    assert stats["prior_iteration"] == 1
    assert stats["prior"] == {"math": {"count": 8, "mean": 0.5, "m2": 2.0}}  # both shards of iteration 1
    assert stats["batch"] == {"math": {"count": 4, "mean": 1.0, "m2": 0.0}}
    assert {"reward_stats[iter-1][0/2]", "reward_stats[iter-1][1/2]"} <= set(second.inputs)
    # running after the batch: n 12, mean 2/3, m2 2 + .25*8*4/12 -> std sqrt((8/3)/12)
    std = math.sqrt((2 + 0.25 * 8 * 4 / 12) / 12)
    got = rewards_of(second)
    assert [x.normalized_reward for x in got] == pytest.approx([(1 - 2 / 3) / (std + 1e-6)] * 4)
    assert [x.advantage for x in got] == [0.0] * 4  # all equal inside the group
    assert second.outputs["norm_stats"].path.endswith("iter-000002/reward/shard-00000-of-00002/norm_stats.json")


def test_normalize_none_keeps_raw_but_still_records_stats(tmp_path):
    store = Store(str(tmp_path / "store"))
    write_iteration(store, "norm", 1, [[rollout(A, i, c) for i, c in enumerate(["7", "8", "7", "7"])], []], [A])
    ctx = run_reward(recipe("none"), store, 1, "0/2")
    got = rewards_of(ctx)
    assert [x.normalized_reward for x in got] == [1.0, 0.0, 1.0, 1.0]
    assert [x.advantage for x in got] == pytest.approx([0.57735, -1.73205, 0.57735, 0.57735], abs=1e-4)
    assert store.read_json(ctx.outputs["norm_stats"].path)["batch"] == {"math": {"count": 4, "mean": 0.75, "m2": 0.75}}


def test_a_half_finished_previous_iteration_is_a_user_error(tmp_path):
    from components.core.errors import UserError

    store = Store(str(tmp_path / "store"))
    write_iteration(store, "norm", 1, [[rollout(A, 0, "7"), rollout(A, 1, "8")], [rollout(B, 0, "14")]], [A, B])
    run_reward(recipe(), store, 1, "0/2")  # shard 1/2 of iteration 1 never finished
    write_iteration(store, "norm", 2, [[rollout(A, 0, "7")], [rollout(B, 0, "14")]], [A, B])
    with pytest.raises(UserError) as err:
        run_reward(recipe(), store, 2, "0/2")
    assert err.value.field == "stage reward" and "['1/2']" in err.value.fix


@pytest.mark.parametrize("value", [0.1, 1 / 3, 2 / 3, 0.7, 0.9])
@pytest.mark.parametrize("size", [3, 8, 16])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_a_group_of_equal_rewards_has_advantages_of_exactly_zero(value, size, scale_by_std):
    """The mean of eight 0.7s is not 0.7 in floats: each advantage came out near -1e-10,
    not 0, so the trainer without dynamic sampling kept such groups as having signal."""
    from components.reward.advantages import group_advantages

    assert group_advantages([value] * size + [None], 1e-6, scale_by_std) == [0.0] * (size + 1)
    assert group_advantages([value] * (size - 1) + [1.0], 1e-6, scale_by_std)[-1] > 0
