"""The ``vllm`` engine: a clear UserError without vLLM; on a GPU host with vLLM, the same
greedy completions as HFEngine and logprobs that match the trainer's recomputation."""

from __future__ import annotations

import importlib.util

import pytest

from components.core.errors import UserError
from components.core.policy import load_policy, save_policy
from components.core.storage import Store
from components.rollout.engines import HFEngine, get_engine
from tests.rollout.helpers import PROMPTS, tiny_policy
from tests.rollout.test_hf_engine import recomputed

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")
def test_without_vllm_the_engine_names_the_install_line() -> None:
    with pytest.raises(UserError, match=r"rollout.engine='vllm': the vllm package is not importable.*pip install vllm"):
        get_engine("vllm").generate(tiny_policy(), ["1+2="], 4, 1.0, 0, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="needs the vllm package (pip install vllm) and a GPU")
def test_vllm_matches_hf(tmp_path) -> None:
    store = Store(str(tmp_path), "test")
    tiny = tiny_policy(seed=1)
    save_policy(tiny.model, tiny.tokenizer, store, "ckpt")
    policy = load_policy(store.url("ckpt"))
    engine = get_engine("vllm")
    greedy = engine.generate(policy, PROMPTS, 10, 1.0, seed=0, batch_size=8, greedy=True)
    local = HFEngine().generate(policy, PROMPTS, 10, 1.0, seed=0, batch_size=8, greedy=True)
    assert [s.completion_ids for s in greedy] == [s.completion_ids for s in local]
    sampled = engine.generate(policy, PROMPTS * 2, 12, 0.8, seed=3, batch_size=8)
    for s, ref in zip(sampled, recomputed(policy, sampled, 0.8)):
        assert len(s.logprobs) == len(s.completion_ids) == len(ref)
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < 1e-3  # GPU kernels differ from CPU float32
