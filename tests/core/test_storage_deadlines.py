"""Small S3 operations end in bounded time; transfers keep their generous limits.

An endpoint that accepts TCP connections and never answers held a lease or recipe read
for many minutes (botocore waited 60 s per attempt, 4 attempts, inside s3fs's 5 tries)
and a PUT for ever (waiting for "100 Continue"). Each small operation now ends within
``SMALL_OP_DEADLINE_S`` as one InfraError naming the store. Only the error is asserted,
not how long it took: the pytest timeout is the bound.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from components.core import storage
from components.core.errors import InfraError, outage
from components.core.storage import SMALL_OBJECT_BYTES, SMALL_OP_DEADLINE_S, Expected, Store, sha256_bytes
from tests.fixtures.silent import silent_endpoint

ROOT = "s3://bucket/x"


def _point_at(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.mark.timeout(300)  # the limit is SMALL_OP_DEADLINE_S (30 s): these ran for many minutes, a PUT for ever
def test_small_operations_on_a_store_that_never_answers_are_one_outage_naming_it(monkeypatch) -> None:
    with silent_endpoint() as (held, port):
        _point_at(monkeypatch, port)
        store = Store(ROOT, "--run-root")
        small = b"{}"
        operations: dict[str, Callable[[], object]] = {
            "read_bytes": lambda: store.read_bytes("p/_leases/iter-000001/000000.json"),
            "read_bytes manifested": lambda: store.read_bytes("p/a.json", Expected(sha256_bytes(small), 2, "s", "r")),
            "exists": lambda: store.exists("p/_leases/iter-000001/000000.json"),
            "listdir": lambda: store.listdir("p/_leases/iter-000001"),
            "read_small": lambda: store.read_small("p/_leases/iter-000001/000000.json", 1 << 16),
            "create": lambda: store.create("p/_leases/iter-000001/000001.json", small),  # the lease's write
            "write_bytes": lambda: store.write_bytes("p/_MANIFEST.json", small),
            "check_reachable": store.check_reachable,
        }
        with ThreadPoolExecutor(len(operations)) as pool:  # side by side: one deadline's wait for all
            futures = {name: pool.submit(op) for name, op in operations.items()}
            errors = {name: future.exception() for name, future in futures.items()}
        assert held  # each connected, and heard nothing back
    for name, error in errors.items():
        assert isinstance(error, InfraError), (name, repr(error))
        assert (error.what, error.where, error.reason) == ("store", ROOT, f"no answer within {SMALL_OP_DEADLINE_S} s"), name
        assert outage(error) is not None  # what the orchestrators retry
        assert error.line() == f"store unreachable at '{ROOT}': no answer within 30 s; retry once it is back"


def test_transfers_keep_the_generous_client_and_no_deadline(monkeypatch) -> None:
    """Small operations go to ``fs`` (short timeouts, cut off at the deadline), larger
    objects to ``bulk`` (60 s per wait, no overall limit)."""
    _point_at(monkeypatch, 9)
    store = Store(ROOT)
    assert store.fs is not store.bulk
    assert store.fs.config_kwargs == storage.SMALL_S3_CONFIG and store.fs.retries == storage.SMALL_S3_TRIES
    assert store.bulk.config_kwargs == storage.S3_CONFIG and store.bulk.config_kwargs["read_timeout"] == 60
    calls: list[tuple[str, int, dict]] = []
    for name, fs in (("fs", store.fs), ("bulk", store.bulk)):
        monkeypatch.setattr(fs, "pipe_file", lambda path, data, _name=name, **kw: calls.append((_name, len(data), kw)))
    store.write_bytes("small.json", b"x" * SMALL_OBJECT_BYTES)
    store.write_bytes("records.parquet", b"x" * (SMALL_OBJECT_BYTES + 1))
    store.create("big-recipe.yaml", b"x" * (SMALL_OBJECT_BYTES + 1))
    assert calls == [("fs", SMALL_OBJECT_BYTES, {"timeout": SMALL_OP_DEADLINE_S}),
                     ("bulk", SMALL_OBJECT_BYTES + 1, {}), ("bulk", SMALL_OBJECT_BYTES + 1, {"mode": "create"})]


def test_objects_either_side_of_the_small_size_round_trip(s3_env) -> None:
    """On the real server: one read and written as a small operation, one as a transfer,
    with a manifest and without."""
    from tests.fixtures.s3 import unique_prefix

    store = Store(f"s3://{s3_env.bucket}/{unique_prefix('small-or-not')}")
    for size in (SMALL_OBJECT_BYTES, SMALL_OBJECT_BYTES + 1):
        data = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
        store.write_bytes(f"{size}.bin", data)
        assert store.read_bytes(f"{size}.bin") == data
        assert store.read_bytes(f"{size}.bin", Expected(sha256_bytes(data), size, "s", "r")) == data
        assert store.read_small(f"{size}.bin", size) == data
        assert store.create(f"{size}.bin", data) is False
        store.delete(f"{size}.bin")
        assert store.exists(f"{size}.bin") is False
