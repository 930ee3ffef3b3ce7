"""The shared domain machinery: eval sets are fixed, train draws are distinct and disjoint;
``judge`` turns a verdict no record can hold into ``verifier_error``."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from components.domains import registry
from components.domains.arithmetic import Arithmetic


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


@pytest.mark.parametrize(("components", "detail"), [
    ({"a": "yes"}, "verifier returned component 'a' = 'yes', not a finite number"),
    ({"a": None}, "verifier returned component 'a' = None, not a finite number"),
    ({"a": True}, "verifier returned component 'a' = True, not a finite number"),
    ({"a": float("nan")}, "verifier returned component 'a' = nan, not a finite number"),
    ({"a": float("inf")}, "verifier returned component 'a' = inf, not a finite number"),
    ({"x?": 1.0}, "verifier returned component name 'x?': not 1-100 letters, digits, '_', '.', '-' or spaces"),
    ({"a/b": 1.0}, "verifier returned component name 'a/b': not 1-100 letters, digits, '_', '.', '-' or spaces"),
    ({"..": 1.0}, "verifier returned component name '..': not 1-100 letters, digits, '_', '.', '-' or spaces"),
    ({"": 1.0}, "verifier returned component name '': not 1-100 letters, digits, '_', '.', '-' or spaces"),
    ({1: 1.0}, "verifier returned component name 1, not a string"),
    ([("a", 1.0)], "verifier returned components 'list', not a mapping"),
])
def test_components_a_metric_cannot_carry_are_a_verifier_error(components, detail):
    """They were not checked: the reward stage's sums raised TypeError, MLflow refused the
    metric name after the rewards were written (a traceback every retry), and ``posttrain
    verify`` printed ``NaN`` (not JSON) with status ok."""
    from components.domains.base import Verdict, judge

    domain = SimpleNamespace(name="x", verify=lambda t, c, r: Verdict(1.0, True, components=components))
    verdict = judge(domain, None, "ok", None)  # type: ignore[arg-type]
    assert (verdict.status, verdict.score, verdict.passed, verdict.components) == ("verifier_error", 0.0, False, {})
    assert verdict.detail == detail


def test_components_are_made_floats_and_their_names_are_metric_names():
    from mlflow.utils.validation import _validate_metric_name

    from components.domains.base import COMPONENT_NAME, Verdict, judge

    given = {"exact": 1, "well formed": np.float64(0.5), "tests-passed.ratio_2": 0.25}
    domain = SimpleNamespace(name="x", verify=lambda t, c, r: Verdict(1.0, True, components=given))
    verdict = judge(domain, None, "ok", None)  # type: ignore[arg-type]
    assert verdict.status == "ok" and verdict.components == {"exact": 1.0, "well formed": 0.5, "tests-passed.ratio_2": 0.25}
    assert all(type(v) is float for v in verdict.components.values())
    for name in [*given, "a" * 100, "é"]:  # what judge accepts, MLflow logs
        assert COMPONENT_NAME.fullmatch(name)
        _validate_metric_name(f"reward/some-domain/component/{name}")


class _Named(Arithmetic):
    """Arithmetic whose tasks carry a hard-coded name, or are not Tasks."""

    name = "named"
    made = "arithmetic"

    def make_task(self, rng, split):
        task = super().make_task(rng, split)
        return dataclasses.replace(task, domain=self.made) if isinstance(self.made, str) else self.made


@pytest.mark.parametrize(("made", "problem", "fix"), [
    ("arithmetic", f"{__name__}:_Named made a task of domain 'arithmetic'",
     "pass self.name (the name the domain is registered under) to make_task"),
    ({"prompt": "1+1="}, f"{__name__}:_Named.make_task returned 'dict', not a Task",
     "return make_task(self.name, split, ...) (components.domains.base.make_task)"),
])
def test_a_task_not_of_the_domains_registered_name_is_refused(monkeypatch, made, problem, fix):
    """A plug-in class that hard-codes its name (the README's example did) made tasks of a
    domain the recipe never named, refused later as an unknown domain whose fix did not
    help; a make_task returning a dict was an AttributeError traceback."""
    from components.core.errors import UserError

    monkeypatch.setattr(_Named, "made", made)
    from components.taskgen import curriculum

    for make in (lambda d: d.eval_set(2, 0), lambda d: d.train_tasks(random.Random(0), 2, set()),
                 lambda d: d.draw(random.Random(0), "train", set()),
                 lambda d: curriculum.draw(d, random.Random(0), 2, set(), {1: 1.0, 2: 1.0})):  # the adaptive draw
        with pytest.raises(UserError) as info:
            make(_Named())
        assert (info.value.field, info.value.value, info.value.problem, info.value.fix) == ("domain", "named", problem, fix)
    monkeypatch.setattr(_Named, "made", "named")
    assert {t.domain for t in _Named().eval_set(3, 0)} == {"named"}
