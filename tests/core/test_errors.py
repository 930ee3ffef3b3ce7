"""UserError's JSON form: what a trainer worker or a Kubeflow task hands its parent."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from components.core.errors import UserError


def main_thread_sleeps(slept: list[float]):
    """A ``time.sleep`` that records the main thread's waits instead of sleeping (patching
    ``errors.time`` patches the process's ``time``: another test's thread still running
    in this worker sleeps for real)."""
    real = time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread() is threading.main_thread():
            slept.append(seconds)
        else:
            real(seconds)

    return sleep


@pytest.mark.parametrize("value, shown", [
    (0, "--nodes=0"),
    (True, "--nodes=True"),
    (None, "--nodes=None"),
    (2.5, "--nodes=2.5"),
    ("0/3", "--nodes='0/3'"),
    (Path("/tmp/x y"), "--nodes='/tmp/x y'"),
    ("", "--nodes=''"),
])
def test_a_user_error_comes_back_from_its_json_with_the_same_line(value: object, shown: str) -> None:
    error = UserError("--nodes", value, "is wrong", "pass 1")
    back = UserError.from_json(error.to_json())
    assert back.line() == error.line() == f"{shown}: is wrong; fix: pass 1"
    assert (back.field, back.problem, back.fix) == ("--nodes", "is wrong", "pass 1")


def test_a_number_stays_a_number_and_other_values_become_their_text() -> None:
    assert UserError.from_json(UserError("f", 7, "p", "x").to_json()).value == 7
    assert UserError.from_json(UserError("f", Path("/a"), "p", "x").to_json()).value == "/a"


def test_an_integer_past_the_digit_limit_and_a_huge_text_still_make_json() -> None:
    huge = 10 ** 5000
    back = UserError.from_json(UserError("n", huge, "is too large", "pass less").to_json())
    assert back.line() == f"n='<an integer of {huge.bit_length()} bits>': is too large; fix: pass less"
    text = UserError.from_json(UserError("t", "a" * 50_000, "p", "x").to_json()).value
    assert len(text) == 10_000 and text.endswith("...")


def test_a_newline_anywhere_in_the_error_stays_escaped_on_one_line() -> None:
    """A path or value with a newline, interpolated into the field, problem or fix (a task
    file's path, a row's domain), must not split the CLI's one line."""
    error = UserError("taskgen.task_file[/t/a\nb.jsonl]", "x\ny", "row 2: domain 'a\nb' \u2028", "fix\r\nit")
    assert error.line() == r"taskgen.task_file[/t/a\nb.jsonl]='x\ny': row 2: domain 'a\nb' \u2028; fix: fix\r\nit"
    assert UserError("f", "é", "ü ok", "ß").line() == "f='é': ü ok; fix: ß"  # printable text stays as it is


def test_retry_outages_waits_out_an_outage_and_passes_a_mistake_at_once(monkeypatch) -> None:
    from components.core import errors
    from components.core.errors import InfraError, UserError, retry_outages

    slept: list[float] = []
    monkeypatch.setattr(errors.time, "sleep", main_thread_sleeps(slept))
    said: list[str] = []
    calls = iter([InfraError("store", "s3://b", "503"), ConnectionRefusedError("Connection refused"), 7])

    def flaky() -> int:
        step = next(calls)
        if isinstance(step, Exception):
            raise step
        return step

    assert retry_outages(flaky, (10, 20, 40), said.append) == 7
    assert slept == [10, 20]
    assert said == ["store unreachable at 's3://b': 503; retry once it is back (attempt 1 of 4; again in 10 s)",
                    "ConnectionRefusedError: Connection refused (attempt 2 of 4; again in 20 s)"]

    slept.clear()
    mistake = UserError("recipe", "r.yaml", "is not a recipe", "fix it")

    def wrong() -> None:
        raise mistake

    with pytest.raises(UserError) as err:
        retry_outages(wrong, (10, 20, 40), said.append)
    assert err.value is mistake and slept == []
    with pytest.raises(KeyError):  # a bug is not waited out either
        retry_outages(lambda: {}["x"], (10,), said.append)
    assert slept == []

    def down() -> None:
        raise InfraError("store", "s3://b", "503")

    with pytest.raises(InfraError):
        retry_outages(down, (1, 2), said.append)
    assert slept == [1, 2]


