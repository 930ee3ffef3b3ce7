"""taskgen: curriculum weights by iteration, and sampling from a user's task file."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from components.core.context import RecipeView, StageContext
from components.core.errors import UserError
from components.core.facts import StartingPolicy
from components.core.manifest import Shard
from components.core.recipe import parse_recipe
from components.core.records import Task, from_table
from components.core.storage import Store
from components.domains import registry
from components.domains.arithmetic import Arithmetic
from components.domains.base import make_task
from components.taskgen import stage as taskgen
from tests.taskgen.helpers import starting_checkpoint

BASE = {"pipeline": "cur", "seed": 1, "domains": ["arithmetic", "math", "structured"],
        "evaluation": {"tasks_per_domain": 4}, "taskgen": {"tasks_per_iteration": 20}}


def recipe(**taskgen_cfg):
    return parse_recipe({**BASE, "taskgen": {**BASE["taskgen"], **taskgen_cfg}})


CURRICULUM = [{"until": 2, "weights": {"arithmetic": 1.0}},
              {"until": 4, "weights": {"arithmetic": 1.0, "math": 3.0}}]


@pytest.mark.parametrize(("iteration", "expected"), [
    (1, {"arithmetic": 1.0, "math": 0.0, "structured": 0.0}),
    (2, {"arithmetic": 1.0, "math": 0.0, "structured": 0.0}),
    (3, {"arithmetic": 1.0, "math": 3.0, "structured": 0.0}),
    (5, {"arithmetic": 1.0, "math": 1.0, "structured": 2.0}),  # after the curriculum: domain_weights
])
def test_weights_follow_the_curriculum(iteration, expected):
    r = recipe(curriculum=CURRICULUM, domain_weights={"structured": 2.0})
    assert r.taskgen.weights_for(iteration, r.domains) == expected


def run_taskgen(tmp_path, r, iteration: int) -> list[Task]:
    store = Store(str(tmp_path / "store"))
    ctx = StageContext(stage="taskgen", recipe=RecipeView(r, "taskgen", taskgen.SECTIONS),
                       store=store, iteration=iteration, shard=Shard(0, 1),
                       facts=StartingPolicy(policy_version="1", policy_uri=starting_checkpoint(store)))  # what inputs() resolves
    metrics = taskgen.run(ctx)
    tasks = from_table(Task, ctx.store.read_table(ctx.outputs["tasks"].path))
    assert metrics["tasks"] == 20
    return tasks


def test_taskgen_samples_by_the_curriculum_step(tmp_path):
    r = recipe(curriculum=CURRICULUM)
    assert Counter(t.domain for t in run_taskgen(tmp_path, r, 1)) == {"arithmetic": 20}
    assert Counter(t.domain for t in run_taskgen(tmp_path, r, 3)) == {"arithmetic": 5, "math": 15}


@pytest.mark.parametrize(("curriculum", "field", "problem"), [
    ([{"until": 2, "weights": {"code": 1.0}}], "taskgen.curriculum[0].weights", "not in 'domains'"),
    ([{"until": 2, "weights": {"math": 0.0}}], "taskgen.curriculum[0].weights", "no domain has a positive weight"),
    ([{"until": 3, "weights": {"math": 1.0}}, {"until": 3, "weights": {"math": 1.0}}], "taskgen.curriculum[1].until",
     "not after"),
    ([{"until": 2, "weights": {"math": -1.0}}], "taskgen.curriculum[0].weights.math", "negative weight"),
])
def test_bad_curriculum_is_a_user_error(curriculum, field, problem):
    with pytest.raises(UserError) as err:
        recipe(curriculum=curriculum)
    assert field in err.value.field and problem in err.value.problem


def test_taskgen_samples_from_the_task_file(tmp_path):
    rows = [{"domain": "math", "prompt": f"{i}*2-1=", "reference": {"answer": str(2 * i - 1)}} for i in range(30, 36)]
    rows += [{"domain": "structured", "prompt": "box v8 h2\n", "reference": {"kind": "part", "volume": 8, "height": 2,
                                                                             "max_side": 1000, "solution": [2, 2, 2]}}]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tasks = run_taskgen(tmp_path, recipe(task_file=str(path), domain_weights={"math": 3.0, "arithmetic": 0.0}), 1)
    by = Counter(t.domain for t in tasks)
    assert by == {"math": 15, "structured": 5}  # arithmetic, weight 0, needs no rows in the file
    assert {t.prompt for t in tasks if t.domain == "math"} == {r["prompt"] for r in rows[:6]}  # all 6, then repeats
    assert all(t.split == "train" for t in tasks)
    # A repeat is its own GRPO group: the same task drawn twice had the same id, so its
    # rollout ids collided and the validation gate stopped the iteration.
    assert len({t.task_id for t in tasks}) == 20
    firsts = {t.task_id for t in tasks if "~r" not in t.task_id}
    assert len(firsts) == 7 and all(t.task_id.split("~r")[0] in firsts for t in tasks)
    assert {t.task_id.split("~r")[1] for t in tasks if "~r" in t.task_id} <= {"1", "2", "3", "4", "5"}


def test_task_file_with_a_domain_outside_the_recipe_is_a_user_error(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"domain": "code", "prompt": "f(1)=2\nreturn ", "reference": {"inputs": [1], "expected": [2]}}))
    with pytest.raises(UserError) as err:
        run_taskgen(tmp_path, recipe(task_file=str(path)), 1)
    assert err.value.field == "taskgen.task_file" and "'code'" in err.value.problem


def test_a_task_file_row_that_names_its_own_id_is_still_no_eval_task(tmp_path):
    """Eval-suite tasks were skipped by id only: a row with its own ``task_id`` and an eval
    prompt was trained on. Now the content decides too."""
    from components.evalsuite.suite import eval_tasks

    r = recipe()
    evals = [t for t in eval_tasks(r) if t.domain == "math"]
    rows = [{"task_id": f"mine-{i}", "domain": "math", "prompt": t.prompt, "reference": t.reference}
            for i, t in enumerate(evals)]
    rows += [{"task_id": "mine-new", "domain": "math", "prompt": "31*2-1=", "reference": {"answer": "61"}}]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    tasks = run_taskgen(tmp_path, recipe(task_file=str(path), domain_weights={"arithmetic": 0.0, "structured": 0.0}), 1)
    assert {t.prompt for t in tasks} == {"31*2-1="}  # only the row that is no eval task, drawn 20 times
    assert {t.task_id.split("~r")[0] for t in tasks} == {"mine-new"}


def test_a_domain_that_makes_another_domains_eval_tasks_never_trains_on_them():
    """``terminal`` and ``terminal-interactive`` make the same interactive tasks under
    different ids: with both in a recipe, 13 of 500 train tasks were the other's eval
    tasks. Train sampling now excludes eval prompts whatever their domain, and for an
    interactive task (its prompt hides its reference) the eval prompt with its reference."""
    from components.domains.base import exclusion, prompt_key
    from components.evalsuite.suite import eval_tasks

    r = parse_recipe({"pipeline": "both", "seed": 7, "domains": ["terminal", "terminal-interactive"]})
    evals = eval_tasks(r)
    keys = {prompt_key(t.prompt) for t in evals}
    contents = {(t.prompt, json.dumps(t.reference, sort_keys=True)) for t in evals}
    rng = random.Random(7)
    drawn = [t for name in r.domains for t in registry.get(name).train_tasks(rng, 250, exclusion(evals))]
    assert len(drawn) == 500
    assert not any((t.prompt, json.dumps(t.reference, sort_keys=True)) in contents for t in drawn)
    assert not any(prompt_key(t.prompt) in keys for t in drawn if not t.metadata.get("interactive"))
    assert any(prompt_key(t.prompt) in keys for t in drawn if t.metadata.get("interactive"))  # a note's other names
    old_rule = random.Random(7)  # ids alone: the other domain's copies got through
    leaked = [t for name in r.domains for t in registry.get(name).train_tasks(old_rule, 250, {e.task_id for e in evals})]
    assert any(prompt_key(t.prompt) in keys for t in leaked)


def rows_file(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return str(path)


def math_row(i: int, **extra) -> dict:
    return {"domain": "math", "prompt": f"{i}*2-1=", "reference": {"answer": str(2 * i - 1)}, **extra}


def test_task_file_rows_marked_eval_are_never_trained_on(tmp_path):
    """Every row was rewritten to split "train": rows a user held out were trained on. A
    train row with an eval row's prompt is left out as well, as with the eval suite's."""
    path = rows_file(tmp_path, [math_row(30), math_row(31), math_row(33), math_row(33, task_id="held-1", split="eval"),
                                math_row(34, split="eval")])
    tasks = taskgen.from_file(path, ["math"], {"math": 1.0}, 6, random.Random(0), set())
    assert Counter(t.prompt for t in tasks) == {"30*2-1=": 3, "31*2-1=": 3}
    assert {t.split for t in tasks} == {"train"}


def test_a_task_file_of_eval_rows_only_is_a_user_error(tmp_path):
    path = rows_file(tmp_path, [math_row(30, split="eval"), math_row(31, split="eval")])
    with pytest.raises(UserError) as err:
        taskgen.from_file(path, ["math"], {"math": 1.0}, 6, random.Random(0), set())
    assert (err.value.field, err.value.value, err.value.problem, err.value.fix) == (
        "taskgen.task_file", path, "has split 'eval' on every row (2), and eval rows are never trained on",
        "mark the rows to train on split 'train' (or leave split out)")


def test_a_repeat_never_takes_another_rows_id(tmp_path):
    """Math's only row "a" drawn twice became "a~r1", the id of an arithmetic row: two GRPO
    groups with one id. The repeat's k now skips every id the file holds."""
    path = rows_file(tmp_path, [math_row(30, task_id="a"),
                                {"task_id": "a~r1", "domain": "arithmetic", "prompt": "40+2=", "reference": {"answer": "42"}}])
    tasks = taskgen.from_file(path, ["math", "arithmetic"], {"math": 1.0, "arithmetic": 1.0}, 4, random.Random(0), set())
    assert sorted(t.task_id for t in tasks) == ["a", "a~r1", "a~r1~r1", "a~r2"]
    assert {t.task_id: t.domain for t in tasks}["a~r2"] == "math"


