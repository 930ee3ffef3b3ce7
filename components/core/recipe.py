"""Recipes: one config model per stage, a YAML file holding only overrides.

``load_recipe(path)`` reads YAML, merges it over the defaults below and validates it.
Any mistake (unknown key, wrong type, out-of-range value, unknown domain) becomes one
``UserError`` naming the dotted field, the value and the fix.

Validation is total: any file (not UTF-8, UTF-16, binary, nested too deep, a YAML alias
bomb) gives one ``UserError``. The loader (``BoundedLoader``) caps nesting at
``MAX_YAML_DEPTH`` and the expanded size of the document, aliases included, at
``MAX_YAML_NODES``; values are shortened with ``reprlib`` before they enter a message.
Sizes and fan-outs have upper bounds (``sandbox.concurrency`` at most the sandbox's uid
pool, ``SANDBOX_UID_SLOTS``), weights must be finite and >= 0 and add up to at most
``MAX_WEIGHT_SUM`` (loss weights, ``reward.domain_weights``, each at most
``MAX_REWARD_WEIGHT``, some domain's above 0), dynamic sampling's
``trainer.prompts_per_step`` at most ``taskgen.tasks_per_iteration``, an integer field takes no text (``shards: "2"``), ``model.source`` and
``rollout.policy`` must be able to name a checkpoint (not blank, no NUL, a valid store URI
or path: ``storage.normalize_uri``'s rules), and registered names (``domains``,
``rollout.engine``, ``sandbox.backend``) are checked at load. A scratch model has at most
``MAX_SCRATCH_PARAMETERS`` parameters all told, and the bwrap backend's ``sandbox.python``
is an absolute path under /usr (``sandbox_python_problem``). An unquoted number that YAML
1.1 reads otherwise than it looks (``010`` octal 8, ``0x10``, ``0b10``, ``1:00:00`` base 60,
``0o10`` text) or cannot convert (over 4300 digits) is refused by the loader, naming its
key and line. An unknown key's fix names the closest known key, or the section's keys.

Deployment settings (bucket, tracking URI, image tags) never live here: they come from
the environment (``POSTTRAIN_RUN_ROOT``, ``MLFLOW_TRACKING_URI``, AWS variables).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
import reprlib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from components.core.errors import InfraError, UserError, one_line, outage
from components.core.plugins import BACKENDS, DOMAINS, ENGINES
from components.core.stages import stage_ids

MAX_RECIPE_BYTES = 1 << 20
MAX_YAML_DEPTH = 32
MAX_YAML_NODES = 100_000
"""Largest recipe document in YAML nodes, counting every alias as the nodes it expands to."""
SANDBOX_UID_SLOTS = 4096
"""The sandbox's uid pool (``components.sandbox.limits.UID_SLOTS``; core imports no other
package): at most this many jobs can run at once on a host."""
BIG = 1_000_000  # upper bound on counts and sizes no real recipe comes near
MAX_SHARDS = 1024
MIN_JOB_TIMEOUT_S = 0.1  # a sandboxed interpreter starts in milliseconds: a shorter limit times out every job
SCRATCH_VOCAB_SIZE = 101
"""Tokens of the demo tokenizer a scratch model is built for (``policy.build_tokenizer``:
4 special tokens and 97 printable ASCII characters)."""
MAX_SCRATCH_PARAMETERS = 2_000_000_000
"""Largest model ``model.source: scratch`` builds (``ModelConfig.scratch_parameters``). Its
fields are bounded one by one, but together they could ask for trillions of parameters
(hidden_size 65536 alone is 17 billion a layer): torch then failed to allocate, or the
machine ran out of memory, after the run had started. 2 billion float32 parameters are
8 GB of weights and about 32 GB with AdamW's gradients and moments, more than any demo
or test recipe comes near (recipes/demo.yaml: under a million); a bigger model starts
from a pretrained ``model.source``."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """``shards: true`` is a mistake, not 1, and ``allow_weak_isolation: "yes"`` is
        text, not true: pydantic would take them. Checked through ``X | None``, lists and
        dicts too (``timeouts: {trainer: true}``, ``domain_weights: {math: "1"}``)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and (problem := _loose_scalar(field.annotation, value)) is not None:
            raise ValueError(problem)
        return value


EXPONENT_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")
"""A number in exponent form: PyYAML (YAML 1.1) reads ``1e3``, with no dot, as text."""


