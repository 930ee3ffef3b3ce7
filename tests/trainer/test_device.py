"""``trainer.device``, ``trainer.dtype`` and ``trainer.gradient_checkpointing`` in the GRPO
step: checkpointing recomputes the same gradients, bfloat16 autocast changes the update
but not the loss by much, ``auto`` resolves to this machine's device, and (``gpu``) a
step runs on CUDA in bfloat16."""

from __future__ import annotations

import pytest
import torch

from components.core.errors import UserError
from components.core.recipe import TrainerConfig
from components.trainer.device import prepare_model, resolve_device
from components.trainer.grpo import grpo_step
from components.trainer.state import build_optimizer
from tests.rollout.helpers import tiny_policy
from tests.trainer.test_distributed import make_batches

ARGS = dict(pad_id=0, clip_eps=0.2, kl_coef=0.05, temperature=1.0, micro_batch_size=4, max_grad_norm=1.0)


def stepped(device: str = "cpu", dtype: str = "float32", checkpointing: bool = False, packing: bool = True):
    """(stats, gradients, parameters) after one step of the tiny policy on 10 samples."""
    policy = tiny_policy()
    model = prepare_model(policy.model, torch.device(device), checkpointing)
    optimizer = build_optimizer(model, TrainerConfig(learning_rate=1e-2))
    stats = grpo_step(model, optimizer, make_batches(tiny_policy())[0], dtype=dtype, packing=packing, **ARGS)
    grads = torch.cat([p.grad.flatten().cpu() for p in model.parameters()])
    params = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    return stats, grads, params


@pytest.mark.parametrize("packing", [True, False])
def test_gradient_checkpointing_gives_the_same_step(packing: bool) -> None:
    plain_stats, plain_grads, plain_params = stepped(packing=packing)
    stats, grads, params = stepped(checkpointing=True, packing=packing)
    assert torch.allclose(grads, plain_grads, atol=1e-6, rtol=1e-5)
    assert torch.allclose(params, plain_params, atol=1e-6, rtol=0)
    assert stats.loss == pytest.approx(plain_stats.loss, abs=1e-6)
    model = prepare_model(tiny_policy().model, torch.device("cpu"), True)
    assert model.is_gradient_checkpointing


def test_gradient_checkpointing_leaves_the_saved_config_as_it_was(tmp_path) -> None:
    """prepare_model set config.use_cache = False, which the trainer saved into the
    checkpoint's config.json: every later generation from it ran without a KV cache."""
    import json

    from components.core.policy import save_policy
    from components.core.storage import Store

    policy = tiny_policy()
    assert policy.model.config.use_cache is True
    model = prepare_model(policy.model, torch.device("cpu"), True)
    optimizer = build_optimizer(model, TrainerConfig(learning_rate=1e-2))
    grpo_step(model, optimizer, make_batches(tiny_policy())[0], packing=False, **ARGS)
    save_policy(model, policy.tokenizer, Store(str(tmp_path), "test"), "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["use_cache"] is True


def test_bfloat16_autocast_changes_the_step_but_not_the_loss_by_much() -> None:
    f32_stats, f32_grads, f32_params = stepped()
    stats, grads, params = stepped(dtype="bfloat16")
    assert not torch.equal(grads, f32_grads) and not torch.equal(params, f32_params)
    assert (grads - f32_grads).abs().max() > 1e-5  # more than float32 rounding
    assert stats.loss == pytest.approx(f32_stats.loss, abs=0.02)
    assert torch.nn.functional.cosine_similarity(grads, f32_grads, dim=0) > 0.95
    assert {p.dtype for p in tiny_policy().model.parameters()} == {torch.float32}  # weights stay float32


def test_device_auto_resolves_to_what_this_machine_has() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"trainer.device='cuda': torch sees no CUDA device.*set trainer.device: auto or cpu"):
            resolve_device("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_bfloat16_step_on_cuda_follows_the_float32_step_on_cpu() -> None:
    cpu_stats, _, cpu_params = stepped()
    stats, grads, params = stepped(device="cuda", dtype="bfloat16")
    assert stats.tokens == cpu_stats.tokens and torch.isfinite(grads).all()
    assert stats.loss == pytest.approx(cpu_stats.loss, abs=0.02)
    assert (params - cpu_params).abs().max() < 0.05 and not torch.equal(params, cpu_params)


def _on_policy(model, n: int = 4):
    """Samples whose recorded logprobs are the model's own in eval mode, as rollout scores them."""
    from components.core.policy import pad_batch, token_logprobs
    from components.trainer.grpo import Sample

    g = torch.Generator().manual_seed(1)
    out = []
    model.eval()
    for k in range(n):
        p, c = torch.randint(3, 50, (5,), generator=g).tolist(), torch.randint(3, 50, (6,), generator=g).tolist()
        ids, attn, _ = pad_batch([(p, c)], 0)
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, attn, 1.0)
        out.append(Sample(p, c, lp[0, 4:10].tolist(), [1.0, -1.0, 0.5, -0.5][k]))
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_the_trainer_turns_the_models_own_dropout_off(packing: bool) -> None:
    """A checkpoint whose config sets ``attention_dropout`` (or Phi-2's ``resid_pdrop``)
    trained with it on: samples scored as rollout scores them (eval mode) had clipped
    tokens and a KL from the first step. After ``prepare_model`` the first step on such
    samples sees ratio 1 and KL 0 everywhere; the saved config keeps its value."""
    from transformers import PhiConfig, PhiForCausalLM

    policy = tiny_policy()
    llama = policy.model
    llama.config.attention_dropout = 0.1
    for layer in llama.model.layers:
        layer.self_attn.attention_dropout = 0.1
    torch.manual_seed(0)
    phi = PhiForCausalLM(PhiConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, resid_pdrop=0.1, max_position_embeddings=64,
                                   initializer_range=0.15))
    for model in (llama, phi):
        samples = _on_policy(model)
        prepare_model(model, torch.device("cpu"), False)
        stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), samples, pad_id=0, clip_eps=0.2,
                          kl_coef=0.1, temperature=1.0, micro_batch_size=4, max_grad_norm=1e9, packing=packing)
        assert stats.clip_frac == 0.0
        assert abs(stats.kl) < 1e-6
    assert llama.config.attention_dropout == 0.1 and phi.config.resid_pdrop == 0.1


def test_lora_dropout_is_the_recipes_and_stays() -> None:
    from components.core.recipe import LoraConfig
    from components.trainer.device import disable_dropout
    from components.trainer.lora import apply_lora

    model = apply_lora(tiny_policy().model, LoraConfig(rank=4, dropout=0.2))
    disable_dropout(model)
    adapters = [m for name, m in model.named_modules() if "lora_dropout" in name and isinstance(m, torch.nn.Dropout)]
    assert adapters and all(m.p == 0.2 for m in adapters)
