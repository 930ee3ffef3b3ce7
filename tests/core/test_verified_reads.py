"""Verified reads at the Store level, on file:// and on S3 (SeaweedFS): a file with a
manifest expectation is checked (size, then sha256) on every read, streamed check and
checkpoint download; a mismatch is one line naming the file and the fix."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from components.core.context import read_manifest
from components.core.errors import UserError
from components.core.manifest import MANIFEST, InputRef, Manifest, OutputFile
from components.core.storage import Expected, Store, sha256_bytes

REMEDY = "delete x/_MANIFEST.json and re-run stage rollout"


def expected(data: bytes) -> Expected:
    return Expected(sha256=sha256_bytes(data), size=len(data), stage="rollout", remedy=REMEDY)


def test_read_and_verify_check_size_and_digest(store_uri: str) -> None:
    store = Store(store_uri)
    data = b"0123456789" * 1000
    store.write_bytes("a/f.bin", data)
    want = expected(data)
    assert store.read_bytes("a/f.bin", want) == data
    store.verify("a/f.bin", want)

    store.write_bytes("a/f.bin", data[:-1])
    for check in (lambda: store.read_bytes("a/f.bin", want), lambda: store.verify("a/f.bin", want)):
        with pytest.raises(UserError) as err:
            check()
        line = str(err.value)
        assert store.url("a/f.bin") in line and "truncated" in line and REMEDY in line and "\n" not in line

    store.write_bytes("a/f.bin", b"1" + data[1:])
    with pytest.raises(UserError, match="corrupt: sha256"):
        store.verify("a/f.bin", want)
    store.delete("a/f.bin")
    with pytest.raises(UserError, match="is missing"):
        store.read_bytes("a/f.bin", want)


def test_reading_a_manifest_makes_every_read_of_its_outputs_checked(store_uri: str) -> None:
    store = Store(store_uri)
    data, digest = store.write_table("p/iter-000001/rollout/rollouts.parquet", pa.table({"x": [1, 2, 3]}))
    manifest = Manifest(stage="rollout", pipeline="p", iteration=1, shard=None, inputs={}, config_digest="c",
                        code_version="v", outputs={"rollouts": OutputFile("p/iter-000001/rollout/rollouts.parquet", 3,
                                                                           digest, len(data))})
    store.write_json(f"p/iter-000001/rollout/{MANIFEST}", manifest.to_json())
    assert read_manifest(store, "p/iter-000001/rollout") is not None
    assert store.read_table("p/iter-000001/rollout/rollouts.parquet").num_rows == 3

    other = Store(store_uri)  # any Store of this process, e.g. a stage module's own reader
    rel = "p/iter-000001/rollout/rollouts.parquet"
    if store_uri.startswith("file://"):
        Path(other.root, rel).write_bytes(data[: len(data) // 2])  # corrupted outside the Store
    else:
        other.fs.pipe_file(other._path(rel), data[: len(data) // 2])
    with pytest.raises(UserError) as err:
        other.read_table(rel)
    assert store.url(rel) in str(err.value) and f"{store.url('p/iter-000001/rollout')}/{MANIFEST}" in str(err.value)


def test_download_dir_checks_expected_files(store_uri: str, tmp_path: Path) -> None:
    store = Store(store_uri)
    store.write_bytes("ck/model.safetensors", b"weights" * 100)
    store.write_bytes("ck/config.json", b"{}")
    want = {"model.safetensors": expected(b"weights" * 100)}
    assert set(store.download_dir("ck", tmp_path / "ok", want)) == {"model.safetensors", "config.json"}
    store.write_bytes("ck/model.safetensors", b"weightz" * 100)
    with pytest.raises(UserError, match="model.safetensors"):
        store.download_dir("ck", tmp_path / "bad", want)
    store.delete("ck/model.safetensors")
    with pytest.raises(UserError, match="is missing"):
        store.download_dir("ck", tmp_path / "gone", want)


def test_checkpoint_files_are_known_from_the_producing_manifest(tmp_path: Path) -> None:
    """``load_policy`` learns what a checkpoint's files must hold from the manifest above
    it; the trainer state read later through a Store of the checkpoint URI is checked too."""
    from components.core.policy import checkpoint_expectations

    store = Store(f"file://{tmp_path}")
    prefix = "p/iter-000002/trainer"
    weights, state = b"w" * 64, b"s" * 32
    store.write_bytes(f"{prefix}/checkpoint/model.safetensors", weights)
    store.write_bytes(f"{prefix}/checkpoint/trainer_state.pt", state)
    manifest = Manifest(stage="trainer", pipeline="p", iteration=2, shard=None, inputs={}, config_digest="c",
                        code_version="v", outputs={
                            "checkpoint": OutputFile(f"{prefix}/checkpoint", 10, sha256_bytes(weights), len(weights)),
                            "trainer_state": OutputFile(f"{prefix}/checkpoint/trainer_state.pt", 1,
                                                        sha256_bytes(state), len(state))})
    store.write_json(f"{prefix}/{MANIFEST}", manifest.to_json())
    checkpoint = store.url(f"{prefix}/checkpoint")
    found = checkpoint_expectations(checkpoint)
    assert {k: v.sha256 for k, v in found.items()} == {"model.safetensors": sha256_bytes(weights),
                                                        "trainer_state.pt": sha256_bytes(state)}
    assert "re-run stage trainer" in found["model.safetensors"].remedy
    assert checkpoint_expectations(store.url("p/elsewhere/checkpoint")) == {}  # no manifest: nothing to check

    Path(tmp_path, prefix, "checkpoint", "trainer_state.pt").write_bytes(b"t" * 32)
    with pytest.raises(UserError, match="trainer_state.pt.*corrupt.*re-run stage trainer"):
        Store(checkpoint).read_bytes("trainer_state.pt")


def test_a_cut_manifest_is_named(tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}")
    store.write_bytes(f"p/iter-000001/rollout/shard-00000-of-00002/{MANIFEST}", b'{"stage": "rollout", "pipe')
    with pytest.raises(UserError) as err:
        read_manifest(store, "p/iter-000001/rollout/shard-00000-of-00002")
    assert f"shard-00000-of-00002/{MANIFEST}" in str(err.value) and "re-run stage rollout" in str(err.value)


def _real_manifest() -> dict:
    return Manifest(stage="rollout", pipeline="p", iteration=1, shard="0/2", inputs={"tasks": InputRef("u", "d")},
                    config_digest="c", code_version="v",
                    outputs={"rollouts": OutputFile("p/x.parquet", 3, "ab" * 32, 10)}).to_json()


@pytest.mark.parametrize("change, problem", [
    ({"iteration": "x"}, "ValueError: field iteration is a str, not int"),
    ({"iteration": True}, "ValueError: field iteration is a bool, not int"),
    ({"shard": 5}, "ValueError: field shard is a int, not str/NoneType"),
    ({"shard": "5"}, "ValueError: shard '5' is not i/n"),
    ({"info": [1]}, "ValueError: field info is a list, not dict"),
    ({"outputs": {"rollouts": {"path": 7, "rows": 3, "sha256": "s"}}}, "ValueError: field outputs.rollouts.path is a "
                                                                      "int, not str"),
    ({"outputs": {"rollouts": {"path": "p", "rows": 3, "sha256": 123}}}, "ValueError: field outputs.rollouts.sha256 "
                                                                        "is a int, not str"),
    ({"inputs": {"tasks": "u"}}, "ValueError: inputs.tasks is not an object"),
    ({"stage": None}, "ValueError: field stage is a NoneType, not str"),
    ({"extra": 1}, "ValueError: unknown field extra"),
])
def test_a_manifest_with_a_field_of_the_wrong_type_is_named_at_once(change: dict, problem: str, tmp_path: Path) -> None:
    """Tampered with, or written by something else: refused as it is read, naming the field,
    not a TypeError or AttributeError later in whichever stage trips over it (a retried
    task and exit 1 before)."""
    import json

    store = Store(f"file://{tmp_path}")
    prefix = "p/iter-000001/rollout/shard-00000-of-00002"
    assert read_manifest(store, prefix) is None
    store.write_bytes(f"{prefix}/{MANIFEST}", json.dumps(_real_manifest()).encode())
    assert read_manifest(store, prefix).outputs["rollouts"].size == 10  # the untouched one reads
    store.write_bytes(f"{prefix}/{MANIFEST}", json.dumps(_real_manifest() | change).encode())
    with pytest.raises(UserError) as err:
        read_manifest(store, prefix)
    assert err.value.line() == (f"file={store.url(prefix + '/' + MANIFEST)!r}: manifest is unreadable ({problem}); "
                                "fix: delete it and re-run stage rollout")


@pytest.mark.parametrize(("body", "problem"), [(b"[" * 100_000, "RecursionError"),
                                               (b" " * ((64 << 20) + 1), "OSError: more than 67108864 bytes, the most read here")])
def test_a_manifest_nested_too_deep_or_too_large_is_named(body: bytes, problem: str, tmp_path: Path) -> None:
    store = Store(f"file://{tmp_path}")
    store.write_bytes(f"p/iter-000001/rollout/{MANIFEST}", body)
    with pytest.raises(UserError) as err:
        read_manifest(store, "p/iter-000001/rollout")
    assert err.value.problem == f"manifest is unreadable ({problem})"


@pytest.mark.timeout(60)  # a FIFO read blocked forever before: a regression fails here instead of hanging
def test_a_fifo_or_dev_zero_in_place_of_a_manifested_file_is_named_not_read(tmp_path: Path) -> None:
    """A local manifested file replaced by a FIFO (its read waited for a writer forever) or
    a symbolic link to /dev/zero (read until memory ran out): one line naming the file and
    the stage to re-run, before a byte is read; the same for a checkpoint's files."""
    import os

    store = Store(f"file://{tmp_path / 'root'}")
    data = b"0123456789" * 100
    want = expected(data)
    store.write_bytes("a/f.bin", data)
    target = Path(store.root) / "a" / "f.bin"
    target.unlink()
    os.mkfifo(target)
    with pytest.raises(UserError) as err:
        store.read_bytes("a/f.bin", want)
    assert err.value.line() == (f"file={store.url('a/f.bin')!r}: manifested output of stage rollout is not a regular "
                                f"file (a FIFO); fix: {REMEDY}")
    target.unlink()
    target.symlink_to("/dev/zero")
    with pytest.raises(UserError, match=r"manifested output of stage rollout is not a regular file \(a character device\)"):
        store.read_bytes("a/f.bin", want)
    store.write_bytes("ck/config.json", b"{}")
    (Path(store.root) / "ck" / "model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(UserError, match=r"model\.safetensors'?: is not a regular file \(a FIFO, a device or a socket\); "
                                        r"fix: " + REMEDY):
        store.download_dir("ck", tmp_path / "dl", {"model.safetensors": want})