def _loose_scalar(annotation: Any, value: Any) -> str | None:
    """Why ``value`` is a loose spelling of what ``annotation`` wants (None when it is not):
    true/false for a number, text for an integer, anything but true/false for a bool.
    Floats keep taking text: YAML 1.1 (PyYAML) reads ``1e-3``, with no dot, as the text
    "1e-3". Looks inside ``X | None``, ``list[X]`` and ``dict[str, X]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None or len(members) != 1:
            return None
        return _loose_scalar(members[0], value)
    if origin is list and isinstance(value, list):
        return next((p for item in value if (p := _loose_scalar(typing.get_args(annotation)[0], item))), None)
    if origin is dict and isinstance(value, dict):
        inner = typing.get_args(annotation)[1]
        return next((f"{key}: {p}" for key, item in value.items() if (p := _loose_scalar(inner, item))), None)
    if annotation in (int, float) and isinstance(value, bool):
        return "input should be a number, not true/false"
    if annotation is int and isinstance(value, str):
        if EXPONENT_TEXT.fullmatch(value.strip()):  # 1e3 or 1e400, unquoted: text to PyYAML
            return f"input should be a whole number written in digits, not {value.strip()[:40]!r} in exponent form"
        return "input should be a valid integer, not text (write it without quotes)"
    if annotation is bool and not isinstance(value, bool):
        return "input should be true or false (unquoted)"
    return None


class ModelConfig(_Section):
    """The demo policy: a Llama-architecture model built from this config."""

    source: str = Field("scratch", description="'scratch' builds a new model; otherwise a HF model folder, store URI, "
                        "models:/<name>@<alias>, or gguf:<package>/<file>.gguf (a GGUF file of an installed package, "
                        "converted once)")
    hidden_size: int = Field(256, ge=8, le=65536, description="width of the residual stream")
    num_layers: int = Field(4, ge=1, le=1024, description="transformer blocks")
    num_heads: int = Field(4, ge=1, le=1024, description="attention heads")
    intermediate_size: int = Field(768, ge=8, le=262144, description="MLP width")
    max_positions: int = Field(256, ge=32, le=BIG, description="longest prompt + completion in tokens")

    @field_validator("num_heads")
    @classmethod
    def _heads_divide(cls, num_heads: int, info: ValidationInfo) -> int:
        """Named as ``model.num_heads`` with its own value (a model validator was named
        ``model='{...}'``); ``hidden_size`` is validated before it (declared first)."""
        hidden = info.data.get("hidden_size")
        if isinstance(hidden, int) and hidden % num_heads:
            raise ValueError(f"hidden_size {hidden} is not divisible by num_heads {num_heads}")
        return num_heads

    def scratch_parameters(self, vocab_size: int = SCRATCH_VOCAB_SIZE) -> int:
        """The parameters of the model ``policy.build_model`` builds from this config: Llama
        blocks (q, k, v, o projections of hidden_size x hidden_size, as many key/value heads
        as heads; gate, up and down of hidden_size x intermediate_size; two RMSNorm
        weights), a final norm and the embedding, tied to the output head."""
        h, i = self.hidden_size, self.intermediate_size
        return self.num_layers * (4 * h * h + 3 * h * i + 2 * h) + h + vocab_size * h


class BootstrapConfig(_Section):
    """SFT warm start: stop inside the target band so RL has room to improve."""

    max_steps: int = Field(3000, ge=1, le=10 * BIG, description="upper bound on SFT optimizer steps")
    batch_size: int = Field(64, ge=1, le=BIG, description="SFT examples per step")
    batch_tokens: int = Field(0, ge=0, le=100 * BIG, description="if > 0, cap each step at this many padded tokens (fewer "
                                                   "examples on steps of a long-prompt domain); 0 = no cap")
    learning_rate: float = Field(1e-3, gt=0, le=1, description="AdamW learning rate (above 1 diverges at once)")
    eval_every: int = Field(50, ge=1, le=10 * BIG, description="steps between held-out checks")
    target_low: float = Field(0.2, ge=0, le=1, description="stop once mean eval pass rate reaches this")
    target_high: float = Field(0.5, ge=0, le=1, description="upper edge of the target band")
    eval_tasks_per_domain: int = Field(64, ge=1, le=BIG, description="held-out SFT check size (separate from the eval suite)")
    balance_domains: bool = Field(False, description="draw each step's domain by how far its check pass rate is below target_high (else round-robin)")


class CurriculumStep(_Section):
    """Domain weights used for every iteration up to and including ``until``."""

    until: int = Field(..., ge=1, le=10 * BIG, description="last iteration these weights apply to")
    weights: dict[str, float] = Field(..., description="sampling weight per domain (unlisted domains: 0)")


class TaskgenConfig(_Section):
    tasks_per_iteration: int = Field(128, ge=1, le=BIG, description="train tasks sampled per iteration")
    domain_weights: dict[str, float] = Field(default_factory=dict, description="sampling weight per domain (default equal)")
    curriculum: list[CurriculumStep] = Field(
        default_factory=list, max_length=1000, description="weights by iteration: the first step whose 'until' >= k applies to "
                                          "iteration k; after the last step, domain_weights")
    task_file: str = Field("", max_length=4096, description="Parquet/JSONL/JSON task file (path or URI) to sample from instead of generating")
    oversample: float = Field(1.0, ge=1.0, le=16.0, description="draw this many times tasks_per_iteration tasks: the surplus "
                                                                 "dynamic sampling (trainer.dynamic_sampling) refills from; "
                                                                 "without it, every drawn group with signal trains, so "
                                                                 "the iteration takes more steps")
    adaptive_difficulty: bool = Field(False, description="within each domain, sample difficulty pools by weights that follow "
                                                         "each pool's recent pass rate (persisted across iterations), so tasks "
                                                         "stay near the edge of competence; false: the domain's own mix")
    difficulty_memory: float = Field(0.5, ge=0.0, lt=1.0, description="adaptive_difficulty: share of a pool's earlier pass "
                                                                       "rate kept when the latest iteration's is blended in")
    difficulty_floor: float = Field(0.05, gt=0.0, le=1.0, description="adaptive_difficulty: least sampling weight of any pool, "
                                                                       "so a solved or hopeless pool is still visited")

    def weights_for(self, iteration: int, domains: list[str]) -> dict[str, float]:
        """Each domain's weight at ``iteration``: the curriculum step that covers it (unlisted
        domains 0), else ``domain_weights`` (unlisted domains 1)."""
        for step in self.curriculum:
            if iteration <= step.until:
                return {d: float(step.weights.get(d, 0.0)) for d in domains}
        return {d: float(self.domain_weights.get(d, 1.0)) for d in domains}


class RolloutConfig(_Section):
    engine: str = Field("hf", max_length=200, description="generation engine, by registry name")
    policy: str = Field("champion", max_length=4096, description="'champion', 'candidate', or a checkpoint URI to sample from")
    group_size: int = Field(8, ge=2, le=4096, description="samples per task (GRPO needs at least 2)")
    shards: int = Field(2, ge=1, le=MAX_SHARDS, description="fan-out of rollout, sandbox and reward")
    max_new_tokens: int = Field(24, ge=1, le=BIG, description="completion length cap")
    temperature: float = Field(1.0, ge=0.01, le=100, description="sampling temperature")  # serve.MIN_TEMPERATURE: lower overflows hf's softmax
    batch_size: int = Field(256, ge=1, le=BIG, description="sequences per generation batch")
    max_turns: int = Field(4, ge=1, le=64, description="most actions of one multi-turn episode (a task may declare fewer)")
    observation_chars: int = Field(256, ge=16, le=1 << 20, description="characters of a command's output an episode's "
                                                                       "policy sees per turn (the rest is cut)")
    prompt_format: Literal["auto", "raw", "chat"] = Field("auto", description="raw: the task prompt as it is; chat: the "
                                                          "tokenizer's chat template around it as one user turn; auto: chat "
                                                          "when the tokenizer has a template")
    workers: int = Field(1, ge=1, le=64, description="processes that sample generation batches side by side (hf engine, "
                         "forked, one torch thread each; the same samples as one), in rollout and the eval suite: the "
                         "cores a shard has to itself; only where torch runs one thread (POSTTRAIN_TORCH_THREADS=1, "
                         "as under a scheduler), else 1")


class SandboxConfig(_Section):
    backend: str = Field("bwrap", max_length=200, description="executor, by registry name: 'bwrap' (hardened) or 'subprocess' (weak)")
    mode: Literal["strict", "warm"] = Field("strict", description="strict: a fresh sandbox per job; warm: pre-started sandboxed workers fork per job "
                                                    "(bwrap backend; 'subprocess' has one mode)")
    allow_weak_isolation: bool = Field(False, description="run untrusted code even when the host cannot give full isolation (or with backend 'subprocess')")
    timeout_s: float = Field(5.0, ge=MIN_JOB_TIMEOUT_S, le=86400, description="wall-clock limit per job")
    concurrency: int = Field(2, ge=1, le=SANDBOX_UID_SLOTS, description="jobs at once (at most the sandbox's uid pool); "
                                                                        "mirrored by the Airflow pool")
    shards: int = Field(0, ge=0, le=MAX_SHARDS, description="fan-out of the sandbox stage; 0 = as wide as rollout.shards (re-sharded "
                                             "through the manifests when it differs)")
    memory_mb: int = Field(512, ge=16, le=1 << 20, description="address-space limit per job")
    output_cap_bytes: int = Field(8192, ge=256, le=1 << 30, description="stdout/stderr kept per job")
    python: str = Field("", max_length=4096, description="interpreter for jobs; empty means /usr/bin/python3, else this one")
    dedupe: bool = Field(True, description="run jobs that run the same thing (same files, command, stdin) once per stage "
                                           "and share the result among their rollouts; false: one run per rollout, for "
                                           "programs whose verdict is not a function of what they run")


class RewardConfig(_Section):
    normalize: Literal["none", "domain_zscore"] = Field("none", description="per-domain z-score of rewards before the group "
                                                                  "advantages; under scale_by_std (the default) it changes "
                                                                  "no advantage, so it acts only with scale_by_std: false")
    advantage_eps: float = Field(1e-6, gt=0, le=1, description="added to the group std (above 1 it flattens every advantage)")
    scale_by_std: bool = Field(True, description="divide advantages by the group std (GRPO) or only centre them")
    domain_weights: dict[str, float] = Field(default_factory=dict, description="loss weight per domain (unlisted: 1): "
                                             "multiplies each sample's advantage after group scaling, so it acts on the "
                                             "update, not only on sampling")
    control: Literal["none", "shuffled"] = Field("none", description="shuffled: permute raw rewards within each domain "
                                                                      "before advantages (a control run that must not learn)")


class ValidationConfig(_Section):
    min_ok_fraction: float = Field(0.5, ge=0, le=1, description="least share of rewards with status ok (neither excluded as an infra error nor verifier_error)")


class LoraConfig(_Section):
    """Low-rank adapters (``peft``) on the trainer's model; ``rank: 0`` trains every weight."""

    rank: int = Field(0, ge=0, le=4096, description="adapter rank r; 0 = off (full fine-tuning)")
    alpha: float = Field(16.0, gt=0, le=1e6, description="adapter scaling numerator (the update is scaled by alpha / rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1,
                                      max_length=64, description="module names that get adapters (Llama attention projections by default)")


