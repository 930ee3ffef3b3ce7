"""Math: short expressions with ``+ - * /`` and fractions, scored after normalisation.

Prompts are at most ~12 characters, e.g. ``"3*4-5="`` (reference ``"7"``) or
``"1/2+1/4="`` (reference ``"3/4"``). Difficulty 1 is ``a*b±c``; difficulty 2 puts the
product second (``a+b*c``), so operator precedence matters; difficulty 3 adds or
subtracts two unit fractions.

Normalisation: the first line of the completion, spaces removed, is read as an integer
(``"7"``, ``"-3"``), a fraction (``"3/4"``, ``"6/8"``, ``"-1/2"``), or a decimal
(``"0.75"``, ``".75"``). It counts as correct when it equals the answer exactly, or, when
the answer has no exact decimal (its reduced denominator has a prime factor other than 2
or 5, as 1/3 or 1/6), for a decimal with at least 2 decimal places within half a unit of
its last place (``"0.333"`` for 1/3). An answer with an exact decimal needs its value:
``"0.125"`` for 1/8, not ``"0.12"`` or ``"0.13"``. Components: ``exact`` (correct),
``well_formed`` (it parsed).

Trap tasks (``metadata["trap"] = True``): difficulty-2 tasks whose left-to-right
evaluation differs from the correct one (``"2+3*4="``: 14, not 20). A policy that learnt
the shortcut "evaluate left to right" from difficulty-1 tasks (where both agree) fails them.

Not covered: parentheses, powers, word problems, mixed numbers (``"1 1/2"``), numbers of
more than 12 digits in a part (a task file's answer is refused, a completion's does not
parse), or partial credit for near misses.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction

from components.core.jobs import Outcome
from components.core.records import Task
from components.domains.base import Domain, Verdict, first_line, make_task, malformed

# ASCII digits only (as extraction reads numbers: not "٣" or "３"), the whole text (fullmatch: no trailing newline).
_INT = re.compile(r"[+-]?[0-9]{1,12}")
_FRAC = re.compile(r"([+-]?[0-9]{1,12})/([0-9]{1,12})")
_DEC = re.compile(r"[+-]?[0-9]{0,12}\.([0-9]{1,12})")


def parse_number(text: str) -> tuple[Fraction, int] | None:
    """``(value, decimal places)`` of an int, fraction or decimal; None if it is none of them."""
    text = text.replace(" ", "")
    if _INT.fullmatch(text):
        return Fraction(int(text)), 0
    if m := _FRAC.fullmatch(text):
        den = int(m.group(2))
        return (Fraction(int(m.group(1)), den), 0) if den else None
    if m := _DEC.fullmatch(text):
        return Fraction(text), len(m.group(1))
    return None


def answer_text(value: Fraction) -> str:
    """Canonical reference: an integer, else the reduced fraction."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def terminates(value: Fraction) -> bool:
    """Whether ``value`` has an exact decimal: its reduced denominator has no prime factor but 2 and 5."""
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    return den == 1


def matches(completion_value: Fraction, places: int, answer: Fraction) -> bool:
    """Whether a completion's value (with ``places`` decimal places) is ``answer``: exactly,
    or, for an answer with no exact decimal (1/3), rounded to at least 2 places (0.333).
    Such an answer is never exactly half a unit from a decimal (that point has an exact
    decimal itself), so only its correct rounding lies within the bound."""
    if completion_value == answer:
        return True
    if terminates(answer):  # 1/8 is 0.125: "0.12" and "0.13" are both wrong
        return False
    return places >= 2 and abs(completion_value - answer) <= Fraction(1, 2 * 10**places)


def left_to_right(a: int, op1: str, b: int, op2: str, c: int) -> Fraction:
    first = a + b if op1 == "+" else a - b if op1 == "-" else a * b
    return first + c if op2 == "+" else first - c if op2 == "-" else first * c


class Math(Domain):
    name = "math"
    def make_task(self, rng: random.Random, split: str) -> Task:
        difficulty = rng.choice((1, 2, 3))
        if difficulty == 1:
            a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
            op = rng.choice("+-")
            prompt, value = f"{a}*{b}{op}{c}=", Fraction(a * b + (c if op == "+" else -c))
            trap = False
        elif difficulty == 2:
            a, b, c = rng.randint(1, 20), rng.randint(2, 9), rng.randint(2, 9)
            op = rng.choice("+-")
            prompt, value = f"{a}{op}{b}*{c}=", Fraction(a + (b * c if op == "+" else -b * c))
            trap = left_to_right(a, op, b, "*", c) != value
        else:
            x, y = rng.randint(2, 9), rng.randint(2, 9)
            op = rng.choice("+-")
            value = Fraction(1, x) + (Fraction(1, y) if op == "+" else -Fraction(1, y))
            prompt, trap = f"1/{x}{op}1/{y}=", False
        return make_task(self.name, split, difficulty, prompt, {"answer": answer_text(value)}, trap=trap)

    def reference_completion(self, task: Task) -> str:
        return task.reference["answer"]

    def reference_problem(self, reference: dict) -> tuple[str, str] | None:
        answer = reference.get("answer")
        if not isinstance(answer, str) or len(answer) > 64 or parse_number(answer) is None:
            return "answer", ("must be a string holding an integer, fraction or decimal, at most 12 digits in each "
                              "part (e.g. '3/4')")
        return None

    def verify(self, task: Task, completion: str, result: Outcome | None) -> Verdict:
        if (bad := malformed(completion)) is not None:
            return bad
        answer = parse_number(task.reference["answer"])
        assert answer is not None, f"task {task.task_id} has an unparseable answer {task.reference['answer']!r:.80}"
        parsed = parse_number(first_line(completion))
        correct = parsed is not None and matches(parsed[0], parsed[1], answer[0])
        return Verdict(
            score=1.0 if correct else 0.0,
            passed=correct,
            components={"exact": float(correct), "well_formed": float(parsed is not None)},
        )