def test_an_s3_object_of_another_size_is_refused_before_it_is_read(s3_env, monkeypatch) -> None:
    """Its size comes from a HEAD: a file replaced by a huge object is not read into memory."""
    from tests.fixtures.s3 import unique_prefix

    store = Store(f"s3://{s3_env.bucket}/{unique_prefix('sized-read')}")
    data = b"0123456789" * 100
    store.write_bytes("a/f.bin", data * 3)
    read: list[str] = []
    monkeypatch.setattr(store.fs, "cat_file", lambda path, **kw: read.append(path))
    with pytest.raises(UserError, match=r"has 3000 bytes, its manifest says 1000 \(truncated or overwritten\)"):
        store.read_bytes("a/f.bin", expected(data))
    assert read == []


def test_read_small_refuses_an_s3_object_over_its_limit_from_the_head(s3_env, monkeypatch) -> None:
    from tests.fixtures.s3 import unique_prefix

    store = Store(f"s3://{s3_env.bucket}/{unique_prefix('read-small')}")
    store.write_bytes("lease.json", b"x" * 100)
    assert store.read_small("lease.json", 100) == b"x" * 100
    read: list[str] = []
    monkeypatch.setattr(store.fs, "cat_file", lambda path, **kw: read.append(path))
    with pytest.raises(OSError, match=r"100 bytes, more than the 10 read here"):
        store.read_small("lease.json", 10)
    assert read == []


