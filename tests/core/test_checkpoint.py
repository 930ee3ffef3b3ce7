"""Hostile checkpoint folders (``components/core/checkpoint.py``, through ``load_policy``):
each is one UserError naming the field and what is wrong, before transformers allocates
for it or after it loaded something that is not the checkpoint. Before: 7 GB and a
traceback (1e9 layers), a 34 GB allocation (a 2**28 vocabulary with no embedding), a
Rust panic (a token id of 2**31), a hang (300,000 special tokens), and models with
random, NaN or integer weights loaded in silence."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from components.core.errors import UserError
from components.core.policy import load_policy, save_policy
from components.core.storage import Store
from tests.rollout.helpers import tiny_policy


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    tiny = tiny_policy(seed=1)
    save_policy(tiny.model, tiny.tokenizer, Store(str(root), "test"), "ok")
    return root / "ok"


def edited(good: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(good, folder)
    edit(folder)
    return folder


def json_edit(name: str, change):
    def edit(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        change(data)
        (folder / name).write_text(json.dumps(data))
    return edit


def weights_edit(change):
    def edit(folder: Path) -> None:
        tensors = load_file(folder / "model.safetensors")
        save_file(change(tensors), folder / "model.safetensors")
    return edit


def refused(folder: Path) -> str:
    with pytest.raises(UserError) as info:
        load_policy(f"file://{folder}", field="--checkpoint")
    assert info.value.field == "--checkpoint"
    return info.value.problem


@pytest.mark.parametrize(("edit", "problem"), [
    (json_edit("config.json", lambda c: c.update(num_hidden_layers=10**9)),
     "config.json's 'num_hidden_layers' is 1000000000, not a whole number from 1 to 1024"),
    (json_edit("config.json", lambda c: c.update(num_hidden_layers=0)),
     "config.json's 'num_hidden_layers' is 0, not a whole number from 1 to 1024"),
    (json_edit("config.json", lambda c: c.update(vocab_size=2**28)),
     "config.json's 'vocab_size' is 268435456, not a whole number from 1 to 4194304"),
    (json_edit("config.json", lambda c: c.update(max_position_embeddings=-5)),
     "config.json's 'max_position_embeddings' is -5"),
    (json_edit("config.json", lambda c: c.update(rms_norm_eps=float("nan"))),
     "config.json's 'rms_norm_eps' is nan, not a finite number"),
    (weights_edit(lambda t: {k: v for k, v in t.items() if "q_proj" not in k}),
     "the checkpoint's weights lack 'model.layers.0.self_attn.q_proj.weight'"),
    (weights_edit(lambda t: {k: torch.full_like(v, float("nan")) if "norm" in k else v for k, v in t.items()}),
     "holds values that are not finite (NaN or inf)"),
    (weights_edit(lambda t: {k: v.to(torch.int32) for k, v in t.items()}), "is I32, not a float"),
    (json_edit("tokenizer_config.json", lambda c: c.pop("eos_token")),
     "the tokenizer has no end-of-sequence token (eos_token)"),
    (json_edit("tokenizer_config.json", lambda c: c.update(chat_template="x" * (1 << 21))),
     "tokenizer_config.json's chat_template is longer than 1048576 characters"),
    (json_edit("tokenizer_config.json", lambda c: c.update(extra_special_tokens=[f"<t{i}>" for i in range(100_001)])),
     "tokenizer_config.json's extra_special_tokens holds 100001 tokens, more than 100000"),
    (json_edit("tokenizer.json", lambda t: t["model"]["vocab"].update(a=2**31 - 5)),
     "tokenizer.json holds a token id outside 0 .. 4194303"),
    (json_edit("tokenizer.json", lambda t: t["model"]["vocab"].update({f"w{i}": 200 + i for i in range(50)})),
     "the tokenizer's vocabulary has 151 tokens, more than the model's 101 embeddings"),
    (json_edit("tokenizer_config.json", lambda c: c.update(eos_token="<nosuch>")),
     "the tokenizer's eos_token_id 101 is outside the model's 101 embeddings"),
    (json_edit("tokenizer.json", lambda t: t["added_tokens"].append(
        {"id": 101, "content": "<tool>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True})),
     "the tokenizer's token '<tool>' has id 101, outside the model's 101 embeddings"),
    (json_edit("config.json", lambda c: (c.clear(), c.update(model_type="gpt2", n_layer=10**9, vocab_size=101))),
     "config.json's 'n_layer' (num_hidden_layers) is 1000000000, not a whole number from 1 to 1024"),
    (json_edit("config.json", lambda c: c.update(text_config={"num_hidden_layers": 10**9})),
     "config.json's 'text_config.num_hidden_layers' is 1000000000, not a whole number from 1 to 1024"),
    (json_edit("config.json", lambda c: c.update(hidden_size=65536, vocab_size=4194304)),
     "config.json's sizes (vocab_size 4194304, hidden_size 65536, intermediate_size 64, num_hidden_layers 2, "
     "num_attention_heads 2, num_key_value_heads 2, head_dim 16, max_position_embeddings 96) make 274,920,177,664 "
     "parameters, more than the "),
    (json_edit("config.json", lambda c: c["rope_parameters"].update(rope_theta=float("nan"))),
     "config.json's 'rope_parameters.rope_theta' is nan, not a finite number"),
    (json_edit("config.json", lambda c: c["rope_parameters"].update(rope_theta=0.0)),
     "config.json's 'rope_parameters.rope_theta' is 0.0, not a number above 0 (the rotary embedding's base)"),
    (weights_edit(lambda t: t | {"model.layers.0.mlp.up_proj.weight": torch.zeros(65, 32)}),
     "the checkpoint's 'model.layers.0.mlp.up_proj.weight' has shape (65, 32), its config gives (64, 32)"),
], ids=["layers", "no-layers", "vocab", "positions", "nan-eps", "missing-weight", "nan-weights", "int-weights", "no-eos",
        "long-template", "many-specials", "token-id", "vocab-past-embeddings", "eos-past-embeddings",
        "added-token-past-embeddings", "gpt2-layers", "nested-layers", "sizes-together", "nan-rope-theta",
        "zero-rope-theta", "other-shape"])
def test_a_hostile_checkpoint_is_one_line(edit, problem: str, good: Path, tmp_path: Path) -> None:
    assert problem in refused(edited(good, tmp_path, edit))


def test_a_causal_lm_without_a_model_layers_stack_is_refused_for_what_it_lacks(tmp_path: Path) -> None:
    """A GPT-2 folder was refused as "not a decoder-only language model", which GPT-2 is."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = tiny_policy(seed=1).tokenizer
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=32)) \
        .save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    assert refused(tmp_path / "gpt2") == (
        "model_type 'gpt2' (GPT2LMHeadModel) has no model.layers (its modules: transformer, lm_head); posttrain samples "
        "from and trains a Llama-style causal LM, whose decoder layers are the stack model.layers")


