"""Prefix-shared sampling (one prefill per prompt, its KV cache repeated for the G samples)
gives the logprobs the plain path gives for the same tokens, the previous path's greedy
results, and results in the caller's order, grouped per prompt."""

from __future__ import annotations

import pytest
import torch

from components.core.policy import pad_batch, token_logprobs
from components.rollout import hf_engine
from components.rollout.engines import Engine, Generation
from components.rollout.hf_engine import HFEngine
from tests.rollout.helpers import PROMPTS

TOLERANCE = 1e-5  # max abs difference of float32 logprobs (observed: < 1e-6, greedy vs the previous path too)


def teacher_forced(policy, samples: list[Generation], temperature: float) -> list[list[float]]:
    """Each sample's prompt + completion through one plain forward pass (no cache)."""
    ids, attn, _ = pad_batch([(s.prompt_ids, s.completion_ids) for s in samples], policy.pad_id)
    with torch.no_grad():
        logp, _ = token_logprobs(policy.model, ids, attn, temperature)
    return [logp[r, len(s.prompt_ids) - 1: len(s.prompt_ids) - 1 + len(s.completion_ids)].tolist()
            for r, s in enumerate(samples)]


def max_gap(policy, samples: list[Generation], temperature: float) -> float:
    gaps = []
    for s, ref in zip(samples, teacher_forced(policy, samples, temperature)):
        assert len(s.logprobs) == len(s.completion_ids) == len(ref)
        gaps.extend(abs(a - b) for a, b in zip(s.logprobs, ref))
    return max(gaps)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bucket", [True, False])
def test_shared_prefill_logprobs_equal_teacher_forced(policy, temperature: float, bucket: bool) -> None:
    samples = HFEngine(bucket=bucket).generate_groups(policy, PROMPTS, 4, max_new_tokens=12, temperature=temperature,
                                                      seed=3, batch_size=8)
    assert len(samples) == 4 * len(PROMPTS)
    assert max_gap(policy, samples, temperature) < TOLERANCE
    assert all(lp <= 0.0 for s in samples for lp in s.logprobs)


def test_stopped_rows_dropped_from_the_cache_keep_logprobs(policy, monkeypatch) -> None:
    # At temperature 50 the random policy is near uniform over ~100 tokens: about half the
    # samples stop on EOS within the 72 tokens left, so stopped rows are dropped mid-batch.
    caches: list[int] = []  # rows of each cache built: one per batch, then one per drop
    build = hf_engine.static_cache

    def counting(model, layers, max_len):
        caches.append(len(layers[0][0]))
        return build(model, layers, max_len)

    monkeypatch.setattr(hf_engine, "static_cache", counting)
    samples = HFEngine().generate_groups(policy, PROMPTS, 8, max_new_tokens=200, temperature=50.0, seed=1,
                                         batch_size=64)
    assert caches[0] == 8 * len(PROMPTS) and len(caches) > 1, "seed 1 stops a quarter of the rows before the cap"
    assert caches == sorted(caches, reverse=True) and caches[-1] < caches[0]
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert len(stopped) >= len(samples) // 4
    assert all(s.completion_ids[-1] == policy.eos_id and policy.eos_id not in s.completion_ids[:-1] for s in stopped)
    width = max(len(policy.encode_prompt(p)) for p in PROMPTS)
    cap = policy.model.config.max_position_embeddings - width
    assert all(len(s.completion_ids) == cap and policy.eos_id not in s.completion_ids
               for s in samples if s.finish_reason == "length")
    assert max_gap(policy, samples, 50.0) < TOLERANCE


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_equals_previous_path_exactly(policy, batch_size: int) -> None:
    previous = HFEngine(prefix_sharing=False).generate(policy, PROMPTS, 10, 1.0, seed=0, batch_size=batch_size,
                                                       greedy=True)
    shared = HFEngine().generate(policy, PROMPTS, 10, 1.0, seed=0, batch_size=batch_size, greedy=True)
    assert [(s.prompt_ids, s.completion_ids, s.text, s.finish_reason) for s in shared] == \
        [(s.prompt_ids, s.completion_ids, s.text, s.finish_reason) for s in previous]
    assert max(abs(a - b) for s, p in zip(shared, previous) for a, b in zip(s.logprobs, p.logprobs)) < TOLERANCE
    grouped = HFEngine().generate_groups(policy, PROMPTS, 3, 10, 1.0, seed=0, batch_size=batch_size, greedy=True)
    assert [s.completion_ids for s in grouped] == [s.completion_ids for s in previous for _ in range(3)]


def test_caller_order_and_groups(policy) -> None:
    seen: list[int] = []
    samples = HFEngine().generate_groups(policy, PROMPTS, 3, 6, 2.0, seed=9, batch_size=7, progress=seen.append)
    assert seen == [6, 6, 6, 6]  # 7 // 3 = 2 prompts (6 rows) per batch, never a split group
    assert [s.prompt_ids for s in samples] == [policy.encode_prompt(p) for p in PROMPTS for _ in range(3)]
    groups = [[tuple(s.completion_ids) for s in samples[i * 3:(i + 1) * 3]] for i in range(len(PROMPTS))]
    assert all(len(set(g)) > 1 for g in groups)  # each row samples on its own after the shared prefill
    again = HFEngine().generate_groups(policy, PROMPTS, 3, 6, 2.0, seed=9, batch_size=7)
    assert [s.completion_ids for s in again] == [s.completion_ids for s in samples]
    small = HFEngine().generate_groups(policy, PROMPTS[:2], 3, 2, 1.0, seed=0, batch_size=2, progress=seen.append)
    assert seen[-2:] == [3, 3] and len(small) == 6  # a batch smaller than a group still holds the whole group


def test_default_generate_groups_repeats_prompts_in_order(policy) -> None:
    class Echo(Engine):
        name = "echo"

        def generate(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy=False, progress=None):
            return [Generation([], [], [], p, "stop") for p in prompts]

    out = Echo().generate_groups(policy, ["a", "b"], 3, 4, 1.0, 0, 8)
    assert [g.text for g in out] == ["a", "a", "a", "b", "b", "b"]
