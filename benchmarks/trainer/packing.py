"""Trainer throughput: packed micro-batches against right-padded ones, side by side.

The demo's shapes: a ``ModelConfig(hidden 128, 4 layers, 4 heads, intermediate 384)``
policy, steps of 32 groups x 8 completions (``prompts_per_step`` 32, ``group_size`` 8),
``micro_batch_size`` 64, torch on one thread. Prompts are real tasks of the demo's
domains (math, code, terminal, extraction, structured) drawn with ``Domain.draw``, so
extraction's long statements sit beside one-line questions; completions of up to 16
tokens are sampled from the policy with the ``hf`` engine, which also records their old
logprobs. Rewards are random, so every group carries signal.

Each repeat starts both paths from the same weights and a fresh optimizer and times
``grpo_step`` over the same batches, one step of each path in turn (which goes first
alternates), after one untimed warm-up step each, whose loss and gradient norm are
compared as a check that both paths compute the same thing. Tokens/s counts trained
(completion) tokens, as the trainer stage reports them, so the ratio is the ratio of
step times. On a shared machine wall-clock rates swing with its load; the rates per CPU
second of this process (one torch thread) are printed beside them.

    python benchmarks/trainer/packing.py [--out DIR]   # full run, writes packing_results.md/json here (or into DIR)
    python benchmarks/trainer/packing.py --quick [--out DIR]   # smoke run (< 1 minute), writes nothing unless --out

Not covered: GPUs (the packed path's attention is sdpa with a block-diagonal mask, not a
varlen flash kernel), other model sizes, and the rest of the trainer stage (loading,
checkpointing, MLflow).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: benchmarks/ is not an installed package

from benchmarks.provenance import provenance, provenance_line  # noqa: E402

DOMAINS = ["math", "code", "terminal", "extraction", "structured"]
PROMPTS_PER_STEP, GROUP, MICRO_BATCH, MAX_NEW_TOKENS = 32, 8, 64, 16


def build_policy(seed: int):
    import torch

    from components.core.policy import Policy, build_model, build_tokenizer
    from components.core.recipe import ModelConfig

    torch.manual_seed(seed)
    cfg = ModelConfig(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384)
    tokenizer = build_tokenizer()
    return Policy(model=build_model(cfg, len(tokenizer)), tokenizer=tokenizer, uri="memory://bench")


def draw_batches(policy, steps: int, seed: int) -> list:
    """``steps`` batches of 32 groups x 8 sampled completions of demo-domain tasks."""
    from components.domains import registry
    from components.reward.advantages import group_advantages
    from components.rollout.hf_engine import HFEngine
    from components.trainer.grpo import Sample

    rng = random.Random(seed)
    batches = []
    for step in range(steps):
        tasks = [registry.get(DOMAINS[k % len(DOMAINS)]).draw(rng, "train", set()) for k in range(PROMPTS_PER_STEP)]
        prompts = [t.prompt for t in tasks for _ in range(GROUP)]
        policy.model.eval()
        out = HFEngine().generate(policy, prompts, MAX_NEW_TOKENS, 1.0, seed=seed + step, batch_size=64)
        samples = []
        for g in range(PROMPTS_PER_STEP):
            group = out[g * GROUP:(g + 1) * GROUP]
            adv = group_advantages([rng.random() for _ in group], eps=1e-6, scale_by_std=True)
            samples += [Sample(s.prompt_ids, s.completion_ids, s.logprobs, a) for s, a in zip(group, adv)]
        batches.append(samples)
    return batches


def fresh(policy, start: dict):
    """The policy at ``start`` with a new optimizer, as one path of a repeat trains it."""
    from components.core.recipe import TrainerConfig
    from components.trainer.state import build_optimizer

    model = copy.deepcopy(policy.model)
    model.load_state_dict(start)
    return model, build_optimizer(model, TrainerConfig(learning_rate=1e-4))


def one_step(policy, model, optimizer, samples, packing: bool):
    """(wall seconds, CPU seconds of this process, stats) of one ``grpo_step``."""
    from components.trainer.grpo import grpo_step

    wall, cpu = time.perf_counter(), time.process_time()
    stats = grpo_step(model, optimizer, samples, pad_id=policy.pad_id, clip_eps=0.2, kl_coef=0.0, temperature=1.0,
                      micro_batch_size=MICRO_BATCH, max_grad_norm=1.0, packing=packing)
    return time.perf_counter() - wall, time.process_time() - cpu, stats


def layout(batches: list) -> dict[str, int]:
    """Tokens per step as each path lays them out: real, padded (rows x longest per micro-batch), packed."""
    from components.trainer.grpo import micro_batches, packed_micro_batches

    real = padded = packed = 0
    for samples in batches:
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
        real += sum(lengths)
        padded += sum(len(b) * max(lengths[i] for i in b) for b in micro_batches(samples, MICRO_BATCH))
        for rows in packed_micro_batches(samples, MICRO_BATCH):
            packed += len(rows) * max(sum(lengths[i] for i in row) for row in rows)
    n = len(batches)
    return {"real_tokens_per_step": real // n, "padded_tokens_per_step": padded // n,
            "packed_tokens_per_step": packed // n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 repeats of 1 step (the warm-up batch); writes results only with --out")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats (full run)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per repeat and path (full run)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=None, help="folder for packing_results.json/.md (default: beside this script; "
                    "with --quick: none written unless given)")
    args = ap.parse_args()
    repeats, steps = (2, 1) if args.quick else (args.repeats, args.steps)
    out_dir = Path(args.out) if args.out else (None if args.quick else HERE)

    import torch
    import transformers

    from components.core.seeds import configure_torch

    configure_torch()
    policy = build_policy(args.seed)
    batches = draw_batches(policy, 1 if args.quick else steps + 1, args.seed)
    warm, timed = batches[:1], (batches if args.quick else batches[1:])  # --quick times its warm-up batch again
    start = {k: v.clone() for k, v in policy.model.state_dict().items()}
    shapes = layout(timed)
    print(f"per step: {shapes['real_tokens_per_step']} real tokens; padded layout {shapes['padded_tokens_per_step']}, "
          f"packed layout {shapes['packed_tokens_per_step']}", flush=True)

    # Same start, same first batch: the two paths' loss and gradient norm (also the warm-up).
    first = {}
    for mode in ("packed", "padded"):
        model, optimizer = fresh(policy, start)
        first[mode] = one_step(policy, model, optimizer, warm[0], packing=mode == "packed")[2]
    check = {"loss_packed": first["packed"].loss, "loss_padded": first["padded"].loss,
             "loss_abs_diff": abs(first["packed"].loss - first["padded"].loss),
             "grad_norm_packed": first["packed"].grad_norm, "grad_norm_padded": first["padded"].grad_norm}
    print(f"first step: loss packed {check['loss_packed']:.6f} padded {check['loss_padded']:.6f} "
          f"(|diff| {check['loss_abs_diff']:.2e}); grad norm packed {check['grad_norm_packed']:.6f} "
          f"padded {check['grad_norm_padded']:.6f}", flush=True)

    # Per repeat, both paths train from the same start on the same batches, one step of
    # each in turn (which goes first alternates), so both see the same machine load.
    load_before = os.getloadavg()[0]
    rates: dict[str, list[float]] = {"packed": [], "padded": []}
    cpu_rates: dict[str, list[float]] = {"packed": [], "padded": []}
    for r in range(repeats):
        paths = {mode: fresh(policy, start) for mode in ("packed", "padded")}
        wall = {mode: 0.0 for mode in paths}
        cpu = {mode: 0.0 for mode in paths}
        tokens = {mode: 0 for mode in paths}
        for k, samples in enumerate(timed):
            for mode in (("packed", "padded") if (r + k) % 2 == 0 else ("padded", "packed")):
                w, c, stats = one_step(policy, *paths[mode], samples, packing=mode == "packed")
                wall[mode] += w
                cpu[mode] += c
                tokens[mode] += stats.tokens
        for mode in paths:
            rates[mode].append(tokens[mode] / wall[mode])
            cpu_rates[mode].append(tokens[mode] / cpu[mode])
        print(f"repeat {r + 1}/{repeats}: packed {rates['packed'][-1]:.0f} tokens/s, "
              f"padded {rates['padded'][-1]:.0f} tokens/s (per CPU second: {cpu_rates['packed'][-1]:.0f} vs "
              f"{cpu_rates['padded'][-1]:.0f})", flush=True)

    load = (round(load_before, 2), round(os.getloadavg()[0], 2))  # 1-minute load average before and after
    best = {m: max(v) for m, v in rates.items()}
    median = {m: statistics.median(v) for m, v in rates.items()}
    ratio_median, ratio_best = median["packed"] / median["padded"], best["packed"] / best["padded"]
    ratio_cpu = statistics.median(cpu_rates["packed"]) / statistics.median(cpu_rates["padded"])
    print("| path | best tokens/s | median tokens/s |\n|---|---:|---:|")
    for m in ("packed", "padded"):
        print(f"| {m} | {best[m]:.0f} | {median[m]:.0f} |")
    if out_dir is not None:
        results = {
            "date": dt.date.today().isoformat(), "machine": platform.machine(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "load_average_before_after": load,
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "repeats": repeats, "steps_per_repeat": steps,
            "model": "hidden 128, 4 layers, 4 heads, intermediate 384", "domains": DOMAINS,
            "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP, "micro_batch_size": MICRO_BATCH,
            "max_new_tokens": MAX_NEW_TOKENS, **shapes, "first_step": check,
            "tokens_per_s": {m: [round(x, 1) for x in v] for m, v in rates.items()},
            "best_tokens_per_s": {m: round(v, 1) for m, v in best.items()},
            "median_tokens_per_s": {m: round(v, 1) for m, v in median.items()},
            "cpu_tokens_per_s": {m: [round(x, 1) for x in v] for m, v in cpu_rates.items()},
            "ratio_median": round(ratio_median, 3), "ratio_best": round(ratio_best, 3),
            "ratio_median_cpu_time": round(ratio_cpu, 3), "goal_ratio": 1.3,
            "provenance": provenance(torch.get_num_threads(), *load),
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "packing_results.json").write_text(json.dumps(results, indent=2) + "\n")
        (out_dir / "packing_results.md").write_text(
            f"# Trainer: packed vs padded micro-batches\n\n"
            f"`python benchmarks/trainer/packing.py{' --quick' if args.quick else ''}`, {results['date']}, {results['machine']}, torch "
            f"{results['torch']} on {results['torch_threads']} thread, transformers {results['transformers']}. "
            f"Demo shapes: {results['model']}; {PROMPTS_PER_STEP} groups x {GROUP} completions (up to "
            f"{MAX_NEW_TOKENS} tokens) of {', '.join(DOMAINS)} tasks per step; micro_batch_size {MICRO_BATCH}. "
            f"{repeats} interleaved repeats of {steps} optimizer steps per path, on {results['cpus']} CPUs with a "
            f"1-minute load average of {load[0]} before and {load[1]} after (other work shared the machine: wall-clock "
            f"rates swing with it, the rates per CPU second much less).\n\n"
            f"{provenance_line(results['provenance'])}\n\n"
            f"Tokens per step: {shapes['real_tokens_per_step']} real, {shapes['padded_tokens_per_step']} in the "
            f"padded layout, {shapes['packed_tokens_per_step']} in the packed one.\n\n"
            f"| path | best tokens/s | median tokens/s |\n|---|---:|---:|\n"
            + "".join(f"| {m} | {best[m]:.0f} | {median[m]:.0f} |\n" for m in ("packed", "padded"))
            + f"\nFirst step from the same weights: loss packed {check['loss_packed']:.6f}, padded "
              f"{check['loss_padded']:.6f} (|diff| {check['loss_abs_diff']:.1e}).\n\n"
              f"**packed vs padded: {ratio_median:.2f}x tokens/s** (median of wall-clock rates; best "
              f"{ratio_best:.2f}x; per CPU second of the process {ratio_cpu:.2f}x; goal >= 1.3x)\n")
    print(f"packed vs padded: {ratio_median:.2f}x tokens/s (median of {repeats}; best {ratio_best:.2f}x; "
          f"per CPU second {ratio_cpu:.2f}x)")


if __name__ == "__main__":
    main()
