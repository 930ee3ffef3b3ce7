"""The project's error types: a user's mistake, an outage, and a failed data-quality gate.

A ``UserError`` names the field (or thing), the value that was wrong, and the fix. The
CLI prints it as one line and exits with status 2; no traceback. Internal invariants use
``assert`` instead and surface as ordinary tracebacks, because they are our bugs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input: a recipe, URI, task file, credential or argument."""

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(self.line())

    def __reduce__(self):  # crosses a process boundary (the stage host) as itself; the value as its text
        value = self.value if _bare(self.value) else str(self.value)
        return type(self), (self.field, value, self.problem, self.fix), self.__dict__ | {"value": value}

    def line(self) -> str:
        """``field=value: problem; fix: fix``; a number or boolean shows as itself
        (``--nodes=0``), anything else quoted (``--shard='0/3'``), so an empty or padded text is visible."""
        shown = value_text(self.value) if _bare(self.value) else repr(value_text(self.value))
        return f"{one_line(self.field)}={shown}: {one_line(self.problem)}; fix: {one_line(self.fix)}"

    def to_json(self) -> str:
        """The error as one JSON object, for a process that hands it to its parent (a
        trainer worker, a Kubeflow task under ``posttrain kfp-local``); the value as in
        ``__reduce__``."""
        value = self.value if _bare(self.value) else value_text(self.value, limit=10_000)
        if isinstance(value, int) and value_text(value).startswith("<"):
            value = value_text(value)  # past Python's 4300-digit limit: json cannot write it
        return json.dumps({"field": self.field, "value": value, "problem": self.problem, "fix": self.fix})

    @classmethod
    def from_line(cls, text: str) -> UserError | None:
        """The UserError whose ``line()`` is ``text`` exactly (what a stage container or pod
        printed after ``posttrain: error: ``), or None where no UserError writes it."""
        import ast

        if len(text) > MAX_LINE or not text.isprintable():
            return None
        for i in (i for i, c in enumerate(text) if c == "="):
            field, rest, start = text[:i], text[i + 1:], 0
            while (j := rest.find(": ", start)) != -1:
                start = j + 1
                try:
                    value = ast.literal_eval(rest[:j])
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    continue
                if not (_bare(value) or isinstance(value, str)):
                    continue
                tail, k = rest[j + 2:], len(rest)
                while (k := tail.rfind(_FIX, 0, k)) != -1:  # the last "; fix: " first: a problem may hold one
                    error = cls(field, value, tail[:k], tail[k + len(_FIX):])
                    if error.line() == text:
                        return error
        return None

    @classmethod
    def from_json(cls, text: str) -> UserError:
        """The error ``to_json`` wrote. Not for untrusted text: a file that is not one
        raises ``ValueError`` or ``KeyError``."""
        fields = json.loads(text)
        return cls(str(fields["field"]), fields["value"], str(fields["problem"]), str(fields["fix"]))


MAX_LINE = 20_000  # longer than any line a UserError writes (its value is cut to 200 characters)
_FIX = "; fix: "


def one_line(text: str) -> str:
    """``text`` with newlines and other unprintable characters escaped (``\\n``), so that
    a path or value interpolated into a field, problem or fix keeps the error one line."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def exc_line(exc: BaseException) -> str:
    """``Type: first line of the message``; only the type for an empty or blank message
    (``MemoryError()``), where ``str(exc).splitlines()[0]`` raised IndexError."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _bare(value: object) -> bool:
    return isinstance(value, (bool, int, float)) or value is None


def value_text(value: object, limit: int = 200) -> str:
    try:
        text = str(value)
    except ValueError:  # an integer past Python's 4300-digit conversion limit
        text = f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) else f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


EXIT_DATA_QUALITY = 3


class DataQualityError(Exception):
    """The data-quality gate failed: the trainer's input is malformed. Retrying cannot
    help (the data would be just as bad); the CLI exits with status 3."""

    exit_code = EXIT_DATA_QUALITY

    def to_json(self) -> str:
        """The error as one JSON object (``final_error_from_json`` reads it back)."""
        return json.dumps({"kind": "data_quality", "message": str(self)})


def final_error_from_json(text: str) -> UserError | DataQualityError:
    """The UserError or DataQualityError whose ``to_json`` wrote ``text`` (a Kubeflow task
    hands it to ``posttrain kfp-local`` that way). Not for untrusted text."""
    fields = json.loads(text)
    if isinstance(fields, dict) and fields.get("kind") == "data_quality":
        return DataQualityError(str(fields["message"]))
    return UserError.from_json(text)


def final_error_from_line(status: int, line: str, stage: str) -> UserError | DataQualityError:
    """The error a stage's container or pod ended with, from its exit status (2: a UserError,
    3: a failed data-quality gate) and its last line, as ``posttrain stage`` printed it
    (``posttrain: error: <the UserError's line>``, ``posttrain: <the gate's message>``); a
    line no UserError writes (no output, argparse's usage error) becomes one naming the
    stage and carrying that line."""
    text = line.strip()
    if status == EXIT_DATA_QUALITY:
        return DataQualityError(text.removeprefix("posttrain: ") or f"{stage}: failed its data-quality gate")
    assert status == EXIT_USER_ERROR, status
    found = UserError.from_line(text.removeprefix("posttrain: error: "))
    return found if found is not None else UserError(
        stage, text, f"its container exited {status} (a user's mistake)", "see the task's log for the stage's output")


