"""Records round-trip through Arrow and Parquet (via the Store) exactly; schemas are fixed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from components.core.records import (
    RECORD_TYPES,
    EvalResult,
    Execution,
    LayoutError,
    Reward,
    Rollout,
    Task,
    Turn,
    from_table,
    schema_of,
    to_table,
)
from components.core.storage import Store

TASKS = [
    Task(task_id="arith-0001", domain="arithmetic", split="train", difficulty=2, prompt="12+30=", context_tokens=7,
         reference={"answer": "42", "operands": [12, 30], "nested": {"tol": 0.5, "ok": True, "none": None}},
         metadata={"source": "generator", "ünïcode": "✓"}),
    Task(task_id="code-7", domain="code", split="eval", difficulty=1, prompt="def f(x):\n", context_tokens=0,
         reference={"tests": ["assert f(1) == 2", "assert f(0) == 1"]}),
]
ROLLOUTS = [
    Rollout(rollout_id="arith-0001-i1-g0", task_id="arith-0001", domain="arithmetic", group_index=0, policy_version="1",
            engine="hf", prompt="12+30=", completion="42", prompt_token_ids=[1, 20, 21, 30], completion_token_ids=[25, 23, 2],
            logprobs=[-0.125, -2.5, -1e-9], finish_reason="stop", prompt_tokens=4, completion_tokens=3,
            turns=[Turn(action="ls", observation="a.py\n", tool_call="bash", duration_s=0.25),
                   Turn(action="cat a.py", observation="", tool_call="bash", duration_s=1.5)]),
    Rollout(rollout_id="code-7-i1-g3", task_id="code-7", domain="code", group_index=3, policy_version="external",
            engine="vllm", prompt="def f(x):\n", completion="", prompt_token_ids=[1], completion_token_ids=[], logprobs=[],
            finish_reason="length", prompt_tokens=1, completion_tokens=0),
]
EXECUTIONS = [
    Execution(rollout_id="code-7-i1-g3", task_id="code-7", domain="code", backend="bwrap", isolation="bwrap+seccomp",
              status="timeout", exit_code=-9, signal=9, stdout="partial\n", stderr="Killed", duration_s=5.01,
              cpu_time_s=4.99, peak_memory_mb=12.5, result={"values": [[1, "2"], [None, 3.5]], "state_checks": []}),
    Execution(rollout_id="r2", task_id="t2", domain="code", backend="subprocess", isolation="process+rlimits",
              status="ok", exit_code=0, signal=0, stdout="", stderr="", duration_s=0.0, cpu_time_s=0.0,
              peak_memory_mb=0.0),
]
REWARDS = [
    Reward(rollout_id="arith-0001-i1-g0", task_id="arith-0001", domain="arithmetic", group_index=0, raw_reward=1.0,
           components={"correct": 1.0, "format": 0.5}, normalized_reward=0.75, weight=1.0, advantage=1.224744871391589,
           status="ok"),
    Reward(rollout_id="code-7-i1-g3", task_id="code-7", domain="code", group_index=3, raw_reward=0.0, components={},
           normalized_reward=0.0, weight=0.0, advantage=0.0, status="excluded", reason="infra_error: sandbox died"),
]
EVAL_RESULTS = [
    EvalResult(task_id="arith-eval-3", domain="arithmetic", difficulty=3, context_bucket="0-64", policy_version="2",
               score=1.0, passed=True, completion="17"),
    EvalResult(task_id="code-eval-9", domain="code", difficulty=1, context_bucket="64-256", policy_version="2",
               score=0.5, passed=False),
]
SAMPLES = {Task: TASKS, Rollout: ROLLOUTS, Execution: EXECUTIONS, Reward: REWARDS, EvalResult: EVAL_RESULTS}


def test_every_record_type_has_samples() -> None:
    assert set(SAMPLES) == set(RECORD_TYPES.values())


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_round_trip_through_parquet_in_the_store(cls: type, tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}")
    table = to_table(SAMPLES[cls], cls)
    assert table.schema.equals(schema_of(cls))
    _, digest = store.write_table(f"{cls.__name__}.parquet", table)
    back = store.read_table(f"{cls.__name__}.parquet")
    assert back.schema.equals(schema_of(cls))
    assert from_table(cls, back) == SAMPLES[cls]
    assert len(digest) == 64


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_empty_list_round_trips_with_schema(cls: type, tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}")
    store.write_table("empty.parquet", to_table([], cls))
    back = store.read_table("empty.parquet")
    assert back.num_rows == 0
    assert back.schema.equals(schema_of(cls))
    assert from_table(cls, back) == []


def test_nested_turns_and_dict_fields_keep_their_types(tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}")
    store.write_table("r.parquet", to_table(ROLLOUTS))
    first = from_table(Rollout, store.read_table("r.parquet"))[0]
    assert first.turns == [Turn("ls", "a.py\n", "bash", 0.25), Turn("cat a.py", "", "bash", 1.5)]
    assert all(type(t) is Turn for t in first.turns)
    assert first.logprobs == [-0.125, -2.5, -1e-9]
    store.write_table("t.parquet", to_table(TASKS))
    task = from_table(Task, store.read_table("t.parquet"))[0]
    assert task.reference["nested"] == {"tol": 0.5, "ok": True, "none": None}
    assert task.metadata == {"source": "generator", "ünïcode": "✓"}


def test_rollout_schema() -> None:
    turn = pa.struct([pa.field("action", pa.string(), nullable=False), pa.field("observation", pa.string(), nullable=False),
                      pa.field("tool_call", pa.string(), nullable=False),
                      pa.field("duration_s", pa.float64(), nullable=False)])
    expected = [
        ("rollout_id", pa.string()), ("task_id", pa.string()), ("domain", pa.string()), ("group_index", pa.int64()),
        ("policy_version", pa.string()), ("engine", pa.string()), ("prompt", pa.string()), ("completion", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int64())), ("completion_token_ids", pa.list_(pa.int64())),
        ("logprobs", pa.list_(pa.float64())), ("finish_reason", pa.string()), ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()), ("turns", pa.list_(turn)),
        ("completion_mask", pa.list_(pa.int64())),
    ]
    schema = schema_of(Rollout)
    assert [(f.name, f.type) for f in schema] == expected
    assert not any(f.nullable for f in schema)
    assert schema.names == [f.name for f in dataclasses.fields(Rollout)]


def test_dict_fields_are_json_strings_readable_by_pandas(tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}")
    store.write_table("rw.parquet", to_table(REWARDS))
    assert schema_of(Reward).field("components").type == pa.string()
    frame = pd.read_parquet(tmp_path / "rw.parquet")
    assert list(frame["components"]) == ['{"correct": 1.0, "format": 0.5}', "{}"]
    assert list(frame["status"]) == ["ok", "excluded"]


@pytest.mark.parametrize("missing", ["logprobs", "turns"])
def test_table_missing_a_field_names_it(missing: str, tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}")
    store.write_table("old.parquet", to_table(ROLLOUTS).drop_columns([missing]))
    with pytest.raises(LayoutError, match=f"no column '{missing}' of the Rollout layout"):
        from_table(Rollout, store.read_table("old.parquet"))


def test_a_table_of_another_record_type_is_refused_naming_the_column(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match="^no column 'rollout_id' of the Reward layout"):
        from_table(Reward, to_table(TASKS))
    with pytest.raises(LayoutError, match="^no column 'difficulty' of the EvalResult layout"):
        from_table(EvalResult, to_table(REWARDS))


def replaced(table: pa.Table, name: str, column: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, column)


@pytest.mark.parametrize(("cls", "name", "column", "problem"), [
    (Reward, "advantage", pa.array(["1.5", "0"]), "column 'advantage' is string, where the Reward layout has double"),
    (Reward, "group_index", pa.array([0.0, 3.0]), "column 'group_index' is double, where the Reward layout has int64"),
    (Rollout, "turns", pa.array([[], []], pa.list_(pa.string())), "column 'turns' is list<item: string>, where the Rollout layout"),
    (Reward, "advantage", pa.array([1.0, None], pa.float64()), "Reward.advantage is null"),
    (Reward, "status", pa.array(["ok", "approved"]), r"Reward.status is 'approved', not one of \['ok', 'excluded', "),
    (Reward, "components", pa.array(["{}", '{"a": '] ), "Reward.components is not JSON"),
    (Reward, "components", pa.array(["{}", "[" * 100_000 + "]" * 100_000]), "Reward.components is not JSON"),
    (Reward, "components", pa.array(["{}", "[1]"]), "Reward.components is a JSON list, not an object"),
    (Reward, "components", pa.array(["{}", '{"ok": "yes"}']), r"Reward.components\['ok'\] is not a number"),
    (Reward, "components", pa.array(["{}", '{"ok": null}']), r"Reward.components\['ok'\] is not a number"),
    (Task, "reference", pa.array(["null", "{}"]), "Task.reference is a JSON NoneType, not an object"),
    (Rollout, "logprobs", pa.array([[-0.1, None, -2.0], []], pa.list_(pa.float64())), "Rollout.logprobs holds a null"),
    # a null record inside a list of records (before: TypeError from the field lookup)
    (Rollout, "turns", pa.array([[None], []], schema_of(Rollout).field("turns").type), "Rollout.turns holds a null"),
])
def test_a_column_that_is_not_the_layout_is_refused(cls: type, name: str, column: pa.Array, problem: str) -> None:
    table = replaced(to_table(SAMPLES[cls]), name, column)
    with pytest.raises(LayoutError, match=f"^{problem}"):
        from_table(cls, table)


def test_records_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        REWARDS[0].advantage = 0.0  # type: ignore[misc]
