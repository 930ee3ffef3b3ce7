"""Executors run ``Job``s; backends are picked by name from a small registry.

``get_executor(config)`` returns the backend the recipe names (``sandbox.backend``).
``run_many`` fans jobs out over a thread pool capped at ``sandbox.concurrency`` and
retries infrastructure errors only, never the program's own failure.

The ``subprocess`` backend here gives process-level containment only: a fresh temp work
folder, its own session (so a timeout kills the whole tree), rlimits for CPU time,
address space, file size and open files, capped output, and ``-I`` for Python. It is
NOT isolation from the host: the job can read what the user can read and reach the
network. Use it for trusted code or development only.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from components.core.jobs import PYTHON, RESULT_FD, Job, JobResult, SessionJob

DEFAULT_PYTHON = "/usr/bin/python3"


class Executor(Protocol):
    name: str
    isolation: str

    def run(self, job: Job | SessionJob) -> JobResult: ...

    def close(self) -> None: ...


_BACKENDS: dict[str, Callable[..., Executor]] = {}
_BUILTIN_MODULES = ("components.sandbox.bwrap",)  # imported on first lookup; they register themselves
_builtins_loaded = False


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        from importlib import import_module

        for module in _BUILTIN_MODULES:
            import_module(module)


def register_backend(name: str):
    def wrap(factory: Callable[..., Executor]) -> Callable[..., Executor]:
        _BACKENDS[name] = factory
        return factory

    return wrap


def backend_names() -> list[str]:
    _load_builtins()
    return sorted(_BACKENDS)


def get_executor(config) -> Executor:
    """The executor named by ``config.backend`` (a ``SandboxConfig``)."""
    from components.core.errors import UserError

    _load_builtins()
    if config.backend not in _BACKENDS:
        raise UserError("sandbox.backend", config.backend, "unknown sandbox backend", f"use one of {backend_names()}")
    return _BACKENDS[config.backend](config)


def cap(data: bytes, limit: int) -> str:
    text = data[:limit].decode("utf-8", errors="replace")
    return text + f"\n...[{len(data) - limit} bytes cut]" if len(data) > limit else text


def python_for(config) -> str:
    return config.python or (DEFAULT_PYTHON if os.path.exists(DEFAULT_PYTHON) else shutil.which("python3") or "python3")


@register_backend("subprocess")
class SubprocessExecutor:
    name = "subprocess"
    isolation = "process+rlimits"

    def __init__(self, config) -> None:
        from components.core.errors import UserError

        # Process-level containment only: refuse untrusted code unless the recipe says so.
        if not getattr(config, "allow_weak_isolation", False):
            raise UserError("sandbox.allow_weak_isolation", False,
                            "backend 'subprocess' gives no namespace isolation (weaker than the 'bwrap' backend)",
                            "use sandbox.backend: bwrap, or set sandbox.allow_weak_isolation: true for trusted code")
        self.config = config
        self.python = python_for(config)

    def _limits(self) -> None:
        mem = self.config.memory_mb * 1024 * 1024
        cpu = int(self.config.timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    def run(self, job: Job | SessionJob) -> JobResult:
        if isinstance(job, SessionJob):
            from components.sandbox.session import flatten

            job = flatten(job)
        timeout = job.timeout_s or self.config.timeout_s
        limit = self.config.output_cap_bytes
        with tempfile.TemporaryDirectory(prefix="posttrain-job-") as work:
            for rel, text in job.files.items():
                path = Path(work) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            argv = [self.python if a == PYTHON else a for a in job.argv]
            result_r = result_w = None
            if job.uses_result_fd:  # the write end keeps its number in the child (pass_fds)
                result_r, result_w = os.pipe()
                argv = [str(result_w) if a == RESULT_FD else a for a in argv]
            start = time.perf_counter()
            try:
                proc = _Popen(
                    argv, cwd=work, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True, preexec_fn=self._limits, env={"PATH": "/usr/bin:/bin", "HOME": work},
                    pass_fds=[result_w] if result_w is not None else [],
                )
            except OSError as exc:
                return _infra(job, f"could not start {argv[0]}: {exc}", self)
            finally:
                if result_w is not None:
                    os.close(result_w)
            reader = _Reader(result_r) if result_r is not None else None
            timed_out = False
            try:
                out, err = proc.communicate(job.stdin.encode(), timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            duration = time.perf_counter() - start
            # communicate() reaped the child; its own rusage came back through wait4 in _wait
            usage = proc.usage
            cpu = usage.ru_utime + usage.ru_stime if usage else 0.0  # None only if the child was reaped elsewhere
            peak = usage.ru_maxrss / 1024 if usage else 0.0
            result = None
            if reader is not None:
                result = reader.json()
            elif job.result_file and (Path(work) / job.result_file).is_file():
                try:
                    result = json.loads((Path(work) / job.result_file).read_text()[:1_000_000])
                except (json.JSONDecodeError, UnicodeDecodeError):
                    result = None
            code = proc.returncode
            sig = -code if code < 0 else 0
            if timed_out:
                status = "timeout"
            elif sig == signal.SIGXCPU:
                status = "timeout"
            elif sig:
                status = "killed"
            elif code != 0 and b"MemoryError" in err:
                status = "oom"
            else:
                status = "ok" if code == 0 else "failed"
            return JobResult(
                status=status, exit_code=code, signal=sig, stdout=cap(out, limit), stderr=cap(err, limit),
                duration_s=duration, cpu_time_s=cpu, peak_memory_mb=peak,
                result=result, backend=self.name, isolation=self.isolation,
            )

    def close(self) -> None:
        return None


class _Popen(subprocess.Popen):
    """Popen that reaps with ``os.wait4``, keeping this child's own rusage.

    ``getrusage(RUSAGE_CHILDREN)`` sums every child this process ever reaped, so under
    concurrency it mixes jobs; ``wait4`` gives exactly this child and its waited-for tree.
    """

    usage = None

    def _try_wait(self, wait_flags):
        try:
            pid, status, usage = os.wait4(self.pid, wait_flags)
        except ChildProcessError:
            pid, status = self.pid, 0
        else:
            if pid == self.pid:
                self.usage = usage
        return pid, status


class _Reader:
    """Reads a result pipe on a thread until EOF, keeping at most 1 MB."""

    LIMIT = 1 << 20

    def __init__(self, fd: int) -> None:
        import threading

        self.fd = fd
        self.data = bytearray()
        self.total = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while chunk := os.read(self.fd, 1 << 16):
                self.total += len(chunk)
                if len(self.data) < self.LIMIT:
                    self.data += chunk[: self.LIMIT - len(self.data)]
        finally:
            os.close(self.fd)

    def json(self):
        self.thread.join(timeout=2.0)
        if self.total == 0 or self.total > self.LIMIT:
            return None
        try:
            return json.loads(bytes(self.data))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None


def _infra(job: Job, why: str, executor: Executor) -> JobResult:
    return JobResult(
        status="infra_error", exit_code=-1, signal=0, stdout="", stderr=why, duration_s=0.0, cpu_time_s=0.0,
        peak_memory_mb=0.0, backend=executor.name, isolation=executor.isolation,
    )


def run_many(executor: Executor, jobs: Iterable[Job], concurrency: int, retries: int = 2,
             on_done: Callable[[int], None] | None = None) -> list[JobResult]:
    """Run jobs at most ``concurrency`` at once; retry only ``infra_error`` results."""
    jobs = list(jobs)

    def one(job: Job) -> JobResult:
        for attempt in range(retries + 1):
            try:
                result = executor.run(job)
            except Exception as exc:  # a backend crash is an infrastructure error, not a verdict
                result = _infra(job, f"{type(exc).__name__}: {exc}", executor)
            if result.status != "infra_error":
                break
        if on_done:
            on_done(1)
        return result

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, jobs))