def _manifested(store: Store, stage: str, name: str, rel: str, data: bytes) -> Manifest:
    """A manifest whose output ``name`` is ``data``, digest and size matching (as a hand-edited
    run root would have them)."""
    store.write_bytes(rel, data)
    prefix = rel.rsplit("/", 1)[0]
    manifest = Manifest(stage=stage, pipeline="p", iteration=1, shard=None, inputs={}, config_digest="c",
                        code_version="v", outputs={name: OutputFile(rel, 1, sha256_bytes(data), len(data))})
    store.write_json(f"{prefix}/{MANIFEST}", manifest.to_json())
    return read_manifest(store, prefix)


def test_records_of_another_type_under_a_matching_digest_are_one_line(tmp_path: Path) -> None:
    """Bytes that match the manifest can still not be what the stage writes: a Parquet file
    of tasks put where rollouts belong is refused naming the file, the missing column and
    the stage to re-run (a KeyError traceback, retried, before)."""
    from components.core.context import read_output_records
    from components.core.records import Rollout, Task, to_table

    store = Store(f"file://{tmp_path}")
    task = Task(task_id="t", domain="math", split="train", difficulty=1, prompt="1+1=", context_tokens=4,
                reference={"answer": "2"})
    rel = "p/iter-000001/rollout/rollouts.parquet"
    data, _ = store.write_table(rel, to_table([task]))
    manifest = _manifested(store, "rollout", "rollouts", rel, data)
    assert read_output_records(store, manifest, "rollouts", Task) == [task]
    with pytest.raises(UserError) as err:
        read_output_records(store, manifest, "rollouts", Rollout)
    assert err.value.line() == (
        f"file={store.url(rel)!r}: output of stage rollout is not what it writes (no column 'rollout_id' of the "
        f"Rollout layout (another record type, or an older layout)); fix: delete "
        f"{store.url('p/iter-000001/rollout')}/{MANIFEST} and re-run stage rollout ('posttrain stage rollout "
        "--iteration 1', or the whole iteration)")
    with pytest.raises(UserError, match="manifest of stage rollout lists no output 'executions'"):
        read_output_records(store, manifest, "executions", Rollout)


