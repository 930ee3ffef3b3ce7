"""Stage ``trainer``: GRPO updates on the iteration's batch -> checkpoint k+1.

Reads every shard's rollouts and rewards (only after validation passed), drops excluded
samples, chooses the groups to train on (``sampling.py``), runs ``trainer.epochs``
passes of ``prompts_per_step`` groups per optimizer step, saves the new policy in
Hugging Face format under this stage's prefix, registers it as a new version of
``<pipeline>-policy`` and moves the ``candidate`` alias to it. The trainer's MLflow run
logs the rollout and reward files it trained on as datasets and the policy version it
started from, which is the lineage the registry version points back to.

Which groups train: by default every group with learning signal (some weighted
advantage not 0), the last step partial. With ``trainer.dynamic_sampling`` (DAPO),
groups whose rewards behind the advantages (``normalized_reward``: the raw score, its
per-domain z-score, or the shuffled control's permuted score) are all equal are dropped and every step holds exactly
``prompts_per_step`` informative groups of domains whose loss weight
(``reward.domain_weights``) is above 0, for ``taskgen.tasks_per_iteration //
prompts_per_step`` steps per epoch (fewer, whole ones, when too few groups are
informative); a seeded shuffle picks them, and the informative groups beyond the target
(``taskgen.oversample``'s surplus) are left unused. Either way informative groups of a
weight-0 domain never train (as if the domain were left out) and are counted apart, and
the stage returns ``groups_kept``, ``groups_dropped``, ``groups_zero_weight``,
``groups_unused`` and per domain ``<domain>/groups_kept``, ``<domain>/groups_dropped`` and
``<domain>/groups_zero_weight``, logged as ``trainer/...``.
When no step runs (no group had a learning signal, or too few for one whole step) the
stage prints a WARNING line with the reason and the fix (``no_steps_warning``) and
registers the parent's weights as the new version; its step means (``trainer/loss``,
``kl``, ``lr``, ...) read 0.
Dynamic sampling with ``prompts_per_step`` above ``tasks_per_iteration`` (no step could
ever be filled) is a ``UserError`` when the recipe is parsed (``recipe.parse_recipe``).

Optimizer state is carried across iterations: ``trainer_state.pt`` (AdamW moments, LR
schedule position, RNG states, data position; see ``state.py``) is saved beside the
new checkpoint, and the next iteration's trainer loads it from the checkpoint it starts
from when present (``trainer.carry_optimizer_state``). Engines that need only weights
never download it (``load_policy`` skips it). Per step it logs
``trainer/step/{loss,clip_frac,kl,entropy,grad_norm,lr}``, and ``trainer/torch_threads`` the
intra-op threads it ran on (``POSTTRAIN_TORCH_THREADS``). Micro-batches are packed
without padding unless ``trainer.packing`` is false (``grpo.py``).

Off the CPU (``device.py``): the model trains on ``trainer.device`` (``auto``: CUDA when
torch sees a GPU), with ``trainer.dtype: bfloat16`` as autocast of the forward passes
(weights and AdamW state stay float32) and ``trainer.gradient_checkpointing``
recomputing activations in the backward pass. The checkpoint is always saved from CPU
in float32.

``trainer.processes`` > 1, or ``trainer.parallelism: fsdp`` at any count, runs the optimizer steps under ``torchrun`` on this node
(``distributed.py``: gloo on CPU, nccl on GPU; DDP or FSDP2 per ``trainer.parallelism``),
every step's global batch split between the processes by tokens, with the same result
as one process. Rank 0 writes one consolidated Hugging Face checkpoint and the full
optimizer state; this stage uploads, registers and logs them exactly as the
one-process path does. A worker's bad setting is a UserError, a crashed or stuck worker
an InfraError, within the stage's timeout. A stopped or killed stage leaves no worker
running (torchrun dies with it), and its work folder (``posttrain-trainer-<pid>-*`` in
the temporary folder) is removed, or, after a SIGKILL, swept by the next trainer stage.

LoRA (``trainer.lora.rank`` > 0, ``lora.py``): adapters are added after loading (and in
each torchrun worker before wrapping), only they train, and they are merged into the
base weights on save, so the checkpoint is a plain Hugging Face model. Each iteration
starts fresh adapters on the merged weights, so under LoRA only the schedule's position
is carried in, not the Adam moments (the saved ``trainer_state.pt`` holds the adapters'
moments, for inspection only).

On several nodes (a PyTorchJob's replicas, ``dags/execution/pytorchjob.py``): every
replica runs ``posttrain stage trainer``; the ``PET_*`` variables (``components/core/nodes.py``) make
torchrun join the job's rendezvous with ``trainer.processes`` workers per node. Node 0
runs this stage as above; the other nodes run ``follow`` (through
``runner.follow_stage``): the same plan from the same inputs, their share of every
step, and no manifest, checkpoint, registry version or MLflow run of their own.

Not covered: resuming half-way through one trainer stage (a killed stage re-runs from
its starting checkpoint, by the stage contract), starting the nodes (a cluster engine
does), serving
adapters unmerged or merging them between steps, and drawing fresh rollouts when too
few groups are informative (dynamic sampling refills only from what taskgen
oversampled).

Benchmarks call ``distributed.train`` directly to time N steps with P processes on one
global batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from components.core import models, stages, tracking
from components.core.context import StageContext
from components.core.facts import Checkpoint, StartingPolicy
from components.core.manifest import WEIGHTS, InputRef
from components.core.nodes import Node, this_node
from components.core.policy import load_policy, save_policy
from components.core.progress import bar, say
from components.core.records import Reward, Rollout
from components.core.seeds import seed_everything
from components.core.storage import Store, sha256_bytes
from components.trainer import distributed
from components.trainer.device import prepare_model, resolve_device
from components.trainer.grpo import StepStats, grpo_step, step_batches
from components.trainer.lora import apply_lora, merge_for_save
from components.trainer.sampling import Selection, collect_groups, select_groups
from components.trainer.state import (
    STATE_FILE,
    DataPosition,
    build_optimizer,
    build_scheduler,
    load_trainer_state,
    read_trainer_state,
    save_trainer_state,
)

SECTIONS = ("trainer", "rollout", "taskgen")
"""Recipe sections read: the optimizer settings, the sampling temperature of the rollouts,
and taskgen's tasks per iteration (the steps dynamic sampling aims at)."""

