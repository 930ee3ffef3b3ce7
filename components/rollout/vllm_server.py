"""vLLM's OpenAI-compatible server, started from its own environment on one checkpoint.

Where ``vllm`` is not importable in posttrain's environment (the CPU build pins numpy and
setuptools that posttrain cannot share), the ``vllm`` engine runs vLLM's server with the
interpreter of a separate environment (``POSTTRAIN_VLLM_PYTHON``, by default
``.venv-vllm/bin/python`` of this checkout, which ``make vllm`` creates):

    <python> -m vllm.entrypoints.openai.api_server --model <local checkpoint folder> ...

``VLLMServer(python, uri, ...)`` downloads the checkpoint (its weights, config and tokenizer; never
the optimizer state beside them) into a temporary folder, starts the server there on a
free local port, and waits for ``GET /v1/models`` to list it (at most
``POSTTRAIN_VLLM_START_TIMEOUT_S`` seconds). The server samples and reports logprobs
exactly as the in-process engine does: float32, seed 0, eager mode, vLLM's own
generation defaults (not the checkpoint's ``generation_config.json``) and
``--logprobs-mode processed_logprobs`` (the sampled token's logprob under the
temperature-scaled distribution, which the trainer's ratio needs). On the CPU build the
KV cache is a fixed ``VLLM_CPU_KVCACHE_SPACE`` GiB (1 unless the deployment sets it), and
a model whose head size its attention kernels lack is refused before the server starts
(the sizes are asked of that environment's vLLM once per interpreter).

The server runs in its own process group, and is stopped (SIGTERM to the group, SIGKILL
after a grace period) by ``stop()``, when its ``VLLMServer`` is garbage-collected, and at
interpreter exit; on Linux it also receives SIGTERM when the process that started it dies,
so a killed stage leaves no server behind. A server that exits during start-up is a
UserError quoting the last lines of its log; one that does not answer in time is an
InfraError (a loaded machine may do better on a retry).

Not covered: several servers per checkpoint, tensor parallelism, LoRA adapters, and
reusing a running server for another checkpoint (each checkpoint is a new server).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

from components.core import settings
from components.core.checkpoint import LOADED_FOLDERS
from components.core.children import die_with_parent
from components.core.errors import InfraError, UserError
from components.core.policy import TRAINER_STATE, checkpoint_expectations
from components.core.storage import Store

SERVED_NAME = "policy"
LOG_TAIL_LINES = 8
STOP_GRACE_S = 20.0


PROBE = """
import json
from vllm.platforms import current_platform
sizes = []
if current_platform.is_cpu():
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        pass
print(json.dumps(sizes))
"""


@functools.lru_cache(maxsize=4)
def cpu_head_sizes(python: str) -> tuple[int, ...]:
    """The head sizes the CPU build behind ``python`` has attention kernels for (empty: not the
    CPU build, or a vLLM layout that does not say; vLLM then decides itself)."""
    fix = "run `make vllm` again, or point POSTTRAIN_VLLM_PYTHON at a Python with vllm"
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, errors="replace", timeout=300)
    except OSError as exc:  # not executable, not a program at all
        raise UserError("POSTTRAIN_VLLM_PYTHON", python, f"cannot run it ({exc.strerror or type(exc).__name__})",
                        fix) from None
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]  # the exception, not its traceback
        raise UserError("POSTTRAIN_VLLM_PYTHON", python, f"cannot import vllm there ({last_line[:300]})", fix)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    try:
        sizes = json.loads(last)
    except (ValueError, RecursionError):
        sizes = None
    if not isinstance(sizes, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
        raise UserError("POSTTRAIN_VLLM_PYTHON", python, f"is not a Python that ran the vllm probe "
                        f"(it printed {last[:80]!r})", fix)
    return tuple(sizes)


def check_head_size(folder: Path, uri: str, sizes: tuple[int, ...] | list[int]) -> None:
    """The CPU attention kernels support only some head sizes (32, 64, 80, ...): fail clearly
    before vLLM starts instead of inside the first forward pass (no check when ``sizes`` is empty)."""
    if not sizes:
        return
    cfg = json.loads((folder / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head not in sizes:
        raise UserError("rollout.engine", "vllm", f"the CPU build of vLLM has no attention kernel for head size {head} "
                        f"(policy {uri})", f"use a model whose hidden_size / num_heads is one of {list(sizes)}, "
                        "or set rollout.engine: hf")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(python: str, folder: Path, port: int) -> list[str]:
    return [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0", "--enforce-eager",
        "--generation-config", "vllm", "--logprobs-mode", "processed_logprobs", "--disable-log-stats",
        "--disable-uvicorn-access-log",
    ]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept) or "(empty log)"


def _stop(proc: subprocess.Popen, folder: tempfile.TemporaryDirectory) -> None:
    """SIGTERM to the server's process group, SIGKILL after ``STOP_GRACE_S``; then remove its folder."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
    try:  # engine processes vLLM started and that outlived the server itself
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    folder.cleanup()


