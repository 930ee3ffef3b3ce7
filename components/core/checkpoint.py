"""What a Hugging Face checkpoint folder must be before and after transformers loads it.

A checkpoint named by a recipe (``model.source``, ``rollout.policy``) or by ``posttrain
serve --checkpoint`` is a user's input. ``before_load`` reads its small files and refuses,
in one ``UserError`` naming the field, what would make transformers allocate without
bound or abort the process: config, index and tokenizer files past ``READ_LIMITS`` (by
size, before they are read); model sizes past ``SIZE_LIMITS`` at any depth of config.json
and under other architectures' names (``num_hidden_layers: 1e9`` built layers until
memory ran out; ``vocab_size: 2**28`` with no embedding asked for 34 GB; GPT-2's
``n_layer``, a nested ``text_config``), then the same sizes as transformers reads the
config and a model of more parameters than its weight files could hold (sizes each
within its limit, together 1 TiB); numbers that are not finite anywhere in config.json
and a ``rope_theta`` not above 0; weight files outside the folder (an index naming an
absolute or ``..`` shard) and weights that are not floats (safetensors headers, ``.bin``
files through torch's safe unpickler); a chat template past ``MAX_TEMPLATE_CHARS``, more
special tokens than ``MAX_SPECIAL_TOKENS`` (300,000 hung the load), token ids past
``MAX_TOKEN_ID`` in ``tokenizer.json`` (a Rust panic asked for 8 GB). ``after_load``
refuses a model that loaded but is not the checkpoint: weights missing from the files
(transformers fills them at random and only logs a table), of another shape (named, with
both shapes: ``load_policy`` loads with ``ignore_mismatched_sizes`` so transformers reports
it rather than raising with its report hidden), not finite, a model with no decoder layer
stack, a tokenizer with no end-of-sequence token, a vocabulary larger than the model's
embeddings or any token id past them (added tokens included).

Not covered: sizes within the limits that still exceed the machine's memory (a real
70B model on a small machine), ``.bin`` weights in torch's legacy (pre-zip) format (refused:
they cannot be opened without reading them), and a chat template that is slow or large
only for some prompts (``components/core/prompts.py`` bounds its render time).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from components.core.errors import UserError, exc_line, value_text

SIZE_LIMITS = {
    "vocab_size": 1 << 22,  # 4M tokens; the largest released vocabularies are ~260k
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 19,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 24,
}
"""Config fields that size a model, and the largest value taken (each at least 1)."""
MAX_TEMPLATE_CHARS = 1 << 20  # real chat templates are a few KB
MAX_SPECIAL_TOKENS = 100_000
MAX_TOKEN_ID = SIZE_LIMITS["vocab_size"]
FIX = "re-run the stage that wrote it, or point at another checkpoint"


def no_checkpoint(field: str, uri: str) -> UserError:
    """The error for a checkpoint URI without ``config.json``: a local one that is no
    folder says so (a FIFO, a file, nothing there), rather than "config.json missing"."""
    from components.core.files import not_a_folder
    from components.core.storage import scheme

    why = not_a_folder(uri[len("file://"):]) if scheme(uri) == "file" else None
    return UserError(field, uri, why or "no Hugging Face checkpoint there (config.json missing)",
                     "point at a folder written by save_pretrained, or re-run the stage that writes it")


MAX_CONFIG_BYTES = 16 << 20  # a model's config.json is a few kilobytes (the preflight reads no more either)
MAX_TOKENIZER_BYTES = 128 << 20  # the largest tokenizer.json files (260k-token vocabularies) are ~35 MB
READ_LIMITS = {"config.json": MAX_CONFIG_BYTES, "generation_config.json": MAX_CONFIG_BYTES,
               "model.safetensors.index.json": MAX_CONFIG_BYTES, "pytorch_model.bin.index.json": MAX_CONFIG_BYTES,
               "tokenizer.json": MAX_TOKENIZER_BYTES, "tokenizer_config.json": MAX_TOKENIZER_BYTES,
               "special_tokens_map.json": MAX_TOKENIZER_BYTES, "added_tokens.json": MAX_TOKENIZER_BYTES,
               "vocab.json": MAX_TOKENIZER_BYTES, "merges.txt": MAX_TOKENIZER_BYTES, "vocab.txt": MAX_TOKENIZER_BYTES,
               "tokenizer.model": MAX_TOKENIZER_BYTES}
"""The small files a load reads whole (config, index and tokenizer files), and the most
bytes each may hold: checked by size before anything reads them."""


def _json(folder: Path, name: str, field: str, uri: str) -> Any:
    path = folder / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise UserError(field, uri, f"{name} is not JSON ({type(exc).__name__})", FIX) from None


LOADED_FOLDERS = ("additional_chat_templates",)
"""The only sub-folder of a model folder a load reads (transformers' named chat templates);
the rest (a training output's ``checkpoint-*/``, ``runs/``) is never copied."""
MAX_TEMPLATE_FILE_BYTES = 4 * MAX_TEMPLATE_CHARS
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""The names transformers loads a causal LM's weights from (one file, or an index of shards),
in the order it looks for them."""
SIZE_ALIASES = {"n_layer": "num_hidden_layers", "n_layers": "num_hidden_layers", "num_layers": "num_hidden_layers",
                "n_embd": "hidden_size", "d_model": "hidden_size", "n_head": "num_attention_heads",
                "n_heads": "num_attention_heads", "n_inner": "intermediate_size", "n_positions": "max_position_embeddings",
                "n_ctx": "max_position_embeddings", "seq_length": "max_position_embeddings"}
"""Other architectures' names (GPT-2's ``n_layer``, MPT's ``d_model``, ...) of the sizes in ``SIZE_LIMITS``."""


def _walk(config: dict) -> list[tuple[str, Any]]:
    """Every (dotted path, value) of a JSON object, nested objects and lists included
    (``text_config.num_hidden_layers``, ``rope_parameters.rope_theta``); iterative, so a
    deeply nested file cannot overflow the stack."""
    found, todo = [], [("", config)]
    while todo:
        prefix, node = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            path = f"{prefix}.{key}" if prefix else str(key)
            found.append((path, value))
            if isinstance(value, (dict, list)):
                todo.append((path, value))
    return found


def _check_config(config: dict, field: str, uri: str) -> None:
    """config.json as JSON: every number finite and every ``rope_theta`` above 0, anywhere
    in it; every size (``SIZE_LIMITS``, or another architecture's name for it, at any
    depth: a nested ``text_config``) a whole number within its limit."""
    for path, value in sorted(_walk(config), key=lambda item: item[0].count(".")):
        key = path.rsplit(".", 1)[-1]
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(field, uri, f"config.json's {path!r} is {value}, not a finite number", FIX)
        if key == "rope_theta" and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                                          or not value > 0):
            raise UserError(field, uri, f"config.json's {path!r} is {value_text(value, 40)}, not a number above 0 "
                            "(the rotary embedding's base)", FIX)
        name = SIZE_ALIASES.get(key, key)
        limit = SIZE_LIMITS.get(name)
        if limit is None or value is None or key.isdigit():
            continue
        for each in value if isinstance(value, list) and value and all(isinstance(v, int) for v in value) else [value]:
            if isinstance(each, bool) or not isinstance(each, int) or not 1 <= each <= limit:
                alias = f" ({name})" if name != key else ""
                raise UserError(field, uri, f"config.json's {path!r}{alias} is {value_text(value, 40)}, not a whole "
                                f"number from 1 to {limit}", FIX)


def _check_sizes(folder: Path, field: str, uri: str) -> None:
    """Every file a load reads whole is within its ``READ_LIMITS``, checked by size before
    it is read (serve and stage loads read config.json and the tokenizer files unbounded)."""
    for name, limit in READ_LIMITS.items():
        path = folder / name
        if path.is_file() and path.stat().st_size > limit:
            raise UserError(field, uri, f"{name} is larger than {limit >> 20} MiB ({path.stat().st_size} bytes; a "
                            f"model's is far smaller)", FIX)


def before_load(folder: Path, field: str, uri: str) -> None:
    """The checkpoint's config and tokenizer files, read before transformers builds anything."""
    _check_sizes(folder, field, uri)
    config = _json(folder, "config.json", field, uri)
    if not isinstance(config, dict):
        raise UserError(field, uri, "config.json is not a JSON object", FIX)
    _check_config(config, field, uri)
    weights = _check_weights(folder, field, uri)
    templates = [folder / "chat_template.jinja", folder / "chat_template.json",
                 *sorted((folder / LOADED_FOLDERS[0]).glob("*"))]
    for path in templates:
        if path.is_file() and path.stat().st_size > MAX_TEMPLATE_FILE_BYTES:
            raise UserError(field, uri, f"{path.relative_to(folder)} is larger than {MAX_TEMPLATE_FILE_BYTES >> 20} MiB "
                            "(a chat template is a few KB)", FIX)
    tokenizer_config = _json(folder, "tokenizer_config.json", field, uri)
    if isinstance(tokenizer_config, dict):
        template = tokenizer_config.get("chat_template")
        if template is not None and len(json.dumps(template)) > MAX_TEMPLATE_CHARS:
            raise UserError(field, uri, f"tokenizer_config.json's chat_template is longer than {MAX_TEMPLATE_CHARS} "
                            "characters", FIX)
        for key in ("extra_special_tokens", "additional_special_tokens"):
            tokens = tokenizer_config.get(key)
            if isinstance(tokens, (list, dict)) and len(tokens) > MAX_SPECIAL_TOKENS:
                raise UserError(field, uri, f"tokenizer_config.json's {key} holds {len(tokens)} tokens, more than "
                                f"{MAX_SPECIAL_TOKENS}", FIX)
    tokenizer = _json(folder, "tokenizer.json", field, uri)
    if isinstance(tokenizer, dict):
        vocab = (tokenizer.get("model") or {}).get("vocab") if isinstance(tokenizer.get("model"), dict) else None
        ids = list(vocab.values()) if isinstance(vocab, dict) else []
        added = tokenizer.get("added_tokens")
        ids += [t.get("id") for t in added if isinstance(t, dict)] if isinstance(added, list) else []
        if any(isinstance(i, int) and not 0 <= i < MAX_TOKEN_ID for i in ids):
            raise UserError(field, uri, f"tokenizer.json holds a token id outside 0 .. {MAX_TOKEN_ID - 1}", FIX)
    _check_model(folder, weights, field, uri)


FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}
BIN_FIX = "save the model with safetensors (save_pretrained's default), or point at another checkpoint"


