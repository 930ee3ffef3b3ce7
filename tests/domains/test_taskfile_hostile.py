"""Task files that cost memory, name a store without keys, or hold a terminal reference of
the wrong shape: each is one UserError (exit 2, one stderr line) naming the file, field
and value, with the fix that applies.

Sizes here are small: the caps are patched down to a MiB, and memory running out is a
``MemoryError`` raised by a patched parser, so no test writes or parses hundreds of MB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from components.cli import main
from components.core.errors import UserError
from components.domains import taskfile
from components.domains.base import MAX_REFERENCE_CHARS
from components.domains.taskfile import load_tasks, read_rows

ROOT = Path(__file__).resolve().parents[2]
ROW = {"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}}
JSON_FIX = "write it as JSON Lines (.jsonl, one task per line) or Parquet, or split it into smaller files"


def error_line(capsys, code: int | None) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def verify(tmp_path: Path, task: str, domain: str = "math") -> int | None:
    (tmp_path / "c.txt").write_text("2")
    return main(["verify", "--domain", domain, "--task", task, "--completion", str(tmp_path / "c.txt")])


# -- 1. a file too large to parse in memory ----------------------------------------------------


def test_a_json_task_file_over_its_own_cap_is_refused_before_it_is_parsed(tmp_path, capsys, monkeypatch):
    """Before, a 420 MB ``[[],[],...]`` .json file (under the 1 GiB cap of every task file)
    was read whole and parsed at about 20 times its size: a MemoryError traceback and exit 1
    after 95 s. A .json file is one document, so it has a cap of its own, and the read
    stops one byte past it."""
    cap = 1 << 20
    monkeypatch.setattr(taskfile, "MAX_JSON_FILE_BYTES", cap)
    path = tmp_path / "t.json"
    path.write_bytes(b"[" + b"[]," * ((cap + 1) // 3) + b"[]]")  # just over the cap
    assert cap < path.stat().st_size < cap + 8
    limits: list[int] = []
    real = taskfile.read_regular
    monkeypatch.setattr(taskfile, "read_regular", lambda name, limit: limits.append(limit) or real(name, limit))
    parsed: list[str] = []
    monkeypatch.setattr(taskfile, "loads", lambda text: parsed.append(text))
    problem = ("larger than 1 MiB, the limit for a .json file (one document, parsed whole: it takes up to 20 times "
               "its size in memory)")
    assert error_line(capsys, verify(tmp_path, str(path))) == (
        f"posttrain: error: task file='{path}': {problem}; fix: {JSON_FIX}")
    with pytest.raises(UserError) as err:  # run's pre-run check and taskgen read with load_tasks
        load_tasks(str(path))
    assert (err.value.field, err.value.value, err.value.problem, err.value.fix) == ("task file", str(path), problem, JSON_FIX)
    assert limits == [cap, cap] and parsed == []  # never more than the cap and a byte read, nothing parsed


def test_jsonl_and_parquet_task_files_are_not_held_to_the_json_cap(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(taskfile, "MAX_JSON_FILE_BYTES", 1 << 10)
    rows = [{**ROW, "prompt": f"{i}+0=", "reference": {"answer": str(i)}} for i in range(200)]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert jsonl.stat().st_size > 1 << 10
    assert [t.prompt for t in load_tasks(str(jsonl))] == [r["prompt"] for r in rows]
    parquet = tmp_path / "t.parquet"
    pq.write_table(pa.table({"domain": ["math"] * 200, "prompt": [r["prompt"] for r in rows],
                             "reference": [json.dumps(r["reference"]) for r in rows]}), parquet, row_group_size=50)
    assert [t.prompt for t in load_tasks(str(parquet))] == [r["prompt"] for r in rows]
    assert [r["prompt"] for r in read_rows(str(parquet), limit=3)] == ["0+0=", "1+0=", "2+0="]


def test_a_bad_row_0_of_a_large_jsonl_file_ends_the_load_there(tmp_path, monkeypatch):
    """Before, ``load_tasks`` parsed and held every row before checking row 0: a 420 MB
    file of ``[]`` lines took some 9 GB first. Rows are checked as they are parsed now."""
    path = tmp_path / "t.jsonl"
    path.write_text("[]\n" * 10_000)
    parsed: list[str] = []
    real = taskfile.loads
    monkeypatch.setattr(taskfile, "loads", lambda text: parsed.append(text) or real(text))
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert str(err.value) == (f"{path} line 1='[]': a task must be a JSON object; "
                              "fix: write an object with ['domain', 'prompt', 'reference']")
    assert parsed == ["[]"]


@pytest.mark.parametrize(("name", "fix"), [
    ("t.json", "split it into smaller files, or write it as JSON Lines (.jsonl, one task per line) or Parquet"),
    ("t.jsonl", "split it into smaller files"),
])
def test_running_out_of_memory_while_parsing_a_task_file_is_one_line(tmp_path, capsys, monkeypatch, name, fix):
    """A MemoryError while parsing (a file within the caps on a machine with less memory)
    was a traceback and exit 1; now it names the file and how to make it smaller."""
    path = tmp_path / name
    path.write_text(json.dumps(ROW) + "\n")

    def no_memory(text):
        raise MemoryError

    monkeypatch.setattr(taskfile, "loads", no_memory)
    problem = "too large to parse in this machine's memory (MemoryError)"
    assert error_line(capsys, verify(tmp_path, str(path))) == f"posttrain: error: task file='{path}': {problem}; fix: {fix}"
    for read in (read_rows, load_tasks):
        with pytest.raises(UserError) as err:
            read(str(path))
        assert (err.value.field, err.value.value, err.value.problem, err.value.fix) == ("task file", str(path), problem, fix)


def test_running_out_of_memory_while_checking_rows_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ROW) + "\n")

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(taskfile, "parse_task", no_memory)
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert str(err.value) == (f"task file='{path}': too large to parse in this machine's memory (MemoryError); "
                              "fix: split it into smaller files")


# -- 2. a task file in a store without credentials -------------------------------------------------


@pytest.mark.parametrize("endpoint", [None, "http://127.0.0.1:1"])
def test_an_s3_task_file_without_credentials_says_to_set_them(tmp_path, endpoint):
    """The fix was "pass an existing .parquet, .jsonl or .json file", as if the file were
    missing. A fresh process, as for ``serve --checkpoint s3://`` without credentials: no
    credentials cached from another test, none from the environment or ~/.aws, no instance
    metadata asked; with an endpoint, a closed port, so nothing waits on a network."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "POSTTRAIN_HOME": str(tmp_path / "home"),
           "HOME": str(tmp_path), "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
           "AWS_EC2_METADATA_DISABLED": "true"}
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    (tmp_path / "c.txt").write_text("2")
    proc = subprocess.run([sys.executable, "-m", "components.cli", "verify", "--domain", "math", "--task",
                           "s3://bucket/tasks/x.json", "--completion", str(tmp_path / "c.txt")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "posttrain: error: task file='s3://bucket/tasks/x.json': cannot be read (NoCredentialsError); "
        "fix: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for the S3 server"]


class _Refusing:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def cat_file(self, path, start=None, end=None, **kwargs):
        raise self.exc


@pytest.mark.parametrize(("exc", "fix"), [
    (PermissionError("Forbidden"), "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE): the server refused them"),
    (FileNotFoundError("tasks/x.json"), "pass an existing .parquet, .jsonl or .json file (local path, file:// or s3:// URI)"),
    (ValueError("NoSuchBucket"), "pass an existing .parquet, .jsonl or .json file (local path, file:// or s3:// URI)"),
    (ValueError("something else"), "pass an existing .parquet, .jsonl or .json file (local path, file:// or s3:// URI)"),
])
def test_a_store_that_refuses_a_task_file_gets_the_fix_that_applies(monkeypatch, exc, fix):
    from components.core import storage

    monkeypatch.setattr(storage, "filesystem", lambda uri: (_Refusing(exc), uri.split("://", 1)[1]))
    with pytest.raises(UserError) as err:
        taskfile.read_bytes("s3://bucket/tasks/x.json")
    assert (err.value.problem, err.value.fix) == (f"cannot be read ({type(exc).__name__})", fix)


# -- 3 and 4. a terminal reference of the wrong shape names its value -----------------------------

SHAPE_FIX = "fix: see the reference shape in components/domains/terminal.py"


@pytest.mark.parametrize(("start", "shown", "problem"), [
    ({"f": "symlink:/etc/passwd"}, "reference.start['f']='symlink:/etc/passwd'",
     "must be 'dir' or 'file:<text>' (a start state cannot hold a link)"),
    ({"f": 123}, "reference.start['f']=123", "must be 'dir' or 'file:<text>' (a start state cannot hold a link)"),
    ({"/etc/x": "file:a"}, "reference.start['/etc/x']='file:a'",
     "must be a relative path inside the work folder (no leading '/', no '.', '..' or '//')"),
    ({"a": "file:x", "a/b": "dir"}, "reference.start['a/b']='dir'", "lies inside 'a', which is 'file:x', not 'dir'"),
    ({"ok": "dir", "p" * 60: "link"}, "reference.start['" + "p" * 39 + "]='link'",
     "must be 'dir' or 'file:<text>' (a start state cannot hold a link)"),
])
def test_a_terminal_start_entry_of_the_wrong_shape_shows_its_value(tmp_path, capsys, start, shown, problem):
    """The value was always None: the field's name (``start['f']``) was looked up as a key
    of the reference."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"domain": "terminal", "prompt": "p",
                                "reference": {"start": start, "expected": {"f": "file:x"}}}))
    assert error_line(capsys, verify(tmp_path, str(path), "terminal")) == (
        f"posttrain: error: {path} row 0: {shown}: {problem} for domain terminal; {SHAPE_FIX}")


def test_a_terminal_start_file_longer_than_a_reference_text_names_the_limit(tmp_path, capsys):
    """Before: "must be 'dir' or 'file:<text>'", for a text that is a 'file:' entry."""
    text = "file:" + "x" * (MAX_REFERENCE_CHARS - 4)  # one character over
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"domain": "terminal", "prompt": "p",
                                "reference": {"start": {"f": text}, "expected": {"f": "file:x"}}}) + "\n")
    assert error_line(capsys, verify(tmp_path, str(path), "terminal")) == (
        f"posttrain: error: {path} line 1: reference.start['f']='file:{'x' * 75}...': is 10,001 characters, more than "
        f"10,000 (the longest text a reference holds) for domain terminal; {SHAPE_FIX}")
    path.write_text(json.dumps({"domain": "terminal", "prompt": "p",  # at the limit: the start state is fine
                                "reference": {"start": {"f": text[:-1]}, "expected": {"f": "file:x"}}}) + "\n")
    assert load_tasks(str(path))[0].reference["start"]["f"] == text[:-1]


def test_a_terminal_expected_entry_longer_than_a_reference_text_names_the_limit(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"domain": "terminal", "prompt": "p",
                                "reference": {"start": {}, "expected": {"d": "d" * (MAX_REFERENCE_CHARS + 1)}}}) + "\n")
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert err.value.field == f"{path} line 1: reference.expected['d']"
    assert err.value.value == "d" * 80 + "..."
    assert err.value.problem == "is 10,001 characters, more than 10,000 (the longest text a reference holds) for domain terminal"


# -- Parquet values Python cannot represent, columns given twice --------------------------------


def _parquet_with_metadata(path: Path, metadata) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_arrays(
        [pa.array(["math", "math"]), pa.array(["1+1=", "2+2="]), pa.array(['{"answer": "2"}', '{"answer": "4"}']), metadata],
        names=["domain", "prompt", "reference", "metadata"]), path)
    return str(path)


def _unrepresentable(kind: str, row: int):
    """A metadata column whose value in ``row`` (0 or 1) has no Python form."""
    import pyarrow as pa

    if kind == "duplicate-field":  # no row of it converts
        return pa.StructArray.from_arrays([pa.array(["a", "b"]), pa.array(["c", "d"])], names=["tag", "tag"])
    typ, bad = {"timestamp-past-9999": (pa.timestamp("s"), 10**13), "date-past-9999": (pa.date32(), 2**31 - 1),
                "unknown-time-zone": (pa.timestamp("s", tz="Mars/Olympus"), 1)}[kind]
    values = [{"when": None}, {"when": None}]
    values[row] = {"when": bad}
    return pa.array(values, pa.struct([("when", typ)]))


@pytest.mark.parametrize(("kind", "fix"), [
    ("timestamp-past-9999", "store dates and times as ISO 8601 strings"),
    ("date-past-9999", "store dates and times as ISO 8601 strings"),
    ("unknown-time-zone", "store dates and times as ISO 8601 strings"),
    ("duplicate-field", "give each field of the struct its own name"),
])
def test_a_parquet_value_python_cannot_represent_is_one_error_naming_file_row_and_column(tmp_path, capsys, kind, fix):
    """Before, converting the batch to Python raised OverflowError, ArrowInvalid or
    ValueError outside the Parquet ``try``: a traceback and exit 1 from ``load_tasks``,
    ``posttrain verify --task`` and the run's preflight."""
    path = _parquet_with_metadata(tmp_path / "t.parquet", _unrepresentable(kind, 1))
    with pytest.raises(UserError) as err:
        load_tasks(path)
    assert err.value.field == (f"{path} row 0: metadata" if kind == "duplicate-field" else f"{path} row 1: metadata")
    assert err.value.problem.startswith("holds a value Python cannot represent (")
    assert err.value.fix.startswith(fix)
    path = _parquet_with_metadata(tmp_path / "first.parquet", _unrepresentable(kind, 0))  # verify reads row 0
    line = error_line(capsys, verify(tmp_path, path))
    assert line.startswith(f"posttrain: error: {path} row 0: metadata=") and "cannot represent" in line


def test_a_parquet_column_given_twice_is_refused_naming_it(tmp_path, capsys):
    """Before, the second ``reference`` column silently won (JSON refuses a key given twice)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["math"]), pa.array(["1+1="]), pa.array(['{"answer": "2"}']),
                                         pa.array(['{"answer": "3"}'])],
                                        names=["domain", "prompt", "reference", "reference"]), path)
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert (err.value.field, err.value.value, err.value.problem) == (
        "task file", str(path), "has the column 'reference' twice")
    assert error_line(capsys, verify(tmp_path, str(path))).startswith(
        f"posttrain: error: task file='{path}': has the column 'reference' twice; fix: keep one of them")
