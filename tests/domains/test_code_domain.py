"""Code verifier: completions run as real unit tests in the bwrap sandbox."""

from __future__ import annotations

import pytest

from components.core.recipe import SandboxConfig
from components.domains import registry
from components.domains.base import make_task
from components.sandbox.executor import get_executor

DOMAIN = registry.get("code")
# f(x) = 3x + 4, shown on 1 and 2; hidden tests on -3, 0, 2, 5, 11.
TASK = make_task("code", "eval", 3, "f(1)=7 f(2)=10\nreturn ",
                 {"solution": "x*3+4", "inputs": [-3, 0, 2, 5, 11], "expected": [-5, 4, 10, 19, 37]})


@pytest.fixture(scope="module")
def executor():
    ex = get_executor(SandboxConfig(backend="bwrap", mode="warm", timeout_s=5))
    yield ex
    ex.close()


@pytest.mark.parametrize(
    ("completion", "passed_tests"),
    [
        ("x*3+4", 5),
        ("4+3*x", 5),
        ("(x+1)*3+1", 5),
        ("x*3+4\nprint('junk')", 5),  # only the first line becomes the body
        ("x*3", 0),
        ("7 if x == 1 else 10", 1),  # fits the shown examples only: right at x = 2 alone
        ("x*2+4", 1),  # right only at x = 0
        ("x*3+4.0", 0),  # floats are not ints, even when equal
        ("True", 0),
        ("", 0),
        ("(", 0),  # a syntax error
        ("1/0", 0),
    ],
)
def test_verify_table(executor, completion, passed_tests):
    expected_passes = sum(1 for x, want in zip(TASK.reference["inputs"], TASK.reference["expected"])
                          if _value(completion, x) == want and type(_value(completion, x)) is int)
    assert expected_passes == passed_tests, "table row is inconsistent with Python itself"
    result = executor.run(DOMAIN.execution_plan(TASK, completion))
    verdict = DOMAIN.verify(TASK, completion, result)
    assert verdict.components["tests_passed"] == passed_tests
    assert verdict.components["tests_total"] == 5
    assert verdict.score == pytest.approx(passed_tests / 5)
    assert verdict.passed is (passed_tests == 5)


def _value(completion: str, x: int):
    body = completion.split("\n", 1)[0].strip()
    try:
        return eval(body, {}, {"x": x}) if body else None  # noqa: S307 - trusted table rows
    except Exception:
        return None


def test_no_sandbox_result_is_an_infrastructure_failure_not_a_zero():
    verdict = DOMAIN.verify(TASK, "x*3+4", None)
    assert verdict.status == "infra_error"


def test_reference_solutions_pass_for_every_difficulty(executor):
    tasks = DOMAIN.eval_set(30, seed=9)
    assert {t.difficulty for t in tasks} == {1, 2, 3}
    for task in tasks[:9]:
        result = executor.run(DOMAIN.execution_plan(task, DOMAIN.reference_completion(task)))
        assert DOMAIN.verify(task, DOMAIN.reference_completion(task), result).passed, task.prompt


def test_trap_tasks_fail_the_copy_the_first_value_shortcut(executor):
    tasks = [t for t in DOMAIN.eval_set(120, seed=5) if t.difficulty == 1]
    traps = [t for t in tasks if t.metadata["trap"]]
    ordinary = [t for t in tasks if not t.metadata["trap"]]
    assert traps and ordinary
    assert all(t.prompt.startswith("f(2)=") for t in traps)

    def shortcut(task):  # "x*<first shown value>"
        return "x*" + task.prompt.split("=", 1)[1].split(" ", 1)[0]

    for task, want in [(ordinary[0], True), (ordinary[1], True), (traps[0], False), (traps[1], False)]:
        completion = shortcut(task)
        verdict = DOMAIN.verify(task, completion, executor.run(DOMAIN.execution_plan(task, completion)))
        assert verdict.passed is want, (task.prompt, completion)
        reference = DOMAIN.reference_completion(task)
        assert DOMAIN.verify(task, reference, executor.run(DOMAIN.execution_plan(task, reference))).passed