FIELDS = ("evaluation.max_new_tokens",)
"""Single fields read from other sections (part of the cache key, the rest of the section
not): the completion length evaluation scores with, registered as the new version's
serving default. Not the whole ``evaluation`` section: its decision settings
(``bootstrap_resamples``, ``confidence``) would re-run the trainer for nothing."""


def inputs(ctx: StageContext) -> None:
    ctx.depend_on("validation")
    ctx.depend_on("rollout")
    ctx.depend_on("reward")
    start = ctx.facts_of("taskgen", StartingPolicy)
    ctx.inputs["policy"] = InputRef(uri=start.policy_uri, digest=f"version:{start.policy_version}")


@dataclass(frozen=True)
class Plan:
    """What the steps train on, the same on every node: the starting policy and its
    version, the chosen groups and the step batches."""

    start: StartingPolicy
    policy: object
    selection: Selection
    batches: list

    def launched(self, cfg, node: Node) -> bool:
        """Whether the steps run under torchrun: several processes or nodes, or FSDP2 (which
        needs a process group, even of one)."""
        return (cfg.processes > 1 or cfg.parallelism == "fsdp" or node.multi) and bool(self.batches)


def plan(ctx: StageContext) -> Plan:
    """Load the starting policy and choose the steps' batches (seeded, no side effects)."""
    cfg = ctx.recipe.trainer
    start = ctx.facts_of("taskgen", StartingPolicy)
    policy = load_policy(start.policy_uri, start.policy_version)
    # Steps per epoch dynamic sampling aims at: the iteration's tasks before oversampling.
    target_steps = ctx.recipe.taskgen.tasks_per_iteration // cfg.prompts_per_step
    rewards = ctx.read_records("reward", "rewards", Reward)
    rollouts = ctx.read_joined("rollout", "rollouts", Rollout, "rollout_id", {r.rollout_id for r in rewards})
    selection = select_groups(collect_groups(rollouts, rewards),
                              dynamic=cfg.dynamic_sampling, prompts_per_step=cfg.prompts_per_step,
                              target_steps=target_steps, seed=ctx.seed("dynamic_sampling"))
    batches = step_batches(selection.groups, cfg.prompts_per_step, cfg.epochs, ctx.seed("batches"))
    return Plan(start, policy, selection, batches)


