"""Rollout generation with ``HFEngine``: prefix-shared groups vs the previous path (goal: >= 1.5x
completions/s), and length-bucketed vs unbucketed batches (goal: >= 1.3x).

Groups: the demo recipe's policy size (``recipes/demo.yaml``: Llama, hidden 128, 4
layers, random weights; speed does not depend on training) samples ``group_size`` (8)
completions of ``max_new_tokens`` (16) tokens for each of ``--tasks`` prompts drawn from
the demo's domains (``Domain.draw``, round-robin over the recipe's domains), in batches
of ``rollout.batch_size`` (256) rows, as the rollout stage does. ``prefix-shared`` is
``HFEngine().generate_groups`` (one prefill per prompt, its KV cache repeated for the
group); ``previous`` is ``HFEngine(prefix_sharing=False)``, which sends G copies of each
prompt through ``model.generate`` in length buckets (the engine before prefix sharing).

Bucketing: ``ModelConfig()`` defaults (hidden 256, 4 layers) on prompts that mix short
random strings (4-12 characters) with long ones (60-180), as the demo's arithmetic and code
prompts differ in length, one sample each, through
``HFEngine(bucket=True)`` and ``HFEngine(bucket=False)``.

Every variant runs once per repeat, alternating in one process, so all see the same
machine load. It prints completions/s of each and the ratios of the best runs (and of
the medians) and writes ``benchmarks/rollout/results.json`` and ``results.md`` (or into
``--out``).

    python benchmarks/rollout/bench.py [--tasks 96] [--repeats 5] [--threads 1]
    python benchmarks/rollout/bench.py --quick [--out DIR]

``--quick`` is a smoke run through the same code (8 tasks, 16 mixed prompts, 8 new
tokens, 2 repeats): it prints the same ratio lines and writes no results unless ``--out``
is given.

Not measured: vLLM (GPU) and the HTTP engine (their cost is the server's), and sampling
with early EOS (a random policy rarely stops, so nearly every completion runs to the cap;
a trained policy stops early, and the prefix-shared loop then also drops stopped rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))  # benchmarks/ is not an installed package

from benchmarks.provenance import provenance, provenance_line  # noqa: E402


def mixed_prompts(n: int, seed: int = 0) -> list[str]:
    """Half short (4-12 chars), half long (60-180 chars), shuffled."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 +-*=()[]:"
    lengths = [rng.randint(4, 12) if i % 2 else rng.randint(60, 180) for i in range(n)]
    rng.shuffle(lengths)
    return ["".join(rng.choice(alphabet) for _ in range(k)) for k in lengths]


def demo_prompts(domains: list[str], n: int, seed: int = 0) -> list[str]:
    """``n`` train-split task prompts, round-robin over ``domains``."""
    from components.domains import registry

    rng = random.Random(seed)
    return [registry.get(domains[i % len(domains)]).draw(rng, "train", set()).prompt for i in range(n)]


def random_policy(model_cfg):
    import torch

    from components.core.policy import Policy, build_model, build_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    return Policy(model=build_model(model_cfg, len(tokenizer)).eval(), tokenizer=tokenizer, uri="memory://bench")


def ratio_line(a: str, b: str, best: dict[str, float], median: dict[str, float], repeats: int, goal: float) -> str:
    return (f"{a} {best[a]:.2f}/s vs {b} {best[b]:.2f}/s (best of {repeats}) -> {best[a] / best[b]:.2f}x "
            f"(goal >= {goal}x); medians {median[a]:.2f} vs {median[b]:.2f} -> {median[a] / median[b]:.2f}x")


