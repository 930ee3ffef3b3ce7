"""The GPU path end to end: one iteration of recipes/gpu-check.yaml (vLLM rollout, bf16
FSDP2 trainer on CUDA) through ``benchmarks/gpu/check.py``, which must end with its
tokens/s and MFU line. Marked ``gpu``: ``make test`` leaves it out; it runs where a CUDA
device and vLLM are (``benchmarks/gpu/check.sh``). Without a GPU, the script's refusal is
checked instead (one line, exit status 2).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def run_check(tmp_path: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW_", "POSTTRAIN_"))}
    return subprocess.run([sys.executable, "benchmarks/gpu/check.py", "--out", str(tmp_path / "check.json")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the real check runs instead")
def test_check_refuses_without_a_gpu(tmp_path):
    proc = run_check(tmp_path, 120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "gpu check: no CUDA device here; run it on a GPU machine"
    assert not (tmp_path / "check.json").exists()


@pytest.mark.gpu
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_iteration_with_vllm_rollout_and_bf16_fsdp_trainer(tmp_path):
    proc = run_check(tmp_path, 1750)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"gpu check: rollout (\d+) tok/s, trainer (\d+) tok/s, MFU (\d+\.\d)%", line)
    assert match, line
    assert int(match[1]) > 0 and int(match[2]) > 0 and float(match[3]) > 0.0
    provenance = json.loads((tmp_path / "check.json").read_text()).get("provenance")  # benchmarks/provenance.py
    assert isinstance(provenance, dict) and "commit" in provenance, provenance


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10G", 125.0), ("NVIDIA L40S", 362.0),
    ("NVIDIA L4", 121.0),
])
def test_the_peak_is_the_cards_own(name: str, peak: float) -> None:
    """MFU divides by the card's peak: a PCIe H100 read as the SXM part's 989 TFLOPS
    under-reported its MFU by a quarter."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.gpu.check import peak_tflops

    assert peak_tflops(name, None) == peak