class Few(Arithmetic):
    """Arithmetic with only three distinct tasks."""

    def make_task(self, rng: random.Random, split: str) -> Task:
        a = rng.randint(1, 3)
        return make_task(self.name, split, 1, f"{a}+0=", {"answer": str(a)})


def test_more_tasks_than_a_domain_has_is_a_user_error_naming_the_recipe_field(monkeypatch):
    """It was a bare RuntimeError from the domain: a traceback at the CLI."""
    monkeypatch.setattr(registry, "get", lambda name: Few())
    with pytest.raises(UserError) as err:
        taskgen.generate({"arithmetic": 5}, random.Random(0), set(), None)
    assert (err.value.field, err.value.value, err.value.problem, err.value.fix) == (
        "taskgen.tasks_per_iteration", 5, "domain arithmetic gave only 3 distinct train tasks outside the eval suite",
        "ask for fewer tasks of arithmetic (lower tasks_per_iteration, oversample or its domain weight)")


NO_ROWS_FIX = ("add train rows of domain 'arithmetic' to the file, or give it weight 0 (taskgen.domain_weights or the "
               "curriculum step) or remove it from 'domains'")


def test_a_weighted_domain_without_rows_in_the_task_file_is_a_user_error(tmp_path):
    """Before, its share silently went to the other domains: arithmetic weight 3, math 1,
    and a math-only file gave 40 math tasks (each row 4 times) without a word."""
    path = rows_file(tmp_path, [math_row(i) for i in range(30, 40)])
    with pytest.raises(UserError) as err:
        taskgen.from_file(path, ["math", "arithmetic"], {"math": 1.0, "arithmetic": 3.0}, 40, random.Random(0), set())
    assert (err.value.field, err.value.value, err.value.problem, err.value.fix) == (
        "taskgen.task_file", path, "has no rows of domain 'arithmetic', which has weight 3 in this iteration", NO_ROWS_FIX)