def follow(ctx: StageContext) -> None:
    """A node other than 0 of a trainer placed on several nodes (``nodes.this_node()``):
    the same plan, its share of every step under torchrun, and nothing written to the store
    or the tracking server (node 0 stores, registers and logs)."""
    node = this_node()
    cfg = ctx.recipe.trainer
    p = plan(ctx)
    if not p.batches:
        say(f"iter {ctx.iteration} | trainer | node {node.rank} of {node.count} | no steps to train; node 0 stores the policy")
        return
    carried = _carried(p.start.policy_uri, cfg)
    with distributed.work_folder() as tmp:
        say(f"iter {ctx.iteration} | trainer | node {node.rank} of {node.count} | {len(p.batches)} steps under torchrun, "
            f"{cfg.processes} processes here ({cfg.parallelism})")
        distributed.train(p.policy, p.batches, cfg, temperature=ctx.recipe.rollout.temperature, seed=ctx.seed(),
                          iteration=ctx.iteration, workdir=tmp, carried=carried, timeout_s=_timeout(ctx), node=node)
    say(f"iter {ctx.iteration} | trainer | node {node.rank} of {node.count} | done; node 0 stores the checkpoint")


def run(ctx: StageContext) -> dict[str, float]:
    distributed.sweep_work_folders()  # a SIGKILLed earlier trainer's, whichever path this one takes
    cfg = ctx.recipe.trainer
    temperature = ctx.recipe.rollout.temperature  # the rollouts' sampling distribution, for the ratio
    run_id = ctx.mlflow_run_id
    p = plan(ctx)
    start, policy, selection, batches, groups = p.start, p.policy, p.selection, p.batches, p.selection.groups
    datasets = {}
    for stage, name in (("rollout", "rollouts"), ("reward", "rewards")):
        for m in ctx.upstream(stage):
            out = m.outputs[name]
            datasets[f"{name}[{m.shard}]" if m.shard else name] = (ctx.store.url(out.path), out.sha256)
    tracking.log_datasets(run_id, datasets, context="training")
    tracking.client().set_tag(run_id, "posttrain.parent_policy_version", start.policy_version)
    tracking.client().set_tag(run_id, "posttrain.parent_policy_uri", start.policy_uri)

    rel = f"{ctx.prefix}/checkpoint"
    node = this_node()
    launched = p.launched(cfg, node)
    if launched:
        trained = _train_distributed(ctx, policy, batches, start.policy_uri, rel, temperature, node)
    else:
        trained = _train_here(ctx, policy, batches, start.policy_uri, rel, temperature)
    means = step_means(trained.stats)
    for step, stats in enumerate(trained.stats):
        if not trained.logged:
            tracking.log_metrics(run_id, {f"trainer/step/{k}": getattr(stats, k) for k in STEP_METRICS},
                                 step=trained.global_step + step)
    tokens, elapsed = sum(s.tokens for s in trained.stats), trained.seconds
    position = trained.global_step + len(batches)
    ctx.add_checkpoint(rel, rows=trained.parameters, digests=trained.checkpoint_digests)
    ctx.add_output("trainer_state", f"{rel}/{STATE_FILE}", rows=position, digest=trained.state_digest)
    uri = ctx.store.url(rel)
    # The served model's default completion length is evaluation's (what the version is
    # scored on): declared in FIELDS, so that one field is in the cache key, not the section.
    version = models.register_checkpoint(ctx.pipeline, uri, run_id, {
        "posttrain.iteration": str(ctx.iteration), "posttrain.parent_version": start.policy_version,
        "posttrain.run_root": ctx.store.uri,
    }, run_root=ctx.store.uri, max_new_tokens=ctx.recipe.whole.evaluation.max_new_tokens,
       prompt_format=ctx.recipe.rollout.prompt_format, weights_sha256=trained.checkpoint_digests.get(WEIGHTS, ""))
    models.set_alias(ctx.pipeline, "candidate", version, run_root=ctx.store.uri)
    # The run's description (shown first on its page): where the checkpoint is, and its version.
    tracking.client().set_tag(run_id, "mlflow.note.content", f"Checkpoint: `{uri}`\n\nRegistered as "
                              f"`{models.model_name(ctx.pipeline)}` version {version}, trained from version {start.policy_version}.")
    ctx.facts = Checkpoint(checkpoint_uri=uri, version=version, parent_version=start.policy_version)
    if not batches:
        say(no_steps_warning(ctx.iteration, selection, cfg.prompts_per_step, start.policy_version))
    skipped = sum(s.skipped for s in trained.stats)
    if skipped:
        say(f"iter {ctx.iteration} | trainer | WARNING: {skipped} of {len(batches)} steps had a gradient that is not "
            "finite and updated nothing (trainer/skipped_steps); check the rollout's logprobs")
    say(f"iter {ctx.iteration} | trainer | {len(batches)} steps on {len(groups)} groups "
        f"({sum(selection.dropped.values())} dropped, {sum(selection.zero_weight.values())} of loss weight 0, "
        f"{selection.unused} unused) | {cfg.processes} process(es)"
        f"{f' x {node.count} nodes' if node.multi else ''} | "
        f"registered version {version}")
    return {
        "steps": float(len(batches)), "groups": float(len(groups)), **means,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "global_step": float(position), "skipped_steps": float(skipped),
        "carried_optimizer_state": float(trained.carried), "torchrun_processes": float(cfg.processes * node.count if launched else 0),
        "torch_threads": float(trained.threads),
        **selection.metrics(),
    }