def main() -> None:
    import torch

    from components.core.recipe import ModelConfig, load_recipe
    from components.rollout.hf_engine import HFEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=96, help="demo prompts, each sampled group_size times")
    ap.add_argument("--prompts", type=int, default=96, help="mixed prompts of the bucketing comparison")
    ap.add_argument("--bucket-batch-size", type=int, default=16, help="batch size of the bucketing comparison")
    ap.add_argument("--bucket-new-tokens", type=int, default=24, help="new tokens of the bucketing comparison")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: least disturbed by other load)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 8 tasks, 16 mixed prompts, 8 new tokens, 2 repeats; writes results only with --out")
    ap.add_argument("--out", default=None, help="folder for results.json/results.md (default: beside this script; "
                    "with --quick: none written unless given)")
    args = ap.parse_args()
    recipe = load_recipe(REPO / "recipes" / "demo.yaml")
    rollout = recipe.rollout
    max_new_tokens = rollout.max_new_tokens
    if args.quick:
        args.tasks, args.prompts, args.bucket_new_tokens, args.repeats, max_new_tokens = 8, 16, 8, 2, 8
    out_dir = Path(args.out) if args.out else (None if args.quick else HERE)

    torch.set_num_threads(args.threads)
    demo_policy, bucket_policy = random_policy(recipe.model), random_policy(ModelConfig())
    tasks = demo_prompts(list(recipe.domains), args.tasks)
    mixed = mixed_prompts(args.prompts)
    group = rollout.group_size
    runs: dict[str, Callable[[int], int]] = {
        "prefix-shared": lambda seed: len(HFEngine().generate_groups(
            demo_policy, tasks, group, max_new_tokens, rollout.temperature, seed, rollout.batch_size)),
        "previous": lambda seed: len(HFEngine(prefix_sharing=False).generate_groups(
            demo_policy, tasks, group, max_new_tokens, rollout.temperature, seed, rollout.batch_size)),
        "bucketed": lambda seed: len(HFEngine(bucket=True).generate(
            bucket_policy, mixed, args.bucket_new_tokens, 1.0, seed, args.bucket_batch_size)),
        "unbucketed": lambda seed: len(HFEngine(bucket=False).generate(
            bucket_policy, mixed, args.bucket_new_tokens, 1.0, seed, args.bucket_batch_size)),
    }
    HFEngine().generate_groups(demo_policy, tasks[:2], 2, 2, 1.0, 0, 4)  # warm-up
    HFEngine(prefix_sharing=False).generate(bucket_policy, mixed[:4], 2, 1.0, 0, 4)
    load_start = os.getloadavg()
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            done = run(r)
            rates[name].append(done / (time.perf_counter() - started))
            print(f"repeat {r} | {name:13s} | {rates[name][-1]:.2f} completions/s", flush=True)
    # Best of the repeats: on a shared machine other load only ever slows a run down.
    best = {k: max(v) for k, v in rates.items()}
    median = {k: statistics.median(v) for k, v in rates.items()}
    shared_line = ratio_line("prefix-shared", "previous", best, median, args.repeats, 1.5)
    bucket_line = ratio_line("bucketed", "unbucketed", best, median, args.repeats, 1.3)
    print(bucket_line)
    print(shared_line)
    lengths = [len(demo_policy.encode_prompt(p)) for p in tasks]
    result = {
        "benchmark": "rollout generation", "repeats": args.repeats, "completions_per_s": rates,
        "best_completions_per_s": best, "median_completions_per_s": median,
        "groups": {"model": recipe.model.model_dump(), "domains": list(recipe.domains), "tasks": args.tasks,
                   "group_size": group, "max_new_tokens": max_new_tokens, "batch_size": rollout.batch_size,
                   "prompt_tokens": [min(lengths), max(lengths), round(sum(lengths) / len(lengths), 1)],
                   "ratio_of_best": best["prefix-shared"] / best["previous"],
                   "ratio_of_medians": median["prefix-shared"] / median["previous"], "goal": 1.5},
        "bucketing": {"model": ModelConfig().model_dump(), "prompts": args.prompts,
                      "prompt_chars": [min(map(len, mixed)), max(map(len, mixed))],
                      "batch_size": args.bucket_batch_size, "max_new_tokens": args.bucket_new_tokens,
                      "ratio_of_best": best["bucketed"] / best["unbucketed"],
                      "ratio_of_medians": median["bucketed"] / median["unbucketed"], "goal": 1.3},
        "host": {"machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
                 "threads": torch.get_num_threads()},
        "provenance": provenance(torch.get_num_threads(), load_start, os.getloadavg()),
    }
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    g, bk = result["groups"], result["bucketing"]

    def table(names: list[str]) -> str:
        return ("| engine | completions/s (best) | median | each repeat |\n|---|---|---|---|\n"
                + "".join(f"| {k} | {best[k]:.2f} | {median[k]:.2f} | {', '.join(f'{x:.2f}' for x in rates[k])} |\n"
                          for k in names))

    command = ("python benchmarks/rollout/bench.py --quick" if args.quick else
               f"python benchmarks/rollout/bench.py --tasks {args.tasks} --prompts {args.prompts} --bucket-batch-size "
               f"{args.bucket_batch_size} --bucket-new-tokens {args.bucket_new_tokens} --repeats {args.repeats} "
               f"--threads {args.threads}")
    result["command"] = command
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "results.md").write_text(
        "# Rollout: prefix-shared groups, and length buckets\n\n"
        f"`{command}` "
        f"on {platform.machine()} with {torch.get_num_threads()} torch thread(s), torch {torch.__version__}; all four "
        "variants alternate in one process, so they see the same machine load. The machine is shared, so the best "
        "run is the least disturbed.\n\n"
        f"{provenance_line(result['provenance'])}\n\n"
        f"## Prefix-shared groups vs the previous path (goal >= 1.5x)\n\n"
        f"The demo's policy size (hidden {recipe.model.hidden_size}, {recipe.model.num_layers} layers, random "
        f"weights), {args.tasks} prompts drawn from the demo's domains ({', '.join(recipe.domains)}; "
        f"{g['prompt_tokens'][0]}-{g['prompt_tokens'][1]} tokens, mean {g['prompt_tokens'][2]}), {group} samples "
        f"each, {max_new_tokens} new tokens, batches of {rollout.batch_size} rows, temperature "
        f"{rollout.temperature}. `previous` sends {group} copies of each prompt through `model.generate` in length "
        "buckets; `prefix-shared` prefills each prompt once and repeats its KV cache for the group.\n\n"
        + table(["prefix-shared", "previous"])
        + f"\n**Ratio of best runs: {g['ratio_of_best']:.2f}x** (goal >= 1.5x); ratio of medians "
          f"{g['ratio_of_medians']:.2f}x.\n\n"
        "## Length-bucketed vs unbucketed batches (goal >= 1.3x)\n\n"
        f"`ModelConfig()` defaults (hidden 256, 4 layers, random weights), {args.prompts} prompts of "
        f"{bk['prompt_chars'][0]}-{bk['prompt_chars'][1]} characters, one sample each, {args.bucket_new_tokens} new "
        f"tokens, batches of {args.bucket_batch_size}, through today's `HFEngine` with `bucket=True` and "
        "`bucket=False`.\n\n"
        + table(["bucketed", "unbucketed"])
        + f"\n**Ratio of best runs: {bk['ratio_of_best']:.2f}x** (goal >= 1.3x); ratio of medians "
          f"{bk['ratio_of_medians']:.2f}x.\n")


if __name__ == "__main__":
    main()
