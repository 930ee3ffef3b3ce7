"""An MLflow artifact-store error while the validation stage logs its expectation rows
neither hides the gate's verdict nor fails a good batch: the stage prints one line naming
the artifacts not logged and the error, then raises ``DataQualityError`` (exit 3) for a bad
batch and passes a good one. Before, the upload error escaped ``log_report`` first: a bad
batch failed with the MLflow error instead of its failed expectations, a good one failed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from components.core import tracking
from components.core.manifest import MANIFEST
from components.validation.stage import HTML_ARTIFACT, TABLE_ARTIFACT
from tests.validation.test_gate import clean
from tests.validation.test_report_artifacts import _stage

REFUSED = "artifact store refused the write (403)"


def _refuse(*_args, **_kwargs) -> None:
    raise MlflowException(REFUSED)


def _not_logged(said: list[str]) -> list[str]:
    return [line for line in said if "not logged" in line]


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The lines the validation stage says (recorded, not read back from a shared stdout)."""
    from components.validation import stage

    lines: list[str] = []
    monkeypatch.setattr(stage, "say", lines.append)
    return lines


def _run_status_and_artifacts() -> tuple[str, list[str]]:
    c = tracking.client()
    [run] = c.search_runs([tracking.experiment_id("gate")], filter_string="tags.`posttrain.stage` = 'validation'")
    return run.info.status, [a.path for a in c.list_artifacts(run.info.run_id, "validation")]


@pytest.fixture
def refused_uploads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MlflowClient, "log_text", _refuse)
    monkeypatch.setattr(MlflowClient, "log_table", _refuse)


def test_bad_batch_still_fails_on_its_expectations(tmp_path: Path, posttrain_home, refused_uploads, capsys, said) -> None:
    rollouts, rewards = clean()
    rewards[0] = dataclasses.replace(rewards[0], raw_reward=1.5)

    code, store = _stage(tmp_path, rollouts, rewards)

    _, err = capsys.readouterr()
    assert code == 3  # DataQualityError, not the MLflow error
    report_uri = store.url("gate/iter-000001/validation/report.json")
    [line] = [e for e in err.splitlines() if e.startswith("posttrain")]
    assert line.startswith(f"posttrain: validation failed for iteration 1 ({report_uri}): rewards: "
                           "expect_column_values_to_be_between {'column': 'raw_reward'")
    assert REFUSED not in err
    assert _not_logged(said) == [f"iter 1 | validation | {HTML_ARTIFACT} and {TABLE_ARTIFACT} not logged to MLflow "
                                f"(MlflowException: {REFUSED}); the report is in the store ({report_uri})"]
    assert store.read_json("gate/iter-000001/validation/report.json")["success"] is False
    assert not store.exists(f"gate/iter-000001/validation/{MANIFEST}")
    assert _run_status_and_artifacts() == ("FAILED", [])


def test_good_batch_passes(tmp_path: Path, posttrain_home, refused_uploads, said) -> None:
    code, store = _stage(tmp_path, *clean())

    assert code == 0
    report_uri = store.url("gate/iter-000001/validation/report.json")
    assert _not_logged(said) == [f"iter 1 | validation | {HTML_ARTIFACT} and {TABLE_ARTIFACT} not logged to MLflow "
                                f"(MlflowException: {REFUSED}); the report is in the store ({report_uri})"]
    assert store.read_json("gate/iter-000001/validation/report.json")["success"] is True
    assert store.exists(f"gate/iter-000001/validation/{MANIFEST}")
    assert _run_status_and_artifacts() == ("FINISHED", [])


def test_a_refused_table_names_only_the_table(tmp_path: Path, posttrain_home, monkeypatch, said) -> None:
    monkeypatch.setattr(MlflowClient, "log_table", _refuse)  # the page is logged, the table is not

    code, store = _stage(tmp_path, *clean())

    assert code == 0
    report_uri = store.url("gate/iter-000001/validation/report.json")
    assert _not_logged(said) == [f"iter 1 | validation | {TABLE_ARTIFACT} not logged to MLflow "
                                f"(MlflowException: {REFUSED}); the report is in the store ({report_uri})"]
    assert _run_status_and_artifacts() == ("FINISHED", [HTML_ARTIFACT])