def no_steps_warning(iteration: int, selection: Selection, prompts_per_step: int, parent_version: str) -> str:
    """The line printed when no optimizer step ran: why, what the checkpoint is, and the fix.
    Its metrics (``trainer/loss``, ``kl``, ``lr``, ...) still read 0 (``step_means``).
    Not covered: which groups came close (every group's rewards are in the reward stage's
    output)."""
    dropped, zero = sum(selection.dropped.values()), sum(selection.zero_weight.values())
    zero_text = f", {zero} informative groups in domains whose reward.domain_weights is 0" if zero else ""
    if selection.unused:
        why = (f"only {selection.unused} informative groups, fewer than trainer.prompts_per_step ({prompts_per_step}), "
               f"and dynamic sampling trains whole steps only ({dropped} groups had no learning signal{zero_text})")
        fix = "raise taskgen.oversample or lower trainer.prompts_per_step"
    else:
        why = f"none of the {dropped} groups had a learning signal (all rewards in each group equal){zero_text}"
        fix = "raise rollout.group_size or rollout.temperature, or bootstrap further / check the verifier"
        if zero:
            fix = f"give {', '.join(d for d, n in selection.zero_weight.items() if n)} a reward.domain_weights > 0, or {fix}"
    return (f"iter {iteration} | trainer | WARNING: 0 steps: {why}; the new checkpoint holds the parent's weights "
            f"(version {parent_version}); fix: {fix}")


STEP_METRICS = ("loss", "clip_frac", "kl", "entropy", "grad_norm", "lr")
"""Logged per optimizer step as ``trainer/step/<name>``."""


def step_means(stats: list) -> dict[str, float]:
    """The stage's ``STEP_METRICS``: means over the steps that updated the policy (a skipped
    step's loss and gradient norm are not finite, and would make every mean NaN); 0 with none."""
    kept = [s for s in stats if not s.skipped]
    return {k: sum(getattr(s, k) for s in kept) / max(1, len(kept)) for k in STEP_METRICS}


@dataclass(frozen=True)
class Outcome:
    """What either path leaves behind: the per-step stats (already logged when ``logged``),
    the stored checkpoint's and trainer state's digests, the parameter count, the global
    step the run started at and whether it carried optimizer state in."""

    stats: list[StepStats]
    checkpoint_digests: dict[str, str]  # {file in the checkpoint folder: sha256}
    state_digest: str
    parameters: int
    global_step: int
    carried: bool
    logged: bool
    seconds: float  # training time (the distributed path's includes the workers' start)
    threads: int = 1  # torch's intra-op threads per process (torchrun's workers run 1)


