"""Task files: Parquet / JSONL / JSON rows validated into Task records, errors naming row and field."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.core.errors import UserError
from components.domains.base import task_id
from components.domains.taskfile import load_tasks

ROWS = [
    {"domain": "math", "prompt": "3*4-5=", "reference": {"answer": "7"}, "difficulty": 1},
    {"domain": "extraction", "prompt": "Q1 rev 4 tax 2\nrev?\n", "reference": {"fields": ["rev"], "answer": ["4"]},
     "split": "eval", "metadata": {"trap": False}, "task_id": "x-1"},
]


def test_jsonl_and_parquet_load_the_same_tasks(tmp_path):
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    parquet = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "reference": json.dumps(r["reference"]),
                                          "metadata": json.dumps(r.get("metadata", {})),
                                          "split": r.get("split", "train"), "task_id": r.get("task_id", ""),
                                          "difficulty": r.get("difficulty", 1)} for r in ROWS]), parquet)
    a, b = load_tasks(str(jsonl)), load_tasks(parquet.as_uri())
    assert a == b
    assert a[0].task_id == task_id("math", "3*4-5=") and a[0].split == "train" and a[0].context_tokens == 6
    assert (a[1].task_id, a[1].split, a[1].reference["answer"], a[1].metadata) == ("x-1", "eval", ["4"], {"trap": False})


@pytest.mark.parametrize(("content", "field", "problem"), [
    ('{"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}}\n{"domain": "chess"}',
     "line 2: prompt", "missing required task field"),
    ('{"domain": "chess", "prompt": "e4", "reference": {}}', "line 1: domain", "unknown domain"),
    ('{"domain": "math", "prompt": "1+1=", "reference": "2"}', "line 1: reference", "must be an object"),
    ('{"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}, "difficulty": 0}', "line 1: difficulty",
     "must be an integer >= 1"),
    ('{"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}, "split": "test"}', "line 1: split", "unknown split"),
    ('{"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}, "promt": "x"}', "line 1: promt",
     "unknown task field"),
    ('{"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}}\n'
     '{"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}}', "line 2: task_id", "duplicates line 1"),
    ('[1, 2', "line 1", "not valid JSON"),
    ("", "task file", "holds no tasks"),
])
def test_bad_rows_name_row_field_and_fix(tmp_path, content, field, problem):
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert field in err.value.field and problem in err.value.problem and err.value.fix


def test_unknown_suffix_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="unknown file type"):
        load_tasks(str(tmp_path / "t.csv"))
    with pytest.raises(UserError, match="cannot be read"):
        load_tasks(str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(UserError, match="not a readable Parquet file"):
        load_tasks(str(tmp_path / "bad.parquet"))


def test_parquet_nulls_are_absent_keys_at_any_depth(tmp_path):
    """A Parquet struct column gives every row all the keys any row has, null where the row
    has none (and a nullable column gives null): a row without ``metadata.trap`` or
    ``difficulty`` was refused ("leave the key out"), and terminal's ``expected`` got a
    ``None`` path."""
    rows = [
        {"domain": "math", "prompt": "3*4-5=", "reference": {"answer": "7"}, "metadata": {"trap": True}, "difficulty": 2},
        {"domain": "math", "prompt": "1/2+1/4=", "reference": {"answer": "3/4"}, "metadata": {"source": "book"}},
        {"domain": "terminal", "prompt": "new dir a\n$ ", "reference": {"solution": "mkdir a", "expected": {"a": "dir"}}},
        {"domain": "terminal", "prompt": "del x.log\n$ ",
         "reference": {"solution": "rm x.log", "start": {"x.log": "file:"}, "expected": {}}},
    ]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    tasks = load_tasks(str(path))
    assert [t.metadata for t in tasks] == [{"trap": True}, {"source": "book"}, {}, {}]
    assert [t.difficulty for t in tasks] == [2, 1, 1, 1]
    assert [t.reference for t in tasks] == [
        {"answer": "7"}, {"answer": "3/4"}, {"solution": "mkdir a", "expected": {"a": "dir"}},
        {"solution": "rm x.log", "start": {"x.log": "file:"}, "expected": {}}]


@pytest.mark.parametrize(("reference", "problem"), [
    ('{"answer": "2", "answer": "3"}', "key 'answer' is given twice in one object"),
    ('{"answer": ' + "9" * 4400 + "}", "a number has more than 4300 digits"),
    ("[" * 40 + "]" * 40, "nested deeper than 32 levels"),
], ids=["duplicate-key", "huge-number", "too-deep"])
def test_a_reference_json_string_past_a_bound_says_which(tmp_path, reference, problem):
    """A JSON-string reference past a bound was reported as "must be an object (or a JSON
    string of one)", hiding which bound it broke."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"domain": "math", "prompt": "1+1=", "reference": reference}))
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert (err.value.field, err.value.problem) == (f"{path} line 1: reference", problem)


def test_a_row_whose_prompt_hides_its_reference_gets_an_id_of_both(tmp_path):
    """Rows exported from terminal's interactive tasks (``metadata.hidden_reference``) share
    prompts: their derived ids were the prompt's alone and the second row "duplicated" the first."""
    from components.domains.base import HIDDEN_REFERENCE

    def row(name: str, hidden: object = True) -> dict:
        return {"domain": "terminal", "prompt": "new dir named in n\n(has n)\n$ ", "metadata": {
            "interactive": True, HIDDEN_REFERENCE: hidden}, "reference": {
            "solution": f"cat n\nmkdir {name}", "start": {"n": f"file:{name}\n"}, "expected": {"n": f"file:{name}\n",
                                                                                             name: "dir"}}}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row("a")) + "\n" + json.dumps(row("b")))
    a, b = load_tasks(str(path))
    assert (a.task_id, b.task_id) == (task_id("terminal", a.prompt, a.reference), task_id("terminal", b.prompt, b.reference))
    assert a.task_id != b.task_id
    path.write_text(json.dumps(row("a", "yes")))
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert (err.value.field, err.value.value) == (f"{path} line 1: metadata.hidden_reference", "yes")


@pytest.mark.parametrize(("second", "field", "problem"), [
    ('{"domain": "math",', "line 3", "not valid JSON"),
    ('{"domain": "mth", "prompt": "2+2=", "reference": {"answer": "4"}}', "line 3: domain", "unknown domain"),
    ('{"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}}', "line 3: task_id", "duplicates line 2"),
])
def test_a_jsonl_problem_names_the_file_and_its_line(tmp_path, second, field, problem):
    """A syntax error's message named no file ("task file line 2"), and a schema error
    counted rows from 0 over the non-blank lines ("row 1" for the row on line 3)."""
    path = tmp_path / "t.jsonl"
    path.write_text('\n{"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}}\n' + second + "\n")
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert err.value.field == f"{path} {field}" and err.value.problem.startswith(problem)


def test_json_and_parquet_rows_keep_their_0_based_index(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([ROWS[0], {**ROWS[0], "domain": "mth"}]))
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert err.value.field == f"{path} row 1: domain"
    parquet = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{**ROWS[0], "reference": '{"answer": "7"}'}] * 2), parquet)
    with pytest.raises(UserError) as err:
        load_tasks(str(parquet))
    assert (err.value.field, err.value.problem) == (f"{parquet} row 1: task_id", "duplicates row 0")