class TrainerConfig(_Section):
    algorithm: Literal["grpo"] = Field("grpo", description="policy-gradient objective (GRPO is the only one)")
    learning_rate: float = Field(1e-4, gt=0, le=1, description="Adam learning rate (above 1 diverges at once)")
    prompts_per_step: int = Field(16, ge=1, le=BIG, description="tasks (groups) per optimizer step")
    epochs: int = Field(1, ge=1, le=1000, description="passes over the iteration's batch")
    clip_eps: float = Field(0.2, gt=0, le=10, description="PPO ratio clip (10 already clips nothing in practice)")
    kl_coef: float = Field(0.0, ge=0, le=100, description="KL penalty to the iteration's starting policy (at most 100: "
                           "beyond, the penalty is all the loss)")
    max_grad_norm: float = Field(1.0, ge=1e-6, le=1e6, description="gradient clipping (from 1e-6, which already stops "
                                 "learning, to 1e6, which clips nothing)")
    micro_batch_size: int = Field(64, ge=1, le=BIG, description="sequences per forward pass (gradient accumulation)")
    micro_batch_tokens: int = Field(0, ge=0, le=100 * BIG, description="tokens per forward pass, rows x row width with "
                                                                      "padding or packing filler (0: only micro_batch_size caps it)")
    packing: bool = Field(True, description="pack sequences end to end in each forward pass (position ids restart per "
                                            "sequence, block-diagonal causal attention, no padding); false: one right-padded "
                                            "row per sequence")
    loss_aggregation: Literal["token_mean", "sequence_mean", "seq_mean_token_sum"] = Field(
        "token_mean", description="token_mean: over all tokens of a step; sequence_mean: per-sequence token mean, "
                                  "then mean over sequences; seq_mean_token_sum: per-sequence token sum, then mean")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="learning-rate decay after warmup")
    warmup_steps: int = Field(0, ge=0, le=10 * BIG, description="optimizer steps of linear warmup from 0 (counted across "
                              "iterations when carry_optimizer_state carries the schedule position; "
                              "without it, per iteration)")
    decay_steps: int = Field(1000, ge=1, le=10 * BIG, description="steps over which linear/cosine decay to min_lr_ratio (across "
                             "iterations where the schedule position is carried, as for warmup_steps)")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="floor of the decayed learning rate, as a share of learning_rate")
    dynamic_sampling: bool = Field(False, description="drop groups whose rewards are all equal and fill every step with "
                                                       "exactly prompts_per_step informative groups (DAPO), refilling from "
                                                       "taskgen.oversample's surplus; false: every group with signal, last "
                                                       "step partial")
    carry_optimizer_state: bool = Field(True, description="load Adam moments and schedule position from the starting "
                                          "checkpoint (under LoRA, whose adapters are fresh each iteration, only the "
                                          "schedule position)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the trainer's model lives: auto = cuda when "
                                                                    "a GPU is visible, else cpu")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="float32, or bfloat16 autocast of the forward pass "
                                                                        "(weights and optimizer state stay float32)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass (less memory, more compute)")
    processes: int = Field(1, ge=1, le=1024, description="trainer processes under torchrun on one node (gloo on CPU, nccl on "
                                                         "GPU), each taking its share of every step's global batch")
    parallelism: Literal["ddp", "fsdp"] = Field("ddp", description="ddp (a full replica per process; with processes: 1 "
                                                                   "the steps run in the stage's own process) or fsdp (FSDP2 "
                                                                   "fully_shard: parameters, gradients and optimizer state "
                                                                   "sharded; always under torchrun, even with one process)")
    lora: LoraConfig = LoraConfig()


