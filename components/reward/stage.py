"""Stage ``reward``: verifier scores -> per-domain normalisation -> group advantages.

Each rollout is scored by its domain's verifier from the completion and, where the
domain executes code, the sandbox's serialised result. A verdict with status
``infra_error`` is *excluded* (status ``excluded``, weight 0): an infrastructure
failure is never a zero reward and never trained on.

Normalisation (``reward.normalize``) uses running per-domain statistics carried across
iterations (``components.reward.normalize``): each shard reads the cumulative stats
after the previous iteration, normalises, and writes ``norm_stats.json`` beside its
rewards. Group advantages are computed from the normalised rewards.

Model output never fails the stage: every verdict comes through
``components.domains.base.judge``. A completion no verifier should read (not UTF-8,
over the size limit, nested too deep) is ``malformed``: score 0, trained on like any
wrong answer (reason says why; metric ``malformed``). A verifier that raises (or returns
a score outside [0, 1]) is ``verifier_error`` for that sample alone: status
``verifier_error``, weight 0, out of normalisation and advantages like an infra error,
counted in the metric ``verifier_errors`` and logged with the exception.

Per-domain loss weights (``reward.domain_weights``, unlisted domains 1): an ``ok``
sample's ``weight`` is its domain's weight (excluded samples keep 0). The trainer
multiplies ``advantage * weight``, so the weight acts *after* group-std scaling and
survives ``domain_zscore`` (which group scaling would otherwise cancel).

The shuffled control (``reward.control: shuffled``): within each domain, the scores of
the samples that are not excluded are permuted (seeded by ``control_seed``; the stage
derives it from (seed, pipeline, iteration, stage, shard) and records it in
``norm_stats.json`` as ``control_seed``, for replay) before normalisation and group
advantages, so the update carries no information about which completion was right; a
run with it must not learn. The recorded ``raw_reward`` stays the verifier's true
score (pass-rate metrics stay truthful); ``normalized_reward`` and ``advantage`` come
from the shuffled score. Domains are never mixed and the per-domain running statistics
are unchanged (the same multiset). Metric ``control_shuffled`` is 1.0 when on.

Not covered: shuffling across shards (each shard permutes its own samples).
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict

from components.core.context import StageContext
from components.core.facts import NormPrior
from components.core.records import Execution, Reward, Rollout, Task
from components.core.seeds import derive_seed
from components.domains import registry
from components.domains.base import Verdict, judge
from components.reward.advantages import group_advantages
from components.reward.normalize import (
    STATS_OUTPUT,
    RunningStats,
    Stats,
    cumulative_after,
    from_json,
    merge_all,
    to_json,
    zscore,
)

log = logging.getLogger(__name__)
EXCLUDED_VERDICTS = ("infra_error", "verifier_error")
"""Verdict statuses whose score says nothing about the policy: never normalised or trained on."""
LOGGED_ERRORS = 20
"""Verifier errors logged one by one per shard; the rest are only counted."""

SECTIONS = ("reward",)
"""Recipe sections read: normalisation and advantage settings."""
CONTROL_SEED = "control_seed"
"""Key of ``norm_stats.json`` holding the seed the shard's shuffled control permutes with
(written whether or not the control is on), so ``posttrain replay`` permutes the same way."""


def inputs(ctx: StageContext) -> None:
    ctx.depend_on("taskgen")
    ctx.depend_on("rollout", shard_only=True)
    ctx.depend_on("sandbox", shard_only=ctx.aligned("sandbox"))  # else re-sharded: read every sandbox shard
    prior_iteration, prior = cumulative_after(ctx, ctx.iteration - 1)
    ctx.facts = NormPrior(norm_prior_iteration=prior_iteration, norm_prior=to_json(prior))


def batch_stats(rewards: list[Reward]) -> Stats:
    """Per-domain statistics of the raw rewards that were not excluded."""
    by: dict[str, list[float]] = defaultdict(list)
    for r in rewards:
        if r.status == "ok":
            by[r.domain].append(r.raw_reward)
    return {d: RunningStats.of(v) for d, v in sorted(by.items())}


def control_seed(base_seed: int, pipeline: str, iteration: int, shard_index: int) -> int:
    """The shuffled control's seed for one reward shard (the stage's ``ctx.seed("control")``)."""
    return derive_seed(base_seed, pipeline, iteration, "reward", shard_index, "control")


def shuffled_scores(rollouts: list[Rollout], scores: dict[str, float], seed: int) -> dict[str, float]:
    """``scores`` (rollout id -> score, excluded samples absent) permuted within each domain."""
    by: dict[str, list[str]] = defaultdict(list)
    for r in rollouts:
        if r.rollout_id in scores:
            by[r.domain].append(r.rollout_id)
    rng = random.Random(seed)
    out: dict[str, float] = {}
    for domain in sorted(by):
        ids = by[domain]
        values = [scores[i] for i in ids]
        rng.shuffle(values)
        out.update(zip(ids, values))
    return out


def score(tasks: dict[str, Task], rollouts: list[Rollout], executions: dict[str, Execution], cfg,
          prior: Stats | None = None, seed: int = 0) -> list[Reward]:
    """Rewards for a shard's rollouts; pure, so replay can call it with another config.

    ``prior`` is the running per-domain statistics before this batch (used by
    ``cfg.normalize == "domain_zscore"``; merged with this batch's own raw rewards).
    ``seed`` drives the permutation of ``cfg.control == "shuffled"`` (unused otherwise)."""
    verdicts: dict[str, Verdict] = {}
    domains = {}
    errors = 0
    for r in rollouts:
        if r.domain not in domains:
            domains[r.domain] = registry.get(r.domain)
        v = judge(domains[r.domain], tasks[r.task_id], r.completion, executions.get(r.rollout_id))
        if v.status == "verifier_error":
            errors += 1
            if errors <= LOGGED_ERRORS:
                log.error("verifier_error: rollout %s (domain %s, task %s): %s", r.rollout_id, r.domain, r.task_id,
                          v.detail)
        verdicts[r.rollout_id] = v
    if errors > LOGGED_ERRORS:
        log.error("verifier_error: %d more rollouts not logged one by one", errors - LOGGED_ERRORS)
    raw_by: dict[str, list[float]] = defaultdict(list)
    for r in rollouts:
        if verdicts[r.rollout_id].status not in EXCLUDED_VERDICTS:
            raw_by[r.domain].append(verdicts[r.rollout_id].score)
    running = merge_all(prior or {}, {d: RunningStats.of(v) for d, v in raw_by.items()})
    trained = {r.rollout_id: verdicts[r.rollout_id].score for r in rollouts
               if verdicts[r.rollout_id].status not in EXCLUDED_VERDICTS}
    if cfg.control == "shuffled":
        trained = shuffled_scores(rollouts, trained, seed)

    def normalized(domain: str, raw: float) -> float:
        return zscore(raw, running[domain], cfg.advantage_eps) if cfg.normalize == "domain_zscore" else raw

    groups: dict[str, list[Rollout]] = defaultdict(list)
    for r in rollouts:
        groups[r.task_id].append(r)
    rewards = []
    for task_id, members in groups.items():
        norm = [normalized(m.domain, trained[m.rollout_id]) if m.rollout_id in trained else None for m in members]
        adv = group_advantages(norm, cfg.advantage_eps, cfg.scale_by_std)
        for m, a, value in zip(members, adv, norm):
            v = verdicts[m.rollout_id]
            excluded = value is None
            status = ("verifier_error" if v.status == "verifier_error" else "excluded") if excluded else "ok"
            reason = v.detail if excluded or v.status == "malformed" else ""
            if v.status == "malformed":
                reason = f"malformed: {reason}"
            rewards.append(Reward(
                rollout_id=m.rollout_id, task_id=task_id, domain=m.domain, group_index=m.group_index,
                raw_reward=0.0 if excluded else v.score, components=dict(v.components),
                normalized_reward=0.0 if excluded else value,
                weight=0.0 if excluded else float(cfg.domain_weights.get(m.domain, 1.0)),
                advantage=a, status=status, reason=reason,
            ))
    return rewards


def summarize(rewards: list[Reward]) -> dict[str, float]:
    metrics: dict[str, float] = {"rewards": float(len(rewards)), "excluded": float(sum(r.status == "excluded" for r in rewards)),
                                 "verifier_errors": float(sum(r.status == "verifier_error" for r in rewards)),
                                 "malformed": float(sum(r.reason.startswith("malformed:") for r in rewards))}
    by: dict[str, list[Reward]] = defaultdict(list)
    for r in rewards:
        by[r.domain].append(r)
    for domain, rs in sorted(by.items()):
        ok = [r for r in rs if r.status == "ok"]
        if ok:
            metrics[f"{domain}/mean"] = sum(r.raw_reward for r in ok) / len(ok)
            metrics[f"{domain}/pass_rate"] = sum(r.raw_reward >= 1.0 for r in ok) / len(ok)
        for name in sorted({k for r in ok for k in r.components}):
            metrics[f"{domain}/component/{name}"] = sum(r.components.get(name, 0.0) for r in ok) / len(ok)
    return metrics


def run(ctx: StageContext) -> dict[str, float]:
    tasks = {t.task_id: t for t in ctx.read_records("taskgen", "tasks", Task)}
    rollouts = ctx.read_joined("rollout", "rollouts", Rollout, "task_id", tasks, shard_only=True)
    executions = {e.rollout_id: e for e in ctx.read_records("sandbox", "executions", Execution,
                                                             shard_only=ctx.aligned("sandbox"))}
    facts: NormPrior = ctx.facts
    prior = from_json(facts.norm_prior)
    cfg = ctx.recipe.reward
    seed = ctx.seed("control")
    rewards = score(tasks, rollouts, executions, cfg, prior, seed)
    ctx.write_records("rewards", rewards, Reward)
    batch = batch_stats(rewards)
    ctx.write_json(STATS_OUTPUT, {"prior_iteration": facts.norm_prior_iteration, "prior": to_json(prior),
                                  "batch": to_json(batch), CONTROL_SEED: seed})
    metrics = summarize(rewards)
    if cfg.control == "shuffled":
        metrics["control_shuffled"] = 1.0
    for domain, s in sorted(merge_all(prior, batch).items()):
        metrics[f"{domain}/running_mean"] = s.mean
        metrics[f"{domain}/running_std"] = s.std
    return metrics