def test_a_checkpoints_own_python_is_never_run_or_asked_about(good: Path, tmp_path: Path) -> None:
    """``auto_map`` in tokenizer_config.json asked "run the custom code? [y/N]" on a terminal."""
    def custom(config: dict) -> None:
        config.pop("tokenizer_class", None)
        config["auto_map"] = {"AutoTokenizer": ["evil.Tok", None]}

    folder = edited(good, tmp_path, json_edit("tokenizer_config.json", custom))
    (folder / "evil.py").write_text("raise SystemExit('ran')\n")
    assert "contains custom code" in refused(folder)


def test_the_good_checkpoint_loads(good: Path) -> None:
    policy = load_policy(f"file://{good}")
    assert policy.eos_id < policy.model.get_input_embeddings().num_embeddings


def test_a_model_folders_sub_folders_are_not_copied(good: Path, tmp_path: Path) -> None:
    """A training output folder holds ``checkpoint-*/`` and ``runs/`` beside the model,
    which a load never reads: all of it was copied to /tmp first (20 GB of it, in one
    case). A FIFO there shows it is not opened: it was refused as not a regular file."""
    import os

    folder = edited(good, tmp_path, lambda f: None)
    (folder / "checkpoint-500").mkdir()
    os.mkfifo(folder / "checkpoint-500" / "optimizer.pt")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages[0]['content'] }}")
    policy = load_policy(f"file://{folder}")
    assert policy.model.get_input_embeddings().num_embeddings == load_policy(f"file://{good}").model.get_input_embeddings().num_embeddings
    assert policy.tokenizer.chat_template["tool_use"] == "{{ messages[0]['content'] }}"  # the one sub-folder a load reads
    (folder / "model.safetensors").rename(folder / "checkpoint-500" / "model.safetensors")
    assert refused(folder) == "no weights file in the folder (model.safetensors or pytorch_model.bin)"


@pytest.mark.parametrize("name", ["chat_template.jinja", "additional_chat_templates/big.jinja"])
def test_a_chat_template_file_of_megabytes_is_refused_before_the_load(name: str, good: Path, tmp_path: Path) -> None:
    """A 3 GB chat_template.jinja took 6 GB to load."""
    def big(folder: Path) -> None:
        (folder / name).parent.mkdir(exist_ok=True)
        with open(folder / name, "wb") as fh:
            fh.truncate((4 << 20) + 1)  # sparse: its size is what is checked

    assert refused(edited(good, tmp_path, big)) == f"{name} is larger than 4 MiB (a chat template is a few KB)"


