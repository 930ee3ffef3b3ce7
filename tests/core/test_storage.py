"""Store: the same operations on file:// and on a real S3 server (SeaweedFS on loopback)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pytest

from components.core.errors import UserError
from components.core.storage import Store, normalize_uri, sha256_bytes
from tests.fixtures.home import TINY_RECIPE
from tests.fixtures.s3 import closed_port


def test_bytes_and_json_round_trip(store_uri: str) -> None:
    store = Store(store_uri)
    payload = bytes(range(256)) * 3
    store.write_bytes("a/b/blob.bin", payload)
    assert store.read_bytes("a/b/blob.bin") == payload

    obj = {"b": [1, 2.5, "three"], "a": {"nested": True, "none": None}}
    written = store.write_json("a/obj.json", obj)
    assert store.read_bytes("a/obj.json") == written
    assert written == json.dumps(obj, indent=2, sort_keys=True).encode()
    assert store.read_json("a/obj.json") == obj

    store.write_bytes("a/b/blob.bin", b"second")  # a retry overwrites, never duplicates
    assert store.read_bytes("a/b/blob.bin") == b"second"
    assert store.listdir("a/b") == ["blob.bin"]


def test_exists_listdir_glob_delete(store_uri: str) -> None:
    store = Store(store_uri)
    assert store.exists("d/x.txt") is False
    assert store.listdir("d") == []
    for rel in ("d/x.txt", "d/y.txt", "d/sub/z.txt", "d/sub/w.json"):
        store.write_bytes(rel, rel.encode())
    assert store.exists("d/x.txt") is True
    assert store.exists("d/nope.txt") is False
    assert store.listdir("d") == ["sub", "x.txt", "y.txt"]
    assert store.listdir("d/sub") == ["w.json", "z.txt"]
    assert store.glob("d/*.txt") == ["d/x.txt", "d/y.txt"]
    assert store.glob("d/*/*.txt") == ["d/sub/z.txt"]
    store.delete("d/x.txt")
    assert store.exists("d/x.txt") is False
    assert store.listdir("d") == ["sub", "y.txt"]
    store.delete("d/sub", recursive=True)
    # Only the objects are asserted gone: SeaweedFS (unlike AWS S3) keeps an emptied
    # folder as a common prefix, so listdir("d") may still show "sub" there.
    assert store.glob("d/sub/*") == []
    assert store.exists("d/sub/z.txt") is False
    assert store.read_bytes("d/y.txt") == b"d/y.txt"


def test_url_resolves_under_the_root(store_uri: str) -> None:
    store = Store(store_uri)
    assert store.url("p/q.parquet") == store_uri.rstrip("/") + "/p/q.parquet"
    nested = Store(store.url("p"))
    nested.write_bytes("q.bin", b"via a nested root")
    assert store.read_bytes("p/q.bin") == b"via a nested root"


def test_write_table_digest_is_sha256_of_stored_bytes(store_uri: str) -> None:
    store = Store(store_uri)
    table = pa.table({"x": pa.array([1, 2, 3], pa.int64()), "s": ["a", "b", "ü"]})
    data, digest = store.write_table("t/table.parquet", table)
    stored = store.read_bytes("t/table.parquet")
    assert stored == data
    assert digest == hashlib.sha256(stored).hexdigest() == sha256_bytes(stored)
    assert store.read_table("t/table.parquet").equals(table)


def test_upload_and_download_dir_round_trip(store_uri: str, tmp_path: Path) -> None:
    src = tmp_path / "ckpt-src"
    files = {
        "config.json": b'{"model_type": "llama"}',
        "model.safetensors": bytes(range(200)) * 50,
        "tokenizer/tokenizer.json": b'{"version": "1.0"}',
    }
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    store = Store(store_uri)
    digests = store.upload_dir(src, "run/checkpoint")
    assert digests == {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    assert store.listdir("run/checkpoint") == ["config.json", "model.safetensors", "tokenizer"]

    dst = tmp_path / "ckpt-dst"
    store.download_dir("run/checkpoint", dst)
    got = {p.relative_to(dst).as_posix(): p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    assert got == files


def test_check_reachable_passes_and_leaves_no_probe(store_uri: str) -> None:
    store = Store(store_uri)
    store.check_reachable()
    assert store.listdir("") == []
    store.write_bytes("kept.txt", b"x")
    store.check_reachable()
    assert store.listdir("") == ["kept.txt"]


def test_closed_endpoint_is_an_outage_and_exits_1(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    """Nothing listens: the store is down (retry later), not a user's mistake."""
    from components.cli import main
    from components.core.errors import InfraError

    port = closed_port()
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "nothing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("POSTTRAIN_HOME", str(tmp_path))
    store = Store("s3://bucket/x", field="--run-root")
    with pytest.raises(InfraError) as info:
        store.check_reachable()
    assert info.value.line().startswith("store unreachable at 's3://bucket/x': EndpointConnectionError: Could not connect")
    assert f"127.0.0.1:{port}" in info.value.line()
    assert main(["stage", "taskgen", "--run-root", "s3://bucket/x", "--recipe", str(TINY_RECIPE)]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("posttrain")]
    assert len(err) == 1 and err[0].startswith("posttrain: unreachable: store unreachable at 's3://bucket/x'")


