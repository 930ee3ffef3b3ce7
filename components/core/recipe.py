"""Recipes: one config model per stage, a YAML file holding only overrides.

``load_recipe(path)`` reads YAML, merges it over the defaults below and validates it.
Any mistake (unknown key, wrong type, out-of-range value, unknown domain) becomes one
``UserError`` naming the dotted field, the value and the fix.

Deployment settings (bucket, tracking URI, image tags) never live here: they come from
the environment (``POSTTRAIN_RUN_ROOT``, ``MLFLOW_TRACKING_URI``, AWS variables).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from components.core.errors import InfraError, UserError, outage
from components.core.plugins import BACKENDS, DOMAINS, ENGINES
from components.core.stages import stage_ids


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """The demo policy: a Llama-architecture model built from this config."""

    source: str = Field("scratch", description="'scratch' builds a new model; otherwise a HF model folder, store URI, or models:/<name>@<alias>")
    hidden_size: int = Field(256, ge=8, description="width of the residual stream")
    num_layers: int = Field(4, ge=1, description="transformer blocks")
    num_heads: int = Field(4, ge=1, description="attention heads")
    intermediate_size: int = Field(768, ge=8, description="MLP width")
    max_positions: int = Field(256, ge=32, description="longest prompt + completion in tokens")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        return self


class BootstrapConfig(_Section):
    """SFT warm start: stop inside the target band so RL has room to improve."""

    max_steps: int = Field(3000, ge=1, description="upper bound on SFT optimizer steps")
    batch_size: int = Field(64, ge=1, description="SFT examples per step")
    batch_tokens: int = Field(0, ge=0, description="if > 0, cap each step at this many padded tokens (fewer "
                                                   "examples on steps of a long-prompt domain); 0 = no cap")
    learning_rate: float = Field(1e-3, gt=0, description="AdamW learning rate")
    eval_every: int = Field(50, ge=1, description="steps between held-out checks")
    target_low: float = Field(0.2, ge=0, le=1, description="stop once mean eval pass rate reaches this")
    target_high: float = Field(0.5, ge=0, le=1, description="upper edge of the target band")
    eval_tasks_per_domain: int = Field(64, ge=1, description="held-out SFT check size (separate from the eval suite)")
    balance_domains: bool = Field(False, description="draw each step's domain by how far its check pass rate is below target_high (else round-robin)")


class CurriculumStep(_Section):
    """Domain weights used for every iteration up to and including ``until``."""

    until: int = Field(..., ge=1, description="last iteration these weights apply to")
    weights: dict[str, float] = Field(..., description="sampling weight per domain (unlisted domains: 0)")


class TaskgenConfig(_Section):
    tasks_per_iteration: int = Field(128, ge=1, description="train tasks sampled per iteration")
    domain_weights: dict[str, float] = Field(default_factory=dict, description="sampling weight per domain (default equal)")
    curriculum: list[CurriculumStep] = Field(
        default_factory=list, description="weights by iteration: the first step whose 'until' >= k applies to "
                                          "iteration k; after the last step, domain_weights")
    task_file: str = Field("", description="Parquet/JSONL/JSON task file (path or URI) to sample from instead of generating")

    def weights_for(self, iteration: int, domains: list[str]) -> dict[str, float]:
        """Each domain's weight at ``iteration``: the curriculum step that covers it (unlisted
        domains 0), else ``domain_weights`` (unlisted domains 1)."""
        for step in self.curriculum:
            if iteration <= step.until:
                return {d: float(step.weights.get(d, 0.0)) for d in domains}
        return {d: float(self.domain_weights.get(d, 1.0)) for d in domains}


class RolloutConfig(_Section):
    engine: str = Field("hf", description="generation engine, by registry name")
    policy: str = Field("champion", description="'champion', 'candidate', or a checkpoint URI to sample from")
    group_size: int = Field(8, ge=2, description="samples per task (GRPO needs at least 2)")
    shards: int = Field(2, ge=1, description="fan-out of rollout, sandbox and reward")
    max_new_tokens: int = Field(24, ge=1, description="completion length cap")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    batch_size: int = Field(256, ge=1, description="sequences per generation batch")


class SandboxConfig(_Section):
    backend: str = Field("bwrap", description="executor, by registry name: 'bwrap' (hardened) or 'subprocess' (weak)")
    mode: Literal["strict", "warm"] = Field("strict", description="strict: a fresh sandbox per job; warm: pre-started sandboxed workers fork per job")
    allow_weak_isolation: bool = Field(False, description="run untrusted code even when the host cannot give full isolation (or with backend 'subprocess')")
    timeout_s: float = Field(5.0, gt=0, description="wall-clock limit per job")
    concurrency: int = Field(2, ge=1, description="jobs at once; mirrored by the Airflow pool")
    shards: int = Field(0, ge=0, description="fan-out of the sandbox stage; 0 = as wide as rollout.shards (re-sharded "
                                             "through the manifests when it differs)")
    memory_mb: int = Field(512, ge=16, description="address-space limit per job")
    output_cap_bytes: int = Field(8192, ge=256, description="stdout/stderr kept per job")
    python: str = Field("", description="interpreter for jobs; empty means /usr/bin/python3, else this one")


class RewardConfig(_Section):
    normalize: Literal["none", "domain_zscore"] = Field("none", description="per-domain normalisation")
    advantage_eps: float = Field(1e-6, gt=0, description="added to the group std")
    scale_by_std: bool = Field(True, description="divide advantages by the group std (GRPO) or only centre them")


class ValidationConfig(_Section):
    min_ok_fraction: float = Field(0.5, ge=0, le=1, description="least share of rewards not excluded as infra errors")


class TrainerConfig(_Section):
    algorithm: Literal["grpo"] = Field("grpo", description="policy-gradient objective")
    learning_rate: float = Field(1e-4, gt=0, description="Adam learning rate")
    prompts_per_step: int = Field(16, ge=1, description="tasks (groups) per optimizer step")
    epochs: int = Field(1, ge=1, description="passes over the iteration's batch")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the iteration's starting policy")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping")
    micro_batch_size: int = Field(64, ge=1, description="sequences per forward pass (gradient accumulation)")
    micro_batch_tokens: int = Field(0, ge=0, description="padded tokens per forward pass (0: only micro_batch_size caps it)")
    loss_aggregation: Literal["token_mean", "sequence_mean", "seq_mean_token_sum"] = Field(
        "token_mean", description="token_mean: over all tokens of a step; sequence_mean: per-sequence token mean, "
                                  "then mean over sequences; seq_mean_token_sum: per-sequence token sum, then mean")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="learning-rate decay after warmup")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup from 0 (counted across iterations)")
    decay_steps: int = Field(1000, ge=1, description="steps (across iterations) over which linear/cosine decay to min_lr_ratio")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="floor of the decayed learning rate, as a share of learning_rate")
    carry_optimizer_state: bool = Field(True, description="load Adam moments and schedule position from the starting checkpoint")


class EvaluationConfig(_Section):
    tasks_per_domain: int = Field(100, ge=1, description="fixed held-out tasks per domain")
    regression_tolerance: float = Field(0.02, ge=0, le=1, description="largest per-domain drop that still promotes")
    max_new_tokens: int = Field(24, ge=1, description="completion cap for greedy eval")


class StageResources(_Section):
    """A stage's cluster request (``resources: {trainer: {gpus: 2, memory: 64Gi}}``); unset fields keep the registry's."""

    cpu: str | None = Field(default=None, pattern=r"^[0-9]+(\.[0-9]+)?m?$", description="CPU request, e.g. '4' or '500m'")
    memory: str | None = Field(default=None, pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)?$", description="memory request and limit, e.g. '16Gi'")
    gpus: int | None = Field(default=None, ge=0, le=64, description="accelerators per task (0: CPU only)")


class Recipe(_Section):
    """A whole post-training recipe. Only ``pipeline`` is required."""

    pipeline: str = Field(..., pattern=r"^[a-z][a-z0-9-]{0,62}$", description="pipeline name: experiment, registry and storage prefix")
    seed: int = Field(0, ge=0, description="base seed; all others derive from it")
    domains: list[str] = Field(default_factory=lambda: ["arithmetic", "code"], min_length=1)
    model: ModelConfig = ModelConfig()
    bootstrap: BootstrapConfig = BootstrapConfig()
    taskgen: TaskgenConfig = TaskgenConfig()
    rollout: RolloutConfig = RolloutConfig()
    sandbox: SandboxConfig = SandboxConfig()
    reward: RewardConfig = RewardConfig()
    validation: ValidationConfig = ValidationConfig()
    trainer: TrainerConfig = TrainerConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    timeouts: dict[str, int] = Field(default_factory=dict, description="time limit in seconds per stage task, overriding "
                                                                      "the stage registry's (components/core/stages.py)")
    resources: dict[str, StageResources] = Field(default_factory=dict, description="what one task of a stage asks of a "
                                                 "cluster in the container modes, overriding the stage registry's")

    def section(self, sections: Iterable[str]) -> dict[str, Any]:
        """The resolved config a stage depends on: the common fields plus ``sections``
        (the stage module's ``SECTIONS``). What a stage's cache key covers."""
        common: dict[str, Any] = {"pipeline": self.pipeline, "seed": self.seed, "domains": list(self.domains)}
        for name in sections:
            common[name] = getattr(self, name).model_dump()
        return common

    def digest(self, sections: Iterable[str]) -> str:
        blob = json.dumps(self.section(sections), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


COMMON_FIELDS: tuple[str, ...] = ("pipeline", "seed", "domains", "timeouts", "resources")
"""Recipe fields every stage may read (``timeouts`` and ``resources`` are the
orchestrator's, in no cache key); every other field is a section a stage declares."""


def _fix_for(loc: str, msg: str) -> str:
    if "Extra inputs" in msg:
        return f"remove '{loc}' or correct its spelling (see recipes/demo.yaml for the known keys)"
    if "required" in msg.lower():
        return f"add '{loc}' to the recipe"
    return f"set '{loc}' to a valid value ({msg.lower().replace('greater than or equal to', 'at least').replace('less than or equal to', 'at most')})"


def parse_recipe(data: Any, source: str = "<recipe>") -> Recipe:
    if not isinstance(data, dict):
        raise UserError("recipe", source, "the recipe must be a YAML mapping", "write key: value pairs, e.g. 'pipeline: demo'")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "recipe"
        value = err.get("input", "")
        raise UserError(f"{source}: {loc}", value if not isinstance(value, dict) else "{...}", err["msg"], _fix_for(loc, err["msg"])) from None
    for i, name in enumerate(recipe.domains):
        DOMAINS.check(name, f"{source}: domains[{i}]")
    ENGINES.check(recipe.rollout.engine, f"{source}: rollout.engine")
    BACKENDS.check(recipe.sandbox.backend, f"{source}: sandbox.backend")
    for name in recipe.taskgen.domain_weights:
        if name not in recipe.domains:
            raise UserError(f"{source}: taskgen.domain_weights", name, "weight for a domain not in 'domains'", "add it to 'domains' or drop the weight")
    for i, step in enumerate(recipe.taskgen.curriculum):
        where = f"{source}: taskgen.curriculum[{i}]"
        if i and step.until <= recipe.taskgen.curriculum[i - 1].until:
            raise UserError(f"{where}.until", step.until, "not after the previous step's 'until'", "list steps in increasing 'until' order")
        for name, w in step.weights.items():
            if name not in recipe.domains:
                raise UserError(f"{where}.weights", name, "weight for a domain not in 'domains'", "add it to 'domains' or drop the weight")
            if w < 0:
                raise UserError(f"{where}.weights.{name}", w, "negative weight", "use a weight >= 0")
        if not any(w > 0 for w in step.weights.values()):
            raise UserError(f"{where}.weights", step.weights or "{}", "no domain has a positive weight", "give at least one domain a weight > 0")
    for name, seconds in recipe.timeouts.items():
        if name not in stage_ids():
            raise UserError(f"{source}: timeouts", name, "not a stage", f"use one of {list(stage_ids())}")
        if seconds < 1:
            raise UserError(f"{source}: timeouts.{name}", seconds, "not a positive number of seconds", "use e.g. 3600")
    for name in recipe.resources:
        if name not in stage_ids():
            raise UserError(f"{source}: resources", name, "not a stage", f"use one of {list(stage_ids())}")
    if recipe.bootstrap.target_low > recipe.bootstrap.target_high:
        raise UserError(f"{source}: bootstrap.target_low", recipe.bootstrap.target_low, "above bootstrap.target_high", "make target_low <= target_high")
    return recipe


RECIPES_DIR = "recipes"  # under the run root: recipes published for stages that run elsewhere (containers, pods)


def is_uri(path: str | Path) -> bool:
    return "://" in str(path)


def _read_text(path: str | Path) -> str:
    """The recipe's text from a local file or a store URI (``s3://``, ``file://``)."""
    if not is_uri(path):
        if not Path(path).is_file():
            raise UserError("--recipe", str(path), "no such recipe file", "pass a YAML file such as recipes/demo.yaml")
        return Path(path).read_text()
    from components.core.storage import Store

    folder, name = str(path).rsplit("/", 1)
    store = Store(folder, "--recipe")
    try:
        if not store.exists(name):
            raise UserError("--recipe", str(path), "no such recipe in the store", "publish it first (the DAG's plan task does)")
        return store.read_bytes(name).decode()
    except UserError:
        raise
    except Exception as exc:
        if (down := outage(exc)) is not None:
            raise InfraError("--recipe", str(path), down) from None
        raise UserError("--recipe", str(path), f"cannot read it ({type(exc).__name__})", "check the URI and the credentials") from None


def publish_recipe(path: str | Path, run_root: str) -> str:
    """Copy a local recipe into the store (``<run_root>/recipes/<sha256>.yaml``, content-
    addressed, so publishing the same text twice writes once) and return its URI: what a
    stage in a container or pod reads, since the scheduler's files are not there. A URI
    is returned unchanged."""
    if is_uri(path):
        return str(path)
    from components.core.storage import Store

    text = _read_text(path)
    store = Store(run_root, "run_root")
    name = f"{RECIPES_DIR}/{hashlib.sha256(text.encode()).hexdigest()[:32]}.yaml"
    store.create(name, text.encode())
    return store.url(name)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file or a recipe URI; every failure is one UserError
    (an unreachable store is an InfraError)."""
    text = _read_text(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise UserError("--recipe", str(path), f"not valid YAML at {where}", "fix the YAML syntax there") from None
    return parse_recipe(data, source=str(path))
