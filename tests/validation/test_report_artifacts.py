"""The gate's expectation rows reach the reviewer: kept in the report, written to the
store, and logged on the validation stage's MLflow run (an escaped HTML page and an
MLflow table) whether the gate passes or fails."""

from __future__ import annotations

import dataclasses
import html
import json
import re
from pathlib import Path

from components.cli import main
from components.core import tracking
from components.core.facts import StartingPolicy
from components.core.manifest import Shard
from components.core.records import Reward, Rollout
from components.core.storage import Store
from components.validation.suite import CELL_CHARS, COLUMNS, SAMPLE_VALUES, VALUE_CHARS, check, render_html
from tests.reward.builders import write_stage
from tests.validation.test_gate import RECIPE, TASK, clean

ROWS = 23  # 20 GX expectations + rewards-match-rollouts + two non-empty-table checks
RAW_REWARD_KWARGS = '{"column": "raw_reward", "max_value": 1.0, "min_value": 0.0}'


def _stage(tmp_path: Path, rollouts: list[Rollout], rewards: list[Reward]) -> tuple[int, Store]:
    store = Store(str(tmp_path / "store"))
    recipe_file = tmp_path / "gate.yaml"
    recipe_file.write_text("pipeline: gate\ndomains: [math]\nrollout: {shards: 1, max_new_tokens: 4}\n"
                           "validation: {min_ok_fraction: 0.5}\n")
    write_stage(store, "gate", 1, "taskgen", None, {"tasks": ([TASK], type(TASK))}, StartingPolicy("1", "file:///x"))
    write_stage(store, "gate", 1, "rollout", Shard(0, 1), {"rollouts": (rollouts, Rollout)})
    write_stage(store, "gate", 1, "reward", Shard(0, 1), {"rewards": (rewards, Reward)})
    code = main(["stage", "validation", "--recipe", str(recipe_file), "--run-root", store.uri, "--iteration", "1"])
    return code, store


def _artifacts(tmp_path: Path) -> tuple[str, list[dict], str]:
    """The validation run's status, its table rows and its HTML page."""
    c = tracking.client()
    [run] = c.search_runs([tracking.experiment_id("gate")], filter_string="tags.`posttrain.stage` = 'validation'")
    out = tmp_path / "downloaded"
    out.mkdir()
    table = json.loads(Path(c.download_artifacts(run.info.run_id, "validation/expectations.json", str(out))).read_text())
    page = Path(c.download_artifacts(run.info.run_id, "validation/expectations.html", str(out))).read_text()
    assert table["columns"] == list(COLUMNS)
    return run.info.status, [dict(zip(table["columns"], row)) for row in table["data"]], page


def test_passing_gate_logs_every_expectation_as_a_success(tmp_path, posttrain_home) -> None:
    code, store = _stage(tmp_path, *clean())

    assert code == 0
    status, rows, page = _artifacts(tmp_path)
    assert status == "FINISHED"
    assert len(rows) == ROWS and all(r["success"] is True for r in rows)
    assert {(r["table"], r["expectation"], r["column"]) for r in rows} >= {
        ("rewards", "expect_column_values_to_be_between", "raw_reward"),
        ("rewards", "expect_column_mean_to_be_between", "is_ok"),
        ("rollouts", "expect_column_values_to_be_unique", "rollout_id"),
        ("rewards", "posttrain.every_rollout_has_a_reward", ""),
    }
    [mean] = [r for r in rows if r["column"] == "is_ok"]
    assert (mean["observed"], mean["kwargs"]) == ("1.0", '{"column": "is_ok", "max_value": 1.0, "min_value": 0.5}')
    assert page.split("<tbody>")[1].count("<tr>") == ROWS and 'class="fail"' not in page
    assert "Data-quality gate <span class=\"ok\">passed</span>: 23 checks, 0 failed" in page
    report = store.read_json("gate/iter-000001/validation/report.json")
    assert report["success"] is True and report["expectations"] == rows


