"""A checkpoint folder holds only the files of the run that wrote it, on file:// and on
S3 (SeaweedFS): ``upload_dir`` replaces what was under its folder (a re-run wrote file
by file and removed nothing, so an earlier run's ``chat_template.jinja`` stayed), and
``download_dir`` refuses a file the folder's manifest does not list, before a load
reads it unchecked."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core.errors import UserError
from components.core.storage import Expected, Store, sha256_bytes

REMEDY = "delete x/_MANIFEST.json and re-run stage trainer"
WEIGHTS = b"w" * 100
CONFIG = b'{"model_type": "llama"}'


def _folder(path: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def _want(data: bytes) -> Expected:
    return Expected(sha256=sha256_bytes(data), size=len(data), stage="trainer", remedy=REMEDY)


def test_a_re_upload_leaves_nothing_of_the_earlier_one(store_uri: str, tmp_path: Path) -> None:
    store = Store(store_uri)
    first = _folder(tmp_path / "first", {"model.safetensors": b"old" * 10, "config.json": CONFIG,
                                         "chat_template.jinja": b"{{ old }}", "additional_chat_templates/x.jinja": b"x"})
    store.upload_dir(first, "run/checkpoint")
    store.write_bytes("run/other.json", b"{}")  # beside the folder: not the folder's
    second = _folder(tmp_path / "second", {"model.safetensors": WEIGHTS, "config.json": CONFIG})
    assert store.upload_dir(second, "run/checkpoint") == {"model.safetensors": sha256_bytes(WEIGHTS),
                                                         "config.json": sha256_bytes(CONFIG)}
    # the files a load gets (SeaweedFS may still list the emptied sub-folder, as S3 servers that keep folders do)
    assert set(store.download_dir("run/checkpoint", tmp_path / "got")) == {"config.json", "model.safetensors"}
    assert not store.exists("run/checkpoint/chat_template.jinja")
    assert not store.exists("run/checkpoint/additional_chat_templates/x.jinja")
    assert store.listdir("run") == ["checkpoint", "other.json"]
    assert store.read_bytes("run/checkpoint/model.safetensors") == WEIGHTS
    before = {"": store.listdir(), "run": store.listdir("run"), "run/checkpoint": store.listdir("run/checkpoint")}
    for root in ("", "/"):  # never the whole store, under ``python -O`` too
        with pytest.raises(ValueError, match=r"^upload_dir replaces a folder, never the store's root \(got '/?'\)$"):
            store.upload_dir(second, root)
    assert {rel: store.listdir(rel) for rel in before} == before
    assert (before[""], before["run"]) == (["run"], ["checkpoint", "other.json"])
    assert set(store.download_dir("run/checkpoint", tmp_path / "after")) == {"config.json", "model.safetensors"}
    assert store.read_bytes("run/other.json") == b"{}"
    assert store.read_bytes("run/checkpoint/model.safetensors") == WEIGHTS


def test_a_file_the_manifest_does_not_list_is_refused_before_it_is_copied(store_uri: str, tmp_path: Path) -> None:
    store = Store(store_uri)
    store.write_bytes("ck/model.safetensors", WEIGHTS)
    store.write_bytes("ck/config.json", CONFIG)
    store.write_bytes("ck/trainer_state.pt", b"state")
    store.write_bytes("ck/checkpoint-5/optimizer.pt", b"never loaded")
    want = {"model.safetensors": _want(WEIGHTS), "config.json": _want(CONFIG)}
    kept = ("additional_chat_templates",)
    got = store.download_dir("ck", tmp_path / "ok", want, skip=("trainer_state.pt",), folders=kept)
    assert set(got) == {"model.safetensors", "config.json"}

    for stale in ("chat_template.jinja", "additional_chat_templates/tool_use.jinja"):
        store.write_bytes(f"ck/{stale}", b"{{ stale }}")  # left by an earlier run, or put there by hand
        with pytest.raises(UserError) as err:
            store.download_dir("ck", tmp_path / "stale", want, skip=("trainer_state.pt",), folders=kept)
        assert err.value.line() == (f"file={store.url('ck/' + stale)!r}: is in the folder {store.url('ck')}, but the "
                                    "manifest of stage trainer that wrote the folder does not list it (left by an "
                                    f"earlier run, or put there by hand); fix: delete that file; or {REMEDY}")
        assert not (tmp_path / "stale" / stale).exists()
        store.delete(f"ck/{stale}")

    # a manifest from before every checkpoint file was an output lists only the weights: the rest is not refused
    store.write_bytes("ck/chat_template.jinja", b"{{ old }}")
    old = store.download_dir("ck", tmp_path / "old", {"model.safetensors": _want(WEIGHTS)}, skip=("trainer_state.pt",),
                             folders=kept)
    assert set(old) == {"model.safetensors", "config.json", "chat_template.jinja"}
    assert set(store.download_dir("ck", tmp_path / "none", folders=kept)) == {  # no manifest: nothing to check
        "model.safetensors", "config.json", "chat_template.jinja", "trainer_state.pt"}
