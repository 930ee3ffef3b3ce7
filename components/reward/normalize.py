"""Per-domain reward normalisation with running statistics that persist across iterations.

Each reward shard of iteration k writes ``norm_stats.json`` beside its rewards (a
manifested output, so only finished shards count)::

    {"prior_iteration": j, "prior": {domain: stats}, "batch": {domain: stats}}

where ``prior`` is the cumulative statistics of every iteration up to j (the latest
earlier iteration with manifested reward output, normally k-1) and ``batch`` the raw
rewards this shard scored (infrastructure failures excluded). The cumulative statistics
*after* iteration k are ``prior`` merged with every shard's ``batch``; iteration k+1 reads
them back with :func:`cumulative_after`. Stats are (count, mean, M2) and merge exactly
(Chan et al.), so shard order and a restart between iterations do not change them.

With ``reward.normalize: domain_zscore`` a reward is normalised as
``(raw - mean_d) / (std_d + eps)`` with the domain's running mean and std *including*
the current shard's batch; with ``none`` the normalised reward is the raw one.

Not covered: decay or windowing (every past iteration weighs the same). Normalisation
alone does not change how much a domain weighs in the update (under group-std scaling a
per-domain affine map cancels out); that is ``reward.domain_weights``, applied after the
group advantages (``components/reward/stage.py``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from components.core.context import StageContext, read_manifests, read_output_json
from components.core.facts import Moments, StatsFile
from components.core.manifest import MANIFEST, InputRef, Shard, stage_prefix

STATS_OUTPUT = "norm_stats"


@dataclass(frozen=True)
class RunningStats:
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations from the mean

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def merge(self, other: RunningStats) -> RunningStats:
        if not other.count:
            return self
        if not self.count:
            return other
        n = self.count + other.count
        delta = other.mean - self.mean
        return RunningStats(n, self.mean + delta * other.count / n,
                            self.m2 + other.m2 + delta * delta * self.count * other.count / n)

    @classmethod
    def of(cls, values: list[float]) -> RunningStats:
        if not values:
            return cls()
        mean = sum(values) / len(values)
        return cls(len(values), mean, sum((v - mean) ** 2 for v in values))


Stats = dict[str, RunningStats]


def merge_all(*parts: Stats) -> Stats:
    out: Stats = {}
    for part in parts:
        for domain, s in part.items():
            out[domain] = out.get(domain, RunningStats()).merge(s)
    return out


def to_json(stats: Stats) -> dict[str, Moments]:
    return {d: Moments(**asdict(s)) for d, s in sorted(stats.items())}


def from_json(data: dict[str, Moments]) -> Stats:
    """Stats from their JSON, already validated as ``Moments`` (a manifest's facts, or a
    ``StatsFile`` read with ``read_output_json``)."""
    return {d: RunningStats(int(v["count"]), float(v["mean"]), float(v["m2"])) for d, v in data.items()}


def zscore(raw: float, stats: RunningStats, eps: float) -> float:
    return (raw - stats.mean) / (stats.std + eps)


def cumulative_after(ctx: StageContext, iteration: int) -> tuple[int, Stats]:
    """(j, cumulative stats after iteration j) for the latest j <= ``iteration`` whose reward
    stage ran; (0, {}) when there is none. Records what it read as inputs; a UserError when
    that iteration's reward stage is only partly manifested."""
    for j in range(iteration, 0, -1):
        if not ctx.store.listdir(stage_prefix(ctx.pipeline, j, "reward")):
            continue  # that iteration never reached the reward stage: look further back
        # A started but unfinished reward stage is an error (read_manifests says which shards
        # to run): skipping it would silently drop that iteration from the statistics.
        manifests = read_manifests(ctx.store, ctx.pipeline, j, "reward")
        prior: Stats | None = None
        batches: list[Stats] = []
        for m in manifests:
            rel = stage_prefix(ctx.pipeline, j, "reward", Shard.parse(m.shard) if m.shard else None)
            ctx.inputs[f"reward_stats[iter-{j}][{m.shard}]"] = InputRef(uri=ctx.store.url(f"{rel}/{MANIFEST}"),
                                                                         digest=m.content_digest)
            if STATS_OUTPUT not in m.outputs:
                continue  # written before normalisation existed: contributes nothing
            data = read_output_json(ctx.store, m, STATS_OUTPUT, StatsFile)
            prior = from_json(data["prior"]) if prior is None else prior
            batches.append(from_json(data.get("batch", {})))
        return j, merge_all(prior or {}, *batches)
    return 0, {}
