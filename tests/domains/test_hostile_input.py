"""Hostile task files and completions: every case is a verdict or one line with exit 2.

Wrong-shaped references are caught when a task is parsed (``load_tasks``, what
``taskgen.task_file`` reads, and ``posttrain verify``), naming the row and the field;
completions that are not UTF-8, huge or deeply nested are ``malformed`` (score 0)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import pytest

from components.cli import main
from components.core.errors import UserError
from components.domains import registry
from components.domains.taskfile import load_tasks

DOMAINS = ("arithmetic", "code", "terminal", "math", "extraction", "structured")
WEAK = ["--backend", "subprocess", "--allow-weak-isolation"]

BAD_REFERENCES = [
    ("arithmetic", {"answer": [1]}, "answer"),
    ("arithmetic", {"answer": "eighty"}, "answer"),
    ("arithmetic", {}, "answer"),
    ("math", {"answer": 5}, "answer"),
    ("math", {"answer": "x/0"}, "answer"),
    ("extraction", {"answer": "412"}, "answer"),
    ("extraction", {"answer": [412, 30]}, "answer"),
    ("extraction", {"answer": ["1"], "fields": "rev"}, "fields"),
    ("structured", {"kind": "part"}, "volume"),
    ("structured", {"kind": "part", "volume": 8, "height": True, "max_side": 4}, "height"),
    ("structured", {"kind": "scene", "widths": [1], "length": 3}, "widths"),
    ("structured", {"kind": ["part"]}, "kind"),
    ("code", {"inputs": [1], "expected": "x"}, "expected"),
    ("code", {"inputs": [1, 2], "expected": [1]}, "expected"),
    ("code", {"expected": [1]}, "inputs"),
    ("terminal", {"expected": []}, "expected"),
    ("terminal", {"start": {"/etc/passwd": "file:x"}, "expected": {}}, "start"),
    ("terminal", {"start": {"../up": "dir"}, "expected": {}}, "start"),
    ("terminal", {"start": {}, "expected": {"a": 1}}, "expected"),
]


def write(tmp_path, name: str, data: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


def verify(tmp_path, capsys, domain: str, task: str | bytes, completion: str | bytes, name: str = "t.json"):
    """Run ``posttrain verify`` in-process; the exit code and the parsed verdict (None on exit 2)."""
    code = main(["verify", "--domain", domain, "--task", write(tmp_path, name, task),
                 "--completion", write(tmp_path, "c.txt", completion), *WEAK, "--timeout", "2"])
    out, err = capsys.readouterr()
    assert code in (0, 2), (code, out, err)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("posttrain: error: ") and "; fix: " in lines[0], err
        assert len(lines[0]) < 1000
        return code, None
    return code, json.loads(out)


def good_task(domain: str) -> dict:
    t = registry.get(domain).make_task(random.Random(5), "train")
    return {"domain": domain, "prompt": t.prompt, "reference": t.reference, "metadata": t.metadata}


@pytest.mark.parametrize(("domain", "reference", "field"), BAD_REFERENCES)
def test_wrong_shaped_reference_is_one_error_naming_task_and_field(tmp_path, capsys, domain, reference, field):
    row = {"domain": domain, "prompt": "p", "reference": reference}
    path = write(tmp_path, "tasks.jsonl", json.dumps(row) + "\n")
    with pytest.raises(UserError) as err:
        load_tasks(path)
    assert f"{path} line 1" in err.value.field and f"reference.{field}" in err.value.field, err.value.line()
    assert domain in err.value.problem
    code, _ = verify(tmp_path, capsys, domain, json.dumps(row), "1")
    assert code == 2


@pytest.mark.parametrize("domain", DOMAINS)
def test_generated_references_pass_their_shape_check(domain):
    d = registry.get(domain)
    for seed in range(50):
        t = d.make_task(random.Random(seed), "train")
        assert d.reference_problem(t.reference) is None, (t.reference, d.reference_problem(t.reference))


@pytest.mark.parametrize("domain", DOMAINS)
@pytest.mark.parametrize("completion", [b"\xff\xfe\xfa not utf-8 \xc3\x28", b"7\n\xed\xa0\x80", b"\x80" * 5000],
                         ids=["latin", "surrogate-bytes", "continuation-bytes"])
def test_non_utf8_completion_is_a_malformed_verdict(tmp_path, capsys, domain, completion):
    code, verdict = verify(tmp_path, capsys, domain, json.dumps(good_task(domain)), completion)
    assert code == 0 and verdict["score"] == 0.0 and verdict["status"] == "malformed"
    assert verdict["execution"] == "none"  # nothing runs for a completion no verifier reads


@pytest.mark.parametrize("domain", ["arithmetic", "math", "extraction", "structured"])
def test_deeply_nested_completion_scores_zero(tmp_path, capsys, domain):
    code, verdict = verify(tmp_path, capsys, domain, json.dumps(good_task(domain)), "[" * 100_000)
    assert code == 0 and verdict["score"] == 0.0


def test_huge_completion_is_malformed(tmp_path, capsys):
    code, verdict = verify(tmp_path, capsys, "structured", json.dumps(good_task("structured")), b"[" * 5_000_000)
    assert code == 0 and verdict["status"] == "malformed"


@pytest.mark.parametrize("task", [
    "[" * 100_000,
    '{"domain": "math", "prompt": "1=", "reference": ' + "[" * 50_000 + "]" * 50_000 + "}",
    json.dumps({"domain": "math", "prompt": "1=", "reference": "[" * 100_000}),
    '{"domain": "math", "prompt": "1=", "reference": {"answer": "1"}, "metadata": {"a": ' + "[" * 40 + "]" * 40 + "}}",
    "pipeline: x".encode("utf-16"),
    bytes(range(256)) * 10,
    json.dumps({"domain": ["math"], "prompt": "1=", "reference": {"answer": "1"}}),
    json.dumps({"domain": "math", "prompt": ["1="], "reference": {"answer": "1"}}),
    json.dumps({"domain": "math", "prompt": "1=", "reference": {"answer": "1"}, "task_id": {"a": 1}}),
    json.dumps({"domain": "math", "prompt": "1=", "reference": {"answer": "1"}, "split": ["train"]}),
    json.dumps({"domain": "math", "prompt": "1=", "reference": {"answer": "1"}, "difficulty": 1e300}),
    '{"domain": "math", "prompt": "1=", "reference": {"answer": "1"}, "difficulty": NaN}',
    json.dumps({"domain": "math", "prompt": "1=", "reference": {"answer": "1"}, "x" * 100_000: 1}),
    json.dumps({"domain": "math", "prompt": "1=", "reference": {"answer": "9" * 100_000}}),
    "[]",
    "null",
    "",
], ids=lambda t: repr(t[:30]))
def test_malformed_task_files_are_one_line(tmp_path, capsys, task):
    code, _ = verify(tmp_path, capsys, "math", task, "1")
    assert code == 2


def test_a_prompt_over_the_bound_is_one_line_naming_its_length(tmp_path, capsys):
    from components.domains.taskfile import MAX_PROMPT_CHARS

    task = json.dumps({"domain": "math", "prompt": "1" * (MAX_PROMPT_CHARS + 1) + "=", "reference": {"answer": "1"}})
    code = main(["verify", "--domain", "math", "--task", write(tmp_path, "t.json", task),
                 "--completion", write(tmp_path, "c.txt", "1"), *WEAK, "--timeout", "2"])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert ": prompt=" in line and f"is {MAX_PROMPT_CHARS + 2:,} characters, more than {MAX_PROMPT_CHARS:,}" in line


@pytest.mark.parametrize("data", [b"PAR1" + b"\x00" * 100 + b"PAR1", b"not parquet", b""])
def test_garbage_parquet_is_one_line(tmp_path, capsys, data):
    code, _ = verify(tmp_path, capsys, "math", data, "1", name="t.parquet")
    assert code == 2


def test_cli_subprocess_never_prints_a_traceback(tmp_path):
    """The real command line, with undecodable bytes and a wrong-shaped reference."""
    task = write(tmp_path, "t.json", json.dumps(good_task("structured")))
    completion = write(tmp_path, "c.txt", b"[" * 100_000 + b"\xff")
    proc = subprocess.run([sys.executable, "-m", "components.cli", "verify", "--domain", "structured", "--task", task,
                           "--completion", completion], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and json.loads(proc.stdout)["status"] == "malformed", proc.stderr
    bad = write(tmp_path, "b.json", json.dumps({"domain": "code", "prompt": "p", "reference": {"inputs": "x"}}))
    proc = subprocess.run([sys.executable, "-m", "components.cli", "verify", "--domain", "code", "--task", bad,
                           "--completion", completion], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "reference.inputs" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("option", [["--timeout", "-1"], ["--timeout", "1e-9"], ["--timeout", "nan"], ["--timeout", "inf"], ["--backend", "nope"]])
def test_bad_sandbox_options_are_one_line(tmp_path, capsys, option):
    task = write(tmp_path, "t.json", json.dumps(good_task("math")))
    code = main(["verify", "--domain", "math", "--task", task, "--completion", write(tmp_path, "c.txt", "1"), *option])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and option[0] in err


def test_verify_reads_a_task_file_no_further_than_row_0(tmp_path, capsys, monkeypatch):
    """``verify`` scores row 0: a JSON Lines file is parsed up to it (before, every row
    was parsed and held, about 73 s and 3.4 GB for 3 million rows, and a bad row 2 was
    an error), a Parquet file's other rows are never turned into Python objects."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from components.domains import taskfile

    first = json.dumps({"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}})
    jsonl = write(tmp_path, "t.jsonl", "\n" + first + "\n{not json\n" + (first + "\n") * 20_000)
    parsed = []
    real = taskfile.loads
    monkeypatch.setattr(taskfile, "loads", lambda text: parsed.append(text) or real(text))
    code = main(["verify", "--domain", "math", "--task", jsonl, "--completion", write(tmp_path, "c.txt", "2"), *WEAK])
    assert code in (0, None) and json.loads(capsys.readouterr().out)["score"] == 1.0
    assert parsed == [first]
    assert len(taskfile.read_rows(jsonl, limit=1)) == 1
    with pytest.raises(UserError, match=f"{re.escape(jsonl)} line 3="):
        taskfile.read_rows(jsonl)  # every row is still read where every row is used
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"domain": ["math"] * 3, "prompt": ["1+1=", "2+2=", "3+3="],
                             "reference": [{"answer": "2"}, {"answer": "4"}, {"answer": "6"}]}), path)
    assert [r["prompt"] for r in taskfile.read_rows(str(path), limit=2)] == ["1+1=", "2+2="]
    assert len(taskfile.read_rows(str(path))) == 3


@pytest.mark.parametrize(("data", "score", "status"), [(b"2", 1.0, "ok"), (b"3", 0.0, "ok"),
                                                       (b"\xff" * 10, 0.0, "malformed"),
                                                       (b"1" * (4 << 20), 0.0, "malformed")])
def test_a_completion_from_standard_input(tmp_path, data, score, status):
    """``--completion -`` reads a pipe (it was "cannot be read: no such file"), to its end
    or just past the size limit."""
    task = write(tmp_path, "t.json", json.dumps({"domain": "math", "prompt": "1+1=", "reference": {"answer": "2"}}))
    proc = subprocess.run([sys.executable, "-m", "components.cli", "verify", "--domain", "math", "--task", task,
                           "--completion", "-"], input=data, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    verdict = json.loads(proc.stdout)
    assert (verdict["score"], verdict["status"]) == (score, status)
