"""A DAG stage task probes the run root before it checks its iteration is still its run's
(``dags.wiring._check_current``, through ``storage.reachable_store``, as ``posttrain
stage`` does): wrong keys or a missing bucket are one UserError naming ``run_root``
(``_fail_now`` fails the task at once), a store that does not answer one InfraError
naming the store (Airflow retries it). Before, the check read the store unprobed: wrong
keys were a botocore ``PermissionError`` traceback, retried three times, and SeaweedFS
made a missing bucket on the lease's write."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core import lease, planner
from components.core.errors import InfraError, UserError
from components.core.storage import Store
from tests.fixtures.s3 import S3Server, closed_port, unique_prefix


def _plan(run_root: str, holder: str = "airflow:manual__1") -> dict:
    return {"holder": holder, "pipeline": "p", "iteration": 1, "run_root": run_root}


def _check(plan: dict) -> None:
    from dags.wiring import _check_current

    _check_current(plan)


def test_the_plans_own_iteration_passes_and_another_runs_is_refused(tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}/store")
    lease.acquire(store, "p", 1, "airflow:manual__1")
    _check(_plan(store.uri))  # its own lease: nothing raised
    with pytest.raises(UserError) as err:
        _check(_plan(store.uri, "airflow:manual__2"))
    assert err.value.field == "iteration" and "is held by 'airflow:manual__1'" in err.value.problem


def test_an_endpoint_nobody_listens_at_is_an_outage_naming_the_store(monkeypatch) -> None:
    port = closed_port()
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "nothing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with pytest.raises(InfraError) as err:
        _check(_plan("s3://bucket/runs"))
    assert (err.value.what, err.value.where) == ("store", "s3://bucket/runs")
    assert err.value.reason.startswith("EndpointConnectionError: Could not connect to the endpoint URL")
    assert f"127.0.0.1:{port}" in err.value.line() and "\n" not in err.value.line()


def test_an_outage_during_the_check_is_an_outage_naming_the_store(tmp_path: Path, monkeypatch) -> None:
    """The probe passed, then the store went away: not the task's traceback, an InfraError."""
    from botocore.exceptions import EndpointConnectionError

    def gone(*args, **kwargs):
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

    monkeypatch.setattr(planner, "check_current", gone)
    root = f"file://{tmp_path}/store"
    with pytest.raises(InfraError) as err:
        _check(_plan(root))
    assert (err.value.what, err.value.where) == ("store", root)
    assert err.value.reason == 'EndpointConnectionError: Could not connect to the endpoint URL: "http://127.0.0.1:9"'


def test_a_missing_bucket_is_the_users_and_is_not_made(s3_env: S3Server) -> None:
    bucket = "posttrain-no-such-bucket-stage-task"
    with pytest.raises(UserError) as err:
        _check(_plan(f"s3://{bucket}/runs"))
    assert err.value.line() == (f"run_root='s3://{bucket}/runs': store is not reachable or not writable (the S3 server "
                                f"has no bucket '{bucket}'); fix: create the bucket, or name an existing one in the run "
                                "root")
    assert bucket not in [b["Name"] for b in s3_env.client().list_buckets()["Buckets"]]


@pytest.mark.parametrize("variable", ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"])
def test_keys_the_server_refuses_are_the_users(s3_env: S3Server, monkeypatch, variable: str) -> None:
    import s3fs

    root = f"s3://{s3_env.bucket}/{unique_prefix('stage-task-keys')}"
    monkeypatch.setenv(variable, "not-the-key")
    s3fs.S3FileSystem.clear_instance_cache()  # a cached client keeps the key it was made with
    try:
        with pytest.raises(UserError) as err:
            _check(_plan(root))
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert (err.value.field, err.value.value) == ("run_root", root)
    assert err.value.problem.startswith("store is not reachable or not writable (PermissionError: ")
    assert err.value.fix == "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE): the server refused them"
