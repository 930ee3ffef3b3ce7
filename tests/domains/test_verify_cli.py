"""``posttrain verify``: one completion, one task file, a JSON verdict; user mistakes exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.cli import main


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


MATH_TASK = {"domain": "math", "prompt": "1/2+1/4=", "reference": {"answer": "3/4"}}
TERMINAL_TASK = {"domain": "terminal", "prompt": "new dir a\n$ ",
                 "reference": {"solution": "mkdir a", "start": {}, "expected": {"a": "dir"}}}


WEAK = ["--backend", "subprocess", "--allow-weak-isolation"]


@pytest.mark.parametrize(("task", "completion", "score", "passed"), [
    (MATH_TASK, "0.75", 1.0, True),
    (MATH_TASK, "2/6", 0.0, False),
    (TERMINAL_TASK, "mkdir a", 1.0, True),  # executes through the (weak) subprocess sandbox backend
    (TERMINAL_TASK, "mkdir a b", 0.5, False),
])
def test_verify_prints_verdict_json(tmp_path, capsys, task, completion, score, passed):
    code = main(["verify", "--domain", task["domain"], "--task", write(tmp_path, "t.json", json.dumps(task)),
                 "--completion", write(tmp_path, "c.txt", completion), *WEAK])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (out["score"], out["passed"], out["status"]) == (score, passed, "ok")
    assert out["domain"] == task["domain"]
    assert set(out["components"]) >= ({"exact"} if task["domain"] == "math" else {"state_match"})


def test_subprocess_backend_without_the_flag_is_refused(tmp_path, capsys):
    code = main(["verify", "--domain", "terminal", "--task", write(tmp_path, "t.json", json.dumps(TERMINAL_TASK)),
                 "--completion", write(tmp_path, "c.txt", "mkdir a"), "--backend", "subprocess"])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert line.startswith("posttrain: error: --allow-weak-isolation='not given': backend 'subprocess' gives no "
                           "namespace isolation")  # the flag this command has, not the recipe field
    assert "fix: pass --allow-weak-isolation, for trusted code only" in line


@pytest.mark.parametrize(("completion", "why"), [("dir", "is a directory"), ("/dev/zero", "is not a regular file (a character device)"),
                                                 ("none.txt", "no such file")])
def test_a_completion_that_is_not_a_file_is_named(tmp_path, capsys, completion, why):
    (tmp_path / "dir").mkdir()
    name = completion if completion.startswith("/") else str(tmp_path / completion)
    code = main(["verify", "--domain", "math", "--task", write(tmp_path, "t.json", json.dumps(MATH_TASK)),
                 "--completion", name, *WEAK])
    assert code == 2
    assert capsys.readouterr().err.strip() == (f"posttrain: error: --completion='{name}': {why}; fix: pass a text file "
                                               "holding the completion")


def test_verify_reads_first_row_of_parquet_and_fills_domain(tmp_path, capsys):
    path = tmp_path / "tasks.parquet"
    rows = [{"prompt": "3*4-5=", "reference": json.dumps({"answer": "7"})},
            {"prompt": "2+3*4=", "reference": json.dumps({"answer": "14"})}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    code = main(["verify", "--domain", "math", "--task", str(path), "--completion", write(tmp_path, "c.txt", "7")])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["score"] == 1.0


@pytest.mark.parametrize(("domain", "task_text", "message"), [
    ("nosuch", json.dumps(MATH_TASK), "unknown domain"),
    ("math", "{not json", "not valid JSON at line 1"),
    ("math", json.dumps({"prompt": "1+1="}), "reference="),
    ("math", json.dumps({**MATH_TASK, "answer": "3/4"}), "unknown task field"),
    ("code", json.dumps(MATH_TASK), "the task's domain is 'math'"),
])
def test_user_mistakes_exit_2_with_one_line(tmp_path, capsys, domain, task_text, message):
    code = main(["verify", "--domain", domain, "--task", write(tmp_path, "t.json", task_text),
                 "--completion", write(tmp_path, "c.txt", "1")])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_console_script_exit_2_for_missing_task_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "components.cli", "verify", "--domain", "math", "--task",
                           str(tmp_path / "none.json"), "--completion", str(tmp_path / "none.txt")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cannot be read" in proc.stderr and "Traceback" not in proc.stderr


def test_an_unknown_domain_names_the_flag(tmp_path, capsys):
    code = main(["verify", "--domain", "nope", "--task", write(tmp_path, "t.json", json.dumps(MATH_TASK)),
                 "--completion", write(tmp_path, "c.txt", "1")])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert line.startswith("posttrain: error: --domain='nope': unknown domain; fix: use one of [")


def test_a_verifier_component_that_is_nan_prints_valid_json(tmp_path, capsys, monkeypatch):
    """It printed ``"exact": NaN`` (not JSON) with status ok."""
    from components.domains.base import Verdict
    from components.domains.math import Math

    monkeypatch.setattr(Math, "verify", lambda self, t, c, r: Verdict(1.0, True, components={"exact": float("nan")}))
    code = main(["verify", "--domain", "math", "--task", write(tmp_path, "t.json", json.dumps(MATH_TASK)),
                 "--completion", write(tmp_path, "c.txt", "0.75")])
    text = capsys.readouterr().out
    out = json.loads(text, parse_constant=lambda name: pytest.fail(f"printed {name}"))
    assert code == 0 and "NaN" not in text
    assert (out["status"], out["score"], out["components"]) == ("verifier_error", 0.0, {})


def test_a_jsonl_task_is_named_by_its_line(tmp_path, capsys):
    """As ``load_tasks`` names a JSON Lines row (1-based, blank lines counted), not ``row 0``."""
    task = write(tmp_path, "t.jsonl", '\n{"domain": "math", "prompt": "1+1="}\n')
    code = main(["verify", "--domain", "math", "--task", task, "--completion", write(tmp_path, "c.txt", "2")])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert line.startswith(f"posttrain: error: {task} line 2: reference=")
