"""Typed records: frozen dataclasses, each with one matching Arrow schema.

Every record type derives its Arrow schema from its type hints, so the dataclass and the
schema cannot drift apart. Supported field types: ``str``, ``int``, ``float``, ``bool``,
``list[int]``, ``list[float]``, ``list[str]``, a ``Literal`` of strings (a status
vocabulary, stored as a string), ``dict[str, float]`` / ``dict[str, Any]`` / ``Any``
(stored as a JSON string, so the Parquet stays flat and readable by DuckDB and pandas)
and ``list[<record>]`` of a nested record (stored as a list of structs).

Records are stored as Parquet through :mod:`components.core.storage`; read them back
with :func:`from_table`, which checks the layout (every column with its type, no nulls, a
``Literal`` field's value in its vocabulary, a JSON field's value of its type) and raises
``LayoutError`` naming the first column that does not fit: a file of another record type,
or one written by hand, is refused before any of it is used. What this module does not do:
schema evolution (a Parquet file written by an older record layout is refused, naming the
missing column), or checking what a value means (a finite logprob, a known domain).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal, TypeVar, get_args

import pyarrow as pa

R = TypeVar("R")


@dataclass(frozen=True)
class Task:
    """One task for the policy to attempt."""

    task_id: str
    domain: str
    split: str  # "train" or "eval"
    difficulty: int  # 1 (easiest) upward; the meaning is the domain's
    prompt: str
    # prompt length in the policy's tokens as it sees the prompt (rollout.prompt_format; counted by taskgen),
    # for context-length buckets; a domain generator's own tasks hold the character count until then
    context_tokens: int
    reference: dict[str, Any]  # answer, tests, expected state or schema: the domain's
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Turn:
    """One step of a multi-turn episode: the policy's action and what came back."""

    action: str
    observation: str
    tool_call: str
    duration_s: float


@dataclass(frozen=True)
class Rollout:
    """One sampled completion (or episode) of the policy for one task."""

    rollout_id: str
    task_id: str
    domain: str
    group_index: int  # which of the G samples of this task
    policy_version: str
    engine: str
    prompt: str
    completion: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]  # per completion token, under the sampling policy
    finish_reason: str  # "stop" (eos) or "length"
    prompt_tokens: int
    completion_tokens: int
    turns: list[Turn] = field(default_factory=list)
    # Per completion token: 1 = the policy's (trained on), 0 = an observation of a
    # multi-turn episode (context only). Empty means every completion token is the policy's.
    completion_mask: list[int] = field(default_factory=list)


ExecutionStatus = Literal["ok", "failed", "timeout", "oom", "killed", "infra_error"]
"""How a sandbox job ended; ``infra_error`` means the sandbox broke, not the program."""
EXECUTION_STATUSES: tuple[str, ...] = get_args(ExecutionStatus)


@dataclass(frozen=True)
class Execution:
    """What the sandbox saw when it ran a rollout's program or commands."""

    rollout_id: str
    task_id: str
    domain: str
    backend: str  # "subprocess", "bwrap", "none" (nothing to execute)
    isolation: str  # what isolation was actually given, e.g. "process+rlimits"
    status: ExecutionStatus
    exit_code: int
    signal: int  # 0 when the process was not killed by a signal
    stdout: str  # capped
    stderr: str  # capped
    duration_s: float
    cpu_time_s: float
    peak_memory_mb: float
    result: Any = None  # the JSON the job wrote to its result channel; None when nothing came


RewardStatus = Literal["ok", "excluded", "verifier_error"]
"""``excluded``: an infrastructure failure, never scored 0 and never trained on.
``verifier_error``: the verifier itself failed on this sample (a bug, logged by the reward
stage): weight 0, never trained on, counted in the metric ``reward/verifier_errors``."""
REWARD_STATUSES: tuple[str, ...] = get_args(RewardStatus)


@dataclass(frozen=True)
class Reward:
    """A rollout's reward, from raw verifier score to group-relative advantage.

    ``status == "excluded"`` marks an infrastructure failure: never scored 0, never trained on.
    """

    rollout_id: str
    task_id: str
    domain: str
    group_index: int
    raw_reward: float
    components: dict[str, float]
    normalized_reward: float
    weight: float
    advantage: float
    status: RewardStatus
    reason: str = ""


@dataclass(frozen=True)
class EvalResult:
    """One held-out task's score for one policy version."""

    task_id: str
    domain: str
    difficulty: int
    context_bucket: str
    policy_version: str
    score: float
    passed: bool
    completion: str = ""
    trap: bool = False  # the task is one of its domain's trap tasks (metadata["trap"])