def test_failing_gate_logs_the_failed_expectation_before_raising(tmp_path, posttrain_home, capsys) -> None:
    rollouts, rewards = clean()
    rewards[0] = dataclasses.replace(rewards[0], raw_reward=1.5)

    code, store = _stage(tmp_path, rollouts, rewards)

    assert code == 3  # DataQualityError
    assert "posttrain: validation failed for iteration 1" in capsys.readouterr().err
    status, rows, page = _artifacts(tmp_path)
    assert status == "FAILED"
    assert len(rows) == ROWS
    [failed] = [r for r in rows if not r["success"]]
    assert failed == {
        "table": "rewards", "expectation": "expect_column_values_to_be_between", "column": "raw_reward",
        "kwargs": RAW_REWARD_KWARGS, "success": False, "observed": "", "element_count": 4, "unexpected_count": 1,
        "unexpected_percent": 25.0, "unexpected_values": "[1.5]", "exception": "",
    }
    # the failed row comes first in the page, highlighted, with its values
    first = page.split('<tr class="fail">', 1)[1].split("</tr>", 1)[0]
    assert first.startswith("<td>rewards</td><td>expect_column_values_to_be_between</td><td>raw_reward</td>")
    assert html.escape(RAW_REWARD_KWARGS) in first and "<td>[1.5]</td>" in first and "<td>25</td>" in first
    assert page.count('<tr class="fail">') == 1 and page.split("<tbody>")[1].count("<tr>") == ROWS - 1
    report = store.read_json("gate/iter-000001/validation/report.json")
    assert report["success"] is False and report["expectations"] == rows


def test_hostile_values_are_escaped_and_bounded() -> None:
    rollouts, rewards = clean()
    script = "<script>alert('x')</script>"
    hostile = [script, '"><img src=x onerror=alert(1)>', "&amp;" + "A" * 100_000] + [f"<b>{i}</b>" for i in range(10)]
    rollouts = [dataclasses.replace(rollouts[i % 4], rollout_id=f"r{i}", domain=d) for i, d in enumerate(hostile)]
    rewards = [dataclasses.replace(rewards[i % 4], rollout_id=f"r{i}", domain=d) for i, d in enumerate(hostile)]

    report = check(rollouts, rewards, RECIPE)
    page = render_html(report, title=script)

    # the rewards carry their rollouts' domains: the same values fail the rewards' domain check too
    assert [(r["table"], r["expectation"], r["column"]) for r in report.expectations if not r["success"]] == [
        ("rollouts", "expect_column_values_to_be_in_set", "domain"),
        ("rewards", "expect_column_values_to_be_in_set", "domain")]
    row = next(r for r in report.expectations if not r["success"])
    assert row["unexpected_count"] == len(hostile)
    values = json.loads(row["unexpected_values"])  # the long value is cut, so is the list
    assert values[:2] == hostile[:2] and len(values[2]) == VALUE_CHARS and values[2].endswith("\u2026")
    assert len(values) == SAMPLE_VALUES and values[-1] == "<b>1</b>"
    assert len(row["unexpected_values"]) <= CELL_CHARS
    assert all(len(v) <= CELL_CHARS for r in report.expectations for v in r.values() if isinstance(v, str))

    # nothing hostile survives unescaped: the only tags are the page's own
    assert "<script>" not in page and "<img" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert set(re.findall(r"<(/?\w+)", page)) <= {"html", "/html", "head", "/head", "meta", "title", "/title", "style",
                                                 "/style", "body", "/body", "h1", "/h1", "p", "/p", "span", "/span",
                                                 "ul", "/ul", "li", "/li", "table", "/table", "thead", "/thead",
                                                 "tbody", "/tbody", "tr", "/tr", "th", "/th", "td", "/td"}
    cells = re.findall(r"<td>(.*?)</td>", page, flags=re.S) + re.findall(r"<li>(.*?)</li>", page, flags=re.S)
    assert cells and all(len(html.unescape(c)) <= CELL_CHARS for c in cells)
    assert len(page) < 60_000