def test_file_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path / 'root'}")
    for i in range(5):
        store.write_bytes(f"x/f{i}.bin", b"x" * i)
    store.write_json("x/j.json", {"k": 1})
    store.write_table("x/t.parquet", pa.table({"a": [1]}))
    store.write_bytes("x/f0.bin", b"overwritten")
    names = sorted(p.relative_to(tmp_path / "root").as_posix() for p in (tmp_path / "root").rglob("*"))
    assert names == ["x", "x/f0.bin", "x/f1.bin", "x/f2.bin", "x/f3.bin", "x/f4.bin", "x/j.json", "x/t.parquet"]
    assert not [n for n in names if ".tmp-" in n]


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket/prefix/", "s3://bucket/prefix"),
        ("s3://bucket", "s3://bucket"),
        ("file:///tmp/../tmp/store", "file:///tmp/store"),
        ("file:/tmp/store", "file:///tmp/store"),  # RFC 8089's one-slash form
        ("file://localhost/tmp/store", "file:///tmp/store"),
    ],
)
def test_normalize_uri_accepts(uri: str, expected: str) -> None:
    assert normalize_uri(uri) == expected


def test_normalize_uri_makes_bare_paths_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert normalize_uri("rel/store") == f"file://{tmp_path.resolve()}/rel/store"


@pytest.mark.parametrize(
    ("uri", "needles"),
    [
        ("ftp://x", ["run_root='ftp://x'", "unsupported URI scheme 'ftp'", "fix: use one of file://, s3://"]),
        ("s3://", ["run_root='s3://'", "no bucket", "fix: write s3://bucket/prefix"]),
        ("   ", ["run_root=''", "empty storage URI", "fix: pass file:///path or s3://bucket/prefix"]),
        # Each of these used to name another folder than the one written (./tmp/rty, ./mp/rtx, the cwd).
        ("file://tmp/rty", ["run_root='file://tmp/rty'", "the host 'tmp'", "fix: write three slashes for a local path "
                            "(file:///tmp/rty)"]),
        ("file://", ["run_root='file://'", "needs an absolute path", "fix: write file:///absolute/path or a bare path"]),
        ("file:rel/x", ["run_root='file:rel/x'", "needs an absolute path"]),
    ],
)
def test_normalize_uri_errors(uri: str, needles: list[str]) -> None:
    with pytest.raises(UserError) as info:
        normalize_uri(uri)
    line = info.value.line()
    for needle in needles:
        assert needle in line