def _weight_files(folder: Path, field: str, uri: str) -> list[Path]:
    """The weight files a load reads, as transformers looks for them: ``model.safetensors``,
    else the shards ``model.safetensors.index.json`` names, else the same for
    ``pytorch_model.bin``. A shard must be a file of the folder itself, by a plain name
    (an absolute path or ``..`` in the index loaded weights from anywhere)."""
    for single, index in (WEIGHT_FILES[:2], WEIGHT_FILES[2:]):
        if (folder / single).is_file():
            return [folder / single]
        if not (folder / index).is_file():
            continue
        data = _json(folder, index, field, uri)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(field, uri, f"{index} has no weight_map of tensor names to shard files", FIX)
        if not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(field, uri, f"{index}'s weight_map holds a shard that is not a file name", FIX)
        suffix = "." + single.rsplit(".", 1)[1]
        for name in sorted(set(weight_map.values())):
            if "/" in name or "\\" in name or name.startswith(".") or not name.endswith(suffix):
                raise UserError(field, uri, f"{index} names the shard {value_text(name, 120)!r}, not a {suffix} file "
                                "of the folder by its plain name", FIX)
            if not (folder / name).is_file():
                raise UserError(field, uri, f"{index} names the shard {value_text(name, 120)!r}, which is not in the "
                                "folder", FIX)
        return [folder / name for name in sorted(set(weight_map.values()))]
    raise UserError(field, uri, f"no weights file in the folder ({' or '.join(WEIGHT_FILES[::2])})", FIX)


