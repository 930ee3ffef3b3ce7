"""GRPO: the clipped policy-gradient objective on group-relative advantages.

For each completion token t of a sample with advantage A:
    ratio_t = exp(logp_new_t - logp_old_t)
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A) + kl_coef * KL_t
``logp_old`` are the logprobs recorded at rollout, which are also the frozen reference
for the KL term (k3 estimator, Schulman 2020): the iteration's starting policy. With
``trainer.epochs > 1`` the same batch is revisited PPO-style against those old logprobs.

Aggregation over one optimizer step (all micro-batches), ``loss_aggregation``:
``token_mean`` (sum over all tokens / all tokens: long answers weigh more),
``sequence_mean`` (per-sequence token mean, then mean over sequences: the original GRPO)
or ``seq_mean_token_sum`` (per-sequence token sum, then mean over sequences: Dr. GRPO's
length-unbiased form up to a constant). Each is a per-token weight, so the loss does not
depend on how a step is cut into micro-batches (``micro_batch_size`` sequences and, if
set, ``micro_batch_tokens`` tokens per forward pass).

Micro-batches are packed by default (``packing=True``, recipe ``trainer.packing``): the
step's sequences are laid end to end in rows (first-fit decreasing, short sequences in
narrower rows once the gaps beside long ones are full), position ids restart at each
sequence, and the forward pass gets no attention mask, so each sequence attends only to
itself, causally; only completion positions reach the output layer. No pad token enters
the loss or any sequence's attention, and the loss, clipping, KL and sample masks are
the padded path's, token for token. ``packing=False`` keeps one right-padded row per
sequence.

The step runs where the model is (its parameters' device; ``device.py`` puts it there),
with ``dtype="bfloat16"`` as autocast of the forward passes. Scoring goes through
``Scorer``, one module call per micro-batch, so a DDP or FSDP2 wrapper around it sees
every forward pass. Under torchrun each process passes a ``StepPart`` (its share of the
step's samples, chosen by ``distributed.split_step``): token weights still come from
the whole step, the loss is scaled by the number of processes against the wrappers'
gradient averaging (so gradients are summed), every process runs the same number of
micro-batches (extra ones at weight 0; a process with no sample of a step that has fewer
samples than processes runs the step's first sample at weight 0), clipping sees the
global norm, and the step's statistics are summed over the processes: the step equals
the one-process step.

Not covered here: PPO value functions (GRPO needs none), a separate reference model for
the KL, and packing under attention implementations other than sdpa and eager (what the
trainer's models load with; others are refused rather than trusted).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from components.core.policy import PackedBatch, pack_batch, pack_levels, packed_token_logprobs, pad_batch, token_logprobs


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]
    advantage: float
    mask: list[int] = field(default_factory=list)  # per completion token, 1 = trained; empty = all 1

    @property
    def trained_tokens(self) -> int:
        return sum(self.mask) if self.mask else len(self.completion_ids)


def apply_sample_masks(samples: list[Sample], comp_mask: torch.Tensor) -> torch.Tensor:
    """``comp_mask`` with the observation tokens of multi-turn samples (mask 0) switched off."""
    out = comp_mask.clone()
    for row, s in enumerate(samples):
        if s.mask:
            start = len(s.prompt_ids) - 1
            out[row, start : start + len(s.mask)] *= torch.tensor(s.mask, dtype=out.dtype)
    return out


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
    lr: float = 0.0
    skipped: bool = False  # the gradient was not finite: no update (grpo_step)


AGGREGATIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum")


def token_weights(samples: list[Sample], aggregation: str) -> list[float]:
    """The weight of each of a sample's tokens in the step loss, per sample."""
    total_tokens = sum(s.trained_tokens for s in samples)
    if aggregation == "token_mean":
        return [1.0 / total_tokens for _ in samples]
    if aggregation == "sequence_mean":
        return [1.0 / (s.trained_tokens * len(samples)) for s in samples]
    if aggregation == "seq_mean_token_sum":
        return [1.0 / len(samples) for _ in samples]
    raise ValueError(f"unknown loss aggregation {aggregation!r}; use one of {AGGREGATIONS}")


def micro_batches(samples: list[Sample], max_rows: int, max_tokens: int = 0) -> list[list[int]]:
    """Indices of ``samples`` cut into micro-batches of at most ``max_rows`` rows and, when
    ``max_tokens`` > 0, at most ``max_tokens`` padded tokens (rows x longest sequence), for
    the padded path.
    Samples are taken longest first so each micro-batch pads little; a single sample
    longer than the budget forms its own micro-batch."""
    order = sorted(range(len(samples)), key=lambda i: (-(len(samples[i].prompt_ids) + len(samples[i].completion_ids)), i))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        length = len(samples[i].prompt_ids) + len(samples[i].completion_ids)
        new_width = max(width, length)
        if current and (len(current) >= max_rows or (max_tokens and (len(current) + 1) * new_width > max_tokens)):
            batches.append(current)
            current, new_width = [], length
        current.append(i)
        width = new_width
    if current:
        batches.append(current)
    return batches