@pytest.mark.parametrize(("body", "problem"), [
    (b'{"prior": {"math": {"count": 3, "mean": NaN, "m2": 0.5}}}', "prior.math.mean: Input should be a finite number"),
    (b'{"prior": {"math": {"count": -1, "mean": 0.5, "m2": 0.5}}}', "prior.math.count: Input should be greater than or "
                                                                    "equal to 0"),
    (b'{"prior": {"math": {"count": 3, "mean": 0.5, "m2": -2}}}', "prior.math.m2: Input should be greater than or "
                                                                  "equal to 0"),
    (b'{"prior": {"math": {"count": 3, "mean": 0.5}}}', "prior.math.m2: Field required"),
    (b'{"prior": [1, 2]}', "prior: Input should be an object"),
    (b'{"batch": {}}', "prior: Field required"),
    (b"[" * 100_000, "top level: Invalid JSON: recursion limit exceeded at line 1 column 202"),
    (b'{"prior": {}', "top level: Invalid JSON: EOF while parsing an object at line 1 column 12"),
])
def test_norm_stats_that_are_not_statistics_are_one_line(body: bytes, problem: str, tmp_path: Path) -> None:
    from components.core.context import read_output_json
    from components.reward.normalize import STATS_OUTPUT, StatsFile, from_json

    store = Store(f"file://{tmp_path}")
    rel = "p/iter-000001/reward/norm_stats.json"
    good = _manifested(store, "reward", STATS_OUTPUT, rel,
                       b'{"prior": {"math": {"count": 3, "mean": 0.5, "m2": 0.75}}, "batch": {}, "prior_iteration": 0}')
    assert from_json(read_output_json(store, good, STATS_OUTPUT, StatsFile)["prior"])["math"].std == 0.5
    manifest = _manifested(store, "reward", STATS_OUTPUT, rel, body)
    with pytest.raises(UserError) as err:
        read_output_json(store, manifest, STATS_OUTPUT, StatsFile)
    assert err.value.field == "file" and err.value.value == store.url(rel)
    assert err.value.problem == f"output of stage reward is not what it writes ({problem})"
    assert "re-run stage reward" in err.value.fix
