"""Progress: rich bars on a terminal, plain lines in logs.

``say`` prints one line (the per-stage progress line). ``bar`` yields an ``advance(n)``
callable: on a terminal it drives a rich progress bar; elsewhere (Airflow logs, CI) it
prints a plain line every 25% of the work (once, at the end, for small jobs), so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def say(line: str) -> None:
    print(line, flush=True)


def _is_terminal() -> bool:
    return sys.stdout.isatty()


@contextmanager
def bar(label: str, total: int) -> Iterator[Callable[[int], None]]:
    if total <= 0:
        yield lambda n: None
        return
    if _is_terminal():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      transient=True) as progress:
            task = progress.add_task(label, total=total)
            yield lambda n: progress.advance(task, n)
        return
    done = 0
    step = total if total < 32 else max(1, total // 4)  # small jobs: one line at the end
    next_mark = step
    start = time.perf_counter()

    def advance(n: int) -> None:
        nonlocal done, next_mark
        done += n
        if done >= next_mark or done == total:
            say(f"  {label} {done}/{total} ({time.perf_counter() - start:.1f}s)")
            next_mark = done + step

    yield advance
