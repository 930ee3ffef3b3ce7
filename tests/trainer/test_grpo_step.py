"""One GRPO step on a tiny policy: parameters change, the batch's loss drops, the
loss value and its aggregation modes are what the formula says, in packed and padded
micro-batches alike (``test_packing.py`` compares the two directly)."""

from __future__ import annotations

import copy

import pytest
import torch

from components.core.policy import pad_batch, token_logprobs
from components.core.recipe import TrainerConfig
from components.rollout.hf_engine import HFEngine
from components.trainer.grpo import Sample, grpo_step, micro_batches, token_weights
from components.trainer.state import build_optimizer
from tests.rollout.helpers import PROMPTS, tiny_policy

TEMPERATURE = 1.0


def rollout_batch(policy, seed: int = 3) -> list[Sample]:
    """Two groups of 4 samples each, advantages +1/-1 alternating (so the step has signal)."""
    prompts = [PROMPTS[0]] * 4 + [PROMPTS[3]] * 4
    out = HFEngine().generate(policy, prompts, max_new_tokens=6, temperature=TEMPERATURE, seed=seed, batch_size=8)
    return [Sample(s.prompt_ids, s.completion_ids, s.logprobs, 1.0 if k % 2 == 0 else -1.0) for k, s in enumerate(out)]


def reference_loss(model, samples: list[Sample], clip_eps: float = 0.2) -> float:
    """Token-mean clipped surrogate, written out independently of grpo_step."""
    ids, attn, _ = pad_batch([(s.prompt_ids, s.completion_ids) for s in samples], 0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, attn, TEMPERATURE)
    total, tokens = 0.0, 0
    for r, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        for t, old in enumerate(s.old_logprobs):
            ratio = float(torch.exp(logp[r, start + t] - old))
            total += -min(ratio * s.advantage, max(min(ratio, 1 + clip_eps), 1 - clip_eps) * s.advantage)
            tokens += 1
    return total / tokens


def step(model, samples, **kw):
    lr = kw.pop("lr", 1e-2)
    optimizer = build_optimizer(model, TrainerConfig(learning_rate=lr)) if lr else torch.optim.SGD(model.parameters(), lr=0.0)
    args = dict(pad_id=0, clip_eps=0.2, kl_coef=0.0, temperature=TEMPERATURE, micro_batch_size=3, max_grad_norm=1.0)
    return grpo_step(model, optimizer, samples, **{**args, **kw})


