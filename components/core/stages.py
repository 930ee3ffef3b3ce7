"""The stage registry: the one list the DAG, the Kubeflow pipeline and the images derive from.

A ``StageSpec`` says where a stage's code lives (``module``, with ``SECTIONS``,
``inputs`` and ``run``), which stages must finish before it (``upstream``), whether it
fans out over shards and how wide (``fanout``: the recipe field holding the shard
count), which orchestrator pool caps it, its default time limit, and what one task
asks of a cluster in the container modes (``gpus``, ``cpu``, ``memory``, ``scratch``,
and ``sandboxed``: it runs policy-written code, so its container gets the sandbox's
security settings). The DAG builds
one task per spec, mapped over ``shard_list(recipe, id)`` for sharded stages; the
Kubeflow pipeline and ``containers/build.sh`` are checked against the same list by
tests.

Adding a stage is one module plus one ``StageSpec`` here (or, from another package, an
entry point in the ``posttrain.stages`` group that names a ``StageSpec``, whose
``before`` splices it in front of existing stages; a ``before`` stage that must itself
finish before the plug-in's upstream would be a cycle, and is refused). A plug-in that
cannot be loaded, or is refused, is a ``UserError`` naming its entry point, which every
``posttrain`` command (``--help`` too) prints as one line. Time limits come from here unless
the recipe's ``timeouts`` overrides them (``resources`` likewise the cluster requests).

Not covered: conditional stages (every registered stage runs every iteration) and
stages that fan out over something other than shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache
from importlib.metadata import entry_points

from components.core.errors import UserError, exc_line, value_text


@dataclass(frozen=True)
class StageSpec:
    id: str
    module: str  # "package.module" with SECTIONS, inputs(ctx) and run(ctx)
    upstream: tuple[str, ...]  # stages that must finish first
    fanout: str = ""  # recipe field with this stage's shard count ("rollout.shards"); "" = one task
    pool: str = ""  # orchestrator pool ("" = the default pool)
    timeout_s: int = 3600  # default time limit of one task of this stage
    before: tuple[str, ...] = field(default=())  # plug-ins: stages that must now wait for this one
    gpus: int = 0  # accelerators one task asks for on a cluster (container modes); 0 = CPU only
    sandboxed: bool = False  # runs policy-written code through the sandbox: its container needs the sandbox's security settings
    cpu: str = "2"  # CPU request of one task on a cluster (Kubernetes quantity)
    memory: str = "8Gi"  # memory request and limit of one task on a cluster
    scratch: str = "4Gi"  # local disk one task may write (its /tmp and home; the container's root is read-only)

    @property
    def sharded(self) -> bool:
        return bool(self.fanout)


SANDBOX_POOL = "posttrain_sandbox"

# ``scratch`` is sized for what a task writes locally, all under /tmp and the home folder
# (the stages' own files go to the store): the policy copied in and out (components/core/policy.py's
# and models.py's temporary folders), torch's and Triton's compile caches, Hugging Face
# downloads, vLLM's caches and folders (rollout), torchrun's work folders and the trainer's
# checkpoints before upload, the sandbox's per-job folders. GPU nodes hold one such pod per
# GPU on a 200 GB disk (infra/terraform/node_pools.tf), so the sharded GPU stage stays smaller.
BUILTIN: tuple[StageSpec, ...] = (
    StageSpec("bootstrap", "components.bootstrap.stage", (), timeout_s=4 * 3600, sandboxed=True, gpus=1, memory="16Gi",
              scratch="50Gi"),  # the base model downloaded, converted and checkpointed locally
    StageSpec("taskgen", "components.taskgen.stage", ("bootstrap",), timeout_s=1800),
    StageSpec("rollout", "components.rollout.stage", ("taskgen",), fanout="rollout.shards", timeout_s=4 * 3600,
              gpus=1, memory="16Gi", sandboxed=True, scratch="30Gi"),  # multi-turn episodes run commands in sandbox sessions
    StageSpec("sandbox", "components.sandbox.stage", ("rollout",), fanout="sandbox.shards", pool=SANDBOX_POOL,
              timeout_s=2 * 3600, sandboxed=True, cpu="4", scratch="8Gi"),
    StageSpec("reward", "components.reward.stage", ("sandbox",), fanout="rollout.shards", timeout_s=1800),
    StageSpec("validation", "components.validation.stage", ("reward",), timeout_s=1800),
    StageSpec("trainer", "components.trainer.stage", ("validation",), timeout_s=6 * 3600, gpus=1, memory="32Gi",
              scratch="50Gi"),  # checkpoints (weights and optimizer state) and torchrun work folders under /tmp
    StageSpec("evaluation", "components.evaluation.stage", ("trainer",), timeout_s=4 * 3600, sandboxed=True, gpus=1,
              memory="16Gi", scratch="30Gi"),
)


def _splice(specs: list[StageSpec], extra: StageSpec) -> list[StageSpec]:
    """Insert a plug-in stage: after its upstream, and in front of its ``before`` stages."""
    known = {s.id for s in specs}
    if extra.id in known:
        raise UserError("entry point posttrain.stages", extra.id, "stage id already registered",
                        "give the plug-in stage another id")
    for name in (*extra.upstream, *extra.before):
        if name not in known:
            raise UserError(f"stage {extra.id}", name, "names an unknown stage", f"use one of {sorted(known)}")
    upstream_of = {s.id: s.upstream for s in specs}
    for first in extra.upstream:  # the plug-in's upstream stages and theirs, transitively: each finishes before it
        ahead, todo = {first}, [first]
        while todo:
            for u in upstream_of[todo.pop()]:
                if u not in ahead:
                    ahead.add(u)
                    todo.append(u)
        for b in extra.before:
            if b in ahead:
                where = "its upstream too" if b == first else f"upstream of its upstream {first!r}"
                raise UserError("entry point posttrain.stages", extra.id,
                                f"its 'before' stage {b!r} is {where}: each would wait for the other (a cycle)",
                                f"name in 'before' only stages that run after {first!r}, or drop {b!r} from it")
    out = []
    for s in specs:
        if s.id in extra.before:  # s now waits for the plug-in instead of the plug-in's own upstream
            s = replace(s, upstream=tuple(u for u in s.upstream if u not in extra.upstream) + (extra.id,))
        out.append(s)
    at = max(i for i, s in enumerate(out) if s.id in extra.upstream) + 1 if extra.upstream else 0
    return out[:at] + [extra] + out[at:]


@cache
def registered() -> tuple[StageSpec, ...]:
    """Every stage in run order: the built-ins plus plug-ins from ``posttrain.stages``."""
    specs = list(BUILTIN)
    for ep in sorted(entry_points(group="posttrain.stages"), key=lambda e: e.name):
        try:
            extra = ep.load()
        except Exception as exc:  # noqa: BLE001 - whatever a plug-in's import raises is its package's to fix
            package = f"the package {ep.dist.name!r}" if ep.dist is not None else f"the package that provides {ep.value}"
            raise UserError("entry point posttrain.stages", ep.name, f"{ep.value} cannot be loaded "
                            f"({value_text(exc_line(exc))})", f"install or fix {package}, or remove it") from None
        if not isinstance(extra, StageSpec) or extra.id != ep.name:
            raise UserError("entry point posttrain.stages", ep.name, f"{ep.value} is not a StageSpec with id {ep.name!r}",
                            "point the entry point at a StageSpec whose id is the entry point's name")
        specs = _splice(specs, extra)
    return tuple(specs)


def stage_ids() -> tuple[str, ...]:
    return tuple(s.id for s in registered())


def spec(stage: str) -> StageSpec:
    for s in registered():
        if s.id == stage:
            return s
    raise UserError("stage", stage, "unknown stage", f"use one of {list(stage_ids())}")


def shard_count(recipe, stage: str) -> int:
    """How many shards ``stage`` runs in for ``recipe`` (1 for an unsharded stage)."""
    fanout = spec(stage).fanout
    if not fanout:
        return 1
    section, name = fanout.split(".")
    count = getattr(getattr(recipe, section), name)
    return count or recipe.rollout.shards  # 0: as wide as rollout


def shard_list(recipe, stage: str) -> list[str]:
    """``["0/n", ..., "n-1/n"]`` for a sharded stage, ``[""]`` for one task."""
    n = shard_count(recipe, stage)
    return [f"{i}/{n}" for i in range(n)] if spec(stage).sharded else [""]


@dataclass(frozen=True)
class Resources:
    cpu: str
    memory: str
    gpus: int
    scratch: str = StageSpec.scratch  # local disk (Kubernetes quantity) for /tmp and the home folder


def resources(stage: str, recipe=None) -> Resources:
    """What one task of ``stage`` asks of a cluster: the registry's, with the recipe's
    ``resources.<stage>`` fields over it."""
    s = spec(stage)
    override = (getattr(recipe, "resources", None) or {}).get(stage)
    pick = lambda name, default: default if override is None or getattr(override, name) is None else getattr(override, name)
    return Resources(cpu=pick("cpu", s.cpu), memory=pick("memory", s.memory), gpus=pick("gpus", s.gpus),
                     scratch=pick("scratch", s.scratch))
