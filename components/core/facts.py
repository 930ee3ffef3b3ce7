"""Typed facts between stages: what one stage's manifest tells the stages after it.

Each stage that hands on something other than files (which policy the iteration starts
from, which registry version a checkpoint became, whether it was promoted) sets
``ctx.facts`` to one of the frozen dataclasses below; the runner stores it as the
manifest's ``info`` and a reader gets it back typed with ``Manifest.facts(cls)`` or
``StageContext.facts_of(stage, cls)``. A missing or mistyped field is an error at the
read, not a ``KeyError`` three stages later. Facts are part of a manifest's content
digest, so keep them small (URIs, versions, a few numbers): data goes in files.

Not covered: evolving a facts class while old manifests exist. A renamed field makes
old manifests unreadable (the error names the stage to re-run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from typing import Annotated, Any, NotRequired, TypeVar

from pydantic import Field, FiniteFloat, NonNegativeInt, TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic validates typing.TypedDict only from Python 3.12

from components.core.errors import UserError

F = TypeVar("F")


@dataclass(frozen=True)
class Slice:
    """One slice of the layered eval report (domain x difficulty x context bucket x trap)."""

    name: str  # e.g. "math/d3/<=32" or "code/d1/<=128/trap"
    domain: str
    difficulty: int
    context_bucket: str
    trap: bool
    tasks: int
    passed: int
    pass_rate: float
    mean_score: float

    def text(self) -> str:
        return f"{self.name} {self.pass_rate:.2f} (n={self.tasks})"


@dataclass(frozen=True)
class StartingPolicy:
    """taskgen: the policy the whole iteration samples from and trains, fixed once."""

    policy_version: str
    policy_uri: str
    parent_run_id: str = ""  # the iteration's MLflow parent run
    # The baseline evaluation judges this iteration's candidate against, fixed before
    # anything of the iteration can move an alias: the champion at iteration start (else
    # the starting policy's version) and its pass rates. "" in manifests written before
    # this field existed (evaluation then falls back to a tag on the candidate's version).
    baseline_version: str = ""
    baseline_pass_rates: dict[str, float] = field(default_factory=dict)
    # The ``rollout.policy`` it was resolved from: a re-run of taskgen keeps this start
    # unless that setting changed. "" in manifests written before this field existed.
    policy_spec: str = ""


class Moments(TypedDict):
    """One domain's running reward statistics as JSON (``reward.normalize.RunningStats``)."""

    count: NonNegativeInt
    mean: FiniteFloat
    m2: Annotated[FiniteFloat, Field(ge=0)]  # sum of squared deviations from the mean


class StatsFile(TypedDict):
    """A reward shard's ``norm_stats.json`` as read back (``components/reward/normalize.py``)."""

    prior_iteration: NotRequired[int]
    prior: dict[str, Moments]
    batch: NotRequired[dict[str, Moments]]  # absent in files written before per-shard batches


@dataclass(frozen=True)
class NormPrior:
    """reward: the running per-domain statistics this shard normalised with."""

    norm_prior_iteration: int  # the last iteration those statistics include (0: none)
    norm_prior: dict[str, Moments]  # domain -> RunningStats as JSON


@dataclass(frozen=True)
class Checkpoint:
    """trainer: the new checkpoint and its registry version."""

    checkpoint_uri: str
    version: str
    parent_version: str


@dataclass(frozen=True)
class Scored:
    """bootstrap: the base policy, its registry version and its eval-suite scores."""

    checkpoint_uri: str
    version: str
    pass_rates: dict[str, float]
    weakest_slice: Slice | None
    # The settings its eval results were scored under (``evalsuite.suite.eval_settings``);
    # empty in manifests written before they were recorded (unknown: promotion re-scores).
    eval_settings: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """evaluation: the candidate's scores and the promotion decision."""

    version: str
    pass_rates: dict[str, float]
    weakest_slice: Slice | None
    promoted: bool
    reason: str
    baseline: dict[str, float]
    baseline_version: str
    # The rule that decided ("statistical" or "strict", see evaluation.promotion); "" in
    # manifests written before the rule was recorded (the strict rule decided those).
    rule: str = ""
    # The settings the candidate's eval results were scored under, as on ``Scored``.
    eval_settings: dict[str, str] = field(default_factory=dict)
    # Why the baseline was re-scored in this stage (its ``baseline_eval_results``): the
    # settings its own scoring differs in ("evaluation.max_new_tokens 32->256"); "" when not.
    baseline_rescored: str = ""


@cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


def to_json(facts: Any) -> dict[str, Any]:
    return _adapter(type(facts)).dump_python(facts, mode="json")


def from_json(cls: type[F], data: dict[str, Any], stage: str, where: str) -> F:
    """``data`` (a manifest's info) as ``cls``; a UserError naming the manifest and the
    stage to re-run when it does not fit (an older layout, or a hand-edited manifest).
    Validated strictly as the JSON it was written as: ``"yes"`` is no ``promoted`` and
    ``"3"`` no count (pydantic's lax mode would take both)."""
    try:
        return _adapter(cls).validate_json(json.dumps(data), strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UserError(f"manifest {where}", ".".join(map(str, first["loc"])) or "info",
                        f"its facts are not a {cls.__name__} ({first['msg']})",
                        f"re-run stage {stage} (delete its _MANIFEST.json to force it)") from None