def test_one_step_changes_parameters_and_lowers_the_loss() -> None:
    policy = tiny_policy()
    samples = rollout_batch(policy)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    loss_before = reference_loss(policy.model, samples)
    # Old logprobs are the policy's own: every ratio is 1, so the loss is -mean over tokens of A.
    tokens = [len(s.completion_ids) for s in samples]
    expected = -sum(n * s.advantage for n, s in zip(tokens, samples)) / sum(tokens)
    assert loss_before == pytest.approx(expected, abs=1e-5)
    stats = step(policy.model, samples)
    assert stats.loss == pytest.approx(expected, abs=1e-5)
    assert stats.clip_frac == 0.0 and stats.kl == pytest.approx(0.0, abs=1e-6)
    assert stats.tokens == sum(tokens) and stats.grad_norm > 0 and stats.lr == pytest.approx(1e-2)
    changed = [n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    loss_after = reference_loss(policy.model, samples)
    assert loss_after < loss_before - 1e-3


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "seq_mean_token_sum"])
def test_gradient_does_not_depend_on_micro_batching(aggregation: str, packing: bool) -> None:
    grads = []
    for rows, budget in ((8, 0), (1, 0), (8, 40)):
        policy = tiny_policy()
        samples = rollout_batch(policy)
        stats = step(policy.model, samples, lr=0.0, micro_batch_size=rows, micro_batch_tokens=budget,
                     loss_aggregation=aggregation, packing=packing)
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters()]))
        assert stats.loss == pytest.approx(sum(-s.advantage * w * len(s.completion_ids) for s, w in
                                               zip(samples, token_weights(samples, aggregation))), abs=1e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and torch.allclose(grads[0], grads[2], atol=1e-6)


def test_token_weights_and_token_budget() -> None:
    s = [Sample([1, 2], [3], [0.0], 1.0), Sample([1, 2], [3, 4, 5], [0.0] * 3, 1.0)]
    assert token_weights(s, "token_mean") == [0.25, 0.25]
    assert token_weights(s, "sequence_mean") == [0.5, 1 / 6]
    assert token_weights(s, "seq_mean_token_sum") == [0.5, 0.5]
    lengths = [Sample([0] * 4, [1] * n, [0.0] * n, 1.0) for n in (1, 6, 2, 6)]  # total lengths 5, 10, 6, 10
    assert micro_batches(lengths, max_rows=8, max_tokens=20) == [[1, 3], [2, 0]]
    assert micro_batches(lengths, max_rows=8, max_tokens=9) == [[1], [3], [2], [0]]  # too long alone: own batch
    assert micro_batches(lengths, max_rows=3, max_tokens=0) == [[1, 3, 2], [0]]
    with pytest.raises(ValueError, match="unknown loss aggregation 'bogus'"):
        token_weights(s, "bogus")


def test_a_step_whose_gradient_is_not_finite_updates_nothing() -> None:
    """One sample's recorded logprob of -1e4 (the floor a server may send) makes its
    importance ratio overflow with a negative advantage and the KL term overflow: the
    gradient is NaN. The step is skipped, so no weight turns NaN (before: every weight the
    step touched did, and the checkpoint was saved so)."""
    policy = tiny_policy()
    samples = rollout_batch(policy)
    bad = samples[1]  # advantage -1
    samples[1] = Sample(bad.prompt_ids, bad.completion_ids, [-1e4] * len(bad.old_logprobs), bad.advantage)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    stats = step(policy.model, samples, kl_coef=0.1)
    assert stats.skipped and not torch.isfinite(torch.tensor(stats.grad_norm))
    for name, param in policy.model.named_parameters():
        assert torch.equal(param, before[name]), name
    healthy = step(policy.model, rollout_batch(policy), kl_coef=0.1)  # the next step trains as usual
    assert not healthy.skipped and torch.isfinite(torch.tensor(healthy.grad_norm))
    assert any(not torch.equal(p, before[n]) for n, p in policy.model.named_parameters())


def _grads_with_ratio(ratio_log: float, **kw):
    """The step's gradient (clipped as the step leaves it) when every recorded logprob is
    ``ratio_log`` nats below the policy's own, so each importance ratio is e^ratio_log."""
    policy = tiny_policy()
    samples = [Sample(s.prompt_ids, s.completion_ids, [x - ratio_log for x in s.old_logprobs], s.advantage)
               for s in rollout_batch(policy)]
    stats = step(policy.model, samples, lr=0.0, **kw)
    return torch.cat([p.grad.flatten() for p in policy.model.parameters()]), stats


def test_kl_coef_clip_eps_and_max_grad_norm_change_the_update() -> None:
    """Each of the recipe's trainer.kl_coef, clip_eps and max_grad_norm changes the
    gradient the step applies (they were tested only at fixed values)."""
    base, stats = _grads_with_ratio(0.5)  # ratios 1.65: outside clip_eps 0.2 everywhere
    assert stats.clip_frac == 1.0 and stats.kl > 0
    with_kl, _ = _grads_with_ratio(0.5, kl_coef=0.5)
    assert not torch.allclose(base, with_kl, atol=1e-7)
    wide, wide_stats = _grads_with_ratio(0.5, clip_eps=0.9)  # nothing clipped: positive advantages train too
    assert wide_stats.clip_frac == 0.0 and not torch.allclose(base, wide, atol=1e-7)
    small, small_stats = _grads_with_ratio(0.5, max_grad_norm=1e-3)
    assert small_stats.grad_norm == pytest.approx(stats.grad_norm)  # the norm before clipping
    assert float(small.norm()) == pytest.approx(1e-3, rel=1e-3) and float(base.norm()) > 1e-2
    assert torch.allclose(small / small.norm(), base / base.norm(), atol=1e-5)  # the same direction, scaled


def test_the_stages_step_means_leave_out_a_skipped_step() -> None:
    """A skipped step's loss is not finite: the stage's mean loss was NaN for the iteration."""
    from components.trainer.grpo import StepStats
    from components.trainer.stage import step_means

    ok = [StepStats(loss=0.2, clip_frac=0.1, kl=0.01, entropy=1.0, grad_norm=2.0, tokens=10, lr=1e-3),
          StepStats(loss=0.4, clip_frac=0.3, kl=0.03, entropy=3.0, grad_norm=4.0, tokens=10, lr=1e-3)]
    bad = StepStats(loss=float("nan"), clip_frac=0.5, kl=float("inf"), entropy=0.0, grad_norm=float("nan"), tokens=10,
                    lr=1e-3, skipped=True)
    assert step_means([ok[0], bad, ok[1]]) == pytest.approx(
        {"loss": 0.3, "clip_frac": 0.2, "kl": 0.02, "entropy": 2.0, "grad_norm": 3.0, "lr": 1e-3})
    assert step_means([bad]) == {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "entropy": 0.0, "grad_norm": 0.0, "lr": 0.0}


@pytest.mark.parametrize("packing", [True, False])
def test_masked_tokens_the_policy_finds_very_unlikely_change_nothing(packing: bool) -> None:
    """Observation tokens (mask 0, recorded logprob 0) the policy gives a logprob below
    about -88 made exp(old - new) overflow: inf * mask 0 is NaN, so the step was skipped
    (also with kl_coef 0, and in the padded path for its pad positions). Now the step
    equals the one whose masked tokens carry the policy's own logprobs: same loss, same
    gradient, not skipped."""
    temperature = 0.3
    policy = tiny_policy(0)
    with torch.no_grad():
        policy.model.model.norm.weight.mul_(40.0)  # sharp logits: the least likely token is far below -88 at T=0.3
    prompt = policy.encode_prompt("1+2=")
    ids, mask = list(prompt), []
    for k in range(6):
        with torch.no_grad():
            logits = policy.model(torch.tensor([ids])).logits[0, -1]
        masked = k in (2, 3)
        ids.append(int(logits.argmin()) if masked else int(logits.argsort()[-2]))
        mask.append(0 if masked else 1)
    with torch.no_grad():
        own, _ = token_logprobs(policy.model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), temperature)
    own = own[0, len(prompt) - 1:].tolist()
    assert min(x for x, m in zip(own, mask) if not m) < -88 < min(x for x, m in zip(own, mask) if m)
    completion = ids[len(prompt):]
    recorded = [x if m else 0.0 for x, m in zip(own, mask)]  # what a rollout records: observation logprobs are 0
    results = []
    for old in (recorded, own):
        model = copy.deepcopy(policy.model)
        samples = [Sample(prompt, completion, old, 1.0, mask), Sample(prompt, completion[:2], old[:2], -1.0)]
        stats = grpo_step(model, torch.optim.SGD(model.parameters(), lr=0.0), samples, pad_id=policy.pad_id,
                          clip_eps=0.2, kl_coef=0.0, temperature=temperature, micro_batch_size=8, max_grad_norm=1e9,
                          packing=packing)
        results.append((stats, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    (stats, grad), (expected, expected_grad) = results
    assert not stats.skipped and stats.grad_norm > 0 and stats.tokens == 6
    assert stats.loss == pytest.approx(expected.loss, abs=1e-6) and torch.allclose(grad, expected_grad, atol=1e-6)