def test_local_writes_reach_the_disk_before_and_after_their_rename(tmp_path, monkeypatch) -> None:
    """A power loss after an unsynced rename can leave a manifest's name holding no bytes:
    the file is synced before its rename or link, and its folder after."""
    import os
    import stat

    from components.core import storage

    synced: list[tuple[str, str]] = []
    real = os.fsync

    def record(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        synced.append(("folder" if stat.S_ISDIR(mode) else "file", os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(storage.os, "fsync", record)
    store = Store(f"file://{tmp_path}/root")
    store.write_bytes("a/_MANIFEST.json", b"{}")
    folder = f"{tmp_path}/root/a"
    assert [kind for kind, _ in synced] == ["file", "folder"]
    assert synced[0][1].startswith(f"{folder}/_MANIFEST.json.tmp-") and synced[1] == ("folder", folder)
    synced.clear()
    assert store.create("b/lease.json", b"{}")
    assert [kind for kind, _ in synced] == ["file", "folder"] and synced[1] == ("folder", f"{tmp_path}/root/b")


WILDCARD = "which S3 tools read as a wildcard (a delete under it would also delete other prefixes' objects)"
EMPTY_PART = "has an empty part ('//'), which some S3 servers (SeaweedFS) drop, so nothing under the prefix is listed"


@pytest.mark.parametrize(("uri", "problem", "fix"), [
    ("s3://bucket/runs/r*", f"holds '*', {WILDCARD}", "rename the prefix without * ? [ ]"),
    ("s3://bucket/runs/r?", f"holds '?', {WILDCARD}", "rename the prefix without * ? [ ]"),
    ("s3://bucket/x?y=1", f"holds '?', {WILDCARD}", "rename the prefix without * ? [ ]"),
    ("s3://bucket/a[1]", f"holds '[', ']', {WILDCARD}", "rename the prefix without * ? [ ]"),
    ("s3://bucket/a]", f"holds ']', {WILDCARD}", "rename the prefix without * ? [ ]"),
    ("s3://bucket/a//b", EMPTY_PART, "write the prefix with one '/' between its parts"),
    ("s3://bucket//a", EMPTY_PART, "write the prefix with one '/' between its parts"),
    ("s3://bucket/x\\y", "holds a backslash, which some S3 servers (SeaweedFS) turn into '/'",
     "write the prefix with '/' between its parts"),
    ("s3://bucket:9000/x", "the bucket part 'bucket:9000' holds a ':' (a port?), which no bucket name has",
     "put host:port in AWS_ENDPOINT_URL; write s3://bucket/prefix"),
])
@pytest.mark.parametrize("field", ["run_root", "--checkpoint"])
def test_an_s3_prefix_servers_or_tools_read_otherwise_is_refused(uri: str, problem: str, fix: str, field: str) -> None:
    """Each was accepted: 'runs/r*' deleted another run root's checkpoint, 'a//b' listed as
    empty on SeaweedFS (a lease taken twice), and 'bucket:9000' was told to fix its endpoint."""
    with pytest.raises(UserError) as info:
        normalize_uri(uri, field)
    assert (info.value.field, info.value.value, info.value.problem, info.value.fix) == (field, uri, problem, fix)
    with pytest.raises(UserError):
        Store(uri, field)


@pytest.mark.parametrize("uri", ["s3://bucket/a/b/", "s3://bucket/", "s3://bucket/runs-1/x.y_z (2)/é"])
def test_an_s3_prefix_without_them_is_accepted(uri: str) -> None:
    assert normalize_uri(uri) == uri.rstrip("/")


@pytest.mark.parametrize("mine", ["runs/r*", "runs/r?", "runs/r[X]"])
def test_a_delete_is_literal_never_a_pattern(store_uri: str, mine: str, tmp_path: Path) -> None:
    """s3fs's rm reads '*', '?' and '[' as a pattern: deleting 'runs/r*/...' deleted the
    same files under 'runs/rX', a champion's weights among them (on file:// it never did)."""
    store = Store(store_uri)
    others = ["runs/rX/demo/_MANIFEST.json", "runs/rX/ck/model.safetensors", "runs/rX/ck/tok/tokenizer.json"]
    for rel in others:
        store.write_bytes(rel, b"other run root's")
    store.write_bytes(f"{mine}/demo/_MANIFEST.json", b"mine")
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"new weights")
    store.upload_dir(src, f"{mine}/ck")
    store.upload_dir(src, f"{mine}/ck")  # a re-run: replace deletes the folder first

    store.delete(f"{mine}/demo/_MANIFEST.json")
    assert not store.exists(f"{mine}/demo/_MANIFEST.json")
    assert store.read_bytes(f"{mine}/ck/model.safetensors") == b"new weights"
    store.delete(f"{mine}/ck", recursive=True)
    assert not store.exists(f"{mine}/ck/model.safetensors")
    assert [rel for rel in others if store.read_bytes(rel) != b"other run root's"] == []
    store.delete(f"{mine}/nothing-here", recursive=True)  # nothing there: nothing to do, no error
    store.delete(f"{mine}/nothing-here")


def test_a_missing_bucket_is_named(s3_env) -> None:
    """It said 'store is not reachable or not writable (FileNotFoundError: Not Found)'."""
    with pytest.raises(UserError) as info:
        Store("s3://posttrain-no-such-bucket-zz/runs", "--run-root").check_reachable()
    assert info.value.line() == ("--run-root='s3://posttrain-no-such-bucket-zz/runs': store is not reachable or not "
                                 "writable (the S3 server has no bucket 'posttrain-no-such-bucket-zz'); fix: create the "
                                 "bucket, or name an existing one in the run root")


@pytest.mark.parametrize("recursive", [False, True])
def test_an_s3_delete_during_an_outage_raises_it(recursive: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not skipped as if nothing were there (``fs.isfile`` answers False to any error): a
    manifest a cache miss failed to delete would be read as the stage's output."""
    from components.core.errors import outage

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "nothing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with pytest.raises(Exception) as info:  # botocore's error, whichever its type
        Store("s3://bucket/x").delete("demo/_MANIFEST.json", recursive=recursive)
    assert outage(info.value) is not None, repr(info.value)
