"""Housekeeping around the store: an outage is an InfraError (retried), a mistake a
UserError; interrupted writes leave no ``.tmp-`` files; stale MLflow stage runs are ended.

The outage tests run a private SeaweedFS (``restartable_s3``): killed (connection
refused), and while it starts again (the S3 port answers before the filer is ready), every
failure of ``check_reachable`` must be an InfraError, never a UserError.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest

from components.core import storage, tracking
from components.core.errors import InfraError, UserError
from components.core.storage import Store
from tests.fixtures.s3 import RestartableS3, _launch, apply_env


def test_stopped_store_is_an_outage_and_a_starting_one_too(restartable_s3: RestartableS3,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    apply_env(monkeypatch, restartable_s3.server)
    store = Store(f"s3://{restartable_s3.server.bucket}/housekeeping")
    store.check_reachable()
    restartable_s3.kill()
    with pytest.raises(InfraError) as err:
        Store(store.uri).check_reachable()
    assert "store unreachable" in str(err.value) and "\n" not in str(err.value)

    # Bring it back without waiting, and probe while it starts: each failure must be an outage.
    restartable_s3.proc = _launch(restartable_s3.cmd, restartable_s3.run, restartable_s3.log)
    seen: list[str] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            Store(store.uri).check_reachable()
            break
        except InfraError as exc:
            seen.append(exc.reason)
            time.sleep(0.1)
    else:
        pytest.fail(f"the store did not come back; last errors {seen[-3:]}")
    # (a UserError while it started would have ended the loop and the test)


@pytest.mark.parametrize(("code", "status", "kind"), [
    ("ServiceUnavailable", 503, InfraError), ("SlowDown", 503, InfraError), ("503", 503, InfraError),
    ("InternalError", 500, InfraError), ("502", 502, InfraError), ("RequestTimeout", 400, InfraError),
    ("AccessDenied", 403, UserError),
])
def test_server_replies_are_sorted_into_outages_and_mistakes(s3_env, monkeypatch: pytest.MonkeyPatch, code: str,
                                                              status: int, kind: type) -> None:
    """What s3fs raises for each S3 reply (through its own translation), injected at the PUT:
    replies the real server does not give on demand (5xx, throttling, a policy's refusal).
    A missing bucket and unknown keys come from the real server below."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    store = Store(f"s3://{s3_env.bucket}/replies")

    def reply(*args, **kwargs):
        raise translate_boto_error(ClientError({"Error": {"Code": code, "Message": "injected"},
                                                "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"))

    monkeypatch.setattr(store.fs, "pipe_file", reply)
    with pytest.raises(kind):
        store.check_reachable()


@pytest.mark.parametrize("variable", ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"])
def test_a_key_the_server_does_not_accept_is_a_user_error(s3_env, monkeypatch: pytest.MonkeyPatch,
                                                          variable: str) -> None:
    """The real server's InvalidAccessKeyId and SignatureDoesNotMatch: the user's mistake."""
    import s3fs

    monkeypatch.setenv(variable, "not-the-key")
    s3fs.S3FileSystem.clear_instance_cache()  # a cached client keeps the key it was made with
    try:
        with pytest.raises(UserError) as err:
            Store(f"s3://{s3_env.bucket}/replies").check_reachable()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert err.value.fix == ("check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE): the server refused "
                             "them"), err.value.line()


def test_missing_bucket_is_a_user_error(s3_env, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError) as err:
        Store("s3://posttrain-no-such-bucket/prefix").check_reachable()
    assert "posttrain-no-such-bucket" in str(err.value) and "create the bucket" in str(err.value)


def test_not_a_folder_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="writable folder"):
        Store(f"file://{tmp_path / 'file'}").check_reachable()


def disk_full_after(monkeypatch: pytest.MonkeyPatch) -> None:
    def half_then_full(path: str, data: bytes) -> None:
        with open(path, "wb") as fh:
            fh.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(storage, "_write_local", half_then_full)


def test_failed_write_and_create_leave_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(f"file://{tmp_path}")
    store.write_bytes("a/old.bin", b"old")
    disk_full_after(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        store.write_bytes("a/old.bin", b"new bytes")
    with pytest.raises(OSError, match="No space left"):
        store.create("a/lease.json", b"{}")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["old.bin"]
    assert (tmp_path / "a" / "old.bin").read_bytes() == b"old"  # the old version is intact


def test_sweep_removes_only_temporary_files_under_the_prefix(tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}")
    for rel in ("p/s/x.parquet.tmp-0123abcd", "p/s/deep/m.safetensors.tmp-89abcdef", "p/other/y.tmp-0123abcd"):
        store.write_bytes(rel, b"half")
    store.write_bytes("p/s/keep.tmp-notours", b"a user's file")
    removed = store.sweep_temporary("p/s")
    assert sorted(Path(r).name for r in removed) == ["m.safetensors.tmp-89abcdef", "x.parquet.tmp-0123abcd"]
    assert store.exists("p/other/y.tmp-0123abcd") and store.exists("p/s/keep.tmp-notours")


def test_stale_running_stage_runs_are_killed(posttrain_home: Path) -> None:
    c = tracking.client()
    exp = tracking.experiment_id("hk")
    tags = {tracking.TAG_PIPELINE: "hk", tracking.TAG_STAGE: "rollout", tracking.TAG_ITERATION: "3",
            tracking.TAG_RUN_ROOT: "file:///r"}
    stale = c.create_run(exp, run_name="rollout[0/2]", tags=tags).info.run_id
    other_shard = c.create_run(exp, run_name="rollout[1/2]", tags=tags).info.run_id
    other_root = c.create_run(exp, run_name="rollout[0/2]", tags={**tags, tracking.TAG_RUN_ROOT: "file:///q"}).info.run_id
    with tracking.stage_run("hk", "rollout", "rollout[0/2]", None, {}, tags={
            tracking.TAG_ITERATION: "3", tracking.TAG_RUN_ROOT: "file:///r"}) as new:
        assert c.get_run(stale).info.status == "KILLED"
        assert c.get_run(new).info.status == "RUNNING"
    status = {r: c.get_run(r).info.status for r in (stale, other_shard, other_root, new)}
    assert status == {stale: "KILLED", other_shard: "RUNNING", other_root: "RUNNING", new: "FINISHED"}


def test_a_5xx_reply_inside_a_stage_is_an_outage(tmp_path: Path, posttrain_home: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy S3 answering a stage's write with a bare 503 (s3fs: OSError(EBUSY)) is retried
    as an outage, not a crash."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    from components.core.runner import run_stage
    from tests.fixtures.home import TINY_RECIPE

    real = Store.write_bytes

    def busy(self, rel: str, data: bytes) -> None:
        if "/bootstrap/checkpoint/" in rel:
            raise translate_boto_error(ClientError({"Error": {"Code": "503", "Message": "busy"},
                                                    "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject"))
        return real(self, rel, data)

    monkeypatch.setattr(Store, "write_bytes", busy)
    with pytest.raises(InfraError, match="store unreachable"):
        run_stage("bootstrap", TINY_RECIPE, f"file://{tmp_path / 'store'}", 0)