class EvaluationConfig(_Section):
    tasks_per_domain: int = Field(100, ge=1, le=BIG, description="fixed held-out tasks per domain")
    promotion: Literal["statistical", "strict"] = Field(
        "statistical", description="statistical: promote unless a domain's paired-bootstrap interval of the pass-rate "
                                   "difference lies below 0 or the mean over domains drops; strict: unless a domain "
                                   "dropped by more than regression_tolerance (also the fallback without the "
                                   "baseline's per-task results)")
    confidence: float = Field(0.95, gt=0, lt=1, description="confidence level of the promotion intervals and of the "
                                                            "Wilson intervals in the layered report")
    bootstrap_resamples: int = Field(2000, ge=100, le=BIG, description="paired-bootstrap resamples per domain (seeded "
                                                                       "from the recipe seed)")
    regression_tolerance: float = Field(0.02, ge=0, le=1, description="strict rule: largest per-domain drop that still promotes")
    pass_k: int = Field(0, ge=0, le=1024, description="if > 0, also sample this many completions per eval task at "
                                                     "rollout.temperature and log the unbiased pass@k per domain "
                                                     "(never decides promotion); 0 = off")
    max_new_tokens: int = Field(24, ge=1, le=BIG, description="completion cap for greedy eval")


class StageResources(_Section):
    """A stage's cluster request (``resources: {trainer: {gpus: 2, memory: 64Gi, scratch: 100Gi}}``); unset fields keep
    the registry's."""

    cpu: str | None = Field(default=None, pattern=r"^[0-9]+(\.[0-9]+)?m?$", description="CPU request, e.g. '4' or '500m'")
    memory: str | None = Field(default=None, pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)?$", description="memory request and limit, e.g. '16Gi'")
    gpus: int | None = Field(default=None, ge=0, le=64, description="accelerators per task (0: CPU only)")
    scratch: str | None = Field(default=None, pattern=r"^[1-9][0-9]{0,5}(Ki|Mi|Gi|Ti)$",
                                description="local disk a task may write, e.g. '50Gi': the size of its /tmp and home "
                                            "folder (the container's root is read-only) and its ephemeral-storage "
                                            "request and limit")


class Recipe(_Section):
    """A whole post-training recipe. Only ``pipeline`` is required."""

    pipeline: str = Field(..., pattern=r"^[a-z][a-z0-9-]{0,62}$", description="pipeline name: experiment, registry and storage prefix")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="base seed; all others derive from it")
    domains: list[str] = Field(default_factory=lambda: ["arithmetic", "code"], min_length=1, max_length=256)
    model: ModelConfig = ModelConfig()
    bootstrap: BootstrapConfig = BootstrapConfig()
    taskgen: TaskgenConfig = TaskgenConfig()
    rollout: RolloutConfig = RolloutConfig()
    sandbox: SandboxConfig = SandboxConfig()
    reward: RewardConfig = RewardConfig()
    validation: ValidationConfig = ValidationConfig()
    trainer: TrainerConfig = TrainerConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    timeouts: dict[str, int] = Field(default_factory=dict, max_length=64, description="time limit in seconds per stage task, overriding "
                                                                      "the stage registry's (components/core/stages.py)")
    resources: dict[str, StageResources] = Field(default_factory=dict, max_length=64, description="what one task of a stage asks of a "
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


_SCRATCH_FIX = ("set '{loc}' to a Kubernetes storage quantity: a whole number from 1 to 999999 with a Ki, Mi, Gi or Ti "
                "suffix, e.g. 50Gi (not 50GB or lots)")

WORDED_FIXES: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"resources\.[^.]+\.memory"), "should match pattern",
     "set '{loc}' to a Kubernetes memory quantity: a whole number with an optional Ki, Mi, Gi or Ti suffix, "
     "e.g. 16Gi (not 16GB or 16gi)"),
    (re.compile(r"resources\.[^.]+\.scratch"), "should match pattern", _SCRATCH_FIX),
    (re.compile(r"resources\.[^.]+\.scratch"), "should be a valid string", _SCRATCH_FIX),  # a bare number: 50
    (re.compile(r"resources\.[^.]+\.cpu"), "should match pattern",
     "set '{loc}' to a Kubernetes CPU quantity: cores such as 4 or 0.5, or millicores such as 500m"),
    (re.compile(r"model\.num_heads"), "not divisible",
     "set '{loc}' to a divisor of model.hidden_size (each head gets hidden_size / num_heads dimensions), "
     "e.g. 4 for hidden_size 256"),
)
"""(field, a phrase of pydantic's message, the fix) where the generic fix would only repeat
a regular expression or a rule."""


def _fix_for(parts: tuple, loc: str, kind: str, msg: str) -> str:
    """The fix for pydantic's error of ``kind`` at ``parts`` (``loc`` as text): an unknown
    key's closest known key (or the section's keys), a worded fix where there is one, else
    the message as the rule to follow. Only its first letter is lowered: a regular
    expression's pattern or a class name changes meaning with its case."""
    if kind == "extra_forbidden":
        return _unknown_key_fix(parts, loc)
    if kind == "missing":
        return f"add '{loc}' to the recipe"
    for pattern, phrase, fix in WORDED_FIXES:
        if pattern.fullmatch(loc) and phrase in msg:
            return fix.format(loc=loc)
    rule = (msg[:1].lower() + msg[1:]).replace("greater than or equal to", "at least").replace(
        "less than or equal to", "at most")
    return f"set '{loc}' to a valid value ({rule})"


