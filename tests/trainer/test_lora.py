"""LoRA through peft on a tiny policy: rank 0 is the model itself, rank 4 trains only the
adapters in a GRPO step (base weights bit-identical), merging gives the adapted model's
logits as a plain transformers model that saves and loads with no adapter keys, and a
target name that matches nothing is a UserError that names the field and the fix."""

from __future__ import annotations

import pytest
import torch

from components.core.errors import UserError
from components.core.policy import load_policy, save_policy
from components.core.recipe import LoraConfig, TrainerConfig
from components.core.storage import Store
from components.trainer.grpo import grpo_step
from components.trainer.lora import apply_lora, is_lora, linear_module_names, merge_for_save, trainable_parameters
from components.trainer.state import build_optimizer
from tests.rollout.helpers import PROMPTS, TINY, tiny_policy
from tests.trainer.test_grpo_step import rollout_batch

RANK = 4


def one_step(model, samples, packing: bool = True) -> None:
    optimizer = build_optimizer(model, TrainerConfig(learning_rate=1e-2))
    grpo_step(model, optimizer, samples, pad_id=0, clip_eps=0.2, kl_coef=0.0, temperature=1.0,
              micro_batch_size=4, max_grad_norm=1.0, packing=packing)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def prompt_ids(policy) -> torch.Tensor:
    return torch.tensor([policy.encode_prompt(PROMPTS[3])])


def test_rank_zero_returns_the_model_unchanged() -> None:
    policy = tiny_policy()
    model = apply_lora(policy.model, LoraConfig(rank=0))
    assert model is policy.model and not is_lora(model)
    trainable, total = trainable_parameters(model)
    assert trainable == total == sum(p.numel() for p in policy.model.parameters())
    assert merge_for_save(model) is model


@pytest.mark.parametrize("packing", [True, False])
def test_rank_four_trains_only_the_adapters(packing: bool) -> None:
    policy = tiny_policy()
    samples = rollout_batch(policy)
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    model = apply_lora(policy.model, LoraConfig(rank=RANK))
    trainable, total = trainable_parameters(model)
    # q, k, v, o projections are hidden x hidden here: r * (in + out) parameters each, per layer
    per_module = RANK * (TINY.hidden_size + TINY.hidden_size)
    assert trainable == 4 * TINY.num_layers * per_module == 2048
    assert total == sum(base[n].numel() for n in base) + trainable
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert len(adapters) == 2 * 4 * TINY.num_layers and all("lora_" in n for n in adapters)

    one_step(model, samples, packing)

    merged_names = dict(model.get_base_model().named_parameters())
    for name, before in base.items():
        layer = name.replace(".weight", ".base_layer.weight") if any(
            f".{t}." in name for t in ("q_proj", "k_proj", "v_proj", "o_proj")) else name
        assert torch.equal(merged_names[layer], before), name
    changed = [n for n, p in model.named_parameters() if n in adapters and not torch.equal(p, adapters[n])]
    # B starts at zero, so the first step moves every B (A's gradient is B^T-weighted: zero)
    assert sorted(changed) == sorted(n for n in adapters if "lora_B" in n)


def test_the_same_step_without_lora_moves_every_weight() -> None:
    policy = tiny_policy()
    samples = rollout_batch(policy)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    one_step(apply_lora(policy.model, LoraConfig(rank=0)), samples)
    assert all(not torch.equal(p, before[n]) for n, p in policy.model.named_parameters())


def test_merged_model_equals_the_adapted_one_and_saves_without_adapter_keys(tmp_path) -> None:
    policy = tiny_policy()
    samples = rollout_batch(policy)
    ids = prompt_ids(policy)
    untrained = logits(policy.model, ids)
    model = apply_lora(policy.model, LoraConfig(rank=RANK, alpha=32.0))
    one_step(model, samples)
    one_step(model, samples)  # the second step moves A as well
    adapted = logits(model, ids)
    assert not torch.allclose(adapted, untrained, atol=1e-4)

    merged = merge_for_save(model)
    assert type(merged).__name__ == "LlamaForCausalLM" and not is_lora(merged)
    assert not [k for k in merged.state_dict() if "lora" in k or "base_layer" in k]
    torch.testing.assert_close(logits(merged, ids), adapted, atol=1e-5, rtol=1e-5)

    store = Store(str(tmp_path), "test")
    save_policy(merged, policy.tokenizer, store, "ckpt")
    loaded = load_policy(store.url("ckpt"))
    assert set(loaded.model.state_dict()) == set(tiny_policy().model.state_dict())
    torch.testing.assert_close(logits(loaded.model, ids), adapted, atol=1e-5, rtol=1e-5)


def test_a_target_that_matches_nothing_is_a_user_error() -> None:
    policy = tiny_policy()
    with pytest.raises(UserError) as caught:
        apply_lora(policy.model, LoraConfig(rank=RANK, target_modules=["q_proj", "qkv_proj"]))
    err = caught.value
    assert err.field == "trainer.lora.target_modules" and err.value == "qkv_proj"
    assert err.problem == "matches no linear layer of the model"
    assert err.fix == ("use names of the model's linear layers: "
                       "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj")  # lm_head is tied here
    assert linear_module_names(policy.model)[0] == "down_proj"
    # the model was not wrapped before the check refused it
    assert not is_lora(policy.model) and not any("lora" in n for n, _ in policy.model.named_parameters())


def test_full_dotted_names_and_mlp_targets_are_accepted() -> None:
    policy = tiny_policy()
    model = apply_lora(policy.model, LoraConfig(rank=2, target_modules=["model.layers.0.mlp.down_proj", "up_proj"]))
    names = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert names == [
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight",
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight",
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight",
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight",
        "base_model.model.model.layers.1.mlp.up_proj.lora_A.default.weight",
        "base_model.model.model.layers.1.mlp.up_proj.lora_B.default.weight",
    ]


@pytest.mark.parametrize("target", ["lm_head", "q_proj"])
def test_the_output_embeddings_tied_to_the_input_ones_are_no_target(target: str) -> None:
    """The tiny policy ties lm_head to embed_tokens: merging an adapter on lm_head added its
    update to the one shared matrix, so the saved model's logits were 23 away from the
    trained one's."""
    policy = tiny_policy()
    with pytest.raises(UserError) as caught:
        apply_lora(policy.model, LoraConfig(rank=RANK, target_modules=[target, "lm_head"]))
    err = caught.value
    assert (err.field, err.value) == ("trainer.lora.target_modules", "lm_head")
    assert err.problem == ("targets the output embeddings (lm_head), whose weight this model ties to its input "
                           "embeddings: the merged adapter would change both")
    assert err.fix == ("remove lm_head from trainer.lora.target_modules (use e.g. down_proj, gate_proj, k_proj, "
                       "o_proj, q_proj, up_proj, v_proj)")
    assert not is_lora(policy.model)


def test_an_untied_lm_head_is_a_target_and_merges_to_the_adapted_model() -> None:
    from components.core.policy import build_model, build_tokenizer

    torch.manual_seed(0)
    model = build_model(TINY, len(build_tokenizer()))
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    adapted_model = apply_lora(model, LoraConfig(rank=RANK, target_modules=["lm_head"]))
    for name, param in adapted_model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)  # as if trained
    ids = torch.tensor([[5, 6, 7, 8]])
    adapted = logits(adapted_model, ids)
    embeddings = model.get_input_embeddings().weight.detach().clone()
    merged = merge_for_save(adapted_model)
    torch.testing.assert_close(logits(merged, ids), adapted, atol=1e-5, rtol=1e-5)
    assert torch.equal(merged.get_input_embeddings().weight, embeddings)