def test_a_domain_of_weight_0_needs_no_rows(tmp_path):
    path = rows_file(tmp_path, [math_row(i) for i in range(30, 40)])
    tasks = taskgen.from_file(path, ["math", "arithmetic"], {"math": 1.0, "arithmetic": 0.0}, 10, random.Random(0), set())
    assert Counter(t.domain for t in tasks) == {"math": 10}


def test_a_weighted_domain_whose_rows_are_all_eval_tasks_is_a_user_error(tmp_path):
    """Rows held out (split "eval") or equal to an eval-suite task are never trained on:
    a domain with only those has no train tasks."""
    arith = {"domain": "arithmetic", "prompt": "40+2=", "reference": {"answer": "42"}}
    path = rows_file(tmp_path, [math_row(30), {**arith, "split": "eval"}])
    with pytest.raises(UserError) as err:
        taskgen.from_file(path, ["math", "arithmetic"], {"math": 1.0, "arithmetic": 1.0}, 4, random.Random(0), set())
    assert err.value.problem == ("has no train tasks of domain 'arithmetic' (its only row is split 'eval' or repeats an "
                                 "eval task's id or prompt), which has weight 1 in this iteration")
    path = rows_file(tmp_path, [math_row(30), arith, {**arith, "prompt": "41+2=", "reference": {"answer": "43"}}])
    from components.domains.base import exclusion
    from components.domains.taskfile import load_tasks

    suite = exclusion([t for t in load_tasks(path) if t.domain == "arithmetic"])  # as if the eval suite held them
    with pytest.raises(UserError) as err:
        taskgen.from_file(path, ["math", "arithmetic"], {"math": 1.0, "arithmetic": 1.0}, 4, random.Random(0), suite)
    assert err.value.problem.startswith("has no train tasks of domain 'arithmetic' (all its 2 rows are split 'eval'")


