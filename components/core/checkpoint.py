"""What a Hugging Face checkpoint folder must be before and after transformers loads it.

A checkpoint named by a recipe (``model.source``, ``rollout.policy``) or by ``posttrain
serve --checkpoint`` is a user's input. ``before_load`` reads its small files and refuses,
in one ``UserError`` naming the field, what would make transformers allocate without
bound or abort the process: model sizes past ``SIZE_LIMITS`` (``num_hidden_layers: 1e9``
built layers until memory ran out; ``vocab_size: 2**28`` with no embedding asked for
34 GB), numbers that are not finite, weights that are not floats, a chat template past ``MAX_TEMPLATE_CHARS``, more
special tokens than ``MAX_SPECIAL_TOKENS`` (300,000 hung the load), token ids past
``MAX_TOKEN_ID`` in ``tokenizer.json`` (a Rust panic asked for 8 GB). ``after_load``
refuses a model that loaded but is not the checkpoint: weights missing from the files
(transformers fills them at random and only logs a table), of another shape, not finite,
a model with no decoder layer stack, a tokenizer with no end-of-sequence token, a
vocabulary larger than the model's embeddings or special-token ids past them (an added
token past them is only refused if it is a special one).

Not covered: sizes within the limits that still exceed the machine's memory (a real
70B model on a small machine), and a chat template that is slow or large only for some
prompts (``components/core/prompts.py`` bounds its render time).
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
"""The names transformers loads a causal LM's weights from (one file, or an index of shards)."""


def before_load(folder: Path, field: str, uri: str) -> None:
    """The checkpoint's config and tokenizer files, read before transformers builds anything."""
    config = _json(folder, "config.json", field, uri)
    if not isinstance(config, dict):
        raise UserError(field, uri, "config.json is not a JSON object", FIX)
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(field, uri, f"config.json's {key!r} is {value}, not a finite number", FIX)
    for key, limit in SIZE_LIMITS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise UserError(field, uri, f"config.json's {key!r} is {value_text(value, 40)}, not a whole number from 1 "
                            f"to {limit}", FIX)
    _check_weights(folder, field, uri)
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


FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}


def _check_weights(folder: Path, field: str, uri: str) -> None:
    """Every tensor in the folder's safetensors files is a float (an I32 file loaded, cast
    to whole numbers, and sampled only token 0). Headers only: no tensor is read."""
    from safetensors import SafetensorError, safe_open

    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise UserError(field, uri, f"no weights file in the folder ({' or '.join(WEIGHT_FILES[::2])})", FIX)
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as fh:
                for key in fh.keys():
                    dtype = fh.get_slice(key).get_dtype()
                    if dtype not in FLOAT_DTYPES:
                        raise UserError(field, uri, f"{path.name}'s tensor {key[:120]!r} is {dtype}, not a float",
                                        FIX)
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(field, uri, f"{path.name} is not a safetensors file ({exc_line(exc)[:200]})", FIX) from None


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
        name = first[0] if isinstance(first, tuple) else first
        raise UserError(field, uri, f"the checkpoint's {name!r} has another shape than its config gives", FIX)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise UserError(field, uri, f"model_type {getattr(model.config, 'model_type', None)!r} is not a decoder-only "
                        "language model with a stack of layers (model.layers), which posttrain samples from and trains",
                        "use a causal LM checkpoint such as Llama, Qwen or SmolLM")
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
