"""UserError's JSON form: what a trainer worker or a Kubeflow task hands its parent."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core.errors import UserError


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
    monkeypatch.setattr(errors.time, "sleep", slept.append)
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
