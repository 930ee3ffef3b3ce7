"""Dynamic sampling (``trainer.dynamic_sampling``) on a hand-built iteration, then through
a real bootstrap and iteration (trainer on and off) with MLflow.

The hand-built set: 5 arithmetic groups with mixed rewards, 3 arithmetic groups all 0, 1
arithmetic group all 1 among its non-excluded samples (its excluded sample's raw reward
0.0 must not count), 4 code groups with mixed rewards, 2 code groups all 1, and 4 math
groups with mixed rewards but loss weight 0 (every weighted advantage 0). With dynamic
sampling on, the 9 informative groups of weight above 0 fill whole steps of
``prompts_per_step`` and the math groups never train (counted as ``zero_weight``, not
dropped); off, the same 9 groups (a non-zero weighted advantage) are cut into steps, the
last partial.
"""

from __future__ import annotations

from collections import Counter

import mlflow
import pytest
import yaml

from components.core import tracking
from components.core.errors import UserError
from components.core.recipe import parse_recipe
from components.core.records import Reward, Rollout
from components.core.runner import run_stage
from components.core.storage import Store
from components.trainer.grpo import Sample, step_batches
from components.trainer.sampling import collect_groups, select_groups
from tests.fixtures.home import TINY_RECIPE, reset_tracking_clients, use_home

G = 4


def group(task: int, domain: str, raws: list[float], weight: float = 1.0, excluded: tuple[int, ...] = ()):
    """One task's rollouts and rewards; the task number is its prompt token, so a batch's
    samples say which task they came from. Advantages are +-1 around the ok samples' mean
    (0 when those are all equal), as the reward stage gives them."""
    ok = [r for k, r in enumerate(raws) if k not in excluded]
    mean = sum(ok) / len(ok)
    rollouts, rewards = [], []
    for k, raw in enumerate(raws):
        rid = f"t{task:02d}-{k}"
        rollouts.append(Rollout(rid, f"t{task:02d}", domain, k, "1", "hf", "p", "c", [task], [7, 8], [-0.5, -0.5],
                                "stop", 1, 2))
        status = "excluded" if k in excluded else "ok"
        adv = 0.0 if status != "ok" or raw == mean else (1.0 if raw > mean else -1.0)
        rewards.append(Reward(rid, f"t{task:02d}", domain, k, raw, {}, raw, weight if status == "ok" else 0.0, adv, status))
    return rollouts, rewards


SPEC = ([(t, "arithmetic", [1, 0, 1, 0], 1.0, ()) for t in range(5)]
        + [(t, "arithmetic", [0, 0, 0, 0], 1.0, ()) for t in range(5, 8)]
        + [(8, "arithmetic", [1, 0, 1, 1], 1.0, (1,))]
        + [(t, "code", [0, 1, 1, 0], 1.0, ()) for t in range(9, 13)]
        + [(t, "code", [1, 1, 1, 1], 1.0, ()) for t in range(13, 15)]
        + [(t, "math", [1, 0, 0, 1], 0.0, ()) for t in range(15, 19)])
INFORMATIVE = set(range(5)) | set(range(9, 13))  # of a domain whose loss weight is above 0
DOMAIN = {t: d for t, d, *_ in SPEC}


def iteration() -> tuple[list[Rollout], list[Reward]]:
    rollouts, rewards = [], []
    for task, domain, raws, weight, excluded in SPEC:
        ro, rw = group(task, domain, raws, weight, excluded)
        rollouts += ro
        rewards += rw
    return rollouts, rewards


def tasks_of(batch: list[Sample]) -> list[int]:
    """The tasks of a step's groups, each once, in order."""
    seen: list[int] = []
    for s in batch:
        if s.prompt_ids[0] not in seen:
            seen.append(s.prompt_ids[0])
    return seen