def _check_weights(folder: Path, field: str, uri: str) -> list[Path]:
    """The weight files a load reads (``_weight_files``), each tensor in them a float (an
    I32 file loaded, cast to whole numbers, and sampled only token 0): the folder's
    safetensors files by their headers, ``.bin`` files opened memory-mapped with torch's
    safe unpickler (``weights_only``; no tensor is read, no code runs). Not covered:
    ``.bin`` files in torch's legacy (pre-zip) format, which are refused."""
    from safetensors import SafetensorError, safe_open

    files = _weight_files(folder, field, uri)
    for path in sorted({*folder.glob("*.safetensors"), *(f for f in files if f.suffix == ".safetensors")}):
        try:
            with safe_open(str(path), framework="pt") as fh:
                for key in fh.keys():
                    dtype = fh.get_slice(key).get_dtype()
                    if dtype not in FLOAT_DTYPES:
                        raise UserError(field, uri, f"{path.name}'s tensor {key[:120]!r} is {dtype}, not a float",
                                        FIX)
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(field, uri, f"{path.name} is not a safetensors file ({exc_line(exc)[:200]})", FIX) from None
    for path in (f for f in files if f.suffix == ".bin"):
        _check_bin(path, field, uri)
    return files


def _check_bin(path: Path, field: str, uri: str) -> None:
    import torch

    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: UnpicklingError, RuntimeError, EOFError, ...
        why = exc_line(exc).replace(str(path), path.name)[:200]  # not the temporary folder's name
        raise UserError(field, uri, f"{path.name} is not a weights file torch reads safely ({why})", BIN_FIX) from None
    if not isinstance(state, dict):
        raise UserError(field, uri, f"{path.name} holds a {type(state).__name__}, not a dict of tensors", BIN_FIX)
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            kind = str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else type(value).__name__
            raise UserError(field, uri, f"{path.name}'s tensor {str(key)[:120]!r} is {kind}, not a float", FIX)


