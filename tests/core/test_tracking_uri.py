"""What ``MLFLOW_TRACKING_URI`` can be, and what an unreachable tracking server is
(``components.core.tracking``, ``components.core.models.resolve_alias``).

- A scheme MLflow has no store for, or a string that is no URI: exit 2, one line naming
  ``MLFLOW_TRACKING_URI`` (before, a registry alias read through it was "not set yet").
- An HTTP server nobody listens on: exit 1 (an outage, retried by Airflow) with one line,
  in seconds; before, MLflow's client retried for about four minutes and then taskgen
  called it a user's mistake ("has no champion yet", exit 2).
- ``resolve_alias``: an unset alias or a missing model is None; a refused connection is
  an InfraError. The refused connection is injected (the real server's outage is the
  CLI test above).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from components.core import models, tracking
from components.core.errors import InfraError
from tests.fixtures.runs import TINY, cli_env, run_posttrain


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("uri", "needle"), [
    ("ftp://x", "unsupported tracking URI scheme 'ftp'"),
    ("http://[bad", "not a URI"),
])
def test_a_tracking_uri_mlflow_cannot_use_is_exit_2(uri: str, needle: str, tmp_path: Path) -> None:
    proc = run_posttrain(["stage", "taskgen", "--recipe", str(TINY)], tmp_path,
                         cli_env(tmp_path / "home", MLFLOW_TRACKING_URI=uri), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"posttrain: error: MLFLOW_TRACKING_URI='{uri}': {needle}")
    assert "unset it for the embedded SQLite database" in lines[0]


def test_a_tracking_server_nobody_listens_on_is_an_outage(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{_closed_port()}"
    proc = run_posttrain(["stage", "taskgen", "--recipe", str(TINY)], tmp_path,
                         cli_env(tmp_path / "home", MLFLOW_TRACKING_URI=uri), timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"posttrain: unreachable: tracking server unreachable at '{uri}': URLError: [Errno 111] Connection refused; "
        "retry once it is back"]


class _Client:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def get_model_version_by_alias(self, name: str, alias: str):
        raise self.exc


def test_resolve_alias_tells_an_unset_alias_from_an_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import (
        INTERNAL_ERROR,
        INVALID_PARAMETER_VALUE,
        PERMISSION_DENIED,
        RESOURCE_DOES_NOT_EXIST,
    )

    cases = [
        (MlflowException("Registered model alias champion not found.", INVALID_PARAMETER_VALUE), None),
        (MlflowException("Registered Model with name=demo-policy not found", RESOURCE_DOES_NOT_EXIST), None),
    ]
    for exc, want in cases:
        monkeypatch.setattr(tracking, "client", lambda exc=exc: _Client(exc))
        assert models.resolve_alias("demo", "champion") is want
    refused = MlflowException("API request to http://h/api/2.0/mlflow/registered-models/alias failed with exception "
                              "HTTPConnectionPool(host='h', port=5000): Max retries exceeded (Caused by "
                              "NewConnectionError('Failed to establish a new connection: [Errno 111] Connection "
                              "refused'))", INTERNAL_ERROR)
    monkeypatch.setattr(tracking, "client", lambda: _Client(refused))
    with pytest.raises(InfraError) as info:
        models.resolve_alias("demo", "champion")
    assert info.value.what == "tracking server"
    denied = MlflowException("Permission denied for registered model demo-policy", PERMISSION_DENIED)
    monkeypatch.setattr(tracking, "client", lambda: _Client(denied))
    with pytest.raises(MlflowException, match="Permission denied"):  # neither unset nor an outage: as it is
        models.resolve_alias("demo", "champion")
