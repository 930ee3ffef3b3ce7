"""The prefix-shared path's KV cache starts with room for ``CACHE_BLOCK`` new tokens and
doubles when full. It was preallocated for rows x (prompt + max_new_tokens) up front: one
legal ``posttrain serve`` request (64 prompts, ``max_tokens`` near the context) reserved
GBs even when every completion stopped after one token."""

from __future__ import annotations

import pytest
import torch

from components.core.policy import Policy, build_model, build_tokenizer
from components.core.recipe import ModelConfig
from components.rollout import hf_engine
from components.rollout.hf_engine import HFEngine
from tests.rollout.helpers import PROMPTS

TOLERANCE = 1e-5  # logprobs: a cache of another length sums attention in another order (observed <= 1e-6)


def long_policy(positions: int) -> Policy:
    """The tests' tiny random policy (helpers.TINY) with ``positions`` positions."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model = build_model(ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                    max_positions=positions), len(tokenizer))
    model.eval()
    return Policy(model=model, tokenizer=tokenizer, uri="memory://long", version="t")


@pytest.fixture
def caches(monkeypatch) -> list[tuple[int, int, int]]:
    """(rows, max_len, allocated positions) of every cache ``_sample`` builds."""
    built: list[tuple[int, int, int]] = []
    real = hf_engine.static_cache

    def recording(model, layers, max_len):
        cache = real(model, layers, max_len)
        built.append((len(layers[0][0]), max_len, max(layer.keys.shape[2] for layer in cache.layers)))
        return cache

    monkeypatch.setattr(hf_engine, "static_cache", recording)
    return built


def test_a_request_that_stops_at_once_allocates_one_block(caches) -> None:
    """64 prompts, max_new_tokens 4086 on 4096 positions, EOS forced first: the cache held
    64 x 4091 positions (268 MB on this tiny model, ~51 GB on Qwen2.5-0.5B at 32k); now 64 x 261."""
    policy = long_policy(4096)
    policy.model.lm_head.register_forward_hook(lambda mod, inp, out: out.index_fill(-1, torch.tensor([policy.eos_id]), 1e4))
    samples = HFEngine().generate(policy, ["1+2="] * 64, 4086, 1.0, seed=0, batch_size=64)
    assert all(s.completion_ids == [policy.eos_id] and s.finish_reason == "stop" for s in samples)
    width = len(policy.encode_prompt("1+2="))
    assert caches == [(64, width + 256, width + 256)]  # hf_engine.CACHE_BLOCK new tokens (was width + 4086)


@pytest.mark.parametrize("group,temperature,greedy", [(1, 1.0, True), (3, 0.7, False), (8, 50.0, False)])
def test_a_growing_cache_samples_what_a_whole_completion_cache_samples(caches, monkeypatch, group: int,
                                                                        temperature: float, greedy: bool) -> None:
    """Block 4 (seven doublings, rows dropped on the way at temperature 50) against a block
    past max_new_tokens (the previous cache, sized for the whole completion up front): the
    same tokens from the same seed, the same logprobs up to float rounding."""
    policy = long_policy(400)
    width = max(len(policy.encode_prompt(p)) for p in PROMPTS)
    full = 400  # the widest prompt plus the new tokens its batch has room for: every position
    runs = {}
    for block in (10**6, 4):
        monkeypatch.setattr(hf_engine, "CACHE_BLOCK", block)
        caches.clear()
        runs[block] = HFEngine().generate_groups(policy, PROMPTS, group, 400, temperature, seed=3, batch_size=64,
                                                 greedy=greedy)
        lengths = [max_len for _, max_len, _ in caches]
        if block == 4:  # width + 4, doubled when full (a dropped row's rebuild keeps the length), capped at full
            sizes = sorted(set(lengths))
            assert lengths == sorted(lengths) and sizes[0] == width + 4 and len(sizes) > 3
            assert all(b == min(full, 2 * a) for a, b in zip(sizes, sizes[1:]))
            assert all(allocated == max_len for _, max_len, allocated in caches)
        else:
            assert set(lengths) == {full}
    whole, grown = runs[10**6], runs[4]
    assert [(s.completion_ids, s.finish_reason) for s in grown] == [(s.completion_ids, s.finish_reason) for s in whole]
    assert max(abs(a - b) for s, w in zip(grown, whole) for a, b in zip(s.logprobs, w.logprobs)) < TOLERANCE
    if temperature == 50.0:  # rows stopped mid-batch were dropped while the cache grew
        assert any(rows < group * len(PROMPTS) for rows, _, _ in caches)
