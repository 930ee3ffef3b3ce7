"""The shared domain machinery: eval sets are fixed, train draws are distinct and disjoint;
``judge`` turns a verdict no record can hold into ``verifier_error``."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import numpy as np
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


def test_a_prompt_that_hides_its_reference_is_one_task_per_reference():
    """An interactive note task's prompt (``new dir named in u``) does not show the name the
    note holds: ids were a digest of the prompt alone, so one id named tasks with different
    references, and since train sampling skipped every eval prompt, an eval set of 200 took
    all 23 note prompts and training never saw a note task."""
    from components.domains.base import HIDDEN_REFERENCE, content_key, exclusion, task_id

    domain = registry.get("terminal-interactive")
    evals = domain.eval_set(200, seed=123)
    assert Counter(t.metadata["kind"] for t in evals) == {"pick": 177, "note": 23}  # one task per prompt, as before
    assert len({t.prompt for t in evals}) == 200
    assert [t.task_id for t in evals[:3]] == ["terminal-interactive-d1392ade1308ef4e",
                                             "terminal-interactive-2b095bdd8a405512",
                                             "terminal-interactive-d64850c022dd942a"]
    assert (evals[1].prompt, evals[1].reference["start"]) == ("new dir named in u\n(has u)\n$ ", {"u": "file:m\n"})
    assert all(t.metadata[HIDDEN_REFERENCE] is True for t in evals)
    assert evals[1].task_id == task_id("terminal-interactive", evals[1].prompt, evals[1].reference)

    train = domain.train_tasks(random.Random(1), 300, exclusion(evals))
    assert Counter(t.metadata["kind"] for t in train) == {"pick": 163, "note": 137}
    assert len({t.task_id for t in train}) == 300
    assert not {content_key(t) for t in train} & {content_key(t) for t in evals}  # none is an eval task
    assert [t.task_id for t in domain.train_tasks(random.Random(1), 300, exclusion(evals))] == [t.task_id for t in train]

    ids: dict[str, str] = {}  # one id per (prompt, reference), and one (prompt, reference) per id
    for seed in range(2000):
        t = domain.make_task(random.Random(seed), "train")
        assert ids.setdefault(t.task_id, content_key(t)) == content_key(t)
    assert len(ids) == len(set(ids.values())) > 1000



@pytest.mark.parametrize("bad_passed", [None, 1, "no", 2.0, np.float64(1)])
def test_a_verdict_whose_passed_is_not_a_bool_is_a_verifier_error(monkeypatch, bad_passed):
    """Only the eval path reads ``passed``: a plugin verifier that returned ``passed=1`` or
    ``None`` trained without complaint, then failed the eval_results write (``ArrowInvalid``)
    or ``pass_rates`` (``TypeError``), or tagged a pass rate of 2.0 on the registry."""
    from components.core.records import EvalResult, to_table
    from components.domains.base import Verdict, judge
    from components.domains.math import Math

    monkeypatch.setattr(Math, "verify", lambda self, t, c, r: Verdict(0.5, bad_passed))
    task = registry.get("math").make_task(random.Random(1), "train")
    verdict = judge(registry.get("math"), task, "1", None)
    assert (verdict.status, verdict.passed, verdict.score) == ("verifier_error", False, 0.0)
    assert verdict.detail == f"verifier returned passed {bad_passed!r:.60}"
    result = EvalResult(task.task_id, "math", task.difficulty, "short", "1", verdict.score, verdict.passed)
    assert to_table([result], EvalResult).column("passed").to_pylist() == [False]


def test_a_numpy_bool_passed_is_a_bool():
    from components.core.records import EvalResult, to_table
    from components.domains.base import Verdict, judge

    for flag in (np.True_, np.False_):
        domain = SimpleNamespace(name="x", verify=lambda t, c, r, f=flag: Verdict(0.5, f, components={"a": 0.5}, detail="d"))
        verdict = judge(domain, None, "ok", None)  # type: ignore[arg-type]
        assert type(verdict.passed) is bool and verdict.passed == bool(flag)
        assert (verdict.status, verdict.score, verdict.components, verdict.detail) == ("ok", 0.5, {"a": 0.5}, "d")
        result = EvalResult("x-1", "x", 1, "short", "1", verdict.score, verdict.passed)
        assert to_table([result], EvalResult).column("passed").to_pylist() == [bool(flag)]


def test_a_long_passed_value_is_cut_in_the_detail():
    from components.domains.base import Verdict, judge

    domain = SimpleNamespace(name="x", verify=lambda t, c, r: Verdict(1.0, "y" * 10_000))
    verdict = judge(domain, None, "ok", None)  # type: ignore[arg-type]
    assert verdict.status == "verifier_error" and len(verdict.detail) == len("verifier returned passed ") + 60
