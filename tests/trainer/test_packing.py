"""Packed micro-batches compute what padded ones do: the same logprobs, loss, gradients
and optimizer step, for mixed lengths, multi-turn masks and every loss aggregation."""

from __future__ import annotations

import random

import pytest
import torch

from components.core.errors import UserError
from components.core.policy import pack_batch, pack_levels, pack_rows, packed_token_logprobs, pad_batch, token_logprobs
from components.core.recipe import TrainerConfig
from components.trainer.grpo import AGGREGATIONS, Sample, grpo_step, packed_micro_batches
from components.trainer.state import build_optimizer
from tests.rollout.helpers import tiny_policy

PAIRS = [([1, 5, 6, 7, 8], [9, 10, 11]), ([1, 5], [7]), ([1, 20, 21, 22, 23, 24, 25], [30, 31, 32, 33]), ([1], [40, 41])]


def mixed_samples(policy, n: int = 14, seed: int = 0) -> list[Sample]:
    """Prompts of 1-40 tokens, completions of 1-12, multi-turn masks on some, and old
    logprobs off the policy's own by up to +-0.4 (so ratios differ from 1 and some clip)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = [1] + [rng.randrange(4, 100) for _ in range(rng.choice([0, 2, 5, 12, 25, 39]))]
        pairs.append((prompt, [rng.randrange(4, 100) for _ in range(rng.randint(1, 12))]))
    ids, attn, comp = pad_batch(pairs, 0)
    with torch.no_grad():
        logp, _ = token_logprobs(policy.model, ids, attn)
    samples = []
    for k, (p, c) in enumerate(pairs):
        own = logp[k, len(p) - 1 : len(p) - 1 + len(c)].tolist()
        old = [x + rng.uniform(-0.4, 0.4) for x in own]
        mask = [0 if 0 < t < len(c) - 1 and t % 3 == 1 else 1 for t in range(len(c))] if k % 3 == 0 else []
        samples.append(Sample(p, c, old, rng.choice([-1.5, -0.5, 0.7, 1.2]), mask))
    return samples


def step(policy, samples, packing: bool, aggregation: str = "token_mean", lr: float = 0.0, **kw):
    optimizer = build_optimizer(policy.model, TrainerConfig(learning_rate=lr)) if lr else torch.optim.SGD(
        policy.model.parameters(), lr=0.0)
    args = dict(pad_id=0, clip_eps=0.2, kl_coef=0.1, temperature=0.9, micro_batch_size=5, max_grad_norm=1.0,
                loss_aggregation=aggregation, packing=packing)
    return grpo_step(policy.model, optimizer, samples, **{**args, **kw})


def test_pack_rows_first_fit_decreasing() -> None:
    assert pack_rows([8, 3, 11, 3], 11) == [[2], [0, 1], [3]]
    assert pack_rows([4, 4, 4, 4, 2], 8) == [[0, 1], [2, 3], [4]]
    assert pack_rows([2, 2, 2, 2], 8, max_per_row=3) == [[0, 1, 2], [3]]
    with pytest.raises(ValueError, match="a sequence of 12 tokens does not fit rows of width 11"):
        pack_rows([12, 3], 11)


def test_position_ids_restart_per_sequence() -> None:
    batch = pack_batch(PAIRS, pack_rows([len(p) + len(c) for p, c in PAIRS], 11), fill_id=0)
    assert batch.ids.tolist() == [[1, 20, 21, 22, 23, 24, 25, 30, 31, 32, 33],
                                  [1, 5, 6, 7, 8, 9, 10, 11, 1, 5, 7],
                                  [1, 40, 41, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
                                           [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2],
                                           [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7]]  # the filler is a segment of its own
    # logits at the prompt's last token predict the first completion token: flat row * 11 + column
    assert batch.targets.tolist() == [15, 16, 17, 20, 6, 7, 8, 9, 22, 23]
    assert batch.spans == [(0, 3), (3, 1), (4, 4), (8, 2)]
    assert batch.placement == [(1, 0), (1, 8), (0, 0), (2, 0)]
    with pytest.raises(ValueError, match="not each of the 4 samples once"):
        pack_batch(PAIRS, [[0, 1], [2]], fill_id=0)
    with pytest.raises(ValueError, match="empty prompt"):
        pack_batch([([], [3])], [[0]], fill_id=0)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_packed_sequence_attends_only_to_itself(attention: str) -> None:
    """Packed logprobs equal each sequence's forward pass on its own: transformers builds
    the block-diagonal causal mask from the restarting position ids."""
    policy = tiny_policy()
    policy.model.config._attn_implementation = attention
    batch = pack_batch(PAIRS, pack_rows([len(p) + len(c) for p, c in PAIRS], 11), fill_id=0)
    with torch.no_grad():
        logp, entropy = packed_token_logprobs(policy.model, batch, temperature=0.7)
        alone, alone_entropy = [], []
        for p, c in PAIRS:
            ids = torch.tensor([p + c])
            lp, ent = token_logprobs(policy.model, ids, torch.ones_like(ids), 0.7)
            alone.append(lp[0, len(p) - 1:])
            alone_entropy.append(ent[0, len(p) - 1:])
        # The same rows run as one causal sequence each (no restart) do see their neighbours.
        leaky = policy.model(input_ids=batch.ids, use_cache=False).logits.reshape(-1, policy.model.config.vocab_size)
    assert torch.allclose(logp, torch.cat(alone), atol=1e-5)
    assert torch.allclose(entropy, torch.cat(alone_entropy), atol=1e-5)
    leaky_logp = torch.log_softmax(leaky[batch.targets].float() / 0.7, -1).gather(
        -1, batch.ids.reshape(-1)[batch.targets + 1].unsqueeze(-1)).squeeze(-1)
    start, n = batch.spans[1]  # sample 1 sits behind sample 0 in its row
    assert (leaky_logp[start:start + n] - logp[start:start + n]).abs().max() > 1e-3


def test_pack_levels_fill_gaps_then_narrow_rows() -> None:
    # 12 and 9 open rows of width 12; 3 fills the gap beside 9; 5 (not over half of 12) and
    # the rest wait for a level of width 5, where 5 and 3 open rows and a 2 fills beside 3.
    lengths = [12, 5, 3, 3, 2, 2, 2, 9]
    assert pack_levels(lengths) == [(12, [[0], [7, 2]]), (5, [[1], [3, 4]]), (2, [[5], [6]])]
    assert pack_levels([4, 4, 4, 4, 2]) == [(4, [[0], [1], [2], [3]]), (2, [[4]])]
    assert pack_levels([6, 4, 1, 1, 1]) == [(6, [[0], [1, 2, 3]]), (1, [[4]])]
    assert pack_levels([6, 4, 1, 1, 1], max_per_row=2) == [(6, [[0], [1, 2]]), (1, [[3], [4]])]


def test_unverified_attention_and_logit_scaling_are_refused() -> None:
    batch = pack_batch(PAIRS, pack_rows([len(p) + len(c) for p, c in PAIRS], 11), fill_id=0)
    policy = tiny_policy()
    policy.model.config._attn_implementation = "flex_attention"
    with pytest.raises(UserError, match=r"^trainer\.packing=True: .*not the model's 'flex_attention'.*fix: .*trainer\.packing: false"):
        packed_token_logprobs(policy.model, batch)
    policy = tiny_policy()
    policy.model.config.logits_scaling = 4.0
    with pytest.raises(UserError, match="logits_scaling=4.0; fix: set trainer.packing: false"):
        packed_token_logprobs(policy.model, batch)


def test_packed_micro_batches_budgets() -> None:
    def sample(n: int) -> Sample:
        return Sample([1] * (n - 1), [2], [0.0], 1.0)

    samples = [sample(n) for n in (12, 5, 3, 3, 2, 2, 2, 9)]
    # rows of one width per micro-batch
    assert packed_micro_batches(samples, max_rows=8) == [[[0], [7, 2]], [[1], [3, 4]], [[5], [6]]]
    assert packed_micro_batches(samples, max_rows=2) == [[[0]], [[7, 2]], [[1]], [[3, 4]], [[5], [6]]]
    # 12 tokens: one row of width 12, two of width 5
    assert packed_micro_batches(samples, max_rows=8, max_tokens=12) == [[[0]], [[7, 2]], [[1], [3, 4]], [[5], [6]]]
    assert packed_micro_batches(samples, max_rows=8, max_tokens=4) == [[[0]], [[7, 2]], [[1]], [[3, 4]], [[5], [6]]]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_packed_step_has_the_padded_loss_and_gradients(aggregation: str) -> None:
    grads, stats = [], []
    for packing in (True, False):
        policy = tiny_policy()
        samples = mixed_samples(policy)
        stats.append(step(policy, samples, packing, aggregation))
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters()]))
    packed, padded = stats
    assert packed.tokens == padded.tokens == sum(s.trained_tokens for s in samples)
    assert packed.tokens < sum(len(s.completion_ids) for s in samples)  # the multi-turn masks switched tokens off
    assert padded.clip_frac > 0 and padded.kl > 0  # clipping and the KL term are exercised
    for field in ("loss", "clip_frac", "kl", "entropy", "grad_norm"):
        assert getattr(packed, field) == pytest.approx(getattr(padded, field), rel=1e-5, abs=1e-6), field
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_packed_gradients_do_not_depend_on_micro_batching() -> None:
    grads = []
    for rows, budget in ((64, 0), (1, 0), (4, 80)):
        policy = tiny_policy()
        samples = mixed_samples(policy, seed=1)
        step(policy, samples, True, "sequence_mean", micro_batch_size=rows, micro_batch_tokens=budget)
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and torch.allclose(grads[0], grads[2], atol=1e-6)


def test_one_optimizer_step_gives_the_padded_parameters() -> None:
    params = []
    for packing in (True, False):
        policy = tiny_policy()
        samples = mixed_samples(policy, seed=2)
        before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
        step(policy, samples, packing, "seq_mean_token_sum", lr=1e-2)
        params.append({n: p.detach().clone() for n, p in policy.model.named_parameters()})
        assert all(not torch.equal(params[-1][n], before[n]) for n in before)
    for name, value in params[0].items():
        assert torch.allclose(value, params[1][name], atol=1e-5), name


def test_packing_is_the_recipe_default() -> None:
    assert TrainerConfig().packing is True
    assert TrainerConfig(packing=False).packing is False
