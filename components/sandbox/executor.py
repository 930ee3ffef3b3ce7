"""Executors run ``Job``s; backends are picked by name from ``core.plugins.BACKENDS``.

``get_executor(config)`` returns the backend the recipe names (``sandbox.backend``):
``bwrap`` (bwrap.py, the hardened sandbox) or ``subprocess`` (subprocess_backend.py,
trusted code only); plug-ins add theirs through the ``posttrain.sandbox_backends``
entry points. Every executor is a context manager (``with get_executor(cfg) as ex:``
closes it). ``run_many`` fans jobs out over a thread pool capped at
``sandbox.concurrency`` and retries infrastructure errors only, never the program's own
failure.

Not covered: choosing a backend per job (one executor runs all of a stage's jobs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from components.core.jobs import Job, JobResult, SessionJob
from components.core.plugins import BACKENDS
from components.sandbox.outcome import infra_error


class Executor(Protocol):
    name: str
    isolation: str

    def run(self, job: Job | SessionJob) -> JobResult: ...

    def close(self) -> None: ...

    def __enter__(self) -> Executor: ...

    def __exit__(self, *exc) -> None: ...


class Closing:
    """``with executor:`` closes it on the way out (``__enter__`` returns the executor)."""

    def close(self) -> None:
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def get_executor(config) -> Executor:
    """The executor named by ``config.backend`` (a ``SandboxConfig``); unknown names are a
    ``UserError`` listing the registered ones."""
    return BACKENDS.load(config.backend)(config)


def run_many(executor: Executor, jobs: Iterable[Job], concurrency: int, retries: int = 2,
             on_done: Callable[[int], None] | None = None) -> list[JobResult]:
    """Run jobs at most ``concurrency`` at once; retry only ``infra_error`` results."""
    jobs = list(jobs)

    def one(job: Job) -> JobResult:
        for _ in range(retries + 1):
            try:
                result = executor.run(job)
            except Exception as exc:  # a backend crash is an infrastructure error, not a verdict
                result = infra_error(f"{type(exc).__name__}: {exc}", executor.name, executor.isolation)
            if result.status != "infra_error":
                break
        if on_done:
            on_done(1)
        return result

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, jobs))