def _section_at(parts: tuple) -> type[BaseModel] | None:
    """The config class a key at ``parts`` (a validation error's location) belongs in:
    ``Recipe`` for a top-level key, ``RolloutConfig`` for ``rollout.x``, ``StageResources``
    for ``resources.trainer.x``, ``CurriculumStep`` for ``taskgen.curriculum[0].x``."""
    current: Any = Recipe
    for part in parts[:-1]:
        if isinstance(current, type) and issubclass(current, BaseModel) and isinstance(part, str) \
                and part in current.model_fields:
            current = current.model_fields[part].annotation
        elif typing.get_origin(current) in (dict, list):
            current = typing.get_args(current)[-1]
        else:
            return None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unknown_key_fix(parts: tuple, loc: str) -> str:
    """Remove the key, or spell it as the closest key its section knows; without a close
    one, the section's keys (recipes/demo.yaml shows only some of them)."""
    section = _section_at(parts)
    if section is None or not isinstance(parts[-1], str):
        return f"remove '{loc}'"
    known = list(section.model_fields)
    parent = loc[: len(loc) - len(_loc_text(parts[-1:]))].rstrip(".")
    close = difflib.get_close_matches(parts[-1], known, n=1, cutoff=0.6)
    if close:
        return f"remove '{loc}' or correct its spelling to '{parent + '.' if parent else ''}{close[0]}'"
    where = f"the keys of {parent}" if parent else "the recipe's keys"
    return f"remove '{loc}' or correct its spelling to one of {where}: {', '.join(known)}"


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlevel = 2


def short(value: Any) -> Any:
    """``value`` for an error message, shortened with ``reprlib`` *before* it is formatted
    (formatting a shared-reference YAML value in full could take minutes and gigabytes);
    small scalars are kept as they are."""
    if isinstance(value, str):
        return value if len(value) <= 80 else value[:77] + "..."
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<integer of {value.bit_length()} bits>"
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, dict):
        return "{...}"
    try:
        return _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails
        return f"<{type(value).__name__}>"


MAX_WEIGHT_SUM = 1e300
"""Most that a section's weights may add up to (unlisted domains of ``taskgen.domain_weights``
count 1 each): taskgen splits up to 16 million tasks by ``count * weight / sum``, which
must stay a finite float (two weights of 1e308 add up to infinity, and taskgen ended
in "cannot convert float NaN to integer"). Weights are relative: 1 and 3 say the same
as 1e300 and 3e300."""


def _weights(weights: dict[str, float], where: str, unlisted: float = 0.0) -> None:
    for name, w in weights.items():
        if not math.isfinite(w) or w < 0:
            raise UserError(f"{where}.{one_line(short(name))}", w, "negative or not a finite weight", "use a weight >= 0")
    total = sum(weights.values()) + unlisted
    if not total <= MAX_WEIGHT_SUM:  # inf too
        raise UserError(where, short(weights), f"the weights add up to {total:.3g}, more than {MAX_WEIGHT_SUM:g}",
                        "use smaller weights: only their ratios matter (e.g. 1 and 3)")


MAX_REWARD_WEIGHT = 1e6
"""Largest loss weight in ``reward.domain_weights``. Unlike sampling weights these are not
ratios: a weight multiplies the domain's advantages directly, so it sets the size of that
domain's policy-gradient term against the KL term and gradient clipping. 1e6 leaves
float32 room (a step's loss is a sum of advantage x weight x ratio over its tokens; 1e300
overflowed to inf and every step was skipped with a NaN gradient) and is far above any
useful emphasis."""


def _reward_weights(recipe: Recipe, source: str) -> None:
    """``reward.domain_weights``: each finite, from 0 to ``MAX_REWARD_WEIGHT``, for a domain
    of the recipe, and some domain (unlisted ones weigh 1) above 0, else no group could
    ever train. Not covered: whether a weight is useful (0.001 trains next to nothing)."""
    where = f"{source}: reward.domain_weights"
    fix = (f"use a loss weight from 0 to {MAX_REWARD_WEIGHT:g}: it multiplies that domain's advantages as it is "
           "(2 doubles the domain's policy-gradient term against the KL term; 1, the default, leaves it as scored)")
    for name, w in recipe.reward.domain_weights.items():
        if not math.isfinite(w) or w < 0:
            raise UserError(f"{where}.{one_line(short(name))}", w, "negative or not a finite weight", fix)
        if w > MAX_REWARD_WEIGHT:
            raise UserError(f"{where}.{one_line(short(name))}", w, f"more than {MAX_REWARD_WEIGHT:g}", fix)
    for name in recipe.reward.domain_weights:
        if name not in recipe.domains:
            raise UserError(where, name, "weight for a domain not in 'domains'", "add it to 'domains' or drop the weight")
    if all(recipe.reward.domain_weights.get(d, 1.0) == 0 for d in recipe.domains):
        raise UserError(where, "{...}", "no domain has a positive loss weight, so no group would ever train",
                        "give at least one domain a weight > 0 (a domain left out of reward.domain_weights weighs 1)")


def _scratch_size(model: ModelConfig, where: str) -> None:
    """A scratch model of at most ``MAX_SCRATCH_PARAMETERS`` parameters, checked at load
    (before, hidden_size 65536 was a traceback in bootstrap, retried by the orchestrator)."""
    count = model.scratch_parameters()
    if count > MAX_SCRATCH_PARAMETERS:
        raise UserError(where, f"hidden_size: {model.hidden_size}, num_layers: {model.num_layers}, "
                        f"intermediate_size: {model.intermediate_size}",
                        f"builds a model of {count:,} parameters ({count * 4 / 1e9:,.0f} GB of float32 weights, about "
                        f"4 times that to train), more than the {MAX_SCRATCH_PARAMETERS:,} a scratch model may have",
                        "make model.hidden_size, model.num_layers or model.intermediate_size smaller (recipes/demo.yaml: "
                        "128, 4 and 384), or start from a pretrained model with model.source")


SANDBOX_PYTHON_ROOT = "/usr/"
"""Where the bwrap backend's job interpreter must live: the sandbox shows the host's /usr
alone (read-only; ``/bin`` and ``/lib`` only as the merged-usr links into it), so an
interpreter elsewhere is not there when a job starts (``components/sandbox/README.md``,
``detect.resolve_python``, which applies the same rule)."""
SANDBOX_PYTHON_FIX = "name a Python 3 interpreter under /usr (e.g. /usr/bin/python3.11), or leave sandbox.python " \
                     "empty to use /usr/bin/python3"


def sandbox_python_problem(python: str) -> str | None:
    """Why ``python`` cannot be the bwrap sandbox's job interpreter by its name alone (None
    when it can): a relative path, a NUL, or a path outside ``SANDBOX_PYTHON_ROOT`` once
    ``..`` parts are resolved. Whether it exists and runs is checked where the jobs run
    (``dags.orchestrate.check_before_run``, ``detect.resolve_python``)."""
    if "\0" in python:
        return "contains a NUL character"
    if not python.startswith("/"):
        return "is not an absolute path"
    if not os.path.normpath(python).startswith(SANDBOX_PYTHON_ROOT):
        return "is outside /usr, the only host folder the bwrap sandbox shows, so no job could start it"
    return None