def _check_model(folder: Path, files: list[Path], field: str, uri: str) -> None:
    """The model config.json describes, as transformers reads it (``AutoConfig``, its own
    code only) and builds it on the meta device (no memory): the sizes of its text model
    within ``SIZE_LIMITS``, and no more parameters than the weight files could hold at one
    byte each (a config of hidden_size 65536 and vocab_size 4194304, each within its limit,
    asked for 1 TiB before the missing weights were found). Not covered: a model within
    both that still exceeds the machine's memory."""
    import torch

    from components.core import hfimport

    hfimport.lean()
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        text = config.get_text_config()
        sizes = {name: getattr(text, name, None) for name in SIZE_LIMITS}
        for name, value in sizes.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= SIZE_LIMITS[name]):
                raise UserError(field, uri, f"the model's {name} (config.json as transformers reads it) is "
                                f"{value_text(value, 40)}, not a whole number from 1 to {SIZE_LIMITS[name]}", FIX)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - what transformers' load would raise too: an unknown or non-causal model
        raise UserError(field, uri, f"checkpoint is unreadable ({exc_line(exc)[:200]})", FIX) from None
    count = sum(p.numel() for p in model.parameters())  # a tied matrix once, as the files hold it
    stored = sum(path.stat().st_size for path in files)
    if count > stored:
        shown = ", ".join(f"{name} {value}" for name, value in sizes.items() if value is not None)
        raise UserError(field, uri, f"config.json's sizes ({shown}) make {count:,} parameters, more than the "
                        f"{stored:,} bytes of its weight files hold (at least a byte each)", FIX)


def after_load(model, tokenizer, info: dict[str, Any], field: str, uri: str) -> None:
    """The loaded model is the checkpoint's, whole; the tokenizer fits its embeddings."""
    import torch

    missing, mismatched = list(info.get("missing_keys") or []), list(info.get("mismatched_keys") or [])
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(field, uri, f"the checkpoint's weights lack {sorted(missing)[0]!r}{more} (they would be random)",
                        FIX)
    if mismatched:
        first = sorted(mismatched, key=str)[0]
        if isinstance(first, tuple) and len(first) == 3:  # (name, the file's shape, the config's), as transformers gives
            name, saved, wanted = first
            shapes = f" has shape {tuple(saved)}, its config gives {tuple(wanted)}"
        else:
            name, shapes = first[0] if isinstance(first, tuple) else first, " has another shape than its config gives"
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise UserError(field, uri, f"the checkpoint's {name!r}{shapes}{more}", FIX)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        # GPT-2 is a causal LM too, its layers at transformer.h: say what is missing, not what the model is not
        has = "an empty model.layers" if isinstance(layers, torch.nn.ModuleList) else \
            f"no model.layers (its modules: {', '.join(name for name, _ in model.named_children()) or 'none'})"
        raise UserError(field, uri, f"model_type {getattr(model.config, 'model_type', None)!r} ({type(model).__name__}) "
                        f"has {has}; posttrain samples from and trains a Llama-style causal LM, whose decoder layers "
                        "are the stack model.layers", "use a Llama-style causal LM checkpoint: Llama, Qwen, SmolLM or "
                        "Mistral")
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise UserError(field, uri, f"the checkpoint's {name!r} holds values that are not finite (NaN or inf)", FIX)
    vocab = model.get_input_embeddings().num_embeddings
    if tokenizer.eos_token_id is None:
        raise UserError(field, uri, "the tokenizer has no end-of-sequence token (eos_token)",
                        "set eos_token in its tokenizer_config.json")
    base = getattr(tokenizer, "vocab_size", 0)  # its vocabulary, without the added tokens
    if isinstance(base, int) and base > vocab:
        raise UserError(field, uri, f"the tokenizer's vocabulary has {base} tokens, more than the model's {vocab} "
                        "embeddings", FIX)
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        token = getattr(tokenizer, name, None)
        if isinstance(token, int) and not 0 <= token < vocab:
            raise UserError(field, uri, f"the tokenizer's {name} {token} is outside the model's {vocab} embeddings", FIX)
    ids = tokenizer.get_vocab()  # added tokens too: one past the embeddings was an IndexError in the forward pass
    token, top = max(ids.items(), key=lambda item: item[1], default=("", -1))
    if top >= vocab:
        raise UserError(field, uri, f"the tokenizer's token {value_text(token, 60)!r} has id {top}, outside the model's "
                        f"{vocab} embeddings", FIX)
