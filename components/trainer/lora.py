"""LoRA through ``peft``: low-rank adapters on the trainer's model, merged into it on save.

``apply_lora(model, cfg)`` wraps a Hugging Face causal LM with ``peft.get_peft_model``
when ``trainer.lora.rank`` is above 0: every base weight is frozen and only the adapter
matrices (``lora_A``/``lora_B`` on the modules named by ``trainer.lora.target_modules``)
train. With ``rank: 0`` the model comes back unchanged and every weight trains. ``peft`` swaps
the targeted layers of the given model in place (the wrapper and the model it was given
share them), after the target names have been checked.
``merge_for_save(model)`` folds the adapters into their base weights
(``merge_and_unload``) and returns the plain transformers model, so the checkpoint a
trainer writes has the base model's keys and nothing else: every engine (``hf``, vLLM,
``load_policy``) loads it as an ordinary Hugging Face checkpoint, and the next
iteration starts fresh adapters on the merged weights.

A target module name that matches no linear layer of the model is a UserError naming
``trainer.lora.target_modules``, the value, and the linear layer names the model has; so
is a name that matches the output embeddings (``lm_head``) of a model that ties them to
its input embeddings (``tie_word_embeddings``), where the merge would change the shared
matrix for both.
Names match as ``peft`` matches them: a module's full dotted name, or its last parts
(``q_proj`` matches ``model.layers.0.self_attn.q_proj``).

Example::

    model = apply_lora(build_model(cfg.model, vocab), LoraConfig(rank=8))
    trainable, total = trainable_parameters(model)   # adapters only
    ...train...
    save_policy(merge_for_save(model), tokenizer, store, "checkpoint")

Not covered: serving adapters separately from their base (a LoRA adapter load in an
engine), QLoRA or any quantised base, adapters on embeddings or convolutions, and
continuing to train a model after ``merge_for_save`` (the merge happens in place; the
adapters are gone afterwards). With gradient checkpointing, the trainer uses the
non-reentrant form, which needs no extra hook for frozen inputs.
"""

from __future__ import annotations

from typing import Any

from components.core.errors import UserError
from components.core.recipe import LoraConfig

FIELD = "trainer.lora.target_modules"


def linear_module_names(model: Any) -> list[str]:
    """The distinct last-part names of the model's ``torch.nn.Linear`` layers, sorted
    (``down_proj``, ``gate_proj``, ``k_proj``, ..., ``lm_head`` for a Llama)."""
    import torch

    return sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                   if name and isinstance(mod, torch.nn.Linear)})


def _matches(module_name: str, target: str) -> bool:
    # peft's rule for a list of names: the whole name, or a suffix at a dot boundary
    return module_name == target or module_name.endswith("." + target)


def tied_output(model: Any) -> str | None:
    """The name of the model's output embeddings (``lm_head``) when they share their weight
    with the input embeddings (``tie_word_embeddings``), else None."""
    output, input_ = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or input_ is None or getattr(output, "weight", None) is not getattr(input_, "weight", 0):
        return None
    return next((name for name, mod in model.named_modules() if mod is output), None)


def check_targets(model: Any, targets: list[str]) -> None:
    """A UserError for the first target name that matches no linear layer of ``model``, or
    that matches its output embeddings when they are tied to the input embeddings: merging
    an adapter there adds its update to the one matrix both share, so the saved model's
    input embeddings change too and it is not the model that was trained."""
    import torch

    tied = tied_output(model)
    linear = [name for name, mod in model.named_modules() if name and isinstance(mod, torch.nn.Linear)]
    usable = [name for name in linear_module_names(model) if tied is None or name != tied.rsplit(".", 1)[-1]]
    for target in targets:
        matched = [name for name in linear if _matches(name, target)]
        if not matched:
            raise UserError(FIELD, target, "matches no linear layer of the model",
                            f"use names of the model's linear layers: {', '.join(usable)}")
        if tied is not None and tied in matched:
            raise UserError(FIELD, target, f"targets the output embeddings ({tied}), whose weight this model ties "
                            "to its input embeddings: the merged adapter would change both",
                            f"remove {target} from {FIELD} (use e.g. {', '.join(usable)})")


def apply_lora(model: Any, cfg: LoraConfig) -> Any:
    """``model`` itself when ``cfg.rank`` is 0; else a ``peft`` model whose base weights
    are frozen and whose adapters on ``cfg.target_modules`` are the only trainable
    parameters."""
    if cfg.rank == 0:
        return model
    import peft

    check_targets(model, cfg.target_modules)
    config = peft.LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules), bias="none", task_type=peft.TaskType.CAUSAL_LM,
    )
    return peft.get_peft_model(model, config)


def is_lora(model: Any) -> bool:
    """Whether ``model`` carries ``peft`` adapters."""
    import peft

    return isinstance(model, peft.PeftModel)


def merge_for_save(model: Any) -> Any:
    """The plain transformers model with the adapters folded into its base weights
    (in place); ``model`` itself when it has no adapters."""
    if not is_lora(model):
        return model
    return model.merge_and_unload()


def trainable_parameters(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts of ``model``."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
