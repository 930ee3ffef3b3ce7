"""GRPO: the clipped policy-gradient objective on group-relative advantages.

For each completion token t of a sample with advantage A:
    ratio_t = exp(logp_new_t - logp_old_t)
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A) + kl_coef * KL_t
aggregated as a token mean over the whole optimizer step (all micro-batches). ``logp_old``
are the logprobs recorded at rollout, which are also the frozen reference for the KL
term (k3 estimator, Schulman 2020): the iteration's starting policy.

Not covered here: PPO value functions (GRPO needs none) and sequence-level aggregation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]
    advantage: float


def pad_batch(samples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, completion_mask); the mask marks the
    positions of the logits (shifted by one) that predict completion tokens."""
    width = max(len(p) + len(c) for p, c in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    comp = torch.zeros((len(samples), width - 1), dtype=torch.float32)
    for row, (p, c) in enumerate(samples):
        seq = p + c
        ids[row, : len(seq)] = torch.tensor(seq)
        attn[row, : len(seq)] = 1
        comp[row, len(p) - 1 : len(seq) - 1] = 1.0
    return ids, attn, comp


def token_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each next token, entropy) for positions 0..L-2, under softmax(logits/T)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def old_logprob_tensor(samples: list[Sample], comp_mask: torch.Tensor) -> torch.Tensor:
    old = torch.zeros_like(comp_mask)
    for row, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        old[row, start : start + len(s.old_logprobs)] = torch.tensor(s.old_logprobs)
    return old


@dataclass
class StepStats:
    loss: float
    clip_frac: float
    kl: float
    entropy: float
    grad_norm: float
    tokens: int


def grpo_step(model, optimizer, samples: list[Sample], *, pad_id: int, clip_eps: float, kl_coef: float,
              temperature: float, micro_batch_size: int, max_grad_norm: float) -> StepStats:
    """One optimizer step over ``samples`` with gradient accumulation; token-mean loss."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total_tokens = sum(len(s.completion_ids) for s in samples)
    sums = {"loss": 0.0, "clip": 0.0, "kl": 0.0, "ent": 0.0}
    for start in range(0, len(samples), micro_batch_size):
        chunk = samples[start : start + micro_batch_size]
        ids, attn, mask = pad_batch([(s.prompt_ids, s.completion_ids) for s in chunk], pad_id)
        new, entropy = token_logprobs(model, ids, attn, temperature)
        old = old_logprob_tensor(chunk, mask)
        adv = torch.tensor([s.advantage for s in chunk]).unsqueeze(-1)
        ratio = torch.exp(new - old)
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
        log_ref_ratio = old - new
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        per_token = -surrogate + kl_coef * kl
        loss = (per_token * mask).sum() / total_tokens
        loss.backward()
        with torch.no_grad():
            sums["loss"] += float(loss)
            sums["clip"] += float(((ratio - 1).abs() > clip_eps).float().mul(mask).sum())
            sums["kl"] += float((kl * mask).sum())
            sums["ent"] += float((entropy * mask).sum())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    optimizer.step()
    return StepStats(loss=sums["loss"], clip_frac=sums["clip"] / total_tokens, kl=sums["kl"] / total_tokens,
                     entropy=sums["ent"] / total_tokens, grad_norm=grad_norm, tokens=total_tokens)


def step_batches(groups: list[list[Sample]], prompts_per_step: int, epochs: int, seed: int) -> list[list[Sample]]:
    """Shuffle groups (deterministically) and cut them into per-step batches, per epoch."""
    rng = random.Random(seed)
    batches = []
    for _ in range(epochs):
        order = list(groups)
        rng.shuffle(order)
        for i in range(0, len(order), prompts_per_step):
            batches.append([s for g in order[i : i + prompts_per_step] for s in g])
    return batches