@pytest.mark.parametrize(("make", "problem"), [
    (lambda p: None, "no such folder"),
    (lambda p: p.write_text("x"), "is a file, not a folder"),
    (os.mkfifo, "is not a folder (a FIFO)"),
    (lambda p: p.mkdir(), "no Hugging Face checkpoint there (config.json missing)"),
])
def test_a_checkpoint_that_is_no_folder_says_so(make, problem: str, tmp_path: Path) -> None:
    """A FIFO, a file or nothing at all was "config.json missing", as for an empty folder."""
    from components.core.prompts import load_tokenizer

    path = tmp_path / "ckpt"
    make(path)
    for load in (load_policy, load_tokenizer):
        with pytest.raises(UserError) as err:
            load(f"file://{path}")
        assert err.value.problem == problem
        assert err.value.fix == "point at a folder written by save_pretrained, or re-run the stage that writes it"


def _as_bin(tensors: dict, convert=lambda v: v):
    def edit(folder: Path) -> None:
        (folder / "model.safetensors").unlink()
        torch.save({k: convert(v) for k, v in tensors.items()}, folder / "pytorch_model.bin")
    return edit


def test_bin_weights_load_when_they_are_floats_and_are_refused_otherwise(good: Path, tmp_path: Path) -> None:
    """int32 weights in pytorch_model.bin loaded in silence (the safetensors check only)."""
    tensors = load_file(good / "model.safetensors")
    loaded = load_policy(f"file://{edited(good, tmp_path / 'float', _as_bin(tensors))}")
    assert torch.equal(loaded.model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    problem = refused(edited(good, tmp_path / "int", _as_bin(tensors, lambda v: (v * 1000).to(torch.int32))))
    assert problem.startswith("pytorch_model.bin's tensor 'model.") and problem.endswith("' is int32, not a float")


def test_a_bin_file_that_runs_code_is_refused_unrun(good: Path, tmp_path: Path) -> None:
    import pickle

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    def edit(folder: Path) -> None:
        (folder / "model.safetensors").unlink()
        torch.save({"x": torch.zeros(1)}, folder / "pytorch_model.bin")  # a zip file, as torch writes it
        (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Evil()}))

    with pytest.raises(UserError) as err:
        load_policy(f"file://{edited(good, tmp_path, edit)}", field="--checkpoint")
    assert err.value.problem.startswith("pytorch_model.bin is not a weights file torch reads safely (")
    assert err.value.fix == "save the model with safetensors (save_pretrained's default), or point at another checkpoint"
    assert not marker.exists()


def _sharded(shard_name: str | None):
    """The weights as two shards and their index; ``shard_name`` replaces the first shard's name in it."""
    def edit(folder: Path) -> None:
        tensors = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        names = sorted(tensors)
        half = len(names) // 2
        parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
        weight_map = {}
        for file, keys in parts.items():
            save_file({k: tensors[k] for k in keys}, folder / file, metadata={"format": "pt"})
            weight_map |= {k: shard_name if shard_name and file.startswith("model-00001") else file for k in keys}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return edit


@pytest.mark.parametrize(("shard", "problem"), [
    ("/elsewhere/model.safetensors", "model.safetensors.index.json names the shard '/elsewhere/model.safetensors', not "
     "a .safetensors file of the folder by its plain name"),
    ("../model-00001-of-00002.safetensors", "model.safetensors.index.json names the shard "
     "'../model-00001-of-00002.safetensors', not a .safetensors file of the folder by its plain name"),
    ("model-00003-of-00002.safetensors", "model.safetensors.index.json names the shard "
     "'model-00003-of-00002.safetensors', which is not in the folder"),
])
def test_an_index_naming_shards_outside_the_folder_is_refused(shard: str, problem: str, good: Path,
                                                              tmp_path: Path) -> None:
    """An absolute shard path in the weight map loaded weights from outside the folder (and
    unchecked: only the folder's own *.safetensors were type-checked)."""
    assert refused(edited(good, tmp_path, _sharded(shard))) == problem


def test_a_sharded_checkpoint_loads(good: Path, tmp_path: Path) -> None:
    loaded = load_policy(f"file://{edited(good, tmp_path, _sharded(None))}")
    assert torch.equal(loaded.model.model.norm.weight, load_file(good / "model.safetensors")["model.norm.weight"])


@pytest.mark.parametrize(("name", "limit"), [("config.json", 16), ("tokenizer.json", 128)])
def test_a_config_or_tokenizer_file_past_its_size_is_refused_unread(name: str, limit: int, good: Path,
                                                                   tmp_path: Path) -> None:
    """serve and stage loads read config.json and the tokenizer files whole, of any size."""
    from components.core.checkpoint import before_load

    folder = edited(good, tmp_path, lambda f: None)
    size = (limit << 20) + 1
    with open(folder / name, "r+b") as fh:
        fh.truncate(size)  # sparse, and no JSON past its first bytes: refused by size, before any read
    with pytest.raises(UserError) as err:
        before_load(folder, "--checkpoint", "file:///c")
    assert err.value.problem == f"{name} is larger than {limit} MiB ({size} bytes; a model's is far smaller)"