def packed_micro_batches(samples: list[Sample], max_rows: int, max_tokens: int = 0) -> list[list[list[int]]]:
    """Per micro-batch, its rows of sample indices: the sequences packed in rows of
    narrowing width (``pack_levels``: short ones fill the gaps beside long ones first, at
    most ``max_rows`` per row), then consecutive rows of one width while a micro-batch
    holds at most ``max_rows`` sequences and, when ``max_tokens`` > 0, at most
    ``max_tokens`` tokens (rows x width). A row is never split, so a row wider than the
    budget forms its own micro-batch."""
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    batches: list[list[list[int]]] = []
    for width, rows in pack_levels(lengths, max_rows):
        current: list[list[int]] = []
        count = 0
        for row in rows:
            if current and (count + len(row) > max_rows or (max_tokens and (len(current) + 1) * width > max_tokens)):
                batches.append(current)
                current, count = [], 0
            current.append(row)
            count += len(row)
        if current:
            batches.append(current)
    return batches


class Scorer(torch.nn.Module):
    """The policy's token scoring as one module call, so that a DDP or FSDP2 wrapper around
    it sees every forward pass (the packed path reaches past the model's own ``forward``)."""

    def __init__(self, policy) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, packed: PackedBatch | None = None, ids=None, attn=None, temperature: float = 1.0):
        if packed is not None:
            return packed_token_logprobs(self.policy, packed, temperature)
        return token_logprobs(self.policy, ids, attn, temperature)


def _padded_forward(scorer, chunk: list[Sample], weights: list[float], pad_id: int, temperature: float, device):
    """(new logprobs, entropy, old logprobs, mask, advantage, weight), each (rows, width - 1) or broadcastable."""
    ids, attn, mask = pad_batch([(s.prompt_ids, s.completion_ids) for s in chunk], pad_id)
    mask = apply_sample_masks(chunk, mask)
    new, entropy = scorer(ids=ids.to(device), attn=attn.to(device), temperature=temperature)
    old = old_logprob_tensor(chunk, mask)
    adv = torch.tensor([s.advantage for s in chunk]).unsqueeze(-1)
    w = torch.tensor(weights).unsqueeze(-1)
    return (new, entropy, *(t.to(device) for t in (old, mask, adv, w)))


def _packed_forward(scorer, chunk: list[Sample], rows: list[list[int]], weights: list[float], pad_id: int,
                    temperature: float, device):
    """The same six tensors, flat over the chunk's completion tokens (sample order). Old
    logprobs and sample masks are cut or extended to the completion as the padded path
    reads them: a missing old logprob is 0, a missing mask entry is 1."""
    batch = pack_batch([(s.prompt_ids, s.completion_ids) for s in chunk], rows, pad_id)
    batch = replace(batch, ids=batch.ids.to(device), position_ids=batch.position_ids.to(device),
                    targets=batch.targets.to(device))
    new, entropy = scorer(packed=batch, temperature=temperature)
    old: list[float] = []
    mask: list[float] = []
    adv: list[float] = []
    w: list[float] = []
    for s, weight in zip(chunk, weights):
        n = len(s.completion_ids)
        old.extend(list(s.old_logprobs[:n]) + [0.0] * (n - len(s.old_logprobs)))
        mask.extend((list(s.mask[:n]) + [1] * (n - len(s.mask))) if s.mask else [1] * n)
        adv.extend([s.advantage] * n)
        w.extend([weight] * n)
    tensors = (torch.tensor(old), torch.tensor(mask, dtype=torch.float32), torch.tensor(adv), torch.tensor(w))
    return (new, entropy, *(t.to(device) for t in tensors))


def plan_micro_batches(samples: list[Sample], micro_batch_size: int, micro_batch_tokens: int,
                       packing: bool) -> list[tuple[list[int], list[list[int]]]]:
    """Per micro-batch: the sample indices it holds and, when packed, its rows (indices
    into that micro-batch); the padded path has no rows."""
    if not packing:
        return [(idx, []) for idx in micro_batches(samples, micro_batch_size, micro_batch_tokens)]
    layouts = []
    for rows in packed_micro_batches(samples, micro_batch_size, micro_batch_tokens):
        idx = [i for row in rows for i in row]
        local = {i: k for k, i in enumerate(idx)}
        layouts.append((idx, [[local[i] for i in row] for row in rows]))
    return layouts


@dataclass(frozen=True)
class StepPart:
    """One process's part of a step trained by several (``distributed.py``).

    ``indices``: the step's samples this process scores; ``world``: how many processes
    share the step (may be empty); ``micro_batches``: how many forward/backward passes every process
    runs (the most any of them needs: the collectives inside DDP and FSDP must pair up,
    so a process with fewer passes runs extra ones at weight 0); ``all_reduce``: sums a
    list of floats over the processes (the step's statistics)."""

    indices: list[int]
    world: int
    micro_batches: int
    all_reduce: Callable[[list[float]], list[float]]