def download_checkpoint(uri: str, folder: Path) -> None:
    """The model files of the checkpoint at ``uri`` (checked against its manifest), not the optimizer state."""
    expected = {k: v for k, v in checkpoint_expectations(uri).items() if k != TRAINER_STATE}
    Store(uri, "policy").download_dir("", folder, expected=expected, skip=(TRAINER_STATE,), folders=LOADED_FOLDERS)


def served_models(reply: object) -> list[str]:
    """The model ids a ``/v1/models`` reply lists (``{"data": [{"id": ...}, ...]}``); none
    for a reply of another shape (not yet vLLM's, or another server on the port), which
    ``_wait_ready`` then treats as not ready."""
    data = reply.get("data") if isinstance(reply, dict) else None
    if not isinstance(data, list):
        return []
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


class VLLMServer:
    """One running vLLM server for the checkpoint at ``uri``; ``base_url`` is where it answers."""

    def __init__(self, python: str, uri: str, start_timeout_s: float, kv_cache_gib: float = 1.0) -> None:
        settings.check_vllm_python(python)
        self.uri = uri
        self._dir = tempfile.TemporaryDirectory(prefix="posttrain-vllm-server-")
        folder = Path(self._dir.name) / "model"
        try:
            download_checkpoint(uri, folder)
            check_head_size(folder, uri, cpu_head_sizes(python))
        except BaseException:
            self._dir.cleanup()
            raise
        self.log_path = Path(self._dir.name) / "server.log"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model = SERVED_NAME
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE") or f"{kv_cache_gib:g}"}
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(server_command(python, folder, self.port), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                          preexec_fn=die_with_parent(signal.SIGTERM))
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._dir)
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"{self.base_url}/v1/models"
        while True:
            code = self._proc.poll()
            if code is not None:
                raise UserError("rollout.engine", "vllm", f"vLLM's server exited with status {code} while starting on "
                                f"{self.uri}; its log ends: {log_tail(self.log_path)}",
                                "fix what the log says (a model vLLM cannot load, a broken install: re-run `make vllm`), "
                                "or set rollout.engine: hf")
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    if SERVED_NAME in served_models(json.loads(reply.read())):
                        return
            except (urllib.error.URLError, OSError, ValueError, RecursionError):
                pass
            if time.monotonic() > deadline:
                raise InfraError("vLLM server", self.base_url, f"no answer on /v1/models within {timeout_s:g}s "
                                 f"(checkpoint {self.uri}); its log ends: {log_tail(self.log_path)}")
            time.sleep(0.5)

    def running(self) -> bool:
        return self._proc.poll() is None

    def stop(self) -> None:
        """Stop the server and its engine processes, and remove the downloaded checkpoint (idempotent)."""
        self._finalizer()