RECORD_TYPES: dict[str, type] = {
    "task": Task,
    "rollout": Rollout,
    "execution": Execution,
    "reward": Reward,
    "eval_result": EvalResult,
}


def _is_json_field(hint: Any) -> bool:
    return hint is Any or typing.get_origin(hint) is dict


def _arrow_type(hint: Any) -> pa.DataType:
    if hint is str or typing.get_origin(hint) is Literal:
        return pa.string()
    if hint is int:
        return pa.int64()
    if hint is float:
        return pa.float64()
    if hint is bool:
        return pa.bool_()
    if _is_json_field(hint):
        return pa.string()
    if typing.get_origin(hint) is list:
        (inner,) = typing.get_args(hint)
        if dataclasses.is_dataclass(inner):
            return pa.list_(pa.struct(list(schema_of(inner))))
        return pa.list_(_arrow_type(inner))
    raise TypeError(f"no Arrow type for field type {hint!r}")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@cache
def schema_of(cls: type) -> pa.Schema:
    """The Arrow schema of a record type, derived from its type hints."""
    hints = _hints(cls)
    return pa.schema(
        [pa.field(f.name, _arrow_type(hints[f.name]), nullable=False) for f in dataclasses.fields(cls)]
    )


def _to_row(record: Any) -> dict[str, Any]:
    hints = _hints(type(record))
    row: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        hint = hints[f.name]
        if _is_json_field(hint):
            value = json.dumps(value, sort_keys=True)
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            value = [_to_row(item) for item in value]
        row[f.name] = value
    return row


class LayoutError(ValueError):
    """A table or row that is not a record type's layout: another type's file, an older
    layout, or one written by hand."""


def _json_value(cls: type, name: str, hint: Any, text: str) -> Any:
    """A JSON field's stored text as its value: ``Any`` takes whatever parses, a ``dict``
    field an object (of numbers, for ``dict[str, float]``)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise LayoutError(f"{cls.__name__}.{name} is not JSON ({type(exc).__name__})") from None
    if hint is Any:
        return value
    if not isinstance(value, dict):
        raise LayoutError(f"{cls.__name__}.{name} is a JSON {type(value).__name__}, not an object")
    if get_args(hint)[1] is float:
        bad = next((k for k, v in value.items() if not isinstance(v, int | float)), None)  # a bool is a number too
        if bad is not None:
            raise LayoutError(f"{cls.__name__}.{name}[{bad[:40]!r}] is not a number")
    return value


def _from_row(cls: type[R], row: dict[str, Any]) -> R:
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in row:
            raise LayoutError(f"{cls.__name__} row has no field {f.name!r}; was it written by an older layout?")
        value = row[f.name]
        if value is None:
            raise LayoutError(f"{cls.__name__}.{f.name} is null")
        hint = hints[f.name]
        if _is_json_field(hint):
            value = _json_value(cls, f.name, hint, value)
        elif typing.get_origin(hint) is Literal and value not in get_args(hint):
            raise LayoutError(f"{cls.__name__}.{f.name} is {value[:40]!r}, not one of {list(get_args(hint))}")
        elif typing.get_origin(hint) is list:
            inner = typing.get_args(hint)[0]
            if any(v is None for v in value):
                raise LayoutError(f"{cls.__name__}.{f.name} holds a null")
            value = [_from_row(inner, item) for item in value] if dataclasses.is_dataclass(inner) else list(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def check_layout(cls: type, schema: pa.Schema) -> None:
    """A ``LayoutError`` naming the first of ``cls``'s columns that ``schema`` lacks or
    types otherwise (extra columns are allowed)."""
    for want in schema_of(cls):
        index = schema.get_field_index(want.name)
        if index < 0:
            raise LayoutError(f"no column {want.name!r} of the {cls.__name__} layout (another record type, or an older layout)")
        got = schema.field(index).type
        if not got.equals(want.type):
            raise LayoutError(f"column {want.name!r} is {got}, where the {cls.__name__} layout has {want.type}")


def to_table(records: list[Any], cls: type | None = None) -> pa.Table:
    """Records of one type as an Arrow table with that type's schema (empty lists work)."""
    if cls is None:
        assert records, "to_table needs cls= for an empty list"
        cls = type(records[0])
    rows = [_to_row(r) for r in records]
    return pa.Table.from_pylist(rows, schema=schema_of(cls))


def from_table(cls: type[R], table: pa.Table) -> list[R]:
    """Arrow table back to records; the inverse of :func:`to_table`. A ``LayoutError``
    when the table is not ``cls``'s layout."""
    check_layout(cls, table.schema)
    return [_from_row(cls, row) for row in table.to_pylist()]