def _location(value: str, where: str, fix: str, what: str = "checkpoint") -> None:
    """A recipe's location of a checkpoint (``model.source``, ``rollout.policy``) or of a
    task file (``taskgen.task_file``, ``what="task file"``) can name one: not blank, no
    NUL, a store URI of a known scheme with a valid host part, a ``~`` of a known user;
    checked at load, before any work, by the same rules the stages resolve it by
    (``storage.normalize_uri``). A checkpoint's registry (``models:/``) and ``gguf:``
    references are the stages' to check."""
    from components.core.storage import SUPPORTED_SCHEMES, normalize_uri, scheme

    if not value.strip():
        raise UserError(where, value, f"empty: names no {what}", fix)
    if what == "task file" and scheme(value) not in ("", *SUPPORTED_SCHEMES):
        return  # another fsspec protocol (https://, hf://): the preflight reads it
    if what == "checkpoint" and value.startswith(("models:/", "gguf:")):
        if "\0" in value:
            raise UserError(where, value, "contains a NUL character", fix)
        return
    try:
        normalize_uri(value, where)
    except UserError as exc:
        raise UserError(where, value, exc.problem, exc.fix) from None


def _loc_text(loc: tuple) -> str:
    """A validation error's location as the recipe's own checks name fields: keys joined by
    ``.``, list positions in brackets (``domains[0]``, ``taskgen.curriculum[1].weights``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + one_line(str(short(part)))
    return out


def parse_recipe(data: Any, source: str = "<recipe>") -> Recipe:
    source = one_line(source)
    if not isinstance(data, dict):
        raise UserError("recipe", source, "the recipe must be a YAML mapping", "write key: value pairs, e.g. 'pipeline: demo'")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_context=False)[0]
        loc = _loc_text(err["loc"]) or "recipe"
        loc = loc if len(loc) <= 160 else loc[:157] + "..."
        msg = one_line(str(err["msg"])[:200]).removeprefix("Value error, ")
        value = None if err["type"] == "missing" else short(err.get("input", ""))  # not the mapping it is missing from
        raise UserError(f"{source}: {loc}", value, msg, _fix_for(tuple(err["loc"]), loc, err["type"], msg)) from None
    except RecursionError:
        raise UserError("recipe", source, f"nested deeper than {MAX_YAML_DEPTH} levels",
                        "flatten the recipe (see recipes/demo.yaml)") from None
    if recipe.sandbox.shards > recipe.rollout.shards * 64:
        raise UserError(f"{source}: sandbox.shards", recipe.sandbox.shards, "more than 64 times rollout.shards",
                        "use at most 64 sandbox shards per rollout shard")
    if recipe.model.source == "scratch":
        _scratch_size(recipe.model, f"{source}: model")
    if recipe.sandbox.backend == "bwrap" and recipe.sandbox.python \
            and (problem := sandbox_python_problem(recipe.sandbox.python)) is not None:
        raise UserError(f"{source}: sandbox.python", recipe.sandbox.python, problem, SANDBOX_PYTHON_FIX)
    if recipe.model.source != "scratch":
        _location(recipe.model.source, f"{source}: model.source",
                  "use 'scratch', a Hugging Face model folder, a store URI, models:/<name>@<alias> or gguf:<package>/<file>.gguf")
    if recipe.rollout.policy not in ("champion", "candidate"):
        _location(recipe.rollout.policy, f"{source}: rollout.policy",
                  "use 'champion', 'candidate', or the URI of a checkpoint")
    if recipe.taskgen.task_file:
        _location(recipe.taskgen.task_file, f"{source}: taskgen.task_file", "pass an existing .parquet, .jsonl or .json "
                  "file (local path, file:// or s3:// URI), or leave it out to generate tasks", what="task file")
    _weights(recipe.taskgen.domain_weights, f"{source}: taskgen.domain_weights",
             unlisted=float(sum(1 for d in recipe.domains if d not in recipe.taskgen.domain_weights)))
    if recipe.taskgen.domain_weights and all(recipe.taskgen.domain_weights.get(d, 1.0) == 0 for d in recipe.domains):
        raise UserError(f"{source}: taskgen.domain_weights", "{...}", "no domain has a positive weight",
                        "give at least one domain a weight > 0")
    for i, name in enumerate(recipe.domains):
        DOMAINS.check(name, f"{source}: domains[{i}]")
        if name in recipe.domains[:i]:
            raise UserError(f"{source}: domains[{i}]", name, f"is listed twice (first as domains[{recipe.domains.index(name)}])",
                            "list each domain once; weigh it with taskgen.domain_weights")
    ENGINES.check(recipe.rollout.engine, f"{source}: rollout.engine")
    BACKENDS.check(recipe.sandbox.backend, f"{source}: sandbox.backend")
    _reward_weights(recipe, source)
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
            if not math.isfinite(w) or w < 0:
                raise UserError(f"{where}.weights.{one_line(short(name))}", w, "negative weight", "use a weight >= 0")
        _weights(step.weights, f"{where}.weights")
        if not any(w > 0 for w in step.weights.values()):
            raise UserError(f"{where}.weights", short(step.weights) if step.weights else "{}",
                            "no domain has a positive weight", "give at least one domain a weight > 0")
    for name, seconds in recipe.timeouts.items():
        if name not in stage_ids():
            raise UserError(f"{source}: timeouts", name, "not a stage", f"use one of {list(stage_ids())}")
        if seconds < 1 or seconds > 7 * 86400:
            raise UserError(f"{source}: timeouts.{one_line(short(name))}", seconds, "not a number of seconds from 1 to a week", "use e.g. 3600")
    for name in recipe.resources:
        if name not in stage_ids():
            raise UserError(f"{source}: resources", name, "not a stage", f"use one of {list(stage_ids())}")
    tasks = recipe.taskgen.tasks_per_iteration
    if recipe.trainer.dynamic_sampling and recipe.trainer.prompts_per_step > tasks:
        # Dynamic sampling trains whole steps only, tasks_per_iteration // prompts_per_step of them.
        raise UserError(f"{source}: trainer.prompts_per_step", recipe.trainer.prompts_per_step,
                        f"is more than taskgen.tasks_per_iteration ({tasks}), so dynamic sampling would never fill a step",
                        f"set trainer.prompts_per_step to at most {tasks}, or trainer.dynamic_sampling to false")
    if recipe.bootstrap.target_low > recipe.bootstrap.target_high:
        raise UserError(f"{source}: bootstrap.target_low", recipe.bootstrap.target_low, "above bootstrap.target_high", "make target_low <= target_high")
    return recipe


RECIPES_DIR = "recipes"  # under the run root: recipes published for stages that run elsewhere (containers, pods)


def is_uri(path: str | Path) -> bool:
    return "://" in str(path)


def _decode(data: bytes, path: str | Path) -> str:
    """A recipe's bytes as text: UTF-8 (an optional BOM dropped), no NUL bytes, at most
    ``MAX_RECIPE_BYTES``; anything else is one UserError."""
    fix = "save the recipe as UTF-8 text (see recipes/demo.yaml)"
    if len(data) > MAX_RECIPE_BYTES:
        raise UserError("--recipe", str(path), f"larger than {MAX_RECIPE_BYTES >> 10} KiB", "a recipe holds only overrides; shorten it")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise UserError("--recipe", str(path), "UTF-16 text, not UTF-8", fix)
    if b"\x00" in data:
        raise UserError("--recipe", str(path), "binary data (NUL bytes), not YAML text", fix)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError("--recipe", str(path), f"not UTF-8 text (byte {exc.start})", fix) from None


def _read_text(path: str | Path) -> str:
    """The recipe's text from a local file or a store URI (``s3://``, ``file://``)."""
    if not is_uri(path):
        try:
            is_file, is_dir = Path(path).is_file(), Path(path).is_dir()
        except OSError as exc:  # a name longer than the filesystem's limit
            raise UserError("--recipe", str(path), f"cannot be looked up ({exc.strerror or type(exc).__name__})",
                            "pass a YAML file such as recipes/demo.yaml") from None
        if not is_file:
            if is_dir:
                raise UserError("--recipe", str(path), "is a folder, not a recipe file", "name the recipe's YAML file in it")
            if os.path.lexists(path):  # a FIFO, a device, a dangling link
                raise UserError("--recipe", str(path), "is not a regular file", "pass a YAML file such as recipes/demo.yaml")
            raise UserError("--recipe", str(path), "no such recipe file", "pass a YAML file such as recipes/demo.yaml")
        try:
            with Path(path).open("rb") as fh:
                data = fh.read(MAX_RECIPE_BYTES + 1)
        except OSError as exc:
            raise UserError("--recipe", str(path), f"cannot be read ({type(exc).__name__})", "check its permissions") from None
        return _decode(data, path)
    from components.core.storage import Store, normalize_uri, s3_fix

    given = str(path)
    uri = normalize_uri(given, "--recipe")  # a malformed URI is named as the user wrote it
    scheme, rest = uri.split("://", 1)
    folder, slash, name = rest.rpartition("/")
    if scheme == "s3" and not slash:
        raise UserError("--recipe", given, "names a bucket, not a recipe file in it", "write s3://bucket/prefix/recipe.yaml")
    if not name:
        raise UserError("--recipe", given, "names no recipe file", "write file:///path/to/recipe.yaml or s3://bucket/prefix/recipe.yaml")
    store = Store(f"{scheme}://{folder or '/'}", "--recipe")
    try:
        if store.isdir(name):
            raise UserError("--recipe", given, "is a folder, not a recipe file", "name the recipe's YAML file in it")
        if not store.exists(name):
            bucket = rest.split("/", 1)[0]
            if scheme == "s3" and not store.fs.exists(bucket):
                raise UserError("--recipe", str(path), f"no bucket {bucket!r} in the store",
                                "name an existing bucket (or check AWS_ENDPOINT_URL: another server has other buckets)")
            if scheme == "file":
                raise UserError("--recipe", str(path), "no such recipe file", "pass a YAML file such as recipes/demo.yaml")
            raise UserError("--recipe", str(path), "no such recipe in the store", "publish it first (the DAG's plan task does)")
        return _decode(store.read_bytes(name), path)
    except UserError:
        raise
    except Exception as exc:
        if (down := outage(exc)) is not None:
            raise InfraError("--recipe", str(path), down) from None
        raise UserError("--recipe", str(path), f"cannot read it ({type(exc).__name__})",
                        s3_fix(exc) if scheme == "s3" else "check the URI") from None


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


