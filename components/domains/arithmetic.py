"""Arithmetic: integer addition, scored by exact answer.

Prompt ``"47+38="``, reference completion ``"85"``. Difficulty 1 adds two one-digit
numbers, difficulty 2 a one-digit number to a two-digit one, difficulty 3 two two-digit
numbers (a quarter, a half and a quarter of the tasks). The verifier reads the first
line of the completion, strips spaces and compares the integer exactly (an optional
leading ``+`` or ``-``, as the math domain reads one: ``+85`` is 85); anything that is not
an integer scores 0. Nothing runs in the sandbox.

Trap tasks (``metadata["trap"] = True``): difficulty-2 and -3 sums with a carry out of the
units digit (``"47+38="``: 85; a difficulty-1 carry such as ``"1+9="`` is not marked). The shortcut "add digit by digit, drop the carry" (75) passes every
task without a carry and fails these.

A task file's answer has at most 100 digits (the most the verifier reads).

Not covered: other operations (see the ``math`` domain), word problems, or partial
credit for near misses.
"""

from __future__ import annotations

import random
import re

from components.core.jobs import Outcome
from components.core.records import Task
from components.domains.base import Domain, Verdict, first_line, is_int, make_task, malformed

_INT = re.compile(r"[+-]?[0-9]{1,100}")  # ASCII digits only (as extraction reads numbers), whole text (fullmatch); a sign as math reads one
MAX_ANSWER = 10**100 - 1  # the largest answer _INT reads (100 digits): a longer one could never match


class Arithmetic(Domain):
    name = "arithmetic"
    def make_task(self, rng: random.Random, split: str) -> Task:
        difficulty = rng.choices((1, 2, 3), weights=(1, 2, 1))[0]
        a = rng.randint(0, 9) if difficulty == 1 else rng.randint(10, 99)
        b = rng.randint(10, 99) if difficulty == 3 else rng.randint(0, 9)
        trap = difficulty > 1 and a % 10 + b % 10 >= 10
        return make_task(self.name, split, difficulty, f"{a}+{b}=", {"answer": str(a + b)}, trap=trap)

    def reference_completion(self, task: Task) -> str:
        return task.reference["answer"]

    def reference_problem(self, reference: dict) -> tuple[str, str] | None:
        answer = reference.get("answer")
        if not (is_int(answer, -MAX_ANSWER, MAX_ANSWER) or (isinstance(answer, str) and _INT.fullmatch(answer))):
            return "answer", "must be an integer of at most 100 digits or a string of one (e.g. '85')"
        return None

    def verify(self, task: Task, completion: str, result: Outcome | None) -> Verdict:
        if (bad := malformed(completion)) is not None:
            return bad
        text = first_line(completion).replace(" ", "")
        whole = bool(_INT.fullmatch(text))  # bounded: an integer of 4,300+ digits cannot be parsed
        correct = whole and int(text) == int(task.reference["answer"])
        return Verdict(
            score=1.0 if correct else 0.0,
            passed=correct,
            components={"exact": float(correct), "well_formed": float(whole)},
        )