def _train_here(ctx: StageContext, policy, batches, start_uri: str, rel: str, temperature: float) -> Outcome:
    """The steps in this process, on ``trainer.device`` (the path of ``trainer.processes: 1``)."""
    cfg, run_id = ctx.recipe.trainer, ctx.mlflow_run_id
    device = resolve_device(cfg.device)
    seed_everything(ctx.seed())  # LoRA's adapter initialisation draws from it
    model = prepare_model(apply_lora(policy.model, cfg.lora), device, cfg.gradient_checkpointing)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    carried = None
    if cfg.carry_optimizer_state:  # under LoRA (fresh adapters each iteration) only the schedule's position
        carried = load_trainer_state(Store(start_uri, "policy"), "", optimizer, scheduler, cfg, restore_rng=False)
    global_step = carried.global_step if carried else 0
    # Seeded after loading (not before): a library imported for the first time may draw from
    # the global streams (transformers' first AutoModel import reaches rich, which does), so
    # seeding earlier would leave the saved RNG state depending on what the process imported
    # before: a stage in a fresh container and one in a long-lived worker would differ.
    seed_everything(ctx.seed())
    stats, started = [], time.perf_counter()
    with bar("trainer", len(batches)) as advance:
        for step, batch in enumerate(batches):
            s = grpo_step(model, optimizer, batch, pad_id=policy.pad_id, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef,
                          temperature=temperature, micro_batch_size=cfg.micro_batch_size,
                          max_grad_norm=cfg.max_grad_norm, micro_batch_tokens=cfg.micro_batch_tokens,
                          loss_aggregation=cfg.loss_aggregation, scheduler=scheduler, packing=cfg.packing,
                          dtype=cfg.dtype)
            stats.append(s)
            tracking.log_metrics(run_id, {f"trainer/step/{k}": getattr(s, k) for k in STEP_METRICS},
                                 step=global_step + step)
            advance(1)
    seconds = time.perf_counter() - started
    model = merge_for_save(model).to("cpu")
    model.eval()
    digests = save_policy(model, policy.tokenizer, ctx.store, rel)
    position = DataPosition(iteration=ctx.iteration, steps_done=len(batches), global_step=global_step + len(batches))
    state_digest = save_trainer_state(ctx.store, rel, optimizer, scheduler, position)
    import torch

    return Outcome(stats, digests, state_digest, sum(p.numel() for p in model.parameters()),
                   global_step, carried is not None, logged=True, seconds=seconds, threads=torch.get_num_threads())


def _carried(start_uri: str, cfg) -> bytes | None:
    """The starting checkpoint's trainer state, when it is carried in."""
    source = Store(start_uri, "policy")
    if cfg.carry_optimizer_state and source.exists(STATE_FILE):
        return source.read_bytes(STATE_FILE)
    return None


def _timeout(ctx: StageContext) -> float:
    return ctx.recipe.whole.timeouts.get("trainer", stages.spec("trainer").timeout_s)


def _train_distributed(ctx: StageContext, policy, batches, start_uri: str, rel: str, temperature: float,
                       node: Node) -> Outcome:
    """The steps under torchrun (``distributed.train``), then the consolidated checkpoint and
    the trainer state uploaded beside each other as the in-process path stores them."""
    cfg = ctx.recipe.trainer
    carried = _carried(start_uri, cfg)
    with distributed.work_folder() as tmp:
        on = f" x {node.count} nodes" if node.multi else ""
        say(f"iter {ctx.iteration} | trainer | {len(batches)} steps under torchrun, {cfg.processes} processes{on} "
            f"({cfg.parallelism})")
        started = time.perf_counter()
        result = distributed.train(policy, batches, cfg, temperature=temperature, seed=ctx.seed(),
                                   iteration=ctx.iteration, workdir=tmp, carried=carried,
                                   timeout_s=_timeout(ctx), node=node)
        assert result is not None  # node 0 gets the results
        seconds = time.perf_counter() - started
        digests = ctx.store.upload_dir(result.checkpoint, rel)
        data = result.trainer_state.read_bytes()
        ctx.store.write_bytes(f"{rel}/{STATE_FILE}", data)
    position = read_trainer_state(data, ctx.store.url(f"{rel}/{STATE_FILE}"))["position"]
    return Outcome(result.stats, digests, sha256_bytes(data), result.parameters,
                   int(position["global_step"]) - len(batches), carried is not None, logged=False, seconds=seconds)
