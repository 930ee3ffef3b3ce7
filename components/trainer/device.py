"""Where and in what precision the trainer computes: ``trainer.device``, ``trainer.dtype``
and ``trainer.gradient_checkpointing``.

- ``resolve_device``: ``auto`` is ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda``
  without a visible GPU is a UserError naming ``trainer.device``.
- ``forward_precision``: the context the forward passes run in. ``bfloat16`` is
  ``torch.autocast`` (on CPU too): matrix products in bfloat16, weights, gradients and
  AdamW state stay float32, and the loss is computed from float32 logits.
- ``prepare_model``: moves the model to the device and, with gradient checkpointing,
  turns it on (non-reentrant, so frozen embeddings under LoRA still pass gradients on).
  The KV cache is off in every scoring forward pass (``use_cache=False`` per call), not
  in the model's config, which the trainer saves with the checkpoint. It also turns the
  model's own dropout off (``disable_dropout``): rollout scored the samples in eval mode,
  so a dropout left on in the training forward makes the importance ratio noise (clipped
  on-policy tokens, a KL against the dropout) from the first step; a checkpoint whose
  config sets ``attention_dropout`` or ``resid_pdrop`` (Phi-2's 0.1) keeps its config.
  ``trainer.lora.dropout``, a setting of the recipe's, stays on.

Not covered: pure bfloat16 weights or optimizer state (master weights stay float32),
float16 with loss scaling, and choosing one of several GPUs (a process uses
``cuda:<LOCAL_RANK>``, the default device index under torchrun).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from components.core.errors import UserError


def resolve_device(choice: str) -> torch.device:
    """``trainer.device`` as a torch device; this process's GPU under torchrun."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise UserError("trainer.device", "cuda", "torch sees no CUDA device on this machine",
                            "set trainer.device: auto or cpu, or run the trainer on a GPU node")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def forward_precision(device: torch.device, dtype: str) -> contextlib.AbstractContextManager[Any]:
    """The context of a forward pass: bfloat16 autocast on ``device``, or nothing for float32."""
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def disable_dropout(model: torch.nn.Module) -> int:
    """Every dropout of ``model`` at probability 0, LoRA's adapters' own (``lora_dropout``,
    the recipe's ``trainer.lora.dropout``) aside: its ``nn.Dropout`` modules and the
    ``attention_dropout`` float attributes attention modules read in training mode. Not
    ``model.eval()``: transformers checkpoints activations only in training mode. Returns
    how many it set to 0 (the config, saved with the checkpoint, is left as it is)."""
    changed = 0
    for name, module in model.named_modules():
        if "lora_dropout" in name:
            continue
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p = 0.0
            changed += 1
        value = getattr(module, "attention_dropout", None)
        if isinstance(value, float) and value > 0:
            module.attention_dropout = 0.0
            changed += 1
    return changed


def prepare_model(model, device: torch.device, gradient_checkpointing: bool):
    """The model on ``device``, its own dropout off (``disable_dropout``), with activation
    checkpointing when asked; returns it."""
    disable_dropout(model)
    model.to(device)
    if gradient_checkpointing:
        # the KV cache is off per call (token_logprobs, packed_token_logprobs: use_cache=False), not in
        # model.config: the trainer saves this model, and its config.json kept use_cache: false
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