def test_a_final_error_crosses_to_posttrain_kfp_local_as_itself() -> None:
    """A Kubeflow task's failed gate reached ``posttrain kfp-local`` as a failed run (exit 1,
    a retryable outage's status); it now comes back as the gate's error, exit 3."""
    from components.core.errors import DataQualityError, UserError, final_error_from_json

    gate = final_error_from_json(DataQualityError("validation failed for iteration 1 (x): rows").to_json())
    assert type(gate) is DataQualityError and str(gate) == "validation failed for iteration 1 (x): rows"
    assert gate.exit_code == 3
    mistake = final_error_from_json(UserError("taskgen.task_file", "t.jsonl", "has no rows", "add rows").to_json())
    assert type(mistake) is UserError and mistake.line() == "taskgen.task_file='t.jsonl': has no rows; fix: add rows"


def test_an_outage_wrapped_in_another_error_keeps_its_reason_once() -> None:
    """The outage line said "...: InfraError: tracking server unreachable at ...; retry once
    it is back; retry once it is back"."""
    from components.core.errors import InfraError, outage

    first = InfraError("tracking server", "http://127.0.0.1:9", "ConnectionRefusedError: refused")
    try:
        raise RuntimeError("the stage failed") from first
    except RuntimeError as exc:
        again = InfraError("tracking server", "http://127.0.0.1:9", outage(exc))
    assert again.line() == "tracking server unreachable at 'http://127.0.0.1:9': ConnectionRefusedError: refused; " \
                           "retry once it is back"


def _raised_while_handling(error: Exception, suppress: bool) -> Exception:
    """``error`` raised inside the handler of a refused connection, ``from None`` or not."""
    try:
        try:
            raise ConnectionRefusedError("Connection refused")
        except ConnectionRefusedError:
            if suppress:
                raise error from None
            raise error  # noqa: B904 - the point: the connection error stays its context
    except Exception as exc:
        return exc


def test_an_error_raised_from_none_while_handling_an_outage_is_not_one() -> None:
    """``outage`` followed ``__context__`` past ``raise ... from None``: a UserError a
    handler raised in place of a refused connection read as that outage."""
    from components.core.errors import outage

    mistake = _raised_while_handling(UserError("task file", "t.jsonl", "has no rows", "add rows"), suppress=True)
    assert outage(mistake) is None
    other = _raised_while_handling(RuntimeError("the stage failed"), suppress=True)
    assert outage(other) is None
    # raised in the handler without ``from None``, or ``from`` it: still that outage, as before
    kept = _raised_while_handling(RuntimeError("the stage failed"), suppress=False)
    assert outage(kept) == "ConnectionRefusedError: Connection refused"
    try:
        raise RuntimeError("wrapped") from ConnectionResetError("Connection reset by peer")
    except RuntimeError as exc:
        assert outage(exc) == "ConnectionResetError: Connection reset by peer"


@pytest.mark.parametrize("suppress", [True, False])
def test_retry_outages_passes_a_mistake_found_while_handling_an_outage_at_once(suppress: bool, monkeypatch) -> None:
    """A UserError or failed gate raised while a connection error was being handled was
    retried (and said as that outage) 3 times with backoff, then raised."""
    from components.core import errors
    from components.core.errors import DataQualityError, retry_outages

    slept: list[float] = []
    monkeypatch.setattr(errors.time, "sleep", main_thread_sleeps(slept))
    said: list[str] = []
    for error in (UserError("task file", "t.jsonl", "has no rows", "add rows"), DataQualityError("validation failed")):
        raised = _raised_while_handling(error, suppress)
        calls: list[int] = []

        def fails(raised: Exception = raised, calls: list[int] = calls) -> None:
            calls.append(1)
            raise raised

        with pytest.raises(type(error)) as err:
            retry_outages(fails, (10, 20, 40), said.append)
        assert err.value is error and calls == [1]
    assert slept == [] and said == []


@pytest.mark.parametrize("error", [
    UserError("--recipe", "/nonexistent/recipe.yaml", "no such recipe file", "pass a YAML file such as recipes/demo.yaml"),
    UserError("--nodes", 0, "must be at least 1", "pass 1"),
    UserError("taskgen.task_file[/t/a=b: c.jsonl]", "it's \"x\": y", "row 2: a; fix: b", "fix: it"),
    UserError("f", Path("/tmp/x y"), "p", "x"),
    UserError("n", None, "p", "x"),
])
def test_a_stage_containers_line_comes_back_as_its_user_error(error: UserError) -> None:
    """A container or pod hands its UserError to the DAG's worker as the one line it prints."""
    from components.core.errors import final_error_from_line

    back = final_error_from_line(2, f"posttrain: error: {error.line()}\n", "taskgen")
    assert type(back) is UserError and back.line() == error.line()
    value = error.value if isinstance(error.value, (int, type(None))) else str(error.value)
    assert (back.field, back.value, back.problem, back.fix) == (error.field, value, error.problem, error.fix)
