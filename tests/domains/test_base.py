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


@pytest.mark.parametrize("name", ["arithmetic", "code"])
def test_eval_set_is_fixed_by_its_seed(name):
    domain = registry.get(name)
    assert [t.task_id for t in domain.eval_set(50, seed=3)] == [t.task_id for t in domain.eval_set(50, seed=3)]
    assert [t.task_id for t in domain.eval_set(50, seed=3)] != [t.task_id for t in domain.eval_set(50, seed=4)]


def test_asking_for_more_distinct_tasks_than_exist_says_so():
    with pytest.raises(RuntimeError, match="distinct tasks"):
        registry.get("code").eval_set(100_000, seed=1)
