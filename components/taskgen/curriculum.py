"""Adaptive difficulty: per-domain difficulty pools sampled by their recent pass rate.

With ``taskgen.adaptive_difficulty`` each domain's share of an iteration's tasks is split
across its difficulty pools so that tasks stay near the edge of competence (the idea of
prime-rl's difficulty pools and ROLL's difficulty masks):

- **pools**: the difficulties a domain generates, discovered from a seeded sample of its
  ``make_task`` (never a hard-coded table, so a domain that gains a level gains a pool);
- **pass rate** per (domain, difficulty): the share of the latest scored iteration's
  samples with status ``ok`` and ``raw_reward >= 1.0``, blended across iterations as
  ``p <- memory * p_old + (1 - memory) * p_latest`` (``taskgen.difficulty_memory``); a pool
  with no scored sample in that iteration keeps its old estimate;
- **weight** of a pool: ``max(floor, 4 p (1 - p))`` (``taskgen.difficulty_floor``): 1 at a
  50% pass rate, the floor for a solved or hopeless pool so it is still visited; a pool
  with no estimate yet weighs 1 (so before any data all pools are equal, and a new pool
  is explored first). Weights are normalised within the domain;
- **draw**: the domain's n tasks are split across pools by weight (largest remainder) and
  drawn by rejection from ``make_task`` (distinct ids, none in the eval suite). A pool that
  yields nothing new in ``TRIES`` draws is exhausted and its remaining share moves to the
  others by weight. From a task file the pools are the difficulties of the domain's rows
  (sampled by the taskgen stage).

State persists as taskgen's ``curriculum.json`` (a manifested output)::

    {"after_iteration": j, "pass_rates": {domain: {difficulty: p}},
     "latest": {domain: {difficulty: [passes, samples]}}, "weights": {...}, "tasks": {...}}

where j is the latest earlier iteration whose reward stage ran (an iteration that never
reached it is skipped), ``latest`` what j scored, and ``pass_rates`` the estimate after j:
taskgen j's own ``pass_rates`` (the estimate before j) blended with ``latest``. Every
manifest read is recorded as an input, so new rewards re-run taskgen.

Not covered: pass rates from the bootstrap's held-out check (iteration 1 starts
uniform), and a chain through an iteration whose taskgen ran without adaptive difficulty
(the estimate restarts from that iteration's rewards).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from pydantic import Field
from typing_extensions import TypedDict

from components.core.context import StageContext, read_manifests, read_output_json, read_output_records
from components.core.errors import UserError
from components.core.manifest import MANIFEST, InputRef, Shard, stage_prefix
from components.core.records import Reward, Task
from components.domains.base import Domain, excluded

OUTPUT = "curriculum"
PASS = 1.0  # a raw reward at or above this is a pass
SAMPLE = 2000  # make_task draws that discover a domain's pools
TRIES = 2000  # draws without a new task of an open pool before that pool counts as exhausted

K = TypeVar("K")
Rates = dict[str, dict[int, float]]  # domain -> difficulty -> pass rate
Counts = dict[str, dict[int, tuple[int, int]]]  # domain -> difficulty -> (passes, samples)


def largest_remainder(weights: Mapping[K, float], total: int) -> dict[K, int]:
    """Split ``total`` by weight: floors first, the rest to the largest remainders (ties by key)."""
    norm = sum(weights.values()) or 1.0
    exact = {k: total * w / norm for k, w in weights.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(weights, key=lambda k: (counts[k] - exact[k], k))[: total - sum(counts.values())]:
        counts[k] += 1
    return counts


_POOLS: dict[type[Domain], tuple[int, ...]] = {}  # per domain class: the registry hands out new instances


def pools(domain: Domain) -> tuple[int, ...]:
    """The difficulties ``domain`` generates, seen in a fixed seeded sample of its tasks."""
    if type(domain) not in _POOLS:
        rng = random.Random(f"difficulty-pools:{domain.name}")
        _POOLS[type(domain)] = tuple(sorted({domain.make_task(rng, "train").difficulty for _ in range(SAMPLE)}))
    return _POOLS[type(domain)]


def pool_weight(p: float | None, floor: float) -> float:
    """``max(floor, 4 p (1 - p))``; 1 for a pool with no estimate yet."""
    return 1.0 if p is None else max(floor, 4.0 * p * (1.0 - p))


def pool_weights(difficulties: tuple[int, ...], rates: Mapping[int, float], floor: float) -> dict[int, float]:
    """Each pool's sampling weight, normalised to sum 1 within the domain."""
    raw = {d: pool_weight(rates.get(d), floor) for d in difficulties}
    norm = sum(raw.values())
    return {d: w / norm for d, w in raw.items()}


def blend(old: Rates, latest: Counts, memory: float) -> Rates:
    """The estimate after one more iteration: ``memory * old + (1 - memory) * latest`` per
    pool; the latest alone for a pool with no old estimate, the old one for a pool the
    iteration did not score."""
    out: Rates = {d: dict(v) for d, v in old.items()}
    for domain, by in latest.items():
        for difficulty, (passes, samples) in by.items():
            if not samples:
                continue
            p = passes / samples
            prev = out.setdefault(domain, {}).get(difficulty)
            out[domain][difficulty] = p if prev is None else memory * prev + (1.0 - memory) * p
    return out


