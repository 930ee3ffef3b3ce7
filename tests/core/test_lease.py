"""Iteration leases in the store, on file:// and on a real S3 server (SeaweedFS on loopback).

Everything rests on ``Store.create`` being exclusive: of writers racing for one key exactly
one creates it. On S3 that is a conditional PUT (``If-None-Match: *``); SeaweedFS honours
it, but answers a plain 412 that s3fs does not recognise as "exists" (it does only for
AWS's reply, which names the condition), so ``Store.create`` reads the 412 itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from components.core import lease
from components.core.errors import UserError
from components.core.storage import Store
from tests.fixtures import race

PIPE = "p"
RACERS = 5


def test_seaweedfs_refuses_a_second_put_if_none_match(s3_env) -> None:
    """The server itself, without s3fs: a second conditional PUT is refused with 412 and
    the first body stays. (Its reply has no ``Condition`` field, unlike AWS's.)"""
    import botocore.exceptions

    client = s3_env.client()
    key = "if-none-match/probe.json"
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as info:
        client.put_object(Bucket=s3_env.bucket, Key=key, Body=b"second", IfNoneMatch="*")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert info.value.response["Error"]["Code"] == "PreconditionFailed"
    assert client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read() == b"first"


def test_create_writes_once_and_never_overwrites(store_uri: str) -> None:
    store = Store(store_uri)
    assert store.create("l/000000.json", b"first") is True
    assert store.create("l/000000.json", b"second") is False
    assert store.read_bytes("l/000000.json") == b"first"
    assert store.create("l/000001.json", b"next") is True
    assert store.listdir("l") == ["000000.json", "000001.json"]  # no temporary file left beside them


def test_create_race_between_processes_has_one_winner(store_uri: str) -> None:
    store = Store(store_uri)
    store.write_bytes("race/seen.txt", b"folder exists, and each racer has listed it")
    results = race.race(race.create, [(store_uri, "race/key.json", f"racer-{i}".encode()) for i in range(RACERS)])
    assert sorted(results) == [("created", False)] * (RACERS - 1) + [("created", True)], race.describe(results)
    winner = [i for i, r in enumerate(results) if r == ("created", True)][0]
    assert store.read_bytes("race/key.json") == f"racer-{winner}".encode()
    assert store.listdir("race") == ["key.json", "seen.txt"]


def test_acquire_is_exclusive_and_names_the_holder(store_uri: str) -> None:
    store = Store(store_uri)
    mine = lease.acquire(store, PIPE, 3, "alice", ttl_s=600)
    assert (mine.iteration, mine.holder, mine.generation) == (3, "alice", 0)
    assert 599 < mine.expires_at - mine.acquired_at <= 600
    with pytest.raises(lease.LeaseHeld) as info:
        lease.acquire(store, PIPE, 3, "bob", ttl_s=600)
    assert info.value.lease == mine
    text = str(info.value)
    assert text.startswith("iteration 3 of pipeline 'p' is held by 'alice' (lease expires in ")
    assert text.endswith("wait for that run to finish, or stop it and release its lease: posttrain release "
                         "--iteration 3 --holder alice (with that run's --recipe and --run-root)")
    assert 590 <= float(text.split("expires in ")[1].split(" s)")[0]) <= 600
    assert lease.current(store, PIPE, 3) == mine  # bob's attempt wrote nothing
    assert store.listdir(f"{PIPE}/_leases/iter-000003") == ["000000.json"]
    stored = json.loads(store.read_bytes(f"{PIPE}/_leases/iter-000003/000000.json"))
    assert stored == {"iteration": 3, "holder": "alice", "generation": 0, "acquired_at": mine.acquired_at,
                      "expires_at": mine.expires_at}


def test_holder_renews_its_own_lease(store_uri: str) -> None:
    store = Store(store_uri)
    first = lease.acquire(store, PIPE, 1, "alice", ttl_s=60)
    again = lease.acquire(store, PIPE, 1, "alice", ttl_s=120)
    assert (again.holder, again.generation) == ("alice", 1)
    assert again.expires_at > first.expires_at
    assert lease.current(store, PIPE, 1) == again


def test_expired_lease_is_taken_over(store_uri: str) -> None:
    store = Store(store_uri)
    old = lease.acquire(store, PIPE, 2, "alice", ttl_s=2.0)
    with pytest.raises(lease.LeaseHeld):
        lease.acquire(store, PIPE, 2, "bob")
    time.sleep(max(0.0, old.expires_at - time.time()) + 0.1)
    assert not lease.current(store, PIPE, 2).live()
    taken = lease.acquire(store, PIPE, 2, "bob", ttl_s=600)
    assert (taken.holder, taken.generation) == ("bob", 1)
    assert lease.release(store, PIPE, 2, "alice") is False  # alice's lease is gone: she cannot release bob's
    assert lease.current(store, PIPE, 2) == taken
    with pytest.raises(lease.LeaseHeld, match="is held by 'bob'"):
        lease.acquire(store, PIPE, 2, "alice")


def test_released_lease_can_be_taken_at_once(store_uri: str) -> None:
    store = Store(store_uri)
    lease.acquire(store, PIPE, 4, "alice", ttl_s=3600)
    assert lease.release(store, PIPE, 4, "bob") is False  # only the holder releases
    assert lease.release(store, PIPE, 4, "alice") is True
    released = lease.current(store, PIPE, 4)
    assert (released.holder, released.generation, released.live()) == ("", 1, False)
    assert lease.release(store, PIPE, 4, "alice") is False  # released once
    taken = lease.acquire(store, PIPE, 4, "bob", ttl_s=3600)
    assert (taken.holder, taken.generation) == ("bob", 2)
    assert store.listdir(f"{PIPE}/_leases/iter-000004") == ["000000.json", "000001.json", "000002.json"]


def test_held_by_lists_a_holders_iterations_newest_first(store_uri: str) -> None:
    store = Store(store_uri)
    assert lease.held_by(store, PIPE, "alice") == []
    for k, holder in ((1, "alice"), (2, "bob"), (3, "alice"), (12, "alice")):
        lease.acquire(store, PIPE, k, holder, ttl_s=3600)
    lease.acquire(store, PIPE, 5, "alice", ttl_s=0.0)  # expired at once: still alice's until someone takes it
    assert lease.held_by(store, PIPE, "alice") == [12, 5, 3, 1]
    assert lease.held_by(store, PIPE, "bob") == [2]
    lease.release(store, PIPE, 3, "alice")
    lease.acquire(store, PIPE, 5, "bob", ttl_s=3600)
    assert lease.held_by(store, PIPE, "alice") == [12, 1]
    assert lease.held_by(store, PIPE, "bob") == [5, 2]
    assert lease.held_by(store, "other-pipeline", "alice") == []


def test_last_held_finds_a_holders_iteration_after_it_was_handed_back_and_taken(store_uri: str) -> None:
    """A failed DAG run hands its lease back and another run takes it: ``held_by`` no longer
    names it, the chain still does (a cleared run's plan looks there)."""
    store = Store(store_uri)
    assert lease.last_held(store, PIPE, "alice") is None
    for k, holder in ((1, "alice"), (2, "alice"), (3, "bob")):
        lease.acquire(store, PIPE, k, holder, ttl_s=3600)
    assert lease.last_held(store, PIPE, "alice") == (2, "")  # the newest, still its own
    lease.release(store, PIPE, 2, "alice")
    lease.acquire(store, PIPE, 2, "carol", ttl_s=3600)
    lease.renew(store, PIPE, 2, "carol", ttl_s=3600)
    assert lease.held_by(store, PIPE, "alice") == [1]
    assert lease.last_held(store, PIPE, "alice") == (2, "carol")  # handed back, then taken
    assert lease.last_held(store, PIPE, "carol") == (2, "")
    assert lease.last_held(store, PIPE, "bob") == (3, "")
    assert lease.last_held(store, PIPE, "dave") is None
    assert lease.last_held(store, "other-pipeline", "alice") is None


GOOD = {"iteration": 1, "holder": "x", "generation": 0, "acquired_at": 1.0, "expires_at": 2.0}


def _with(**changed) -> bytes:
    return json.dumps(GOOD | changed).encode()


@pytest.mark.parametrize("garbage", [
    b"\xff\xfe not json", b"[1, 2]", b'{"holder": "x"}', b"{" * 5000, b"[" * 100_000,
    _with(expires_at="soon"), _with(generation="x"), _with(generation=None), _with(generation=-1), _with(holder=[1]),
    _with(iteration=True), b" " * (lease.MAX_LEASE_BYTES + 1),
    _with(generation=3), _with(iteration=2),  # another slot's record: "20 generations lost in a row" before
    _with(expires_at=1e300), _with(acquired_at=1e300, expires_at=1e300), _with(expires_at=0.5),  # blocked for good
    _with(expires_at=float("inf")),
    "fifo", "dev-zero", "folder",
])
@pytest.mark.timeout(60)  # a FIFO blocked the read forever before
def test_a_corrupted_lease_is_one_line_naming_the_object(garbage: bytes | str, tmp_path: Path) -> None:
    """Not JSON, another shape, fields of the wrong type (a traceback from the planner
    before), deep nesting (a RecursionError), a FIFO (a hang), a link to /dev/zero (read
    until memory ran out) or a folder in its place: one line naming the object."""
    import os

    store = Store(str(tmp_path / "store"))
    store.write_bytes("p/_leases/iter-000001/000000.json", b"{}")
    path = Path(store.root) / "p" / "_leases" / "iter-000001" / "000000.json"
    if isinstance(garbage, bytes):
        path.write_bytes(garbage)
    else:
        path.unlink()
        {"fifo": lambda: os.mkfifo(path), "dev-zero": lambda: path.symlink_to("/dev/zero"),
         "folder": lambda: path.mkdir()}[garbage]()
    with pytest.raises(UserError) as info:
        lease.acquire(store, "p", 1, "me")
    assert info.value.line() == (
        f"lease={store.url('p/_leases/iter-000001/000000.json')!r}: is not a lease record (corrupted or written by "
        "another tool); fix: stop any run of this pipeline, then delete that object; the next run takes the lease anew")


def test_a_store_outage_while_reading_a_lease_is_an_outage_not_a_bad_record(tmp_path: Path, monkeypatch) -> None:
    """s3fs raises a 5xx answer (503 Service Unavailable, SlowDown) as an OSError: read as
    "not a lease record", it was a UserError telling the operator to delete the lease, and
    the orchestrator did not retry. Fault injection: a real server gives no 503 on demand."""
    from components.core.errors import InfraError

    store = Store(str(tmp_path / "store"))
    lease.acquire(store, "p", 1, "me")

    def unavailable(rel: str, limit: int) -> bytes:
        raise OSError("An error occurred (ServiceUnavailable) when calling the GetObject operation: Service Unavailable")

    monkeypatch.setattr(store, "read_small", unavailable)
    with pytest.raises(InfraError) as info:
        lease.current(store, "p", 1)
    assert (info.value.what, info.value.where) == ("store", store.uri)
    assert "Service Unavailable" in info.value.reason


@pytest.mark.timeout(60)
def test_a_lease_is_renewed_while_its_stage_runs(tmp_path: Path) -> None:
    """A stage may outlive the lease's lifetime (6 hours, the trainer's own limit): the
    lease is renewed while it runs, and renewing stops once another holder has it."""
    store = Store(f"file://{tmp_path}/store")
    first = lease.acquire(store, "p", 1, "airflow:run-a", ttl_s=0.5)
    with lease.renewed(store, "p", 1, "airflow:run-a", every_s=0.1):
        time.sleep(1.0)  # twice the lifetime it was taken with
        cur = lease.current(store, "p", 1)
        assert cur.holder == "airflow:run-a" and cur.live() and cur.generation > first.generation
    assert lease.release(store, "p", 1, "airflow:run-a")
    taken = lease.acquire(store, "p", 1, "airflow:run-b")
    with lease.renewed(store, "p", 1, "airflow:run-a", every_s=0.05):
        time.sleep(0.3)  # six beats: the first finds run-b's lease and stops
    cur = lease.current(store, "p", 1)
    assert (cur.holder, cur.generation) == ("airflow:run-b", taken.generation)
    assert len(store.listdir("p/_leases/iter-000001")) == taken.generation + 1
