"""taskgen: oversampling, and difficulty pools weighted by their blended pass rate across iterations."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import pytest

from components.core.context import RecipeView, StageContext
from components.core.errors import UserError
from components.core.facts import StartingPolicy, to_json
from components.core.manifest import MANIFEST, Manifest, Shard
from components.core.recipe import parse_recipe
from components.core.records import Reward, Task, from_table
from components.core.storage import Store
from components.domains import registry
from components.domains.arithmetic import Arithmetic
from components.domains.base import make_task
from components.taskgen import curriculum
from components.taskgen import stage as taskgen
from tests.reward.builders import write_stage
from tests.taskgen.helpers import starting_checkpoint

W_EDGE = {1: 0.05 / 1.1, 2: 1.0 / 1.1, 3: 0.05 / 1.1}  # pass rates 1.0 / 0.5 / 0.0, floor 0.05


# -- the rule ------------------------------------------------------------------------------
@pytest.mark.parametrize(("p", "weight"), [(None, 1.0), (0.5, 1.0), (0.25, 0.75), (0.9, 0.36), (1.0, 0.05),
                                           (0.0, 0.05), (0.99, 0.05)])
def test_pool_weight_peaks_at_half_and_keeps_the_floor(p, weight):
    assert curriculum.pool_weight(p, 0.05) == pytest.approx(weight)


def test_pool_weights_are_normalised_within_the_domain():
    assert curriculum.pool_weights((1, 2, 3), {1: 1.0, 2: 0.5, 3: 0.0}, 0.05) == pytest.approx(W_EDGE)
    assert curriculum.pool_weights((1, 2, 3), {}, 0.05) == pytest.approx({1: 1 / 3, 2: 1 / 3, 3: 1 / 3})
    # a pool with no estimate yet (a new difficulty) weighs as much as one at 50%
    assert curriculum.pool_weights((1, 2, 4), {1: 0.25, 2: 1.0}, 0.1) == pytest.approx(
        {1: 0.75 / 1.85, 2: 0.1 / 1.85, 4: 1.0 / 1.85})


def test_blend_across_two_iterations():
    first = curriculum.blend({}, {"math": {1: (3, 4), 2: (0, 4)}}, memory=0.5)
    assert first == {"math": {1: 0.75, 2: 0.0}}  # no earlier estimate: the latest alone
    second = curriculum.blend(first, {"math": {1: (1, 4), 3: (2, 4)}, "code": {2: (0, 0)}}, memory=0.5)
    # d1: .5*.75 + .5*.25; d2 not scored again: kept; d3 new: its latest; an empty pool adds nothing
    assert second == {"math": {1: 0.5, 2: 0.0, 3: 0.5}}
    assert curriculum.blend(first, {"math": {1: (0, 4)}}, memory=0.8)["math"][1] == pytest.approx(0.6)


def reward(task: Task, i: int, raw: float, status: str = "ok") -> Reward:
    return Reward(rollout_id=f"{task.task_id}-{i}", task_id=task.task_id, domain=task.domain, group_index=i,
                  raw_reward=raw, components={}, normalized_reward=raw, weight=1.0, advantage=0.0,
                  status=status)  # type: ignore[arg-type]


def test_tally_counts_ok_passes_per_difficulty():
    easy = make_task("math", "train", 1, "2*3+1=", {"answer": "7"})
    hard = make_task("math", "train", 3, "1/2+1/3=", {"answer": "5/6"})
    rewards = [reward(easy, 0, 1.0), reward(easy, 1, 0.5), reward(hard, 0, 0.0), reward(hard, 1, 1.0, "excluded"),
               reward(hard, 2, 1.0, "verifier_error")]
    assert curriculum.tally(rewards, [easy, hard]) == {"math": {1: (1, 2), 3: (0, 1)}}


# -- pools and drawing with the real domains -------------------------------------------------
class Leveled(Arithmetic):
    """Arithmetic that also generates a difficulty 4, to show pools are discovered."""

    name = "leveled"

    def make_task(self, rng: random.Random, split: str) -> Task:
        task = super().make_task(rng, split)
        return dataclasses.replace(task, difficulty=4) if task.difficulty == 3 and rng.random() < 0.3 else task


def test_pools_are_discovered_from_what_a_domain_generates():
    assert curriculum.pools(registry.get("math")) == (1, 2, 3)
    assert curriculum.pools(registry.get("structured")) == (1, 2)
    assert curriculum.pools(Leveled()) == (1, 2, 3, 4)


def test_adaptive_draw_moves_the_mix_to_the_pool_near_half():
    math = registry.get("math")
    exclude = {t.task_id for t in math.eval_set(20, seed=7)}
    own = Counter(t.difficulty for t in math.train_tasks(random.Random(3), 60, exclude))
    tasks = curriculum.draw(math, random.Random(3), 60, exclude, W_EDGE)
    assert Counter(t.difficulty for t in tasks) == {1: 3, 2: 54, 3: 3}  # 60 * W_EDGE, largest remainder
    assert own[2] < 30  # the domain's own mix is about a third each
    assert len({t.task_id for t in tasks}) == 60 and not exclude & {t.task_id for t in tasks}


def test_an_exhausted_pool_hands_its_share_to_the_others():
    # arithmetic difficulty 1 is a+b with single digits: exactly 100 distinct tasks
    tasks = curriculum.draw(registry.get("arithmetic"), random.Random(0), 150, set(), {1: 0.98, 2: 0.01, 3: 0.01})
    by = Counter(t.difficulty for t in tasks)
    assert by[1] == 100 and by[2] + by[3] == 50 and len({t.task_id for t in tasks}) == 150


class Tiny(Arithmetic):
    name = "tiny"

    def make_task(self, rng: random.Random, split: str) -> Task:
        a = rng.randint(1, 3)
        return make_task(self.name, split, 1, f"{a}+0=", {"answer": str(a)})


def test_a_domain_with_too_few_tasks_is_a_user_error():
    with pytest.raises(UserError) as err:
        curriculum.draw(Tiny(), random.Random(0), 5, set(), {1: 1.0})
    assert err.value.field == "taskgen.tasks_per_iteration" and "only 3 distinct" in err.value.problem


# -- the stage ---------------------------------------------------------------------------
def recipe(**taskgen_cfg):
    return parse_recipe({"pipeline": "adapt", "seed": 1, "domains": ["math"], "evaluation": {"tasks_per_domain": 4},
                         "taskgen": {"tasks_per_iteration": 30, **taskgen_cfg}})


def run_taskgen(store: Store, r, k: int) -> tuple[StageContext, dict[str, float], list[Task]]:
    """taskgen as the runner runs it (inputs' policy resolution aside), manifest last."""
    ctx = StageContext(stage="taskgen", recipe=RecipeView(r, "taskgen", taskgen.SECTIONS), store=store, iteration=k,
                       shard=Shard(0, 1), facts=StartingPolicy(policy_version="1", policy_uri=starting_checkpoint(store)))
    metrics = taskgen.run(ctx)
    m = Manifest(stage="taskgen", pipeline=r.pipeline, iteration=k, shard=None, inputs=dict(ctx.inputs),
                 config_digest="test", code_version="test", outputs=dict(ctx.outputs), metrics=metrics,
                 info=to_json(ctx.facts))
    store.write_json(f"{ctx.prefix}/{MANIFEST}", m.to_json())
    return ctx, metrics, from_table(Task, store.read_table(ctx.outputs["tasks"].path))


def score(store: Store, k: int, tasks: list[Task], pass_rate: dict[int, float]) -> None:
    """Iteration k's reward output: 4 samples per task, round(4 * rate) of them passing,
    plus one excluded sample that must not count."""
    rows = [reward(t, i, 1.0 if i < round(4 * pass_rate[t.difficulty]) else 0.0) for t in tasks for i in range(4)]
    rows.append(reward(tasks[0], 4, 1.0, "excluded"))
    write_stage(store, "adapt", k, "reward", Shard(0, 1), {"rewards": (rows, Reward)})


def test_oversample_draws_more_tasks_split_by_domain_weight(tmp_path):
    r = parse_recipe({"pipeline": "over", "seed": 1, "domains": ["arithmetic", "math", "structured"],
                      "evaluation": {"tasks_per_domain": 4},
                      "taskgen": {"tasks_per_iteration": 20, "oversample": 1.5, "domain_weights": {"math": 4.0}}})
    _, metrics, tasks = run_taskgen(Store(str(tmp_path / "store")), r, 1)
    assert metrics["tasks"] == 30 and Counter(t.domain for t in tasks) == {"arithmetic": 5, "math": 20, "structured": 5}


def test_adaptive_difficulty_persists_across_iterations(tmp_path):
    store = Store(str(tmp_path / "store"))
    r = recipe(adaptive_difficulty=True, difficulty_memory=0.5, difficulty_floor=0.05)
    ctx1, m1, tasks1 = run_taskgen(store, r, 1)
    state1 = store.read_json(ctx1.outputs["curriculum"].path)
    assert state1["after_iteration"] == 0 and state1["pass_rates"] == {}
    assert state1["weights"] == {"math": {"1": pytest.approx(1 / 3), "2": pytest.approx(1 / 3), "3": pytest.approx(1 / 3)}}
    assert Counter(t.difficulty for t in tasks1) == {1: 10, 2: 10, 3: 10}  # before any data: all pools equal
    assert m1["curriculum/math/d2"] == pytest.approx(1 / 3) and "curriculum/math/d2/pass_rate" not in m1

    score(store, 1, tasks1, {1: 1.0, 2: 0.5, 3: 0.0})
    ctx2, m2, tasks2 = run_taskgen(store, r, 2)
    state2 = store.read_json(ctx2.outputs["curriculum"].path)
    assert state2["after_iteration"] == 1
    assert state2["latest"] == {"math": {"1": [40, 40], "2": [20, 40], "3": [0, 40]}}
    assert state2["pass_rates"] == {"math": {"1": 1.0, "2": 0.5, "3": 0.0}}
    assert Counter(t.difficulty for t in tasks2) == {1: 2, 2: 27, 3: 1}  # 30 * W_EDGE, largest remainder
    assert m2["curriculum/math/d2"] == pytest.approx(1 / 1.1) and m2["curriculum/math/d3/pass_rate"] == 0.0
    assert m2["curriculum/math/d2/tasks"] == 27.0
    assert {"curriculum_rewards[iter-1][0/1]", "curriculum_tasks[iter-1]"} <= set(ctx2.inputs)

    score(store, 2, tasks2, {1: 1.0, 2: 1.0, 3: 1.0})
    _, m3, _ = run_taskgen(store, r, 3)  # iteration 3 never reaches the reward stage
    state4 = store.read_json(run_taskgen(store, r, 4)[0].outputs["curriculum"].path)
    assert state4["after_iteration"] == 2  # iteration 3 skipped
    # blended with taskgen 2's estimate: d1 1.0, d2 .5*.5 + .5*1, d3 .5*0 + .5*1
    assert state4["pass_rates"] == {"math": {"1": 1.0, "2": 0.75, "3": 0.5}}
    assert m3["curriculum/math/d3/pass_rate"] == 0.5


def test_adaptive_difficulty_off_keeps_the_domain_mix(tmp_path):
    store = Store(str(tmp_path / "store"))
    _, _, tasks1 = run_taskgen(store, recipe(adaptive_difficulty=True), 1)
    score(store, 1, tasks1, {1: 1.0, 2: 0.5, 3: 0.0})
    off_ctx, off_metrics, off = run_taskgen(store, recipe(), 2)
    assert "curriculum" not in off_ctx.outputs and not off_ctx.inputs
    assert Counter(t.difficulty for t in off)[2] < 15 and "curriculum/math/d2" not in off_metrics
    assert off_metrics["curriculum/math/d2/tasks"] == float(Counter(t.difficulty for t in off)[2])


def test_half_scored_previous_iteration_is_a_user_error(tmp_path):
    store = Store(str(tmp_path / "store"))
    r = recipe(adaptive_difficulty=True)
    _, _, tasks1 = run_taskgen(store, r, 1)
    write_stage(store, "adapt", 1, "reward", Shard(0, 2), {"rewards": ([reward(tasks1[0], 0, 1.0)], Reward)})
    with pytest.raises(UserError) as err:
        run_taskgen(store, r, 2)
    assert "only shards ['0/2'] of 2" in err.value.problem


def test_adaptive_difficulty_weighs_a_task_files_difficulties(tmp_path):
    rows = [{"domain": "math", "prompt": f"{i}*2-1=", "reference": {"answer": str(2 * i - 1)}, "difficulty": 1 + i % 2}
            for i in range(30, 50)]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    store = Store(str(tmp_path / "store"))
    r = recipe(adaptive_difficulty=True, task_file=str(path), tasks_per_iteration=20)
    _, _, tasks1 = run_taskgen(store, r, 1)
    assert Counter(t.difficulty for t in tasks1) == {1: 10, 2: 10}  # the file's two pools, equal before any data
    score(store, 1, tasks1, {1: 1.0, 2: 0.5})
    ctx2, _, tasks2 = run_taskgen(store, r, 2)
    assert Counter(t.difficulty for t in tasks2) == {1: 1, 2: 19}  # weights .05/1.05 and 1/1.05
    hard = [t.task_id for t in tasks2 if t.difficulty == 2]
    assert len({i.split("~r")[0] for i in hard}) == 10 and len(set(hard)) == 19  # all 10 rows, then repeats of their own ids
    assert store.read_json(ctx2.outputs["curriculum"].path)["weights"] == {
        "math": {"1": pytest.approx(0.05 / 1.05), "2": pytest.approx(1 / 1.05)}}