def grpo_step(model, optimizer, samples: list[Sample], *, pad_id: int, clip_eps: float, kl_coef: float,
              temperature: float, micro_batch_size: int, max_grad_norm: float, micro_batch_tokens: int = 0,
              loss_aggregation: str = "token_mean", scheduler=None, packing: bool = True, dtype: str = "float32",
              part: StepPart | None = None) -> StepStats:
    """One optimizer step over ``samples`` with gradient accumulation (then one scheduler step);
    ``packing`` chooses packed micro-batches (the default) or right-padded ones, ``dtype``
    the forward precision (``device.forward_precision``). The model may be a plain model or
    a DDP/FSDP2-wrapped ``Scorer``; with ``part`` this process scores only its share of the
    step, with every token weighted as in the whole step, and gradients are summed over
    the processes (the loss is scaled by ``part.world`` against the wrappers' averaging),
    so the step equals the one-process step on the same samples. A step whose gradient norm
    is not finite (a sample whose recorded logprob makes the importance ratio overflow)
    updates nothing (``StepStats.skipped``); the scheduler still steps."""
    from components.trainer.device import forward_precision

    scorer = model if isinstance(model, (Scorer, torch.nn.parallel.DistributedDataParallel)) else Scorer(model)
    device = next(p.device for p in scorer.parameters())
    scorer.train()
    optimizer.zero_grad(set_to_none=True)
    total_tokens = sum(s.trained_tokens for s in samples)
    weights = token_weights(samples, loss_aggregation)
    lr = float(optimizer.param_groups[0]["lr"])
    sums = {"loss": 0.0, "clip": 0.0, "kl": 0.0, "ent": 0.0}
    mine = part.indices if part else list(range(len(samples)))
    layouts = [([mine[i] for i in idx], rows, 1.0)
               for idx, rows in plan_micro_batches([samples[i] for i in mine], micro_batch_size, micro_batch_tokens, packing)]
    if part:
        # Passes at weight 0 so that every process runs as many: its first micro-batch again,
        # or the step's first sample for a process with none of this step (fewer samples
        # than processes).
        pad = layouts[0][:2] if layouts else ([0], plan_micro_batches(samples[:1], micro_batch_size,
                                                                      micro_batch_tokens, packing)[0][1])
        layouts += [(*pad, 0.0)] * (part.micro_batches - len(layouts))
    scale = float(part.world) if part else 1.0
    for idx, rows, keep in layouts:
        chunk = [samples[i] for i in idx]
        chunk_weights = [weights[i] * keep for i in idx]
        with forward_precision(device, dtype):
            if packing:
                new, entropy, old, mask, adv, w = _packed_forward(scorer, chunk, rows, chunk_weights, pad_id, temperature, device)
            else:
                new, entropy, old, mask, adv, w = _padded_forward(scorer, chunk, chunk_weights, pad_id, temperature, device)
        new, entropy = new.float(), entropy.float()
        # Masked positions (observation tokens, padding: their recorded logprob is 0) are
        # taken out before exponentiating: exp of a very unlikely one overflowed to inf, and
        # inf * mask 0 is NaN, in the loss and in its gradient, so the step was skipped.
        log_ratio = torch.where(mask > 0, new - old, torch.zeros_like(new))
        ratio = torch.exp(log_ratio)
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
        kl = torch.exp(-log_ratio) + log_ratio - 1
        per_token = -surrogate + kl_coef * kl if kl_coef else -surrogate  # 0 * an overflowing kl is NaN
        loss = (per_token * mask * w).sum()
        (loss * scale if scale != 1.0 else loss).backward()
        if keep:
            with torch.no_grad():
                sums["loss"] += float(loss)
                sums["clip"] += float(((ratio - 1).abs() > clip_eps).float().mul(mask).sum())
                sums["kl"] += float((kl * mask).sum())
                sums["ent"] += float((entropy * mask).sum())
    norm = torch.nn.utils.clip_grad_norm_([p for p in scorer.parameters() if p.requires_grad], max_grad_norm)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # an FSDP2 norm is a DTensor
    skipped = not math.isfinite(grad_norm)
    if skipped:  # an infinite or NaN loss (an overflowing ratio): the update would write NaN into every weight
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    if part:
        sums = dict(zip(sums, part.all_reduce(list(sums.values()))))
    return StepStats(loss=sums["loss"], clip_frac=sums["clip"] / total_tokens, kl=sums["kl"] / total_tokens,
                     entropy=sums["ent"] / total_tokens, grad_norm=grad_norm, tokens=total_tokens, lr=lr,
                     skipped=skipped)


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
