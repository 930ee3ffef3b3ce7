"""The eval suite's tasks: more than a domain has distinct is a UserError naming the recipe field."""

from __future__ import annotations

import random

import pytest

from components.core.errors import UserError
from components.core.recipe import parse_recipe
from components.core.records import Task
from components.domains import registry
from components.domains.arithmetic import Arithmetic
from components.domains.base import make_task
from components.evalsuite.suite import eval_tasks


class Few(Arithmetic):
    """Arithmetic with only three distinct tasks."""

    def make_task(self, rng: random.Random, split: str) -> Task:
        a = rng.randint(1, 3)
        return make_task(self.name, split, 1, f"{a}+0=", {"answer": str(a)})


def test_more_eval_tasks_than_a_domain_has_is_a_user_error(monkeypatch):
    """It was the domain's bare RuntimeError: a traceback at the CLI."""
    r = parse_recipe({"pipeline": "few", "seed": 1, "domains": ["arithmetic"], "evaluation": {"tasks_per_domain": 5}})
    monkeypatch.setattr(registry, "get", lambda name: Few())
    with pytest.raises(UserError) as err:
        eval_tasks(r)
    assert (err.value.field, err.value.value, err.value.problem, err.value.fix) == (
        "evaluation.tasks_per_domain", 5, "domain arithmetic gave only 3 distinct eval tasks",
        "ask for fewer tasks of arithmetic (lower tasks_per_domain)")
    assert [t.prompt for t in eval_tasks(r, per_domain=3)] == ["1+0=", "3+0=", "2+0="]