def select(dynamic: bool, tasks_per_iteration: int = 8, prompts_per_step: int = 4, seed: int = 11):
    selection = select_groups(collect_groups(*iteration()), dynamic=dynamic, prompts_per_step=prompts_per_step,
                              target_steps=tasks_per_iteration // prompts_per_step, seed=seed)
    return selection, step_batches(selection.groups, prompts_per_step, 1, seed)


def test_dynamic_sampling_fills_every_step_with_informative_groups() -> None:
    selection, batches = select(dynamic=True)
    assert len(batches) == 2  # tasks_per_iteration // prompts_per_step: 8 // 4
    steps = [tasks_of(b) for b in batches]
    assert [len(s) for s in steps] == [4, 4] and all(len(b) == 4 * G for b in batches)
    trained = [t for s in steps for t in s]
    assert len(set(trained)) == 8 and set(trained) <= INFORMATIVE  # none all-equal, none of math (weight 0)
    kept = Counter(DOMAIN[t] for t in trained)
    assert selection.kept == {"arithmetic": kept["arithmetic"], "code": kept["code"], "math": 0}
    assert selection.dropped == {"arithmetic": 4, "code": 2, "math": 0}
    assert selection.zero_weight == {"arithmetic": 0, "code": 0, "math": 4}
    assert selection.unused == 1  # 9 informative groups of weight above 0, 8 trained
    assert selection.metrics() == {
        "groups_kept": 8.0, "groups_dropped": 6.0, "groups_zero_weight": 4.0, "groups_unused": 1.0,
        "arithmetic/groups_kept": float(kept["arithmetic"]), "arithmetic/groups_dropped": 4.0,
        "arithmetic/groups_zero_weight": 0.0,
        "code/groups_kept": float(kept["code"]), "code/groups_dropped": 2.0, "code/groups_zero_weight": 0.0,
        "math/groups_kept": 0.0, "math/groups_dropped": 0.0, "math/groups_zero_weight": 4.0}


def test_groups_of_a_weight_zero_domain_take_no_step_slot() -> None:
    """Before, the 4 math groups (rewards differ, loss weight 0) counted as informative:
    with 4 per step they filled a step of their own, whose every advantage was 0 (yet it
    moved the weights through carried Adam moments), and elsewhere shared steps and the
    loss denominators with groups that train."""
    selection, batches = select(dynamic=True, tasks_per_iteration=16)  # aims at 4 steps: 9 groups of weight > 0 fill 2
    assert len(batches) == 2 and not {t for b in batches for t in tasks_of(b)} - INFORMATIVE
    assert all(s.advantage != 0 for b in batches for s in b)  # +-1 each: no sample of a weight-0 group
    assert (selection.kept["math"], selection.zero_weight["math"], selection.unused) == (0, 4, 1)


def test_too_few_informative_groups_give_fewer_whole_steps() -> None:
    selection, batches = select(dynamic=True, tasks_per_iteration=16)  # aims at 4 steps; 9 groups fill 2
    assert [len(tasks_of(b)) for b in batches] == [4, 4]
    assert (sum(selection.kept.values()), selection.unused) == (8, 1)
    selection, batches = select(dynamic=True, tasks_per_iteration=16, prompts_per_step=5)
    assert [len(tasks_of(b)) for b in batches] == [5] and selection.unused == 4


def test_the_seeded_shuffle_picks_the_surplus_left_out() -> None:
    left_out = set()
    for seed in range(12):
        selection, batches = select(dynamic=True, seed=seed)
        trained = {t for b in batches for t in tasks_of(b)}
        assert len(trained) == 8 and trained <= INFORMATIVE
        left_out |= INFORMATIVE - trained
    assert {DOMAIN[t] for t in left_out} == {"arithmetic", "code"}  # task order favours no domain
    again, batches = select(dynamic=True, seed=3)
    assert again == select(dynamic=True, seed=3)[0]


def test_without_dynamic_sampling_groups_with_signal_train_and_the_last_step_is_partial() -> None:
    selection, batches = select(dynamic=False)
    steps = [tasks_of(b) for b in batches]
    assert [len(s) for s in steps] == [4, 4, 1]
    assert sorted(t for s in steps for t in s) == [0, 1, 2, 3, 4, 9, 10, 11, 12]  # no group of math (weight 0)
    assert selection.kept == {"arithmetic": 5, "code": 4, "math": 0}
    assert selection.dropped == {"arithmetic": 4, "code": 2, "math": 0}
    assert selection.zero_weight == {"arithmetic": 0, "code": 0, "math": 4}  # counted apart here too
    assert selection.unused == 0
    assert selection.metrics()["groups_dropped"] == 6.0 and selection.metrics()["groups_zero_weight"] == 4.0


def test_prompts_per_step_beyond_the_iteration_is_refused() -> None:
    """Refused when the recipe is parsed (before, only when the trainer stage started,
    after every earlier stage of the iteration had run)."""
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["trainer"] = {**data["trainer"], "dynamic_sampling": True, "prompts_per_step": 9}
    with pytest.raises(UserError) as info:
        parse_recipe(data)
    assert (info.value.field, info.value.value) == ("<recipe>: trainer.prompts_per_step", 9)
    assert info.value.problem == "is more than taskgen.tasks_per_iteration (8), so dynamic sampling would never fill a step"
    assert info.value.fix == "set trainer.prompts_per_step to at most 8, or trainer.dynamic_sampling to false"
    data["trainer"]["prompts_per_step"] = 8
    assert parse_recipe(data).trainer.prompts_per_step == 8
    data["trainer"] = {**data["trainer"], "dynamic_sampling": False, "prompts_per_step": 9}  # a partial step
    assert parse_recipe(data).trainer.prompts_per_step == 9


def recipe(dynamic: bool):
    """recipes/tiny.yaml with a policy that solves some tasks sometimes (a wider model, 400
    SFT steps), 8 tasks per iteration drawn 8 times over, 8 samples per task, and
    arithmetic's loss weight 0 (its groups rarely differ; code's often do, so code fills
    the steps and some arithmetic group still has differing rewards)."""
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["model"] = {**data["model"], "hidden_size": 64, "num_layers": 2, "intermediate_size": 128, "max_positions": 96}
    data["bootstrap"] = {**data["bootstrap"], "max_steps": 400, "eval_every": 100}
    data["taskgen"] = {"tasks_per_iteration": 8, "oversample": 8.0}
    data["rollout"] = {**data["rollout"], "group_size": 8}
    data["reward"] = {"domain_weights": {"arithmetic": 0.0}}
    data["trainer"] = {**data["trainer"], "prompts_per_step": 4, "dynamic_sampling": dynamic}
    return parse_recipe(data)


UPSTREAM = [("taskgen", None), ("rollout", "0/2"), ("rollout", "1/2"), ("sandbox", "0/2"), ("sandbox", "1/2"),
            ("reward", "0/2"), ("reward", "1/2"), ("validation", None)]
TASKS = 64  # 8 x 8


def test_the_trainer_stage_trains_on_informative_groups_and_logs_the_counts_to_mlflow(tmp_path) -> None:
    root = f"file://{tmp_path / 'store'}"
    with pytest.MonkeyPatch.context() as mp:
        use_home(mp, tmp_path / ".posttrain")
        run_stage("bootstrap", recipe(False), root, 0)
        for stage, shard in UPSTREAM:
            run_stage(stage, recipe(False), root, 1, shard)
        store = Store(root)
        by_task: dict[str, list[dict]] = {}
        for path in store.glob("tiny/iter-000001/reward/**/rewards.parquet"):
            for r in store.read_table(path).to_pylist():
                by_task.setdefault(r["task_id"], []).append(r)
        on = run_stage("trainer", recipe(True), root, 1)  # the upstream stages hit their cache
        off = run_stage("trainer", recipe(False), root, 1)
        client = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri())  # the home's SQLite store
        logged = {(run, name): [m.value for m in client.get_metric_history(manifest.mlflow_run_id, f"trainer/{name}")]
                  for run, manifest in (("on", on), ("off", off))
                  for name in ("groups_dropped", "groups_kept", "groups_unused", "groups_zero_weight",
                               "arithmetic/groups_kept", "arithmetic/groups_zero_weight")}
        reset_tracking_clients()
    domain = {t: rs[0]["domain"] for t, rs in by_task.items()}
    informative = {t for t, rs in by_task.items() if len({r["raw_reward"] for r in rs if r["status"] == "ok"}) > 1}
    signal = {t for t, rs in by_task.items() if any(r["advantage"] * r["weight"] != 0 for r in rs)}
    zero = {t for t in informative if domain[t] == "arithmetic"}  # rewards differ, loss weight 0
    trainable = informative - zero
    assert len(by_task) == TASKS and len(trainable) > 8  # some surplus to leave unused
    assert {domain[t] for t in signal} == {"code"}  # arithmetic's weight 0: no arithmetic group has signal off
    assert zero  # some arithmetic group's rewards differ: counted as zero_weight, neither kept nor dropped
    steps = 2  # tasks_per_iteration // prompts_per_step
    assert on.metrics["trainer/steps"] == steps and on.metrics["trainer/groups_kept"] == 4 * steps
    assert logged["on", "groups_dropped"] == [TASKS - len(informative)]
    assert logged["on", "groups_unused"] == [float(len(trainable) - 4 * steps)]
    for d in ("arithmetic", "code"):
        assert on.metrics[f"trainer/{d}/groups_dropped"] == sum(domain[t] == d for t in by_task if t not in informative)
    # A loss weight of 0 is not trained on (as if arithmetic were left out) nor taken for no signal.
    assert logged["on", "arithmetic/groups_kept"] == [0.0]
    assert logged["on", "arithmetic/groups_zero_weight"] == logged["on", "groups_zero_weight"] == [float(len(zero))]
    # Off: every group with signal (the last step partial when their count is not a multiple
    # of 4: how many there are depends on the bootstrap, whose floats vary by CPU), no arithmetic group.
    assert off.metrics["trainer/steps"] == -(-len(signal) // 4)
    assert logged["off", "groups_kept"] == [float(len(signal))] and logged["off", "arithmetic/groups_kept"] == [0.0]
    assert logged["off", "groups_dropped"] == [TASKS - len(signal) - len(zero)]
    assert logged["off", "groups_unused"] == [0.0] and logged["off", "groups_zero_weight"] == [float(len(zero))]


def test_under_the_shuffled_control_groups_are_judged_by_the_rewards_they_train_on() -> None:
    """``reward.control: shuffled`` keeps the true score in ``raw_reward`` and trains on the
    shuffled one (``normalized_reward``): a group whose true scores are all 1 but whose
    shuffled ones differ is informative, and one whose true scores differ but whose
    shuffled ones are all equal is dropped, so the control never sees the true rewards."""
    rollouts, rewards = [], []
    for task, true, shuffled in ((0, [1, 1, 1, 1], [1, 0, 1, 0]), (1, [1, 0, 1, 0], [1, 1, 1, 1])):
        ro, rw = group(task, "arithmetic", shuffled)
        rollouts += ro
        rewards += [Reward(r.rollout_id, r.task_id, r.domain, r.group_index, t, {}, s, r.weight, r.advantage, r.status)
                    for r, t, s in zip(rw, true, shuffled)]
    selection = select_groups(collect_groups(rollouts, rewards), dynamic=True, target_steps=1, prompts_per_step=1, seed=3)
    assert [s.prompt_ids for s in selection.groups[0]] == [[0]] * G
    assert (selection.kept, selection.dropped) == ({"arithmetic": 1}, {"arithmetic": 1})
