"""math domain: normalised numeric answers, precedence traps, malformed completions."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from components.domains import registry
from components.domains.base import make_task
from components.domains.math import terminates

MATH = registry.get("math")


def task(prompt: str, answer: str, trap: bool = False):
    return make_task("math", "train", 1, prompt, {"answer": answer}, trap=trap)


@pytest.mark.parametrize(("prompt", "answer", "completion", "score"), [
    ("3*4-5=", "7", "7", 1.0),
    ("3*4-5=", "7", " 7 \nextra", 1.0),
    ("3*4-5=", "7", "7.0", 1.0),
    ("3*4-5=", "7", "14/2", 1.0),
    ("3*4-5=", "7", "8", 0.0),
    ("1/2+1/4=", "3/4", "3/4", 1.0),
    ("1/2+1/4=", "3/4", "0.75", 1.0),
    ("1/2+1/4=", "3/4", ".75", 1.0),
    ("1/2+1/4=", "3/4", "6/8", 1.0),
    ("1/2+1/4=", "3/4", "0.7", 0.0),
    ("1/2+1/4=", "3/4", "2/6", 0.0),  # adding numerators and denominators
    ("1/3+0/1=", "1/3", "0.333", 1.0),  # rounded at >= 2 places
    ("1/3+0/1=", "1/3", "0.3", 0.0),  # one place is too coarse
    ("1/3+0/1=", "1/3", "0.334", 0.0),  # not the rounding of 1/3
    ("1/2+1/3=", "5/6", "0.83", 1.0),  # a non-terminating answer rounded
    ("1/2+1/3=", "5/6", "0.84", 0.0),
    # a terminating answer needs its exact value: "0.12" and "0.13" were both half a unit from 1/8 and passed
    ("1/4-1/8=", "1/8", "0.125", 1.0),
    ("1/4-1/8=", "1/8", "0.12", 0.0),
    ("1/4-1/8=", "1/8", "0.13", 0.0),
    ("1/5-1/8=", "3/40", "0.075", 1.0),
    ("1/5-1/8=", "3/40", "0.07", 0.0),
    ("1/5-1/8=", "3/40", "0.08", 0.0),
    ("1/2+1/4=", "3/4", "0.7500", 1.0),
    ("2-5*1=", "-3", "-3", 1.0),
    # malformed completions
    ("3*4-5=", "7", "", 0.0),
    ("3*4-5=", "7", "seven", 0.0),
    ("3*4-5=", "7", "7/0", 0.0),
    ("3*4-5=", "7", "1e1", 0.0),
    ("3*4-5=", "7", "7 7", 0.0),
    # other scripts' digits are not numbers here, as in extraction (before: int() and Fraction() took them)
    ("3*4-5=", "7", "\u0667", 0.0),  # ARABIC-INDIC DIGIT SEVEN
    ("3*4-5=", "7", "\uff17", 0.0),  # FULLWIDTH DIGIT SEVEN
    ("1/2+1/4=", "3/4", "\u0663/\u0664", 0.0),
    ("1/2+1/4=", "3/4", "\u0660.\u0667\u0665", 0.0),
])
def test_verify_table(prompt, answer, completion, score):
    v = MATH.verify(task(prompt, answer), completion, None)
    assert v.score == score
    assert v.passed is (score == 1.0)


def test_malformed_is_not_well_formed():
    v = MATH.verify(task("3*4-5=", "7"), "abc", None)
    assert v.components == {"exact": 0.0, "well_formed": 0.0}


@pytest.mark.parametrize(("prompt", "answer", "shortcut"), [
    ("2+3*4=", "14", "20"),  # left to right: (2+3)*4
    ("9-2*3=", "3", "21"),
])
def test_trap_shortcut_fails_real_answer_passes(prompt, answer, shortcut):
    t = task(prompt, answer, trap=True)
    assert MATH.verify(t, shortcut, None).score == 0.0
    assert MATH.verify(t, answer, None).score == 1.0


def test_generated_tasks_reference_passes_and_traps_are_precedence_tasks():
    r = random.Random(11)
    tasks = [MATH.make_task(r, "train") for _ in range(300)]
    assert all(MATH.verify(t, MATH.reference_completion(t), None).passed for t in tasks)
    traps = [t for t in tasks if t.metadata["trap"]]
    assert traps and all(t.difficulty == 2 for t in traps)
    assert max(len(t.prompt) for t in tasks) <= 12
    assert max(len(MATH.reference_completion(t)) for t in tasks) <= 6
    assert {t.difficulty for t in tasks} == {1, 2, 3}


@pytest.mark.parametrize("answer", ["\u0667", "7\n", "3/4\n"])
def test_a_reference_answer_is_ascii_and_whole(answer):
    assert MATH.reference_problem({"answer": answer})[0] == "answer"


@pytest.mark.parametrize(("value", "exact"), [
    (Fraction(1, 8), True), (Fraction(3, 40), True), (Fraction(7), True), (Fraction(-1, 20), True),
    (Fraction(1, 3), False), (Fraction(5, 6), False), (Fraction(1, 14), False), (Fraction(3, 30), True),
])
def test_terminates_says_whether_a_value_has_an_exact_decimal(value, exact):
    assert terminates(value) is exact


@pytest.mark.parametrize("answer", ["1234567890123", "1/1234567890123", "0.1234567890123"])
def test_an_answer_past_12_digits_in_a_part_says_so(answer):
    """It said only "must be a string holding an integer, fraction or decimal", which it was."""
    assert MATH.reference_problem({"answer": answer}) == (
        "answer", "must be a string holding an integer, fraction or decimal, at most 12 digits in each part (e.g. '3/4')")
    assert MATH.reference_problem({"answer": answer[:-1]}) is None