def test_taskgen_refuses_a_weighted_domain_the_task_file_lacks(tmp_path):
    """Through the stage, with the curriculum's weights of the iteration: arithmetic alone
    in iterations 1-2 (the file has no arithmetic row), math and arithmetic in 3-4."""
    path = rows_file(tmp_path, [math_row(i) for i in range(30, 40)])
    r = recipe(task_file=path, curriculum=[{"until": 2, "weights": {"math": 1.0}},
                                           {"until": 4, "weights": {"arithmetic": 1.0, "math": 3.0}}],
               domain_weights={"arithmetic": 0.0, "structured": 0.0})
    assert Counter(t.domain for t in run_taskgen(tmp_path, r, 2)) == {"math": 20}
    with pytest.raises(UserError) as err:
        run_taskgen(tmp_path, r, 3)
    assert err.value.problem == "has no rows of domain 'arithmetic', which has weight 1 in this iteration"


def test_run_preflight_refuses_a_weighted_domain_the_task_file_lacks(tmp_path, monkeypatch):
    """``posttrain run`` checks the task file before any work: each iteration left to run
    whose weights give a domain without rows is refused then, not at that iteration's
    taskgen; iterations already finished are not checked."""
    from types import SimpleNamespace

    from dags import orchestrate

    monkeypatch.setattr(orchestrate, "preflight", SimpleNamespace(**{name: lambda *a, **k: None for name in (
        "tracking_uri", "tracking_vs_run_root", "task_file", "policy_source", "registry_owner", "registered_here")}))
    path = rows_file(tmp_path, [math_row(i) for i in range(30, 40)])
    r = recipe(task_file=path, curriculum=[{"until": 2, "weights": {"math": 1.0}},
                                           {"until": 4, "weights": {"arithmetic": 1.0, "math": 3.0}}],
               domain_weights={"arithmetic": 0.0, "structured": 0.0})
    store = Store(str(tmp_path / "store"))
    orchestrate.check_before_run(r, store, sandbox_here=False, iterations=2)  # iterations 1-2: math only
    with pytest.raises(UserError) as err:
        orchestrate.check_before_run(r, store, sandbox_here=False, iterations=9)
    assert (err.value.field, err.value.problem, err.value.fix) == (
        "taskgen.task_file", "has no rows of domain 'arithmetic', which has weight 1 in iterations 3-4", NO_ROWS_FIX)
    monkeypatch.setattr(orchestrate, "finished", lambda store, pipeline: [1, 2, 3])
    with pytest.raises(UserError, match="which has weight 1 in iteration 4;"):
        orchestrate.check_before_run(r, store, sandbox_here=False, iterations=9)
    monkeypatch.setattr(orchestrate, "finished", lambda store, pipeline: [1, 2, 3, 4])
    orchestrate.check_before_run(r, store, sandbox_here=False, iterations=9)  # 3-4 finished: 5-9 weigh arithmetic 0
