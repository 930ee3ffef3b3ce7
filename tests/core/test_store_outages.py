"""An outage of the store or the tracking server while reading a manifest or a registry
reference is an ``InfraError`` (retried), never a user's mistake (exit 2, "delete it and
re-run", "no such registered model version").

- ``read_manifest`` and ``checkpoint_expectations`` on the real SeaweedFS S3 server, its
  GET answered 503 SlowDown / 500 InternalError. s3fs turns those into a bare
  ``OSError(EBUSY/EREMOTEIO)``; they are injected (``s3fs.errors.translate_boto_error``
  on the botocore error, as s3fs raises them), since a real server gives no 5xx on
  demand. A manifest that is really cut short is still the UserError.
- ``resolve_model_uri`` against a real ``mlflow server``: a missing version or alias is
  the UserError; the same client after the server is stopped is an InfraError.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.core import models, tracking
from components.core.context import read_manifest
from components.core.errors import InfraError, UserError
from components.core.manifest import MANIFEST, Manifest, OutputFile
from components.core.storage import Store, sha256_bytes
from tests.fixtures.home import reset_tracking_clients
from tests.fixtures.s3 import unique_prefix

PREFIX = "p/iter-000002/trainer"


def _s3_error(code: str, status: int) -> OSError:
    """What s3fs raises for a GET the server answered with ``code`` / HTTP ``status``."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    reply = {"Error": {"Code": code, "Message": "Please reduce your request rate." if code == "SlowDown"
                       else "We encountered an internal error. Please try again."},
             "ResponseMetadata": {"HTTPStatusCode": status}}
    return translate_boto_error(ClientError(reply, "GetObject"))


def _stored_checkpoint(store: Store) -> str:
    """A trainer's checkpoint folder with its manifest; the folder's URL."""
    weights = b"w" * 64
    store.write_bytes(f"{PREFIX}/checkpoint/model.safetensors", weights)
    manifest = Manifest(stage="trainer", pipeline="p", iteration=2, shard=None, inputs={}, config_digest="c",
                        code_version="v", outputs={"checkpoint": OutputFile(f"{PREFIX}/checkpoint", 10,
                                                                            sha256_bytes(weights), len(weights))})
    store.write_json(f"{PREFIX}/{MANIFEST}", manifest.to_json())
    return store.url(f"{PREFIX}/checkpoint")


@pytest.mark.parametrize(("code", "status", "errno", "reason"), [
    ("SlowDown", 503, 16, "ClientError: An error occurred (SlowDown) when calling the GetObject operation: "
                          "Please reduce your request rate."),
    ("InternalError", 500, 121, "HTTP 500 InternalError: An error occurred (InternalError) when calling the GetObject "
                                "operation: We encountered an internal error. Please try again."),
])
def test_a_manifest_read_the_store_answers_5xx_is_an_outage(s3_env, code: str, status: int, errno: int, reason: str) -> None:
    from components.core.policy import checkpoint_expectations

    store = Store(f"s3://{s3_env.bucket}/{unique_prefix('manifest-5xx')}")
    checkpoint = _stored_checkpoint(store)
    assert read_manifest(store, PREFIX) is not None  # the server answers: the manifest reads

    failure = _s3_error(code, status)
    assert type(failure) is OSError and failure.errno == errno  # as s3fs raises it: no botocore type left on top

    def refuse(path, *args, **kwargs):
        raise _s3_error(code, status)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(store.fs, "cat_file", refuse)
        with pytest.raises(InfraError) as err:
            read_manifest(store, PREFIX)
        assert (err.value.what, err.value.where, err.value.reason) == ("store", store.uri, reason)
        with pytest.raises(InfraError) as err:
            checkpoint_expectations(checkpoint)  # a Store of its own, on the same (cached) filesystem
        assert (err.value.what, err.value.where, err.value.reason) == ("store", store.url(PREFIX), reason)

    # the server answers again, and the manifest is really cut short: the user's to fix
    store.write_bytes(f"{PREFIX}/{MANIFEST}", b'{"stage": "trainer", "pipe')
    with pytest.raises(UserError) as cut:
        read_manifest(store, PREFIX)
    assert cut.value.line().startswith(f"file={store.url(PREFIX + '/' + MANIFEST)!r}: manifest is unreadable "
                                       "(JSONDecodeError: ")
    assert cut.value.fix == "delete it and re-run stage trainer"
    with pytest.raises(UserError) as cut:
        checkpoint_expectations(checkpoint)
    assert cut.value.problem == "manifest is unreadable (JSONDecodeError)"


def test_a_manifest_over_the_size_limit_is_still_the_users(tmp_path: Path) -> None:
    """The OSError ``read_small`` raises for a file too large is no outage."""
    store = Store(f"file://{tmp_path}")
    store.write_bytes(f"{PREFIX}/{MANIFEST}", json.dumps({"x": " " * (64 << 20)}).encode())
    with pytest.raises(UserError) as err:
        read_manifest(store, PREFIX)
    assert err.value.problem == "manifest is unreadable (OSError: more than 67108864 bytes, the most read here)"


@pytest.mark.timeout(300)
def test_a_registry_reference_is_missing_only_while_the_server_answers(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    from tests.fixtures.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path / "mlflow")
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's client retries for minutes otherwise
        reset_tracking_clients()
        direct = MlflowClient(server.uri)
        direct.create_registered_model("outage-policy")
        direct.create_model_version("outage-policy", "s3://bucket/outage/checkpoint",
                                    tags={models.TAG_CHECKPOINT: "s3://bucket/outage/checkpoint"})
        direct.set_registered_model_alias("outage-policy", "champion", "1")
        assert models.resolve_model_uri("models:/outage-policy@champion", "model.source") == "s3://bucket/outage/checkpoint"
        for uri in ("models:/outage-policy/9", "models:/outage-policy@nope", "models:/missing-policy/1"):
            with pytest.raises(UserError) as err:
                models.resolve_model_uri(uri, "model.source")
            assert (err.value.field, err.value.value) == ("model.source", uri)
            assert err.value.problem == f"no such registered model version at {server.uri}"

        server.stop()  # the client is made (and cached): the next request is refused, or reset on a pooled connection
        for uri in ("models:/outage-policy@champion", "models:/outage-policy/1"):
            with pytest.raises(InfraError) as down:
                models.resolve_model_uri(uri, "model.source")
            assert (down.value.what, down.value.where) == ("tracking server", server.uri)
            assert "Connection refused" in down.value.reason or "Connection reset by peer" in down.value.reason
    finally:
        server.stop()
        reset_tracking_clients()
    assert tracking.tracking_uri() == server.uri