EXIT_INFRA_ERROR = 1

_OUTAGE_TYPES = {
    # botocore / s3fs
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    # urllib3 / requests (MLflow's HTTP client, the OpenAI-compatible engine)
    "NewConnectionError", "MaxRetryError", "ProtocolError", "RemoteDisconnected",
    # aiohttp (s3fs)
    "ClientConnectorError", "ServerDisconnectedError", "ClientOSError",
}
_OUTAGE_WORDS = ("Max retries exceeded", "Connection refused", "Connection reset", "Service Unavailable",
                 "ServiceUnavailable", "SlowDown", "503 Server Error", "502 Server Error", "504 Server Error",
                 "temporarily unavailable")


class InfraError(Exception):
    """Something we depend on (the store, the tracking server, an inference endpoint) is
    unreachable. Not the user's mistake: orchestrators retry it with backoff, and the CLI
    says what was unreachable and exits with status 1."""

    def __init__(self, what: str, where: str, reason: str) -> None:
        self.what, self.where, self.reason = what, where, reason
        super().__init__(self.line())

    def __reduce__(self):  # crosses a process boundary (the stage host) as itself
        return type(self), (self.what, self.where, self.reason), self.__dict__

    def line(self) -> str:
        return (f"{one_line(self.what)} unreachable at {value_text(self.where)!r}: {one_line(value_text(self.reason))}; "
                "retry once it is back")


_SERVER_SIDE_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout"}


def server_side(exc: BaseException) -> str | None:
    """A short reason if an S3 reply in ``exc``'s cause chain says the server, not the
    request, is at fault (HTTP 5xx, or a code that means "busy, try again"), as a server
    that is starting, restarting or overloaded answers (SeaweedFS: 503 while its filer
    comes up); s3fs turns these into a bare ``OSError(EBUSY/EREMOTEIO)``. None otherwise
    (no such bucket, access denied: the user's to fix)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if code in _SERVER_SIDE_CODES or (code.isdigit() and int(code) >= 500) or int(status) >= 500:
                return f"HTTP {status or code} {code}: {str(cur).splitlines()[0][:160] if str(cur) else ''}"
        cur = _underneath(cur)
    return None


def _underneath(exc: BaseException) -> BaseException | None:
    """The error ``exc`` was raised from or while handling, as a traceback shows it:
    its ``__cause__``, else its ``__context__`` unless it was raised ``from None``
    (``__suppress_context__``: the error it replaced is not part of it)."""
    if exc.__cause__ is not None:
        return exc.__cause__
    return None if exc.__suppress_context__ else exc.__context__


def outage(exc: BaseException) -> str | None:
    """A short reason if ``exc`` (or anything in its cause chain) means a service could
    not be reached or answered 5xx; None for anything else (a bug, a user's mistake). An
    error raised ``from None`` while handling an outage is not one: its chain ends there."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, InfraError):  # already one: its reason, not its whole line inside another's
            return cur.reason
        if isinstance(cur, (ConnectionError, TimeoutError)) or type(cur).__name__ in _OUTAGE_TYPES:
            return f"{type(cur).__name__}: {str(cur).splitlines()[0] if str(cur) else ''}"
        if any(word in str(cur) for word in _OUTAGE_WORDS):
            return f"{type(cur).__name__}: {str(cur).splitlines()[0]}"
        cur = _underneath(cur)
    return server_side(exc)


def retry_outages(fn: Callable[[], T], delays_s: Sequence[float], say: Callable[[str], None],
                  also: tuple[type[Exception], ...] = ()) -> T:
    """``fn()``, called again after each of ``delays_s`` while it fails on an outage (an
    ``InfraError``, or what ``outage`` recognises) or on one of ``also`` (another run
    holding a lease: waited out as the DAG's task retries wait it out), with one line to
    ``say`` per wait. A UserError or any other failure, and the outage after the last
    delay, propagate at once. For a step an orchestrator must not retry (a mistake would
    fail once per retry, each after its backoff) that still has to ride out a restarting
    store."""
    for attempt, delay in enumerate((*delays_s, None), start=1):
        try:
            return fn()
        except (UserError, DataQualityError):
            raise  # a mistake or bad data, even one found while handling an outage: retrying cannot fix it
        except Exception as exc:
            if isinstance(exc, also):
                reason: str | None = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            else:
                reason = exc.line() if isinstance(exc, InfraError) else outage(exc)
            if reason is None or delay is None:
                raise
            say(f"{reason} (attempt {attempt} of {len(delays_s) + 1}; again in {delay:g} s)")
            time.sleep(delay)
    raise AssertionError("unreachable: the last attempt returns or raises")