def tally(rewards: list[Reward], tasks: list[Task]) -> Counts:
    """(passes, samples) per (domain, difficulty): rewards with status ``ok`` joined with
    their task's difficulty."""
    difficulty = {t.task_id: t.difficulty for t in tasks}
    acc: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in rewards:
        if r.status != "ok" or r.task_id not in difficulty:
            continue
        cell = acc[r.domain][difficulty[r.task_id]]
        cell[0] += int(r.raw_reward >= PASS)
        cell[1] += 1
    return {d: {k: (v[0], v[1]) for k, v in sorted(by.items())} for d, by in sorted(acc.items())}


def draw(domain: Domain, rng: random.Random, n: int, exclude: set[str], weights: Mapping[int, float]) -> list[Task]:
    """``n`` distinct train tasks of ``domain``, split across its pools by ``weights``, drawn
    by rejection from ``make_task``; an exhausted pool's remaining share moves to the others."""
    seen = set(exclude)
    need = largest_remainder(dict(weights), n)
    open_pools = {d for d, w in weights.items() if w > 0}
    tasks: list[Task] = []
    idle = 0
    while len(tasks) < n:
        task = domain.checked_task(rng, "train")
        if need.get(task.difficulty, 0) > 0 and not excluded(task, seen):
            seen.add(task.task_id)
            tasks.append(task)
            need[task.difficulty] -= 1
            idle = 0
            continue
        idle += 1
        if idle < TRIES:
            continue
        # Every pool still owed tasks produced nothing new in TRIES draws: it has run dry.
        open_pools -= {d for d, k in need.items() if k > 0}
        if not open_pools:
            raise UserError("taskgen.tasks_per_iteration", n, f"domain {domain.name} gave only {len(tasks)} distinct "
                            f"train tasks outside the eval suite", f"ask for fewer tasks of {domain.name} (lower "
                            "tasks_per_iteration, oversample or its domain weight)")
        need = largest_remainder({d: weights[d] for d in open_pools}, n - len(tasks))
        idle = 0
    return tasks


@dataclass(frozen=True)
class Prior:
    """What the latest scored iteration says: its number (0: none), what it scored per pool,
    and the blended estimate after it."""

    after_iteration: int = 0
    latest: Counts = field(default_factory=dict)
    pass_rates: Rates = field(default_factory=dict)


class _StateFile(TypedDict):
    """The part of ``curriculum.json`` read back: pass rates per domain and difficulty."""

    pass_rates: dict[str, dict[int, Annotated[float, Field(ge=0, le=1)]]]


def prior(ctx: StageContext, iteration: int, memory: float) -> Prior:
    """The estimate after the latest j <= ``iteration`` whose reward stage ran (``Prior()``
    when there is none), recording the manifests it read as inputs; a UserError when that
    iteration's reward stage is only partly manifested."""
    for j in range(iteration, 0, -1):
        if not ctx.store.listdir(stage_prefix(ctx.pipeline, j, "reward")):
            continue  # that iteration never reached the reward stage: look further back
        rewards: list[Reward] = []
        for m in read_manifests(ctx.store, ctx.pipeline, j, "reward"):
            rel = stage_prefix(ctx.pipeline, j, "reward", Shard.parse(m.shard) if m.shard else None)
            ctx.inputs[f"curriculum_rewards[iter-{j}][{m.shard}]"] = InputRef(uri=ctx.store.url(f"{rel}/{MANIFEST}"),
                                                                              digest=m.content_digest)
            rewards.extend(read_output_records(ctx.store, m, "rewards", Reward))
        taskgen = read_manifests(ctx.store, ctx.pipeline, j, "taskgen")[0]
        rel = stage_prefix(ctx.pipeline, j, "taskgen")
        ctx.inputs[f"curriculum_tasks[iter-{j}]"] = InputRef(uri=ctx.store.url(f"{rel}/{MANIFEST}"),
                                                            digest=taskgen.content_digest)
        old: Rates = {}
        if OUTPUT in taskgen.outputs:  # absent when iteration j ran without adaptive difficulty
            old = read_output_json(ctx.store, taskgen, OUTPUT, _StateFile)["pass_rates"]
        latest = tally(rewards, read_output_records(ctx.store, taskgen, "tasks", Task))
        return Prior(after_iteration=j, latest=latest, pass_rates=blend(old, latest, memory))
    return Prior()


def to_json(p: Prior, weights: Mapping[str, Mapping[int, float]], tasks: Mapping[str, Mapping[int, int]]) -> dict[str, Any]:
    """The persisted state (string keys, sorted)."""
    def keyed(by: Mapping[str, Mapping[int, Any]]) -> dict[str, dict[str, Any]]:
        return {d: {str(k): (list(v) if isinstance(v, tuple) else v) for k, v in sorted(inner.items())}
                for d, inner in sorted(by.items())}

    return {"after_iteration": p.after_iteration, "pass_rates": keyed(p.pass_rates), "latest": keyed(p.latest),
            "weights": keyed(weights), "tasks": keyed(tasks)}


@dataclass
class Weigher:
    """Pool weights from an estimate (``weigh(domain, difficulties)``), remembering each
    domain's for the persisted state."""

    prior: Prior
    floor: float
    chosen: dict[str, dict[int, float]] = field(default_factory=dict)

    def __call__(self, domain: str, difficulties: tuple[int, ...]) -> dict[int, float]:
        self.chosen[domain] = pool_weights(difficulties, self.prior.pass_rates.get(domain, {}), self.floor)
        return self.chosen[domain]

    def state(self, tasks: Mapping[str, Mapping[int, int]]) -> dict[str, Any]:
        """``curriculum.json``: the estimate, the weights chosen and the tasks drawn per pool."""
        return to_json(self.prior, self.chosen, tasks)
