"""The shared domain machinery: eval sets are fixed, train draws are distinct and disjoint."""

from __future__ import annotations

import random

import pytest

from components.domains import registry


@pytest.mark.parametrize("name", ["arithmetic", "code"])
def test_train_tasks_are_distinct_and_never_in_the_eval_set(name):
    domain = registry.get(name)
    eval_ids = {t.task_id for t in domain.eval_set(100, seed=11)}
    tasks = domain.train_tasks(random.Random(5), 200, exclude=eval_ids)
    ids = [t.task_id for t in tasks]
    assert len(ids) == 200
    assert len(set(ids)) == 200, "a task drawn twice would form two GRPO groups with the same rollout ids"
    assert not set(ids) & eval_ids


FIRST_FIVE = {  # eval_set(50, seed=3): the same in every process (a run's eval set must not move between runs)
    "arithmetic": ["arithmetic-0e0eabb9a907ec2a", "arithmetic-15b0143eefcee482", "arithmetic-f638a465436c035b",
                   "arithmetic-5151d62708168b36", "arithmetic-18cfa8812ecad831"],
    "code": ["code-1fff9cb41f547f34", "code-5beb01be84ff4697", "code-e11bd6e1c86b6f0b", "code-aae5696b56fb2bed",
             "code-76d80d15b640526d"],
}


@pytest.mark.parametrize("name", ["arithmetic", "code"])
def test_eval_set_is_fixed_by_its_seed(name):
    domain = registry.get(name)
    ids = [t.task_id for t in domain.eval_set(50, seed=3)]
    assert (len(ids), len(set(ids))) == (50, 50)
    assert ids[:5] == FIRST_FIVE[name]
    assert ids == [t.task_id for t in domain.eval_set(50, seed=3)]
    assert [t.task_id for t in domain.eval_set(50, seed=3)] != [t.task_id for t in domain.eval_set(50, seed=4)]


def test_asking_for_more_distinct_tasks_than_exist_says_so():
    with pytest.raises(RuntimeError, match="distinct tasks"):
        registry.get("code").eval_set(100_000, seed=1)