class TooLarge(yaml.YAMLError):
    """A YAML document nested too deep or expanding (through aliases) to too many nodes."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with bounds checked while composing, before anything is built:
    nesting at most ``MAX_YAML_DEPTH`` and at most ``MAX_YAML_NODES`` nodes once every
    alias is counted as the nodes it stands for (so a 500-byte alias bomb stops here)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, int] = {}
        self._total = 0
        self._path: list[Any] = []  # the key node or list position of each node being composed

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        self._path.append(index)
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise TooLarge(f"nested deeper than {MAX_YAML_DEPTH} levels", self.peek_event().start_mark)
            node = super().compose_node(parent, index)
            if isinstance(node, yaml.ScalarNode) and node.style is None:
                self._plain_number(node)
        finally:
            self._depth -= 1
            self._path.pop()
        size = self._sizes.get(id(node))
        if size is None:  # a new node: its children's sizes are known (an alias's too)
            if isinstance(node, yaml.SequenceNode):
                size = 1 + sum(self._sizes.get(id(child), 1) for child in node.value)
            elif isinstance(node, yaml.MappingNode):
                size = 1 + sum(self._sizes.get(id(k), 1) + self._sizes.get(id(v), 1) for k, v in node.value)
            else:
                size = 1
            self._sizes[id(node)] = size
        else:
            self._total += size  # an alias: what it expands to counts again
        if size + self._total > MAX_YAML_NODES:
            raise TooLarge(f"expands to more than {MAX_YAML_NODES} values (YAML aliases count in full)",
                           node.start_mark)
        if isinstance(node, yaml.MappingNode):
            _no_repeated_keys(node)
        return node

    def _plain_number(self, node: Any) -> None:
        """``NumberForm`` for an unquoted number YAML 1.1 (PyYAML) reads otherwise than it
        reads to most people, or cannot convert: ``010`` (octal 8), ``0x10``, ``0b10``,
        ``1:00:00`` (base 60: 3600), ``0o10`` (text in YAML 1.1), a whole number of more
        digits than Python converts."""
        text = node.value
        digits = text.lstrip("+-").replace("_", "")
        found: tuple[str, str] | None = None
        if node.tag == "tag:yaml.org,2002:int":
            if len(digits) > MAX_NUMBER_DIGITS:
                found = (f"is a whole number of {len(digits):,} digits",
                         "write a number of at most 19 digits (the largest a recipe takes is seed's 2**63 - 1)")
            elif ":" in digits:
                number = self._converted(node)
                found = (f"reads as base 60 ({number}) in YAML 1.1",
                         f"write {number} if you mean that number, or quote it if it is text")
            elif digits[:2] in ("0x", "0b"):
                number = self._converted(node)
                found = (f"reads as {'hexadecimal' if digits[1] == 'x' else 'binary'} {number} in YAML 1.1",
                         f"write it in decimal: {number}")
            elif len(digits) > 1 and digits[0] == "0":
                number, decimal = self._converted(node), int(text.replace("_", ""))
                found = (f"reads as octal {number} in YAML 1.1",
                         f"write {number} without the leading zero" if number == decimal else
                         f"write {number}, or {decimal} if you meant it as a decimal number")
        elif node.tag == "tag:yaml.org,2002:float" and ":" in digits:
            number = self._converted(node)
            found = (f"reads as base 60 ({number}) in YAML 1.1",
                     f"write {number} if you mean that number, or quote it if it is text")
        elif node.tag == "tag:yaml.org,2002:str" and OCTAL_12.fullmatch(text):
            number = int(text.replace("_", "").replace("0o", ""), 8)
            found = (f"is text in YAML 1.1, not the octal number {number}",
                     f"write it in decimal: {number} (or quote it if it is text)")
        elif node.tag == "tag:yaml.org,2002:str" and LEADING_ZERO_TEXT.fullmatch(text):  # 08, 09: not octal, so text
            found = ("is text in YAML 1.1 (a number with a leading zero that is not octal)",
                     f"write {int(text.replace('_', ''))} (or quote it if it is text)")
        if found is not None:
            raise NumberForm(self._where(node), text, *found, node.start_mark)

    def _converted(self, node: Any) -> Any:
        try:
            return self.yaml_constructors[node.tag](self, node)
        except (ValueError, OverflowError):  # past Python's digit limit: no number to show
            return "a number too long to convert"

    def _where(self, node: Any) -> str:
        """The dotted key of ``node``, the node being composed (``rollout.shards``,
        ``domains[1]``; a key as its own text: ``timeouts.010``)."""
        out = ""
        last = len(self._path) - 1
        for i, index in enumerate(self._path[1:], start=1):
            if isinstance(index, int):
                out += f"[{index}]"
                continue
            if isinstance(index, yaml.ScalarNode):
                key = index.value
            else:  # None: a mapping's key, the node itself when it is the last
                key = node.value if i == last else "?"
            out += ("." if out else "") + one_line(str(short(key)))
        return out or "recipe"


MAX_NUMBER_DIGITS = 4300
"""Most digits of a whole number in a recipe: Python's limit on converting text to an int
(``sys.get_int_max_str_digits``), far above any field's bound."""
OCTAL_12 = re.compile(r"[-+]?0o[0-7][0-7_]{0,40}")
"""YAML 1.2's octal form, which YAML 1.1 (PyYAML) reads as text."""
LEADING_ZERO_TEXT = re.compile(r"[-+]?0[0-9_]{0,40}")
"""A number with a leading zero that YAML 1.1 reads as text (``08``, ``09``: not octal)."""


