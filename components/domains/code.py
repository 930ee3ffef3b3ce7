"""Code: write the body of a one-line Python function from input/output examples.

The prompt shows ``f`` on two inputs (enough to pin down a line) and ends at ``return``
(``"f(1)=5 f(2)=7\nreturn "``); the completion is an expression in ``x``
(``x*2+3``), which becomes the body of ``def f(x): return <completion>``. Hidden unit
tests call ``f`` on other inputs too. Difficulty 1 is ``x*a`` (read ``a`` off ``f(1)``),
difficulty 2 is ``x+b`` (``b = f(1) - 1``), difficulty 3 is ``x*a+b``.

The sandbox runs ``components.sandbox.harness``: a trusted parent forks a child that
loads the solution and calls ``f`` on each test input, and only the parent writes the
*serialised* return values to a result pipe the solution cannot reach. The verifier compares those values with
the expected ones outside the sandbox, so an object with a forged ``__eq__`` cannot
pass. Score = tests passed / tests total; a pass needs all of them.

Trap tasks (``metadata["trap"] = True``): a quarter of the difficulty-1 tasks show ``f``
on 2 and 3 instead of 1 and 2 (``"f(2)=14 f(3)=21\nreturn "``, answer ``x*7``). The
shortcut "copy the first shown value as the multiplier" passes every ordinary
difficulty-1 task and fails these.

Not covered: multi-line functions, imports, or performance tests.
"""

from __future__ import annotations

import random

from components.core.jobs import Job, Outcome
from components.core.records import Task
from components.domains.base import Domain, Verdict, first_line, int_list, make_task, malformed
from components.sandbox.harness import python_tests_job

EXAMPLE_INPUTS = (1, 2)
TRAP_INPUTS = (2, 3)
TEST_INPUTS = (-3, 0, 2, 5, 11)

def expression(a: int, b: int) -> str:
    """The shortest reference solution for a*x + b."""
    core = "x" if a == 1 else f"x*{a}"
    return core if b == 0 else f"{core}+{b}"


class Code(Domain):
    name = "code"

    def make_task(self, rng: random.Random, split: str) -> Task:
        difficulty = rng.choice((1, 2, 3))
        a = {1: rng.randint(2, 99), 2: 1, 3: rng.randint(2, 9)}[difficulty]
        b = {1: 0, 2: rng.randint(1, 99), 3: rng.randint(1, 39)}[difficulty]
        trap = difficulty == 1 and rng.random() < 0.25
        shown = " ".join(f"f({x})={a * x + b}" for x in (TRAP_INPUTS if trap else EXAMPLE_INPUTS))
        prompt = f"{shown}\nreturn "
        reference = {"solution": expression(a, b), "inputs": list(TEST_INPUTS), "expected": [a * x + b for x in TEST_INPUTS]}
        return make_task(self.name, split, difficulty, prompt, reference, trap=trap)

    def reference_completion(self, task: Task) -> str:
        return task.reference["solution"]

    def execution_plan(self, task: Task, completion: str) -> Job | None:
        body = first_line(completion)
        return python_tests_job(task.task_id, f"def f(x):\n  return {body}\n", "f", task.reference["inputs"])

    def reference_problem(self, reference: dict) -> tuple[str, str] | None:
        if not int_list(reference.get("inputs")):
            return "inputs", "must be a non-empty list of integers (test inputs of f)"
        if not int_list(reference.get("expected")):
            return "expected", "must be a non-empty list of integers (f's outputs)"
        if len(reference["inputs"]) != len(reference["expected"]):
            return "expected", f"has {len(reference['expected'])} values for {len(reference['inputs'])} inputs"
        return None

    def verify(self, task: Task, completion: str, result: Outcome | None) -> Verdict:
        if (bad := malformed(completion)) is not None:
            return bad
        expected = task.reference["expected"]
        if result is None or result.status == "infra_error":
            return Verdict(0.0, False, status="infra_error", detail="sandbox did not run the tests")
        values = (result.result or {}).get("values", []) if isinstance(result.result, dict) else []
        passed = 0
        for want, got in zip(expected, values):
            # Compare serialised values by type and value: True == 1 must not pass for 1.
            if isinstance(got, dict) and got.get("ok") and type(got.get("value")) is int and got["value"] == want:
                passed += 1
        total = len(expected)
        return Verdict(
            score=passed / total,
            passed=passed == total,
            components={"tests_passed": float(passed), "tests_total": float(total), "ran": float(bool(values))},
            detail=result.status,
        )
