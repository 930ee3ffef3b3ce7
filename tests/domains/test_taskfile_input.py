"""Task and completion files that are not what they seem: each is one stderr line and exit 2.

A FIFO or a device (``/dev/zero``, or a symlink to it) is refused before it is read (no
hang, no unbounded read); a non-UTF-8 task file names its byte and line; a UTF-8 BOM is
dropped; a lone surrogate anywhere in a row, an integer past Python's 4300-digit limit
and a newline in a value or a path each give a message of their own, on one line. The
FIFO tests run under a pytest-timeout deadline so a regression fails instead of hanging.
"""

from __future__ import annotations

import json
import os

import pytest

from components.cli import main
from components.core.errors import UserError
from components.core.files import Unreadable, read_regular
from components.domains.base import task_id
from components.domains.taskfile import MAX_FILE_BYTES, load_tasks

ROW = {"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}}
TASK_FIX = "fix: pass an existing regular .parquet, .jsonl or .json file (local path, file:// or s3:// URI)"


def verify(tmp_path, task: str, completion: str | None = None) -> int:
    """``posttrain verify --domain math --task TASK --completion COMPLETION`` (default: a file holding 2)."""
    if completion is None:
        completion = str(tmp_path / "c.txt")
        (tmp_path / "c.txt").write_text("2")
    return main(["verify", "--domain", "math", "--task", task, "--completion", completion])


def error_line(capsys, code: int) -> str:
    """The one stderr line of a run that exited 2."""
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(("uri", "problem"), [
    ("file://rel/t.json", "a file URI with the host 'rel': only local paths are supported; "
                          "fix: write three slashes for a local path (file:///rel/t.json)"),
    ("ftp://h/t.json", "unsupported URI scheme 'ftp'; fix: use one of file://, s3://"),
    ("s3:///t.json", "s3 URI has no bucket; fix: write s3://bucket/prefix"),
])
def test_a_task_file_uri_of_another_kind_is_refused_unread(uri, problem, tmp_path, capsys, monkeypatch):
    """``file://rel/t.json`` read the relative ``rel/t.json`` (exit 0 when it existed), and
    ``ftp://`` was tried and named only by its exception's type (``gaierror``)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / "t.json").write_text(json.dumps({"prompt": "1+1", "reference": {"answer": "2"}}))
    assert error_line(capsys, verify(tmp_path, uri)) == f"posttrain: error: task file='{uri}': {problem}"


@pytest.mark.timeout(20)
def test_a_fifo_task_file_is_refused_not_waited_on(tmp_path, capsys):
    fifo = tmp_path / "f.jsonl"
    os.mkfifo(fifo)
    line = error_line(capsys, verify(tmp_path, str(fifo)))
    assert line == f"posttrain: error: task file='{fifo}': is not a regular file (a FIFO); {TASK_FIX}"


@pytest.mark.timeout(20)
def test_a_fifo_task_file_uri_is_refused_not_waited_on(tmp_path, capsys):
    fifo = tmp_path / "f.json"
    os.mkfifo(fifo)
    line = error_line(capsys, verify(tmp_path, f"file://{fifo}"))
    assert line == f"posttrain: error: task file='file://{fifo}': is not a regular file (a FIFO); {TASK_FIX}"


@pytest.mark.timeout(20)
def test_a_symlink_to_dev_zero_is_refused_not_read(tmp_path, capsys):
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    line = error_line(capsys, verify(tmp_path, str(tmp_path / "zero.jsonl")))
    assert line == f"posttrain: error: task file='{tmp_path / 'zero.jsonl'}': is not a regular file (a character device); {TASK_FIX}"


def test_a_missing_task_file_still_says_cannot_be_read(tmp_path, capsys):
    line = error_line(capsys, verify(tmp_path, str(tmp_path / "none.jsonl")))
    assert line == f"posttrain: error: task file='{tmp_path / 'none.jsonl'}': cannot be read: no such file; {TASK_FIX}"


@pytest.mark.timeout(20)
def test_a_fifo_completion_is_refused_not_waited_on(tmp_path, capsys):
    (tmp_path / "t.json").write_text(json.dumps(ROW))
    fifo = tmp_path / "c.txt"
    os.mkfifo(fifo)
    line = error_line(capsys, verify(tmp_path, str(tmp_path / "t.json"), str(fifo)))
    assert line == (f"posttrain: error: --completion='{fifo}': is not a regular file (a FIFO); "
                    "fix: pass a text file holding the completion")


def test_read_regular_reads_at_most_one_byte_past_the_limit(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 100)
    assert read_regular(tmp_path / "big", 10) == b"x" * 11  # "too large" is visible, the rest is never read
    assert read_regular(tmp_path / "big", 100) == b"x" * 100
    (tmp_path / "empty").write_bytes(b"")
    assert read_regular(tmp_path / "empty", 10) == b""
    # a /proc file says size 0 but has content: read to its end all the same
    assert read_regular("/proc/self/status", MAX_FILE_BYTES).startswith(b"Name:")
    with pytest.raises(Unreadable, match=r"^is a directory$"):
        read_regular(tmp_path, 10)
    with pytest.raises(Unreadable, match=r"^no such file$"):
        read_regular(tmp_path / "none", 10)


def test_a_lone_surrogate_in_the_prompt_is_named(tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    path.write_text('{"domain":"math","prompt":"\\ud800","reference":{"answer":"2"}}\n')
    line = error_line(capsys, verify(tmp_path, str(path)))
    assert line == (f"posttrain: error: {path} line 1: prompt='\\ud800': is not valid Unicode text (a lone surrogate, "
                    "e.g. a \\ud800 escape); fix: write the character itself, or both halves of its \\u surrogate pair")


@pytest.mark.parametrize(("text", "field", "value"), [
    ('{"domain":"math","prompt":"x","reference":{"answer":"2"},"metadata":{"tags":["ok","\\udfff"]}}', "metadata.tags[1]",
     "\udfff"),
    ('{"domain":"math","prompt":"x","reference":{"answer":"2","\\ud801x":1}}', "reference.\\ud801x", "\ud801x"),
    # a reference given as a JSON string (as Parquet files hold it): checked once it is parsed
    ('{"domain":"math","prompt":"x","reference":"{\\"answer\\": \\"\\\\ud800\\"}"}', "reference.answer", "\ud800"),
    ('{"domain":"math","prompt":"x","reference":{"answer":"2"},"task_id":"a\\udc80"}', "task_id", "a\udc80"),
])
def test_a_lone_surrogate_anywhere_in_a_row_is_named(tmp_path, text, field, value):
    path = tmp_path / "s.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert (err.value.field, err.value.value) == (f"{path} line 1: {field}", value)
    assert err.value.problem.startswith("is not valid Unicode text")


def test_a_surrogate_pair_is_one_character_and_fine(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text('{"domain":"math","prompt":"\\ud83d\\ude00 1+1=","reference":{"answer":"2"}}\n')
    assert load_tasks(str(path))[0].prompt == "\N{GRINNING FACE} 1+1="


def test_a_latin1_task_file_names_its_byte_and_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(ROW).encode() + b'\n{"domain":"math","prompt":"caf\xe9","reference":{"answer":"2"}}\n')
    line = error_line(capsys, verify(tmp_path, str(path)))
    offset = len(json.dumps(ROW)) + 1 + len('{"domain":"math","prompt":"caf')
    assert line == f"posttrain: error: task file='{path}': not UTF-8 text (byte 0xe9 at offset {offset}, line 2); fix: save it as UTF-8"


@pytest.mark.parametrize("name", ["t.json", "t.jsonl"])
def test_a_utf16_task_file_is_refused(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(json.dumps(ROW).encode("utf-16"))
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert (err.value.field, err.value.problem, err.value.fix) == ("task file", "UTF-16 text, not UTF-8", "save it as UTF-8")


@pytest.mark.parametrize("name", ["t.json", "t.jsonl"])
def test_a_utf8_bom_is_dropped(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROW).encode() + b"\n")
    [task] = load_tasks(str(path))
    assert (task.domain, task.prompt, task.reference) == ("math", "1+1=", {"answer": "2"})


def test_a_byte_offset_counts_the_bom(tmp_path):
    path = tmp_path / "t.jsonl"
    head = b'{"domain":"math","prompt":"'
    path.write_bytes(b"\xef\xbb\xbf" + head + b'\xff"}\n')
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert err.value.problem == f"not UTF-8 text (byte 0xff at offset {3 + len(head)}, line 1)"


@pytest.mark.parametrize("name", ["t.json", "t.jsonl"])
def test_an_integer_past_4300_digits_has_its_own_message(tmp_path, name):
    path = tmp_path / name
    path.write_text(json.dumps(ROW)[:-1] + ', "difficulty": ' + "1" * 5000 + "}\n")
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert err.value.problem == "a number has more than 4300 digits"
    assert err.value.fix == "write numbers of at most 4300 digits (or quote it as a string)"
    assert "set_int_max_str_digits" not in err.value.line() and "nest" not in err.value.fix


def test_a_newline_in_the_task_domain_stays_on_one_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({**ROW, "domain": "a\nb"}) + "\n")
    line = error_line(capsys, verify(tmp_path, str(path)))
    assert line == ("posttrain: error: --domain='math': the task's domain is 'a\\nb'; "
                    "fix: set the task's domain to 'math' (or drop it: --domain fills it in)")


def test_a_registered_task_domain_is_still_named_in_the_fix(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**ROW, "domain": "code"}))
    line = error_line(capsys, verify(tmp_path, str(path)))
    assert line == ("posttrain: error: --domain='math': the task's domain is 'code'; "
                    "fix: pass --domain code or a task of domain math")


def test_a_newline_in_the_task_file_path_stays_on_one_line(tmp_path, capsys):
    folder = tmp_path / "a\nb"
    folder.mkdir()
    path = folder / "t.jsonl"
    path.write_text(json.dumps({**ROW, "reference": {}}) + "\n")
    line = error_line(capsys, verify(tmp_path, str(path)))
    assert line.startswith(f"posttrain: error: {tmp_path}/a\\nb/t.jsonl line 1: reference.answer=None: ")
    with pytest.raises(UserError) as err:  # load_tasks' duplicate-id message names the path the same way
        path.write_text((json.dumps(ROW) + "\n") * 2)
        load_tasks(str(path))
    assert err.value.field == f"{tmp_path}/a\\nb/t.jsonl line 2: task_id"


def test_an_s3_task_file_is_read_one_byte_past_the_limit_at_most(s3_env, monkeypatch) -> None:
    """An object over the limit is refused after reading the limit and one byte (a ranged
    GET), not read whole into memory first; a store nobody answers is an outage."""
    from components.core.errors import InfraError
    from components.domains import taskfile
    from tests.fixtures.s3 import closed_port, unique_prefix

    key = f"{unique_prefix('task-file-limit')}/tasks.jsonl"
    row = b'{"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}}\n'
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=key, Body=row * 4)
    uri = f"s3://{s3_env.bucket}/{key}"
    assert taskfile.read_bytes(uri) == row * 4
    from components.core import storage

    asked: list[tuple] = []
    real = storage.filesystem

    class Spy:
        def __init__(self, fs) -> None:
            self.fs = fs

        def cat_file(self, path, start=None, end=None, **kwargs):
            asked.append((start, end))
            return self.fs.cat_file(path, start=start, end=end, **kwargs)

    monkeypatch.setattr(storage, "filesystem", lambda u: (Spy(real(u)[0]), real(u)[1]))
    monkeypatch.setattr(taskfile, "MAX_FILE_BYTES", len(row))  # the object is 4 rows: over this limit
    with pytest.raises(UserError) as caught:
        taskfile.read_bytes(uri)
    assert (caught.value.field, caught.value.value) == ("task file", uri)
    assert caught.value.problem.startswith("larger than")
    assert asked == [(0, len(row) + 1)]  # a ranged read: the limit and one byte
    with pytest.raises(UserError) as caught:  # no such object: the user's to fix
        taskfile.read_bytes(f"s3://{s3_env.bucket}/missing-{key}")
    assert caught.value.problem == "cannot be read (FileNotFoundError)"
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(InfraError, match="EndpointConnectionError"):  # before: botocore's traceback
        taskfile.read_bytes(f"s3://{s3_env.bucket}/other-{key}")


def test_jsonl_rows_end_at_newlines_only(tmp_path):
    """Before, rows were split with str.splitlines(): a raw U+2028 or U+0085 inside a
    string (as ensure_ascii=False writes them) ended the row mid-string."""
    rows = [{"domain": "math", "prompt": f"1+1={ch}", "reference": {"answer": "2"}} for ch in "\u2028\u2029\x85\x1c"]
    path = tmp_path / "t.jsonl"
    path.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n", encoding="utf-8")
    assert [t.prompt for t in load_tasks(str(path))] == [r["prompt"] for r in rows]


@pytest.mark.parametrize(("start", "metadata", "field", "problem"), [
    ({"a": "file:x", "a/b": "file:y"}, {}, "start['a/b']", "lies inside 'a', which is 'file:x', not 'dir'"),
    ({".": "file:x"}, {}, "start['.']", "must be a relative path inside the work folder"),
    ({"a/./b": "dir"}, {}, "start['a/./b']", "must be a relative path inside the work folder"),
    ({"a\x00b": "file:x"}, {}, "start['a\\x00b']", "must hold no control characters"),
    ({"a\nb": "file:x"}, {}, "start['a\\nb']", "must hold no control characters"),
    ({"a" * 256: "file:x"}, {}, "start['" + "a" * 38, "has a part longer than a file name can be"),
    ({"l": "link"}, {}, "start['l']", "must be 'dir' or 'file:<text>' (a start state cannot hold a link)"),
    ({"d": "dir"}, {"multi_step": True}, "start['d']", "must be 'file:<text>' in a multi-step or interactive task"),
])
def test_a_terminal_start_state_the_sandbox_cannot_lay_out_is_refused(tmp_path, start, metadata, field, problem):
    """Before, these loaded, and then every completion of the task scored 0 (the driver
    failed laying them out) or was an infra_error (a session could not), or the two paths
    laid a 'link' out differently."""
    row = {"domain": "terminal", "prompt": "new dir a\n$ ", "metadata": metadata,
           "reference": {"solution": "mkdir a", "start": start, "expected": {"a": "dir"}}}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert err.value.field.startswith(f"{path} line 1: reference.{field}")
    assert err.value.problem.startswith(problem)


def test_an_expected_file_text_longer_than_the_listing_reads_is_refused(tmp_path):
    row = {"domain": "terminal", "prompt": "a says x\n$ ",
           "reference": {"solution": "", "start": {}, "expected": {"a": "file:" + "x" * 65}}}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(UserError, match="file text must be at most 64 bytes"):
        load_tasks(str(path))
    row["reference"]["expected"] = {"a": "file:" + "x" * 64, "d": "dir", "d/e": "link"}
    path.write_text(json.dumps(row) + "\n")
    assert load_tasks(str(path))[0].reference["expected"]["a"] == "file:" + "x" * 64


def written(tmp_path, row: dict) -> str:
    """``row`` as the one line of a JSON Lines task file; returns its path."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return str(path)


def refused_line(tmp_path, row: dict) -> str:
    """The one line ``load_tasks`` refuses a task file of ``row`` with."""
    with pytest.raises(UserError) as err:
        load_tasks(written(tmp_path, row))
    return err.value.line()


def test_a_terminal_mode_flag_that_is_not_a_boolean_is_named_with_its_value(tmp_path):
    """Before, ``"interactive": "no"`` loaded and turned the interactive mode on."""
    row = {"domain": "terminal", "prompt": "p", "metadata": {"interactive": "no"},
           "reference": {"start": {"a": "file:x"}, "expected": {"a": "file:x"}}}
    assert refused_line(tmp_path, row) == (
        f"{tmp_path}/t.jsonl line 1: metadata.interactive='no': must be true or false without quotes (a JSON boolean: the string "
        "'no' would turn the mode on) for domain terminal; fix: see the metadata keys in components/domains/terminal.py")
    row["metadata"] = {"interactive": False, "multi_step": True}
    assert load_tasks(written(tmp_path, row))[0].metadata == {"interactive": False, "multi_step": True}


@pytest.mark.parametrize("domain", ["math", "terminal"])
def test_a_trap_flag_that_is_not_a_boolean_is_named_with_its_value(domain, tmp_path):
    """Before, ``"trap": "no"`` loaded and the eval reports counted the task as a trap."""
    reference = {"answer": "7"} if domain == "math" else {"start": {"a": "file:x"}, "expected": {"a": "file:x"}}
    row = {"domain": domain, "prompt": "p", "metadata": {"trap": "no"}, "reference": reference}
    assert refused_line(tmp_path, row) == (
        f"{tmp_path}/t.jsonl line 1: metadata.trap='no': must be true or false without quotes (a JSON boolean: the eval reports "
        "would count the string 'no' as a trap task); fix: write true or false, or leave the key out")
    row["metadata"] = {"trap": False}
    assert load_tasks(written(tmp_path, row))[0].metadata == {"trap": False}


def test_an_extraction_answer_no_completion_matches_is_named_with_its_value(tmp_path):
    """Before, ``"1,000"`` loaded, and every completion scored 0 (a completion is split at commas)."""
    row = {"domain": "extraction", "prompt": "Q1 rev 1000\nrev?\n", "reference": {"fields": ["rev"], "answer": ["1,000"]}}
    assert refused_line(tmp_path, row) == (
        f"{tmp_path}/t.jsonl line 1: reference.answer[0]='1,000': is '1,000', which holds a ',': a completion is split at commas, so "
        "it never matches; write the number without separators (1,000 as 1000) for domain extraction; fix: see the "
        "reference shape in components/domains/extraction.py")


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("split", 0, "unknown split"),
    ("split", False, "unknown split"),
    ("metadata", 0, "must be an object"),
    ("metadata", False, "must be an object"),
    ("metadata", [], "must be an object"),
    ("task_id", "a\nb", "must be a string of at most 200 characters without control characters"),
    ("task_id", "a\x00b", "must be a string of at most 200 characters without control characters"),
])
def test_a_falsy_or_control_character_field_is_named_not_defaulted(tmp_path, field, value, problem):
    """Before, split 0 became 'train', metadata 0 or [] became {}, and a task id with a
    newline or NUL went on into every rollout id."""
    row = {"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}, field: value}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert err.value.field == f"{path} line 1: {field}" and err.value.problem.startswith(problem)


def test_a_task_id_of_0_is_the_id_0(tmp_path):
    """It was replaced by one derived from the prompt (``row.get("task_id") or ...``); an
    empty one (a Parquet column's missing value) still is."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}, "task_id": 0}) + "\n")
    assert load_tasks(str(path))[0].task_id == "0"
    path.write_text(json.dumps({"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}, "task_id": ""}) + "\n")
    assert load_tasks(str(path))[0].task_id == task_id("math", "1+1=")


def test_a_missing_or_null_split_and_metadata_take_their_defaults(tmp_path):
    rows = [{"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}, "split": None, "metadata": None},
            {"domain": "math", "prompt": "2+2=", "reference": {"answer": "4"}, "split": "", "metadata": ""}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [(t.split, t.metadata) for t in load_tasks(str(path))] == [("train", {}), ("train", {})]


@pytest.mark.parametrize(("column", "name", "kind"), [
    ("when", "metadata.when", "datetime"),
    ("blob", "metadata.blob", "bytes"),
    ("amount", "metadata.amount", "Decimal"),
])
def test_a_parquet_value_json_cannot_hold_is_named_as_the_file_loads(tmp_path, column, name, kind):
    """Before, a timestamp, bytes or decimal in a Parquet task file's metadata passed every
    check and then crashed taskgen writing its tasks (TypeError: not JSON serializable)."""
    import datetime
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    value = {"when": datetime.datetime(2026, 1, 2), "blob": b"\x00\xff", "amount": decimal.Decimal("1.50")}[column]
    table = pa.Table.from_pylist([{"domain": "math", "prompt": "1+2=", "reference": '{"answer": "3"}',
                                   "metadata": {column: value}}])
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert err.value.field == f"{path} row 0: {name}"
    assert err.value.problem == f"is a {kind}, which a JSON value cannot be"


@pytest.mark.parametrize(("name", "text"), [
    ("t.jsonl", '{"domain": "math", "domain": "code", "prompt": "1+1=", "reference": {"answer": "2"}}\n'),
    ("t.json", '[{"domain": "math", "prompt": "1+1=", "reference": {"answer": "2", "answer": "3"}}]'),
])
def test_a_key_given_twice_is_refused(tmp_path, name, text):
    """Before, the last of the two was kept without a word (recipes already refused this)."""
    path = tmp_path / name
    path.write_text(text)
    key = "domain" if name.endswith(".jsonl") else "answer"
    with pytest.raises(UserError) as err:
        load_tasks(str(path))
    assert err.value.problem == f"key {key!r} is given twice in one object"


def test_a_command_that_exits_right_after_reading_parquet_does_not_abort(tmp_path):
    """pyarrow's reader threads, still winding down when a process exits right after a
    read, aborted it about one time in three (exit 134, "terminate called without an
    active exception"): ``posttrain verify`` on a Parquet task file the rows of which it
    refuses. Every Parquet read now decodes on the calling thread; the thread count
    after the reads is checked too, since the abort itself is rare on a quiet machine."""
    import subprocess
    import sys
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "tasks.parquet"
    pq.write_table(pa.table({"task_id": [f"t{i}" for i in range(50)], "prompt": ["p"] * 50,
                             "reference": ["1"] * 50}), path)
    script = ("import os, sys\nfrom components.domains.taskfile import read_rows\nfrom components.core.storage import Store\n"
              "threads = len(os.listdir('/proc/self/task'))\n"
              f"rows = read_rows({str(path)!r})\nassert len(rows) == 50\n"
              f"t = Store({str(tmp_path)!r}, 'x').read_table('tasks.parquet')\nassert t.num_rows == 50\n"
              "assert len(os.listdir('/proc/self/task')) == threads, os.listdir('/proc/self/task')\n"
              "sys.exit(2)\n")
    root = Path(__file__).resolve().parents[2]
    runs = [subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, timeout=120)
            for _ in range(12)]
    assert [r.returncode for r in runs] == [2] * 12, [r.stderr[-500:] for r in runs if r.returncode != 2]
