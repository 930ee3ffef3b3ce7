"""Which of an iteration's groups the trainer trains on, and how many of each domain it kept.

A group is one task's G samples. ``collect_groups`` joins the rollouts with their rewards
and keeps, per group, the samples that can train (status ``ok``, a non-empty completion,
at least one trained token), with the sample's advantage times its domain weight.
``select_groups`` then decides which groups make the iteration's batch:

- ``dynamic=False`` (the default): every group with some signal, i.e. a sample whose
  weighted advantage is not 0; the rest are dropped. ``step_batches`` cuts them into
  steps of ``prompts_per_step``, the last one partial.
- ``dynamic=True`` (DAPO's dynamic sampling, Yu et al. 2025): a group is dropped when the
  rewards its advantages were computed from are all equal (``normalized_reward`` of the
  non-excluded samples: the raw score, or its per-domain z-score, or under
  ``reward.control: shuffled`` the shuffled score, so the control's groups are chosen by
  the rewards it trains on, not the true ones). Of the informative groups whose domain's
  loss weight (``reward.domain_weights``) is above 0, a seeded shuffle (so task order
  favours no domain) picks ``prompts_per_step`` per step for ``target_steps`` steps, or
  as many whole steps as there are such groups for; the ones left over (taskgen's
  oversampled surplus, or too few to fill a step) are unused.

In both modes an informative group of a domain whose loss weight is 0 is counted as
``zero_weight``, not as dropped: its rewards differ, but the recipe asked not to train on
its domain. It never trains (as if the domain were left out: it takes no step slot and
no share of the loss denominators), and a weight-0 group whose rewards are all equal is
dropped like any other.

Every task with a rollout is counted once: kept, dropped, zero_weight or unused (``Selection``).

Not covered: drawing more rollouts when too few groups are informative (the surplus is
what ``taskgen.oversample`` drew up front), and per-sample filtering inside a group
(overlong or truncated completions train like any other).
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from components.core.records import Reward, Rollout
from components.trainer.grpo import Sample


@dataclass(frozen=True)
class Group:
    """One task's trainable samples, with what the selection needs to know of it."""

    task_id: str
    domain: str
    samples: list[Sample]
    raw_rewards: list[float]  # the rewards behind the advantages (``normalized_reward``) of the samples
    # not excluded (status ``ok``), trainable or not
    weight: float = 1.0  # its domain's loss weight (``Reward.weight`` of its non-excluded samples)

    @property
    def has_signal(self) -> bool:
        """Some trainable sample has a non-zero weighted advantage (today's filter)."""
        return any(s.advantage != 0 for s in self.samples)

    @property
    def informative(self) -> bool:
        """Trainable, and its non-excluded samples' rewards are not all equal (DAPO's filter)."""
        return bool(self.samples) and len(set(self.raw_rewards)) > 1

    @property
    def zero_weight(self) -> bool:
        """Informative, but its domain's loss weight is 0: never trained, counted apart."""
        return self.informative and self.weight <= 0


@dataclass(frozen=True)
class Selection:
    """The groups to train on (task order), and per domain how many groups were kept,
    dropped (no signal) and set aside for a loss weight of 0 (every domain with a group, 0
    included); ``unused`` counts the informative groups dynamic sampling left out."""

    groups: list[list[Sample]]
    kept: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    unused: int = 0
    zero_weight: dict[str, int] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """``groups_kept``, ``groups_dropped``, ``groups_zero_weight``, ``groups_unused`` and
        ``<domain>/groups_kept``, ``<domain>/groups_dropped``, ``<domain>/groups_zero_weight``
        (the stage logs them under ``trainer/``)."""
        out = {"groups_kept": float(sum(self.kept.values())), "groups_dropped": float(sum(self.dropped.values())),
               "groups_zero_weight": float(sum(self.zero_weight.values())), "groups_unused": float(self.unused)}
        for domain in sorted(self.kept):
            out[f"{domain}/groups_kept"] = float(self.kept[domain])
            out[f"{domain}/groups_dropped"] = float(self.dropped.get(domain, 0))
            out[f"{domain}/groups_zero_weight"] = float(self.zero_weight.get(domain, 0))
        return out


def collect_groups(rollouts: list[Rollout], rewards: list[Reward]) -> list[Group]:
    """Every task's group, sorted by task id; a group may hold no trainable sample."""
    by_id = {r.rollout_id: r for r in rewards}
    samples: dict[str, list[Sample]] = defaultdict(list)
    raw: dict[str, list[float]] = defaultdict(list)
    domain: dict[str, str] = {}
    weight: dict[str, float] = {}
    for ro in rollouts:
        rw = by_id[ro.rollout_id]
        domain[ro.task_id] = rw.domain
        samples.setdefault(ro.task_id, [])
        if rw.status != "ok":
            continue  # an excluded sample's weight is 0 whatever its domain's
        raw[ro.task_id].append(rw.normalized_reward)
        weight[ro.task_id] = rw.weight
        if not ro.completion_token_ids or (ro.completion_mask and not any(ro.completion_mask)):
            continue
        samples[ro.task_id].append(Sample(ro.prompt_token_ids, ro.completion_token_ids, ro.logprobs,
                                          rw.advantage * rw.weight, list(ro.completion_mask)))
    return [Group(t, domain[t], samples[t], raw[t], weight.get(t, 1.0)) for t in sorted(samples)]


def select_groups(groups: list[Group], *, dynamic: bool, prompts_per_step: int, target_steps: int,
                  seed: int) -> Selection:
    """The groups to train on; see the module docstring for the two rules."""
    zero = [g for g in groups if g.zero_weight]
    if not dynamic:
        chosen = [g for g in groups if g.has_signal]
        dropped = [g for g in groups if not g.has_signal and not g.zero_weight]
        return Selection([g.samples for g in chosen], _per_domain(groups, chosen), _per_domain(groups, dropped),
                         zero_weight=_per_domain(groups, zero))
    trainable = [g for g in groups if g.informative and not g.zero_weight]
    steps = min(target_steps, len(trainable) // prompts_per_step)
    order = list(range(len(trainable)))
    random.Random(seed).shuffle(order)
    picked = sorted(order[: steps * prompts_per_step])
    chosen = [trainable[i] for i in picked]
    return Selection([g.samples for g in chosen], _per_domain(groups, chosen),
                     _per_domain(groups, [g for g in groups if not g.informative]),
                     unused=len(trainable) - len(chosen), zero_weight=_per_domain(groups, zero))


def _per_domain(every: list[Group], some: list[Group]) -> dict[str, int]:
    """How many of ``some`` each domain of ``every`` has (0 included)."""
    counts = Counter(g.domain for g in some)
    return {d: counts[d] for d in sorted({g.domain for g in every})}
