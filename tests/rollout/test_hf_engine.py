"""HFEngine: rollout logprobs equal the trainer's recomputed ones (prefix-shared and previous
path); bucketing keeps order."""

from __future__ import annotations

import pytest
import torch

from components.core.errors import UserError
from components.core.policy import pad_batch, token_logprobs
from components.rollout.engines import get_engine
from components.rollout.hf_engine import HFEngine
from components.rollout.openai_engine import OpenAIEngine
from tests.rollout.helpers import PROMPTS, tiny_policy

TOLERANCE = 1e-4  # max abs difference of float32 logprobs (observed: < 1e-6)


def recomputed(policy, samples, temperature: float) -> list[list[float]]:
    """The trainer's view: right-padded batch, ``token_logprobs`` under softmax(logits / T)."""
    ids, attn, _ = pad_batch([(s.prompt_ids, s.completion_ids) for s in samples], policy.pad_id)
    with torch.no_grad():
        logp, _ = token_logprobs(policy.model, ids, attn, temperature)
    return [logp[r, len(s.prompt_ids) - 1: len(s.prompt_ids) - 1 + len(s.completion_ids)].tolist()
            for r, s in enumerate(samples)]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
@pytest.mark.parametrize("bucket,prefix_sharing", [(True, True), (False, True), (True, False)])
def test_rollout_logprobs_match_trainer(policy, temperature: float, bucket: bool, prefix_sharing: bool) -> None:
    engine = HFEngine(bucket=bucket, prefix_sharing=prefix_sharing)
    samples = engine.generate(policy, PROMPTS, max_new_tokens=12, temperature=temperature, seed=11, batch_size=3)
    assert [s.prompt_ids for s in samples] == [policy.encode_prompt(p) for p in PROMPTS]
    for s, ref in zip(samples, recomputed(policy, samples, temperature)):
        assert len(s.logprobs) == len(s.completion_ids) == len(ref)
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < TOLERANCE
        assert all(lp <= 0.0 for lp in s.logprobs)


def test_stopped_samples_end_on_eos_and_match(policy) -> None:
    # At temperature 4 the random policy is near uniform, so some samples stop on EOS early.
    samples = HFEngine().generate(policy, PROMPTS * 4, max_new_tokens=40, temperature=4.0, seed=5, batch_size=16)
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, "seed 5 yields stopped samples"
    assert all(s.completion_ids[-1] == policy.eos_id and policy.eos_id not in s.completion_ids[:-1] for s in stopped)
    assert all(len(s.completion_ids) == 40 and policy.eos_id not in s.completion_ids
               for s in samples if s.finish_reason == "length")
    for s, ref in zip(samples, recomputed(policy, samples, 4.0)):
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < TOLERANCE


def test_greedy_results_in_input_order_and_independent_of_batch_size(policy) -> None:
    runs = {bs: HFEngine().generate(policy, PROMPTS, 10, 1.0, seed=0, batch_size=bs, greedy=True) for bs in (1, 3, 8)}
    unbucketed = HFEngine(bucket=False).generate(policy, PROMPTS, 10, 1.0, seed=0, batch_size=3, greedy=True)
    reference = [(s.completion_ids, s.text) for s in runs[1]]
    for bs, samples in runs.items():
        assert [(s.completion_ids, s.text) for s in samples] == reference, f"batch_size={bs}"
        assert [s.prompt_ids for s in samples] == [policy.encode_prompt(p) for p in PROMPTS]
    assert [(s.completion_ids, s.text) for s in unbucketed] == reference
    assert [len(s.completion_ids) for s in runs[1]] == [10] * len(PROMPTS)  # this random policy never picks EOS


def test_bucketing_order_and_progress(policy) -> None:
    seen: list[int] = []
    HFEngine().generate(policy, PROMPTS, 2, 1.0, seed=0, batch_size=3, greedy=True, progress=seen.append)
    assert seen == [3, 3, 2]


def test_unknown_engine_lists_registered() -> None:
    from components.core.errors import UserError

    with pytest.raises(UserError, match=r"rollout.engine='nope'.*\['hf', 'openai', 'vllm'\]"):
        get_engine("nope")


@pytest.mark.parametrize("engine", [HFEngine(), HFEngine(prefix_sharing=False),
                                    OpenAIEngine(base_url="http://127.0.0.1:9", model="m")],
                         ids=["hf", "hf-copies", "openai"])
def test_a_prompt_of_no_tokens_is_refused_by_name(engine) -> None:
    """Under a tokenizer without a BOS token (Qwen2's), "" encodes to nothing: alone it was
    a RuntimeError from a reshape, in a batch a sample continuing padding."""
    policy = tiny_policy()
    policy.tokenizer.bos_token = None
    with pytest.raises(UserError) as caught:
        engine.generate_groups(policy, ["abc", ""], 2, 3, 1.0, 0, 8)
    assert (caught.value.field, caught.value.value, caught.value.problem, caught.value.fix) == (
        "prompt", "", "a task's prompt has no tokens in the policy's prompt format (the tokenizer adds no BOS token)",
        "give every task a non-empty prompt, or use rollout.prompt_format: chat")
