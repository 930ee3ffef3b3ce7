"""A scratch model: the recipe's estimate of its size is the model ``build_model`` builds,
and a model the machine has no memory for is one UserError naming the model section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from components.core.policy import build_model, build_tokenizer
from components.core.recipe import SCRATCH_VOCAB_SIZE, ModelConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cfg", [ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32),
                                 ModelConfig(hidden_size=64, num_layers=3, num_heads=4, intermediate_size=40)])
def test_the_recipe_counts_the_parameters_build_model_makes(cfg: ModelConfig) -> None:
    """The load-time cap (``MAX_SCRATCH_PARAMETERS``) is on this count: it must be the real one."""
    assert len(build_tokenizer()) == SCRATCH_VOCAB_SIZE
    model = build_model(cfg, SCRATCH_VOCAB_SIZE)
    assert sum(p.numel() for p in model.parameters()) == cfg.scratch_parameters()


OUT_OF_MEMORY = """
import resource
from components.core.errors import UserError
from components.core.policy import build_model
from components.core.recipe import ModelConfig
from transformers import LlamaForCausalLM  # imported before the limit: only the model's tensors are short of room

vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), vm + (512 << 20)))
try:
    build_model(ModelConfig(hidden_size=4096, num_layers=4, num_heads=32, intermediate_size=16384), 101)
except UserError as exc:
    print(exc.to_json())
"""


def test_a_model_the_machine_cannot_hold_is_a_user_error_naming_the_model() -> None:
    """Below the cap, 4.3 GB of weights in 512 MiB of address space: torch's "can't
    allocate memory" was a traceback (exit 1, retried four times by Airflow)."""
    out = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    error = json.loads(out.stdout.strip().splitlines()[-1])
    assert error["field"] == "model"
    assert error["value"] == "hidden_size: 4096, num_layers: 4, intermediate_size: 16384"
    assert error["problem"].startswith("this machine has no memory for a model of 1,074,192,384 parameters (4.3 GB of "
                                       "float32 weights; RuntimeError: ")
    assert "can't allocate memory" in error["problem"]
    assert error["fix"] == ("make model.hidden_size, model.num_layers or model.intermediate_size smaller, or run on a "
                            "machine with more memory")


def test_another_runtime_error_is_not_taken_for_memory(monkeypatch) -> None:
    from transformers import LlamaForCausalLM

    def broken(self, config):
        raise RuntimeError("a bug in the model's code")

    monkeypatch.setattr(LlamaForCausalLM, "__init__", broken)  # transformers' lazy module keeps its own attribute
    with pytest.raises(RuntimeError, match="a bug in the model's code"):
        build_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32), SCRATCH_VOCAB_SIZE)
