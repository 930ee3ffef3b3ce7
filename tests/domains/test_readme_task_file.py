"""The README's task-file example ("Task files"): every row loads, and each verifier
passes the completion the README's table gives it, through ``posttrain verify``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from components.cli import main
from components.domains.taskfile import load_tasks

README = Path(__file__).resolve().parents[2] / "README.md"
WEAK = ["--backend", "subprocess", "--allow-weak-isolation"]


def example() -> tuple[list[str], dict[str, str]]:
    """(the example's JSONL rows, {domain: the passing completion in the table})."""
    text = README.read_text()
    section = text[text.index("### Task files"):]
    rows = re.search(r"<!-- task-file-example -->\n```jsonl\n(.*?)\n```", section, re.S)[1].splitlines()
    table = dict(re.findall(r"^\| `([a-z]+)` \|.*\| `([^`]+)` \|$", section.split("\n\n### ")[0], re.M))
    return rows, table


def test_the_example_covers_every_task_domain_and_loads(tmp_path: Path) -> None:
    rows, table = example()
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(rows) + "\n")
    tasks = load_tasks(str(path))
    assert [t.domain for t in tasks] == ["math", "code", "terminal", "extraction", "structured"] == list(table)
    assert [t.split for t in tasks] == ["train"] * 4 + ["eval"]
    assert tasks[1].difficulty == 2


@pytest.mark.parametrize("row", range(5))
def test_each_row_passes_with_the_readmes_completion(row: int, tmp_path: Path, capsys) -> None:
    rows, table = example()
    domain = json.loads(rows[row])["domain"]
    (tmp_path / "t.jsonl").write_text(rows[row] + "\n")
    (tmp_path / "c.txt").write_text(table[domain])
    code = main(["verify", "--domain", domain, "--task", str(tmp_path / "t.jsonl"),
                 "--completion", str(tmp_path / "c.txt"), *WEAK])
    verdict = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (verdict["passed"], verdict["score"], verdict["status"]) == (True, 1.0, "ok")
