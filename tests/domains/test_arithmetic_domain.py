"""Arithmetic verifier: (completion, reference, expected score) tables."""

from __future__ import annotations

import random

import pytest

from components.domains import registry
from components.domains.base import make_task

DOMAIN = registry.get("arithmetic")
TASK = make_task("arithmetic", "eval", 3, "47+38=", {"answer": "85"})


@pytest.mark.parametrize(
    ("completion", "score", "well_formed"),
    [
        ("85", 1.0, 1.0),
        (" 85 ", 1.0, 1.0),
        ("85\n12", 1.0, 1.0),  # only the first line counts
        ("8 5", 1.0, 1.0),  # spaces inside are ignored
        ("84", 0.0, 1.0),
        ("-85", 0.0, 1.0),
        ("+85", 1.0, 1.0),  # a leading '+', as the math domain reads one (before: not well formed, 0)
        ("+-85", 0.0, 0.0),
        ("++85", 0.0, 0.0),
        ("085", 1.0, 1.0),  # the same integer
        ("85.0", 0.0, 0.0),  # not an integer
        ("eighty-five", 0.0, 0.0),
        ("", 0.0, 0.0),
        ("\n85", 0.0, 0.0),  # the answer must be on the first line
        ("\u0668\u0665", 0.0, 0.0),  # ARABIC-INDIC digits: no number here, as in extraction
        ("\uff18\uff15", 0.0, 0.0),  # FULLWIDTH digits
    ],
)
def test_verify_table(completion, score, well_formed):
    verdict = DOMAIN.verify(TASK, completion, None)
    assert verdict.score == score
    assert verdict.passed is (score == 1.0)
    assert verdict.components == {"exact": score, "well_formed": well_formed}
    assert verdict.status == "ok"


def test_generated_tasks_answer_their_own_prompt():
    for task in DOMAIN.eval_set(60, seed=2):
        a, b = task.prompt[:-1].split("+")
        assert task.reference["answer"] == str(int(a) + int(b))
        assert DOMAIN.verify(task, DOMAIN.reference_completion(task), None).passed
        assert task.difficulty == (1 if len(a) == 1 else 3 if len(b) == 2 else 2)


def test_nothing_runs_in_the_sandbox():
    assert DOMAIN.execution_plan(DOMAIN.make_task(random.Random(0), "train"), "12") is None


def test_trap_tasks_are_the_sums_with_a_carry_that_the_no_carry_shortcut_fails():
    def no_carry(a: int, b: int) -> int:  # the shortcut: add the digits column by column, drop the units carry
        return int(str(a // 10 + b // 10) + str((a % 10 + b % 10) % 10))

    tasks = DOMAIN.eval_set(200, seed=3)
    traps = [t for t in tasks if t.metadata["trap"]]
    assert 40 < len(traps) < 120
    for task in tasks:
        a, b = (int(v) for v in task.prompt.rstrip("=").split("+"))
        shortcut = str(no_carry(a, b)) if task.difficulty > 1 else str(a + b)
        # The shortcut passes exactly the ordinary tasks.
        assert DOMAIN.verify(task, shortcut, None).passed is (not task.metadata["trap"]), task.prompt


@pytest.mark.parametrize("answer", ["\u0668\u0665", "85\n"])
def test_a_reference_answer_is_ascii_and_whole(answer):
    assert DOMAIN.reference_problem({"answer": answer})[0] == "answer"


def test_an_integer_answer_past_100_digits_is_refused():
    """The verifier reads at most 100 digits: a longer integer answer loaded and no completion could match it."""
    problem = ("answer", "must be an integer of at most 100 digits or a string of one (e.g. '85')")
    assert DOMAIN.reference_problem({"answer": 10**100}) == problem
    assert DOMAIN.reference_problem({"answer": -(10**100)}) == problem
    assert DOMAIN.reference_problem({"answer": 10**100 - 1}) is None
    task = make_task("arithmetic", "train", 1, "x=", {"answer": 10**100 - 1})
    assert DOMAIN.verify(task, "9" * 100, None).passed