class NumberForm(yaml.YAMLError):
    """An unquoted number YAML 1.1 reads otherwise than it looks (``BoundedLoader._plain_number``)."""

    def __init__(self, where: str, text: str, problem: str, fix: str, mark: Any) -> None:
        super().__init__(problem)
        self.where, self.text, self.problem, self.fix, self.problem_mark = where, text, problem, fix, mark


class RepeatedKey(yaml.YAMLError):
    """A mapping that names a key twice: YAML loaders keep the last value silently, so
    ``pipeline: demo`` then ``pipeline: other`` would run pipeline "other"."""

    def __init__(self, key: str, first: Any, again: Any) -> None:
        super().__init__(key)
        self.key, self.first, self.again = key, first, again


def _no_repeated_keys(node: Any) -> None:
    seen: dict[str, Any] = {}
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
            if key.value in seen:
                raise RepeatedKey(key.value, seen[key.value], key.start_mark)
            seen[key.value] = key.start_mark


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file or a recipe URI; every failure is one UserError
    (an unreachable store is an InfraError)."""
    text = _read_text(path)
    loader = None
    try:
        loader = BoundedLoader(text)  # the reader already rejects unprintable characters here
        data = loader.get_single_data()
    except TooLarge as exc:
        raise UserError("--recipe", str(path), f"{exc.problem} at line {exc.problem_mark.line + 1}",
                        "write the values out plainly, without deep nesting or alias chains") from None
    except NumberForm as exc:
        raise UserError(f"{one_line(str(path))}: {exc.where}", short(exc.text),
                        f"{exc.problem} (line {exc.problem_mark.line + 1})", exc.fix) from None
    except RepeatedKey as exc:
        raise UserError("--recipe", str(path), f"the key {short(exc.key)!r} appears twice in one mapping (lines "
                        f"{exc.first.line + 1} and {exc.again.line + 1}); YAML would keep the last silently",
                        "keep one of them") from None
    except yaml.YAMLError as exc:
        if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow: no line mark
            line = text.count("\n", 0, exc.position) + 1
            raise UserError("--recipe", str(path), f"the character {chr(exc.character)!r} (U+{exc.character:04X}) at "
                            f"line {line} is not allowed in YAML", "remove it or write it as an escape in a "
                            "double-quoted string") from None
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise UserError("--recipe", str(path), f"not valid YAML at {where}", "fix the YAML syntax there") from None
    except RecursionError:
        raise UserError("--recipe", str(path), f"nested deeper than {MAX_YAML_DEPTH} levels",
                        "flatten the recipe (see recipes/demo.yaml)") from None
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. an integer too long to convert
        raise UserError("--recipe", str(path), f"a value YAML cannot convert ({type(exc).__name__})",
                        "fix the value (numbers of at most a few digits)") from None
    finally:
        if loader is not None:
            loader.dispose()
    return parse_recipe(data, source=str(path))
