"""posttrain's GRPO against TRL's ``GRPOTrainer``, side by side on the same policy.

Goals (issues): at least TRL's held-out accuracy at no more than TRL's seconds per step; and
learning per second: posttrain reaches TRL's 30-step held-out accuracy in at most 0.7x TRL's
30-step training time (mean of the seeds).

Both trainers start from the SAME warm-started policy: a small Llama-architecture model
(``ModelConfig(hidden 128, 4 layers, 4 heads, intermediate 384)``, the demo's character
tokenizer) after a short SFT on arithmetic reference completions, stopped as soon as
the greedy check accuracy enters 20-50% (cached under ``--cache``, so a re-run skips
it). Each then trains ``--steps`` optimizer steps on the same arithmetic prompts in the
same order: per step 16 prompts x 8 samples, temperature 1, no top-k/top-p, at most 8
new tokens, no KL (beta 0), clip 0.2, token-mean loss over the step (posttrain
``token_mean``; TRL ``loss_type="dapo"``), group-std-scaled advantages, one AdamW step
per batch (the same optimizer: AdamW betas (0.9, 0.99), no weight decay, constant lr,
grad-norm clip 1), one forward/backward of all 128 sequences, same seed and torch
threads. Rewards come from the arithmetic verifier for both.

- ``posttrain``: ``HFEngine.generate_groups`` sampling with recorded logprobs (as the rollout
  stage calls it: each prompt once with the group size), the arithmetic verifier,
  ``group_advantages``, the trainer's group filter (groups whose advantages are all 0 are
  dropped, as ``components/trainer/stage.py`` does) and ``grpo_step``, all in process.
- ``trl``: ``trl.GRPOTrainer`` (transformers generation, ``steps_per_generation=1``,
  ``num_iterations=1``, so one generation and one optimizer step per batch).

posttrain calls ``grpo_step`` (the trainer stage's update, public API) with every
``TrainerConfig`` setting it takes at the recipe default, except the shared ones above and
one micro-batch of 128 sequences (as TRL runs it), so a faster trainer path that the
pipeline gets by default (packing, say) is what this benchmark measures too.

The training clock counts each step from the end of the previous one (generation, reward
and update). Held-out accuracy is greedy pass@1 on a fixed set of ``--eval-tasks``
arithmetic tasks (never trained on), scored by the same code for both, evaluated every
``--eval-every`` steps along each run; each evaluation is left out of the training clock,
caches nothing and restores the Python/NumPy/torch RNG states (the engine reseeds torch),
so it changes neither side's sampling. Each run thus gives a (training seconds, accuracy)
curve. Reported:

- equal steps: seconds per step (median, the first step of each run excluded as warm-up)
  and the accuracy after ``--steps`` steps, mean of seeds (the line ``posttrain/TRL s/step``);
- equal wall-clock time: posttrain's accuracy at TRL's ``--steps``-step training time: per
  seed, posttrain's last evaluation at or before that seed's TRL time, then the mean of the
  seeds. For this posttrain trains past ``--steps`` until its clock passes 1.3x that seed's
  TRL time (TRL runs first on even seeds) or, where posttrain runs first, 2x the longest
  TRL time so far (the machine's load swings);
- time to TRL's accuracy: the first evaluation, not interpolated, at which posttrain's
  seed-mean curve (at each evaluated step: the mean of the seeds' accuracies and of their
  training seconds) is at or above TRL's seed-mean accuracy after ``--steps`` steps; its
  seconds over TRL's seed-mean ``--steps``-step seconds. The last line reads
  ``time to TRL's 30-step accuracy: posttrain / TRL = N.NNx (goal <= 0.7)`` (the last line
  on stdout). The same rule on TRL's own curve is printed beside it: with noisy evaluations
  a first crossing comes early, and anything below 1.00x there shows by how much. Printed
  too: the per-seed crossings, and how far evaluation noise alone moves the ratio (the
  binomial standard error of a seed-mean accuracy, in the target and in the curve, over
  the least-squares slope of posttrain's seed-mean curve): with 3 seeds and 200 tasks about
  +-0.25x, with 6 seeds about +-0.15x;
- the same on a process-CPU-time clock (evaluation excluded as well), which other load on
  the machine inflates less than the wall clock, and posttrain's step time by phase
  (generate, reward, update).

A third row, ``posttrain-lora``, runs posttrain's trainer with LoRA (``--lora-rank`` 8
through ``components.trainer.lora.apply_lora``: adapters on the attention projections,
base weights frozen) at ``--lora-lr`` (default 1e-3: adapters take a larger rate than
full fine-tuning), on the same prompts, seeds and number of steps, in the same run (the
order of the three alternates by seed). It reports what the others do at equal steps, and
for both posttrain rows the trained (completion) tokens per second, of the whole step and
of its update phase, and the trainable parameter count.

Multi-process rows (``processes.py``): the first seed's posttrain steps, replayed from the
warm start through ``components.trainer.distributed.train`` (the trainer stage's torchrun
launch) with 1 process, 2 with DDP and 2 with FSDP2 on the same global batches: trained
tokens/s end to end (launch to checkpoint) and steady (a long launch minus a one-step
launch), and how far each width's final weights are from the 1-process run's. Their line
reads ``processes: 2 (DDP) / 1 on the same global batches = ...``. ``--quick`` launches 1
and 2 (DDP) once each over its 3 steps, end to end only.

The evaluations do not change either trajectory: a run without them ends at the same
accuracies (the runs are deterministic for a seed), only the clocks move with the load.

Writes ``benchmarks/trainer/results.json``, ``results.md`` and the curves as
``results.svg`` (or into ``--out``). The machine's 1-minute load average before and after
each run is recorded: other load slows whichever trainer it hits, so the two alternate.

    python benchmarks/trainer/bench.py [--steps 30] [--seeds 3] [--eval-tasks 200] [--eval-every 2] [--threads 1] [--lr 1e-4]
                                       [--lora-rank 8] [--lora-lr 1e-3]
    python benchmarks/trainer/bench.py --quick [--out DIR]

``--quick`` is a smoke run through the same code (a short SFT warm start cached apart from
the full run's, 3 RL steps, one seed, 20 held-out tasks evaluated after every step): it
prints the same ratio lines and writes no results unless ``--out`` is given.

Needs ``trl`` (``pip install -e '.[bench]'``). Known differences that remain: TRL scales
advantages by the unbiased group std (ddof 1) plus 1e-4, posttrain by the population std
plus 1e-6; TRL keeps zero-signal groups in the token-mean denominator, posttrain drops
them (so its effective step is larger when many groups are all-right or all-wrong);
posttrain records sampling logprobs during generation, TRL does not need them on-policy.
Not measured: GPU speed, multi-process speed on TRL's side, and vLLM generation in either.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: benchmarks/ is not an installed package

from benchmarks.provenance import provenance, provenance_line  # noqa: E402

PROMPTS_PER_STEP, SAMPLES = 16, 8
MAX_NEW_TOKENS = 8
EXTRA_STEPS = 4  # posttrain runs at most this many times --steps, to reach TRL's training time
BUDGET_MARGIN = 1.3  # ... and stops once its clock passes this multiple of TRL's --steps time
TIME_GOAL = 0.7  # posttrain's time to TRL's --steps accuracy, as a share of TRL's --steps time
LORA = "posttrain-lora"
TRAINERS = (LORA, "posttrain", "trl")  # reversed on even seeds: TRL runs before posttrain there
TIME_DEFINITION = ("the first evaluation (not interpolated) at which posttrain's seed-mean curve is at or above TRL's "
                   "seed-mean accuracy after --steps steps; its seed-mean training seconds there, divided by TRL's "
                   "seed-mean training seconds for --steps steps.")


def model_config():
    from components.core.recipe import ModelConfig

    return ModelConfig(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384, max_positions=64)


def greedy_accuracy(policy, tasks) -> float:
    from components.domains import registry
    from components.rollout.hf_engine import HFEngine

    domain = registry.get("arithmetic")
    policy.model.eval()
    out = HFEngine().generate(policy, [t.prompt for t in tasks], MAX_NEW_TOKENS, 1.0, seed=0, batch_size=100, greedy=True)
    return sum(domain.verify(t, s.text, None).passed for t, s in zip(tasks, out)) / len(tasks)


class Evaluator:
    """Greedy held-out accuracy during a run, off the training clock.

    The engine reseeds torch's global generator, so the Python, NumPy and torch RNG states
    are saved before and restored after: an evaluation never changes what a trainer samples
    next. The model's train/eval mode is restored too. Nothing is cached between calls;
    every evaluation generates all ``eval_set`` completions afresh, for both trainers alike.
    """

    def __init__(self, eval_set) -> None:
        self.eval_set = eval_set
        self.seconds = 0.0  # time spent evaluating (excluded from the training clock)

    def __call__(self, policy) -> float:
        import numpy as np
        import torch

        started = time.perf_counter()
        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        was_training = policy.model.training
        try:
            return greedy_accuracy(policy, self.eval_set)
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])
            policy.model.train(was_training)
            self.seconds += time.perf_counter() - started


def eval_due(step: int, steps: int, every: int) -> bool:
    """Evaluate after optimizer step ``step`` (1-based): every ``every`` steps and at ``steps``."""
    return step % every == 0 or step == steps


def warm_start(cache: Path, seed: int, eval_ids: set[str], max_steps: int = 1500, check_every: int = 25) -> tuple[Path, dict]:
    """SFT on arithmetic reference completions until the check accuracy is in [0.2, 0.5];
    cached. Returns (the policy's folder, the SFT's facts)."""
    import torch

    from components.core.policy import EOS, Policy, build_model, build_tokenizer, pad_batch, save_policy, token_logprobs
    from components.core.storage import Store
    from components.domains import registry

    cfg = model_config()
    # v2: the policy in a "policy" folder beside bench_sft.json (a store's root cannot hold a checkpoint)
    folder = cache / f"sft2-h{cfg.hidden_size}-l{cfg.num_layers}-i{cfg.intermediate_size}-s{seed}-e{len(eval_ids)}"
    if max_steps != 1500:  # a shortened warm start is cached apart from the full one
        folder = folder.with_name(f"{folder.name}-m{max_steps}")
    info_file = folder / "bench_sft.json"
    if info_file.exists():
        return folder / "policy", json.loads(info_file.read_text())
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    policy = Policy(model=build_model(cfg, len(tokenizer)), tokenizer=tokenizer, uri="memory://sft")
    domain = registry.get("arithmetic")
    rng = random.Random(seed)
    check = domain.train_tasks(random.Random(seed + 1), 100, eval_ids)
    exclude = eval_ids | {t.task_id for t in check}
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3, weight_decay=0.01)
    started, acc, step = time.perf_counter(), 0.0, 0
    for step in range(1, max_steps + 1):
        tasks = [domain.draw(rng, "train", exclude) for _ in range(64)]
        examples = [(policy.encode_prompt(t.prompt),
                     list(tokenizer(domain.reference_completion(t), add_special_tokens=False)["input_ids"]) + [EOS])
                    for t in tasks]
        ids, attn, mask = pad_batch(examples, policy.pad_id)
        policy.model.train()
        logp, _ = token_logprobs(policy.model, ids, attn)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        optimizer.step()
        if step % check_every == 0 or step == max_steps:
            acc = greedy_accuracy(policy, check)
            print(f"sft | step {step} | loss {loss.item():.3f} | check acc {acc:.2f}", flush=True)
            if acc >= 0.2:
                break
    info = {"sft_steps": step, "sft_check_accuracy": acc, "sft_seconds": round(time.perf_counter() - started, 1)}
    folder.mkdir(parents=True, exist_ok=True)
    save_policy(policy.model.eval(), tokenizer, Store(str(folder), "cache"), "policy")
    info_file.write_text(json.dumps(info))
    return folder / "policy", info


def train_tasks(seed: int, steps: int, eval_ids: set[str]):
    """``steps`` x 16 distinct train tasks (none from the eval set), in step order."""
    from components.domains import registry

    return registry.get("arithmetic").train_tasks(random.Random(seed + 2), steps * PROMPTS_PER_STEP, eval_ids)


class Cfg:  # the trainer settings both sides use (build_optimizer reads learning_rate)
    def __init__(self, lr: float) -> None:
        self.learning_rate = lr


def trainer_options(micro_batch_size: int) -> dict:
    """``grpo_step``'s keyword settings as the pipeline's trainer stage passes them: every
    ``TrainerConfig`` field that ``grpo_step`` takes by name, at the recipe default, so an
    option the trainer gains (and its default) reaches this benchmark too. Overridden here:
    the benchmark's shared settings (clip, no KL, grad clip, token mean) and one micro-batch
    for the whole step, as TRL runs it."""
    import inspect

    from components.core.recipe import TrainerConfig
    from components.trainer.grpo import grpo_step

    cfg = TrainerConfig()
    params = inspect.signature(grpo_step).parameters
    options = {k: getattr(cfg, k) for k in type(cfg).model_fields if k in params}
    options.update(clip_eps=0.2, kl_coef=0.0, max_grad_norm=1.0, loss_aggregation="token_mean",
                   micro_batch_size=micro_batch_size)
    return {k: v for k, v in options.items() if k in params}


def throughput(runs: list[dict], steps: int) -> dict:
    """Trained (completion) tokens per second of a posttrain trainer over steps 2..``steps`` of
    all its runs: of the whole step, and of its update phase alone. Empty for TRL, whose
    steps report no token counts."""
    if not runs or runs[0].get("tokens") is None:
        return {}
    tokens = sum(t for r in runs for t in r["tokens"][1:steps])
    step_s = sum(x for r in runs for x in r["step_s"][1:steps])
    update_s = sum(x for r in runs for x in r["phases"]["update"][1:steps])
    return {"tokens_per_s": tokens / step_s, "update_tokens_per_s": tokens / update_s if update_s else 0.0,
            "trainable_parameters": runs[0]["trainable_parameters"]}


def run_posttrain(folder: Path, tasks, steps: int, lr: float, seed: int, evaluate: Evaluator, every: int,
                  budget_s: float = 0.0, max_steps: int = 0, lora_rank: int = 0) -> dict:
    """``steps`` optimizer steps, then more (up to ``max_steps``) until the training clock
    reaches ``budget_s``: the accuracy curve must reach TRL's training time. With
    ``lora_rank`` the policy trains through ``apply_lora`` (the trainer's LoRA: adapters on
    the attention projections, base frozen) and is evaluated with its adapters on."""
    import torch

    from components.core.policy import load_policy
    from components.core.recipe import LoraConfig
    from components.domains import registry
    from components.reward.advantages import group_advantages
    from components.rollout.hf_engine import HFEngine
    from components.trainer.grpo import Sample, grpo_step
    from components.trainer.lora import apply_lora, trainable_parameters
    from components.trainer.state import build_optimizer

    policy = load_policy(str(folder))
    policy.model = apply_lora(policy.model, LoraConfig(rank=lora_rank))
    torch.manual_seed(seed)
    domain, engine = registry.get("arithmetic"), HFEngine()
    optimizer = build_optimizer(policy.model, Cfg(lr))
    options = trainer_options(PROMPTS_PER_STEP * SAMPLES)
    max_steps = max(steps, min(max_steps or steps, len(tasks) // PROMPTS_PER_STEP))
    step_s, rewards, curve, train_s, cpu_s, tokens, batches = [], [], [], 0.0, 0.0, [], []
    phases: dict[str, list[float]] = {"generate": [], "reward": [], "update": []}  # seconds per step
    for step in range(max_steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        batch = tasks[step * PROMPTS_PER_STEP:(step + 1) * PROMPTS_PER_STEP]
        policy.model.eval()
        # As the rollout stage asks: each prompt once, with the group size (the engine may share its prefill).
        out = engine.generate_groups(policy, [t.prompt for t in batch], SAMPLES, MAX_NEW_TOKENS, 1.0,
                                     seed=seed + 1000 * step, batch_size=PROMPTS_PER_STEP * SAMPLES)
        generated = time.perf_counter()
        scores = [domain.verify(batch[i // SAMPLES], s.text, None).score for i, s in enumerate(out)]
        samples = []
        for g in range(PROMPTS_PER_STEP):
            group = scores[g * SAMPLES:(g + 1) * SAMPLES]
            adv = group_advantages(group, eps=1e-6, scale_by_std=True)
            if any(a != 0 for a in adv):
                samples += [Sample(s.prompt_ids, s.completion_ids, s.logprobs, a)
                            for s, a in zip(out[g * SAMPLES:(g + 1) * SAMPLES], adv)]
        rewarded = time.perf_counter()
        tokens.append(sum(s.trained_tokens for s in samples))
        batches.append(samples)
        if samples:
            grpo_step(policy.model, optimizer, samples, pad_id=policy.pad_id, temperature=1.0, **options)
        rewards.append(sum(scores) / len(scores))
        step_s.append(time.perf_counter() - started)
        for k, v in (("generate", generated - started), ("reward", rewarded - generated),
                     ("update", started + step_s[-1] - rewarded)):
            phases[k].append(round(v, 4))
        train_s += step_s[-1]
        cpu_s += time.process_time() - cpu_started
        done = step + 1 >= steps and (train_s >= budget_s or step + 1 == max_steps)
        if eval_due(step + 1, steps, every) or done:
            curve.append((step + 1, round(train_s, 4), evaluate(policy), round(cpu_s, 4)))
        if done:
            break
    policy.model.eval()
    return {"step_s": step_s, "rewards": rewards, "curve": curve, "phases": phases, "tokens": tokens,
            "trainable_parameters": trainable_parameters(policy.model)[0], "batches": batches}


def run_trl(folder: Path, tasks, steps: int, lr: float, seed: int, threads: int, evaluate: Evaluator,
            every: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from components.core.policy import load_policy
    from components.domains import registry
    from components.trainer.state import build_optimizer

    policy = load_policy(str(folder))
    tokenizer, model = policy.tokenizer, policy.model
    domain = registry.get("arithmetic")
    # TRL tokenises the prompt text as it is; our tokenizer adds no BOS, so spell it out.
    data = Dataset.from_dict({"prompt": [tokenizer.bos_token + t.prompt for t in tasks], "index": list(range(len(tasks)))})
    ids = tokenizer(data[0]["prompt"])["input_ids"]
    assert ids == policy.encode_prompt(tasks[0].prompt), (ids, policy.encode_prompt(tasks[0].prompt))

    calls: list[tuple[list[int], float]] = []  # (prompt indices, mean reward) per generation batch

    def arithmetic_reward(completions, index, **_):
        scores = [domain.verify(tasks[i], c, None).score for c, i in zip(completions, index)]
        calls.append((sorted(set(index)), sum(scores) / len(scores)))
        return scores

    class Clock(TrainerCallback):
        """The training clock: each step's time from the end of the previous one (or the
        start of training), with the held-out evaluation after a step left out of it."""

        def __init__(self) -> None:
            self.resumed, self.train_s, self.cpu_resumed, self.cpu_s = 0.0, 0.0, 0.0, 0.0
            self.step_s: list[float] = []
            self.curve: list[tuple[int, float, float, float]] = []  # (step, seconds, accuracy, CPU seconds)

        def on_train_begin(self, args, state, control, **kw):
            self.resumed, self.cpu_resumed = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, model=None, **kw):
            self.step_s.append(time.perf_counter() - self.resumed)
            self.train_s += self.step_s[-1]
            self.cpu_s += time.process_time() - self.cpu_resumed
            if eval_due(state.global_step, steps, every):
                policy.model = model if model is not None else trainer.model
                self.curve.append((state.global_step, round(self.train_s, 4), evaluate(policy), round(self.cpu_s, 4)))
            self.resumed, self.cpu_resumed = time.perf_counter(), time.process_time()

    clock = Clock()
    out_dir = tempfile.mkdtemp(prefix="posttrain-bench-trl-")
    args = GRPOConfig(
        output_dir=out_dir, max_steps=steps, learning_rate=lr, seed=seed, data_seed=seed, use_cpu=True, bf16=False,
        gradient_checkpointing=False, per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, num_generations=SAMPLES,
        max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0, beta=0.0, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", max_grad_norm=1.0, shuffle_dataset=False, report_to="none",
        logging_steps=10**6, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    optimizer = build_optimizer(model, Cfg(lr))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=args, train_dataset=data,
                          processing_class=tokenizer, optimizers=(optimizer, scheduler), callbacks=[clock])
    torch.set_num_threads(threads)  # Trainer/accelerate setup may have changed it
    trainer.train()
    rewards = [r for _, r in calls]
    expected = [list(range(k * PROMPTS_PER_STEP, (k + 1) * PROMPTS_PER_STEP)) for k in range(steps)]
    assert [i for i, _ in calls] == expected, "TRL did not see the same prompts in the same order"
    trainer.model.eval()
    assert [c[0] for c in clock.curve][-1:] == [steps], "TRL's last step was not evaluated"
    return {"step_s": clock.step_s, "rewards": rewards, "curve": clock.curve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=3, help="RL runs per trainer (seeds seed..seed+n-1: prompts and sampling)")
    ap.add_argument("--eval-tasks", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both (1: least disturbed by other load)")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "posttrain-bench-trainer"))
    ap.add_argument("--eval-every", type=int, default=2, help="held-out evaluation every N optimizer steps (off the clock)")
    ap.add_argument("--only", choices=list(TRAINERS), default=None, help="run one trainer only (debugging)")
    ap.add_argument("--lora-rank", type=int, default=8, help="adapter rank of the posttrain-lora row (0: no such row)")
    ap.add_argument("--lora-lr", type=float, default=1e-3, help="learning rate of the posttrain-lora row (adapters "
                    "usually take about 10x the full fine-tuning rate)")
    ap.add_argument("--process-epochs", type=int, default=3, help="multi-process rows: passes over the first seed's "
                    "recorded steps in the long launch")
    ap.add_argument("--process-repeats", type=int, default=2, help="multi-process rows: launches per width (0: no rows)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: short warm start, 3 steps, 1 seed, 20 eval tasks; writes results only with --out")
    ap.add_argument("--out", default=None, help="folder for results.json/results.md (default: beside this script; "
                    "with --quick: none written unless given)")
    args = ap.parse_args()
    sft_steps, check_every = 1500, 25
    if args.quick:
        args.steps, args.seeds, args.eval_tasks, args.eval_every = 3, 1, 20, 1
        args.process_epochs, args.process_repeats = 1, min(args.process_repeats, 1)
        sft_steps, check_every = 40, 20
    out_dir = Path(args.out) if args.out else (None if args.quick else HERE)
    if args.only in (None, "trl") and importlib.util.find_spec("trl") is None:
        raise SystemExit("benchmarks/trainer/bench.py needs TRL (the bench extra): pip install -e '.[bench]'")

    names = [n for n in TRAINERS if (not args.only or n == args.only) and (n != LORA or args.lora_rank)]
    os.environ["POSTTRAIN_TORCH_THREADS"] = str(args.threads)
    import torch
    import transformers

    from components.core.policy import load_policy
    from components.core.seeds import configure_torch
    from components.domains import registry

    # Everything both sides use, imported once before the first run: one run, one version of the code.
    for module in ("components.reward.advantages", "components.rollout.hf_engine", "components.trainer.grpo",
                   "components.trainer.state", "trl", "datasets"):
        if module not in ("trl", "datasets") or "trl" in names:
            importlib.import_module(module)
    configure_torch()
    eval_set = registry.get("arithmetic").eval_set(args.eval_tasks, seed=12345)
    eval_ids = {t.task_id for t in eval_set}
    folder, sft = warm_start(Path(args.cache), args.seed, eval_ids, sft_steps, check_every)
    start_acc = greedy_accuracy(load_policy(str(folder)), eval_set)
    print(f"warm start: {sft} | held-out greedy accuracy {start_acc:.3f}", flush=True)

    runs: dict[str, list[dict]] = {n: [] for n in names}
    recorded: list = []  # the first seed's posttrain steps, replayed at 1 and 2 processes
    trl_times: dict[int, float] = {}
    load_start = os.getloadavg()  # the measured runs start here (the warm start before them is not timed)
    for seed in range(args.seed, args.seed + args.seeds):
        tasks = train_tasks(seed, args.steps * EXTRA_STEPS, eval_ids)
        # Alternate the order, so slow drifts in the machine's load hit every trainer alike
        # (TRL first on even seeds: posttrain's time budget is then this seed's TRL time).
        for name in names[::-1] if (seed - args.seed) % 2 == 0 else names:
            torch.set_num_threads(args.threads)
            evaluate = Evaluator(eval_set)
            load_before, started = os.getloadavg()[0], time.perf_counter()
            if name == "posttrain":
                # This seed's TRL time when TRL went first; else twice the longest so far (load swings).
                budget = (BUDGET_MARGIN * trl_times[seed] if seed in trl_times
                          else 2 * max(trl_times.values(), default=0.0))
                run = run_posttrain(folder, tasks, args.steps, args.lr, seed, evaluate, args.eval_every, budget,
                                    args.steps * EXTRA_STEPS)
            elif name == LORA:  # equal steps only: no time budget to reach
                run = run_posttrain(folder, tasks, args.steps, args.lora_lr, seed, evaluate, args.eval_every,
                                    lora_rank=args.lora_rank)
            else:
                run = run_trl(folder, tasks[:args.steps * PROMPTS_PER_STEP], args.steps, args.lr, seed, args.threads,
                              evaluate, args.eval_every)
            wall = time.perf_counter() - started
            if name == "posttrain" and seed == args.seed:
                recorded = run["batches"][:args.steps]
            curve = [(0, 0.0, start_acc, 0.0)] + run["curve"]  # both start from the same checkpoint, evaluated once
            at_steps = point_at_step(curve, args.steps)
            if name == "trl":
                trl_times[seed] = at_steps[1]
            step_s, rewards = run["step_s"], run["rewards"]
            steady = step_s[1:args.steps]
            runs[name].append({
                "seed": seed, "accuracy": at_steps[2], "train_s_at_steps": at_steps[1],
                "s_per_step_median": statistics.median(steady), "s_per_step_mean": statistics.mean(steady),
                "first_step_s": round(step_s[0], 4), "steps_run": len(step_s), "step_s": [round(x, 4) for x in step_s],
                "train_reward": [round(r, 4) for r in rewards[:args.steps]],
                "train_reward_after_steps": [round(r, 4) for r in rewards[args.steps:]],
                "curve": [{"step": k, "train_s": t, "accuracy": a, "cpu_s": c} for k, t, a, c in curve],
                "eval_s": round(evaluate.seconds, 1), "wall_s": round(wall, 1), "phases": run.get("phases"),
                "tokens": run.get("tokens"), "trainable_parameters": run.get("trainable_parameters"),
                "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]})
            print(f"seed {seed} | {name:9s} | {statistics.median(steady):.3f} s/step (median of {len(steady)}, first "
                  f"{step_s[0]:.2f} s) | held-out accuracy {start_acc:.3f} -> {at_steps[2]:.3f} after {args.steps} steps "
                  f"({at_steps[1]:.1f} s of training; {len(step_s)} steps run, {curve[-1][2]:.3f} after the last) | "
                  f"mean train reward {statistics.mean(rewards[:args.steps]):.3f} | {len(curve) - 1} evaluations, "
                  f"{evaluate.seconds:.1f} s off the clock | load {load_before:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    procs, procs_md = None, ""
    if recorded and args.process_repeats:
        from benchmarks.trainer import processes

        procs = processes.measure(folder, recorded, args.lr, args.seed, epochs=args.process_epochs,
                                  repeats=args.process_repeats, **(
                                      {"widths": processes.WIDTHS[:2], "steady": False} if args.quick else {}))
        print(processes.ratio_line(procs), flush=True)
        procs_md = "\n" + processes.markdown(procs)
    summary = {n: {"s_per_step": statistics.median([x for r in rs for x in r["step_s"][1:args.steps]]),
                   "accuracy_mean": statistics.mean(r["accuracy"] for r in rs),
                   "accuracies": [r["accuracy"] for r in rs],
                   "train_s_at_steps_mean": statistics.mean(r["train_s_at_steps"] for r in rs),
                   "train_reward_mean": statistics.mean(x for r in rs for x in r["train_reward"]),
                   **throughput(rs, args.steps)} for n, rs in runs.items()}
    for n, v in summary.items():
        rate = (f" | {v['tokens_per_s']:.0f} trained tokens/s ({v['update_tokens_per_s']:.0f} in the update), "
                f"{v['trainable_parameters']:,} trainable parameters" if "tokens_per_s" in v else "")
        print(f"{n:9s} | {v['s_per_step']:.3f} s/step (median over all seeds) | accuracy {v['accuracy_mean']:.3f} "
              f"(per seed {', '.join(f'{a:.3f}' for a in v['accuracies'])}) after {args.steps} steps, "
              f"{v['train_s_at_steps_mean']:.1f} s of training (mean){rate}")
    phase_text = ""
    if "posttrain" in runs:
        phase = {k: statistics.median(x for r in runs["posttrain"] for x in r["phases"][k][1:args.steps])
                 for k in ("generate", "reward", "update")}
        summary["posttrain"]["phase_s_median"] = phase
        phase_text = ", ".join(f"{k} {v:.3f} s" for k, v in phase.items())
        print(f"posttrain step by phase (median over steps 2..{args.steps} of all seeds): {phase_text}")
    if "posttrain" not in runs or "trl" not in runs:
        return
    p, t = summary["posttrain"], summary["trl"]
    ratio = p["s_per_step"] / t["s_per_step"]
    diff = p["accuracy_mean"] - t["accuracy_mean"]
    met = ratio <= 1.0 and diff >= 0.0
    print(f"posttrain/TRL s/step = {ratio:.2f}x (goal <= 1.0) | accuracy posttrain - TRL = {diff:+.3f} (goal >= 0) | "
          f"goal {'MET' if met else 'NOT met'}")

    # Learning per second: the seed-mean curves, accuracy against training seconds.
    curves = {n: mean_curve([[(c["step"], c["train_s"], c["accuracy"]) for c in r["curve"]] for r in rs])
              for n, rs in runs.items()}
    trl_time = t["train_s_at_steps_mean"]  # TRL's 30-step time (mean of seeds)
    target = t["accuracy_mean"]  # TRL's 30-step accuracy (mean of seeds)
    eq_seeds = [point_at_time([(c["step"], c["train_s"], c["accuracy"]) for c in r["curve"]], trl_times[r["seed"]])
                for r in runs["posttrain"]]
    reach = first_at_or_above(curves["posttrain"], target)
    reach_trl = first_at_or_above(curves["trl"], target)  # the same rule on TRL's own curve: its noise floor
    reach_seeds = [first_at_or_above([(c["step"], c["train_s"], c["accuracy"]) for c in r["curve"]], target)
                   for r in runs["posttrain"]]
    eq_acc = statistics.mean(x[2] for x in eq_seeds)  # each seed at its own TRL run's time: same prompts, same hour
    short = [r["seed"] for r in runs["posttrain"] if r["curve"][-1]["train_s"] < trl_times[r["seed"]]]
    short_text = f" (posttrain's run ended before that time for seed(s) {short}: their last evaluation)" if short else ""
    covered = curves["posttrain"][-1][1]
    time_ratio = reach[1] / trl_time if reach else None
    time_met = time_ratio is not None and time_ratio <= TIME_GOAL
    ratio_text = f"{time_ratio:.2f}x" if reach else f">{covered / trl_time:.2f}x"
    print(f"accuracy at equal wall-clock time (TRL's {args.steps}-step time, {trl_time:.1f} s of training, mean of seeds): "
          f"posttrain {eq_acc:.3f} vs TRL {target:.3f} | difference {eq_acc - target:+.3f} | per seed, posttrain's last "
          f"evaluation at or before that seed's TRL time: {', '.join(f'{x[2]:.3f} (step {x[0]})' for x in eq_seeds)}"
          + short_text)
    print(f"time to TRL's {args.steps}-step accuracy ({target:.3f}), first evaluation of the seed-mean curve at or above "
          f"it, not interpolated: posttrain " + (f"step {reach[0]}, {reach[1]:.1f} s" if reach else
                                                 f"not reached in {covered:.1f} s ({curves['posttrain'][-1][0]} steps)")
          + f" | TRL itself by the same rule: step {reach_trl[0]}, {reach_trl[1] / trl_time:.2f}x | per posttrain seed: "
          + ", ".join(f"{x[1] / trl_times[r['seed']]:.2f}x (step {x[0]})" if x else "not reached"
                      for x, r in zip(reach_seeds, runs["posttrain"])))
    if target <= start_acc:
        print(f"note: TRL's {args.steps}-step accuracy is not above the starting accuracy ({start_acc:.3f}), so the "
              "starting checkpoint already reaches it: the time below is trivially 0")
    # The same on the process-CPU-time clock (evaluation excluded too): less sensitive to other load on the machine.
    cpu_curves = {n: mean_curve([[(c["step"], c["cpu_s"], c["accuracy"]) for c in r["curve"]] for r in rs])
                  for n, rs in runs.items()}
    trl_cpu = point_at_step(cpu_curves["trl"], args.steps)[1]
    reach_cpu = first_at_or_above(cpu_curves["posttrain"], target)
    cpu_ratio = reach_cpu[1] / trl_cpu if reach_cpu else None
    cpu_step_ratio = point_at_step(cpu_curves["posttrain"], args.steps)[1] / trl_cpu
    print(f"on the CPU-time clock (process CPU seconds, evaluation excluded): {args.steps} steps posttrain / TRL = "
          f"{cpu_step_ratio:.2f}x ({trl_cpu:.1f} s for TRL) | time to TRL's {args.steps}-step accuracy posttrain / TRL = "
          + (f"{cpu_ratio:.2f}x (step {reach_cpu[0]})" if reach_cpu else
             f">{cpu_curves['posttrain'][-1][1] / trl_cpu:.2f}x (not reached)"))
    noise_x = ratio_noise(curves["posttrain"], trl_time, target, args.eval_tasks, len(runs["trl"]))
    if noise_x is not None:
        print(f"evaluation noise alone moves that ratio by about +-{noise_x:.2f}x (binomial standard error of a "
              f"{len(runs['trl'])}-seed mean accuracy on {args.eval_tasks} tasks, in the target and in posttrain's curve, "
              f"over the slope of posttrain's seed-mean curve)")
    print(f"time to TRL's {args.steps}-step accuracy: posttrain / TRL = {ratio_text} (goal <= {TIME_GOAL}) | "
          f"goal {'MET' if time_met else 'NOT met'}")
    cfg = model_config()
    import trl

    loads = [x for rs in runs.values() for r in rs for x in r["load_1min"]]
    result = {
        "benchmark": "trainer: posttrain GRPO vs TRL GRPOTrainer", "date": dt.date.today().isoformat(),
        "model": cfg.model_dump(), "parameters": sum(x.numel() for x in load_policy(str(folder)).model.parameters()),
        "warm_start": sft, "start_accuracy": start_acc, "steps": args.steps, "seeds": list(range(args.seed, args.seed + args.seeds)),
        "prompts_per_step": PROMPTS_PER_STEP, "samples_per_prompt": SAMPLES, "max_new_tokens": MAX_NEW_TOKENS,
        "lr": args.lr, "eval_tasks": args.eval_tasks, "eval_every": args.eval_every,
        "posttrain_trainer_options": trainer_options(PROMPTS_PER_STEP * SAMPLES), "summary": summary, "runs": runs,
        "processes": procs,
        "lora": {"trainer": LORA, "rank": args.lora_rank, "alpha": 16.0, "lr": args.lora_lr} if LORA in runs else None,
        "s_per_step_ratio": ratio, "accuracy_diff": diff,
        "goal": "posttrain s/step <= TRL s/step and accuracy >= TRL accuracy", "goal_met": met,
        "mean_curves": {n: [{"step": k, "train_s": s_, "accuracy": a} for k, s_, a in c] for n, c in curves.items()},
        "trl_time_at_steps": trl_time, "trl_accuracy_at_steps": target,
        "equal_time": {"posttrain_accuracy": eq_acc, "trl_accuracy": target, "runs_ended_before": short,
                       "per_seed": [{"seed": r["seed"], "trl_time": trl_times[r["seed"]], "step": x[0], "accuracy": x[2]}
                                    for x, r in zip(eq_seeds, runs["posttrain"])]},
        "time_to_trl_accuracy": {"definition": TIME_DEFINITION, "evaluation_noise_ratio": noise_x, "posttrain_step": reach[0] if reach else None,
                                 "posttrain_train_s": reach[1] if reach else None, "ratio": time_ratio,
                                 "trl_same_rule_ratio": reach_trl[1] / trl_time,
                                 "per_seed_ratio": [x[1] / trl_times[r["seed"]] if x else None
                                                    for x, r in zip(reach_seeds, runs["posttrain"])],
                                 "goal": f"<= {TIME_GOAL}", "goal_met": time_met},
        "cpu_clock": {"trl_cpu_s_at_steps": trl_cpu, "steps_ratio": cpu_step_ratio, "time_to_trl_accuracy_ratio": cpu_ratio,
                      "mean_curves": {n: [{"step": k, "cpu_s": s_, "accuracy": a} for k, s_, a in c]
                                      for n, c in cpu_curves.items()}},
        "load_1min_range": [min(loads), max(loads)],
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                 "threads": args.threads},
        "provenance": provenance(args.threads, load_start, os.getloadavg()),
    }
    spread = max(statistics.pstdev(v["accuracies"]) for v in summary.values())
    noise = (f", but only within noise: the accuracy difference is smaller than the seed-to-seed standard deviation "
             f"({spread:.3f}), so read it as parity, not as an improvement" if abs(diff) < spread else "")
    result["accuracy_seed_std"] = spread
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    plotted = plot_curves(runs, curves, trl_time, target, args.steps, out_dir / "results.svg")
    per_seed = "".join(f"| {n} | {r['seed']} | {r['s_per_step_median']:.3f} | {r['first_step_s']:.2f} | {r['accuracy']:.3f} | "
                       f"{r['train_s_at_steps']:.1f} | {r['steps_run']} | {r['curve'][-1]['accuracy']:.3f} | "
                       f"{statistics.mean(r['train_reward']):.3f} | {r['load_1min'][0]:.2f} -> {r['load_1min'][1]:.2f} |\n"
                       for n, rs in runs.items() for r in rs)
    curve_rows = "".join(f"| {k} | {s_:.1f} | {a:.3f} | " + (
        f"{trl_row[1]:.1f} | {trl_row[2]:.3f} |" if (trl_row := next((c for c in curves['trl'] if c[0] == k), None)) else " | |")
        + "\n" for k, s_, a in curves["posttrain"])
    (out_dir / "results.md").write_text(
        "# Trainer: posttrain GRPO vs TRL GRPOTrainer\n\n"
        f"`python benchmarks/trainer/bench.py --steps {args.steps} --seeds {args.seeds} --eval-tasks {args.eval_tasks} "
        f"--lr {args.lr} --threads {args.threads}` on {result['date']}, {platform.machine()} with {os.cpu_count()} CPUs "
        f"shared with other load (1-minute load average {min(loads):.2f}-{max(loads):.2f} at the starts and ends of "
        f"the runs), {args.threads} torch thread(s), torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl.__version__}.\n\n"
        f"{provenance_line(result['provenance'])}\n\n"
        f"Policy: Llama-architecture, hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads, "
        f"intermediate {cfg.intermediate_size} ({result['parameters']:,} parameters), character tokenizer, warm-started "
        f"by {sft['sft_steps']} SFT steps on arithmetic (held-out greedy accuracy {start_acc:.3f}); every run starts "
        f"from that same checkpoint. Per step: {PROMPTS_PER_STEP} prompts x {SAMPLES} samples, temperature 1, no "
        f"top-k/top-p, <= {MAX_NEW_TOKENS} new tokens, beta 0, clip 0.2, token-mean loss, one AdamW step "
        f"(lr {args.lr}, betas (0.9, 0.99)); for each seed both trainers see the same prompts in the same order. "
        f"posttrain calls `grpo_step` with the pipeline trainer's settings (`{result['posttrain_trainer_options']}`).\n\n"
        f"## Equal steps\n\n"
        f"| trainer | s/step (median, first step of each run excluded) | held-out accuracy after {args.steps} steps "
        f"(mean over seeds) | per seed | training s for {args.steps} steps (mean) | mean train reward | trained "
        "tokens/s (whole step) | trained tokens/s (update) | trainable parameters |\n"
        "|---|---:|---:|---|---:|---:|---:|---:|---:|\n"
        + "".join(f"| {n} | {v['s_per_step']:.3f} | {v['accuracy_mean']:.3f} | {', '.join(f'{a:.3f}' for a in v['accuracies'])} "
                  f"| {v['train_s_at_steps_mean']:.1f} | {v['train_reward_mean']:.3f} | "
                  + (f"{v['tokens_per_s']:.0f} | {v['update_tokens_per_s']:.0f} | {v['trainable_parameters']:,} |\n"
                     if "tokens_per_s" in v else f"n/a | n/a | {result['parameters']:,} |\n") for n, v in summary.items())
        + (f"\n`{LORA}`: posttrain's trainer with `trainer.lora.rank: {args.lora_rank}` (`apply_lora`: adapters on "
           f"q/k/v/o_proj, alpha 16, base weights frozen) at lr {args.lora_lr}, the same prompts, seeds and steps; it "
           f"runs exactly {args.steps} steps (no equal-time extension).\n" if LORA in summary else "")
        + f"\n**posttrain s/step / TRL s/step = {ratio:.2f}x** (goal <= 1.0); **accuracy difference posttrain - TRL = "
          f"{diff:+.3f}** (goal >= 0) on {args.eval_tasks} held-out tasks. Goal {'met' if met else 'not met'}"
          f"{noise}.\n\nposttrain's step by phase (median over steps 2..{args.steps} of all seeds): {phase_text}.\n\n"
          "## Equal wall-clock time\n\n"
          f"Held-out accuracy is evaluated every {args.eval_every} steps along each run (greedy, all {args.eval_tasks} "
          "tasks, nothing cached, RNG states restored afterwards) and the evaluation time is left out of the training "
          "clock; the clock counts generation, reward and update of every step, the first included. posttrain keeps "
          f"training past step {args.steps} until its clock passes {BUDGET_MARGIN}x that seed's TRL {args.steps}-step time "
          f"(where posttrain runs first: 2x the longest TRL time so far; at most "
          f"{EXTRA_STEPS * args.steps} steps). The seed-mean curve averages, at each evaluated step, the seeds' accuracies "
          f"and their training seconds.\n\n"
          f"- TRL's {args.steps}-step time: **{trl_time:.1f} s** of training (mean of seeds); its {args.steps}-step "
          f"accuracy: **{target:.3f}**.\n"
          f"- posttrain's accuracy at equal wall-clock time (per seed, its last evaluation at or before that seed's "
          f"TRL {args.steps}-step time; mean of seeds): **{eq_acc:.3f}**, {eq_acc - target:+.3f} against TRL's "
          f"{target:.3f}; per seed: {', '.join(f'{x[2]:.3f} (step {x[0]})' for x in eq_seeds)}{short_text}.\n"
          f"- Time to TRL's {args.steps}-step accuracy: {TIME_DEFINITION} posttrain: "
          + (f"step {reach[0]}, {reach[1]:.1f} s" if reach else f"not reached in {covered:.1f} s")
          + f", so **posttrain / TRL = {ratio_text}** (goal <= {TIME_GOAL}: {'met' if time_met else 'not met'}). "
          + (f"Evaluation noise alone moves this ratio by about +-{noise_x:.2f}x (the binomial standard error of a "
             f"{len(runs['trl'])}-seed mean accuracy on {args.eval_tasks} tasks, in the target and in posttrain's curve, "
             f"over the least-squares slope of posttrain's seed-mean curve). " if noise_x is not None else "")
          + f"The same rule applied to TRL's own curve gives {reach_trl[1] / trl_time:.2f}x (step {reach_trl[0]}); anything "
          f"below 1.00x there is evaluation noise. Per posttrain seed (first evaluation at or above the same target, "
          f"against that seed's TRL time): "
          + ", ".join(f"{x[1] / trl_times[r['seed']]:.2f}x (step {x[0]})" if x else "not reached"
                      for x, r in zip(reach_seeds, runs["posttrain"])) + ".\n"
          + f"- On the process CPU-time clock instead (the same evaluations; CPU seconds of the benchmark process, "
          f"evaluation excluded, which other load on the machine inflates less than wall time): {args.steps} steps take "
          f"posttrain {cpu_step_ratio:.2f}x TRL's CPU time ({trl_cpu:.1f} s for TRL), and posttrain reaches TRL's "
          f"{args.steps}-step accuracy in " + (f"{cpu_ratio:.2f}x TRL's {args.steps}-step CPU time (step {reach_cpu[0]})"
                                              if reach_cpu else "(not reached)") + ".\n"
          + ("\n![held-out accuracy against training seconds](results.svg)\n" if plotted else "")
          + "\nSeed-mean curves (training seconds, held-out accuracy):\n\n"
          "| step | posttrain s | posttrain accuracy | TRL s | TRL accuracy |\n|---:|---:|---:|---:|---:|\n" + curve_rows +
          "\nPer run:\n\n| trainer | seed | s/step (median) | first step s | accuracy after "
          f"{args.steps} steps | training s for {args.steps} steps | steps run | accuracy after the last | mean train "
          "reward | load (1 min) before -> after |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n" + per_seed +
          "\nRemaining differences: TRL scales advantages by the unbiased group std (+1e-4), posttrain by the population "
          "std (+1e-6); TRL keeps all-zero-advantage groups in the token-mean denominator, posttrain drops those groups "
          "(as its trainer stage does); posttrain records sampling logprobs during generation.\n" + procs_md)


def point_at_step(curve, step: int):
    return next(c for c in curve if c[0] == step)


def mean_curve(curves: list[list[tuple[int, float, float]]]) -> list[tuple[int, float, float]]:
    """At each step every curve evaluated: (step, mean training seconds, mean accuracy)."""
    common = sorted(set.intersection(*({c[0] for c in curve} for curve in curves)))
    by_step = [{c[0]: c for c in curve} for curve in curves]
    return [(k, round(statistics.mean(b[k][1] for b in by_step), 4), round(statistics.mean(b[k][2] for b in by_step), 4))
            for k in common]


def point_at_time(curve, seconds: float):
    """The last evaluation at or before ``seconds`` of training (the checkpoint one would have then)."""
    return [c for c in curve if c[1] <= seconds][-1]


def first_at_or_above(curve, target: float):
    """The first evaluation at or above ``target`` (not interpolated); None if there is none."""
    return next((c for c in curve if c[2] >= target - 1e-9), None)


def ratio_noise(curve, trl_time: float, target: float, eval_tasks: int, seeds: int) -> float | None:
    """About how far evaluation noise alone moves the time-to-accuracy ratio: the binomial
    standard error of a seed-mean accuracy (in the target and in the curve: sqrt 2 of it),
    turned into seconds by the least-squares slope of the seed-mean curve up to TRL's time."""
    points = [(t, a) for _, t, a in curve if t <= trl_time]
    if len(points) < 3:
        return None
    mt, ma = statistics.mean(t for t, _ in points), statistics.mean(a for _, a in points)
    var = sum((t - mt) ** 2 for t, _ in points)
    slope = sum((t - mt) * (a - ma) for t, a in points) / var if var else 0.0
    if slope <= 0:
        return None
    se = (target * (1 - target) / eval_tasks / seeds) ** 0.5
    return 2 ** 0.5 * se / slope / trl_time


def plot_curves(runs, curves, trl_time: float, target: float, steps: int, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours = {"posttrain": "tab:blue", "trl": "tab:orange", LORA: "tab:green"}
    for n, rs in runs.items():
        for r in rs:
            ax.plot([c["train_s"] for c in r["curve"]], [c["accuracy"] for c in r["curve"]], color=colours[n], alpha=0.25, lw=1)
        ax.plot([c[1] for c in curves[n]], [c[2] for c in curves[n]], color=colours[n], lw=2.2, marker="o", ms=3,
                label=f"{n} (mean of {len(rs)} seeds)")
    ax.axvline(trl_time, color="grey", ls="--", lw=1)
    ax.axhline(target, color="grey", ls=":", lw=1)
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(f"GRPO on arithmetic: posttrain vs TRL (dashed: TRL's {steps}-step time, dotted: its accuracy)", fontsize=9)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format=path.suffix[1:], **({"metadata": {"Date": None}} if path.suffix == ".svg" else {}))
    plt.close(fig)
    return True


if __name__ == "__main__":
    main()
