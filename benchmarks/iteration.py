"""Iteration wall time by stage, and Airflow's overhead against calling stages directly.

Bootstraps a pipeline once (not timed), copies that state twice, then runs iteration 1
two ways in the same run of this script, each in its own subprocess:

- ``airflow``: ``posttrain run --iterations 1`` (the DAG through Airflow's in-process
  test runner on SQLite), as users run it;
- ``direct``: every stage called through ``run_stage`` in one Python process.

It prints per-stage seconds (from the manifests' timings) for both and the ratio of
total wall times, and writes ``benchmarks/results/iteration.json`` and ``.md``.

    python benchmarks/iteration.py [--recipe recipes/demo.yaml] [--sft-steps 50]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
STAGES = ["taskgen", "rollout", "sandbox", "reward", "validation", "trainer", "evaluation"]
SHARDED = {"rollout", "sandbox", "reward"}

DIRECT = """
import sys
from components.core.recipe import load_recipe
from components.core.runner import run_stage
recipe, root = sys.argv[1], sys.argv[2]
shards = load_recipe(recipe).rollout.shards
for stage in {stages!r}:
    if stage in {sharded!r}:
        for i in range(shards):
            run_stage(stage, recipe, root, 1, f"{{i}}/{{shards}}")
    else:
        run_stage(stage, recipe, root, 1)
"""


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "POSTTRAIN_"))}
    return {**env, "POSTTRAIN_HOME": str(home), "PYTHONUNBUFFERED": "1"}


def stage_seconds(run_root: Path, pipeline: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for stage in STAGES:
        for m in (run_root / pipeline / "iter-000001" / stage).rglob("_MANIFEST.json"):
            out[stage] = out.get(stage, 0.0) + json.loads(m.read_text())["timings"]["duration_s"]
    return out


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"benchmark command failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "demo.yaml"))
    parser.add_argument("--sft-steps", type=int, default=50, help="bootstrap SFT steps (quality is not measured here)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "iteration"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="posttrain-bench-"))
    data = yaml.safe_load(Path(args.recipe).read_text())
    data.setdefault("bootstrap", {}).update({"max_steps": args.sft_steps, "eval_every": args.sft_steps})
    recipe = work / "bench.yaml"
    recipe.write_text(yaml.safe_dump(data))
    pipeline = data["pipeline"]
    posttrain = [sys.executable, "-m", "components.cli"]

    base = work / "base"
    print(f"bootstrapping {pipeline} once (not timed) in {work}", flush=True)
    timed([*posttrain, "stage", "bootstrap", "--recipe", str(recipe), "--run-root", str(base / "store")], work, env_for(base))
    homes = {name: work / name for name in ("airflow", "direct")}
    for home in homes.values():
        shutil.copytree(base, home)

    wall = {}
    print("iteration 1 through Airflow (posttrain run) ...", flush=True)
    wall["airflow"] = timed([*posttrain, "run", "--recipe", str(recipe), "--run-root", str(homes["airflow"] / "store"),
                             "--iterations", "1"], work, env_for(homes["airflow"]))
    print("iteration 1 with stages called directly ...", flush=True)
    script = DIRECT.format(stages=STAGES, sharded=sorted(SHARDED))
    wall["direct"] = timed([sys.executable, "-c", script, str(recipe), str(homes["direct"] / "store")], work,
                           env_for(homes["direct"]))

    per_stage = {name: stage_seconds(home / "store", pipeline) for name, home in homes.items()}
    result = {
        "recipe": args.recipe, "sft_steps": args.sft_steps, "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"), "wall_s": wall, "stage_s": per_stage,
        "airflow_over_direct": wall["airflow"] / wall["direct"],
    }
    lines = ["| stage | direct (s) | airflow (s) |", "|---|---:|---:|"]
    for stage in STAGES:
        lines.append(f"| {stage} | {per_stage['direct'].get(stage, 0):.2f} | {per_stage['airflow'].get(stage, 0):.2f} |")
    lines.append(f"| **iteration wall time** | **{wall['direct']:.1f}** | **{wall['airflow']:.1f}** |")
    table = "\n".join(lines)
    summary = f"Airflow / direct wall-time ratio: {result['airflow_over_direct']:.2f}x"
    print(table)
    print(summary)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"# Iteration benchmark ({result['date']}, {result['machine']})\n\n"
                                      f"Recipe `{Path(args.recipe).name}` with {args.sft_steps} SFT steps.\n\n{table}\n\n{summary}\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
