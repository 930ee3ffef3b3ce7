"""Progress: rich bars on a terminal, plain lines in logs.

``say`` prints one line (the per-stage progress line). ``bar`` yields an ``advance(n)``
callable: on a terminal it drives a rich progress bar; elsewhere (Airflow logs, CI) it
prints a plain line every 25% of the work (once, at the end, for small jobs), so logs stay readable,
plus a start line (``  <label> 0/<total> started``, for more than one item) and a line
whenever an item finishes ``HEARTBEAT_S`` or more after the last line, so a job of a few
slow items is not silent until its end.

Not covered: a line while one item runs (lines are printed as items finish).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

HEARTBEAT_S = 30.0
"""Outside a terminal, an item that finishes this long after the last line prints one."""

_clock: Callable[[], float] = time.perf_counter  # read at each call, so tests can patch it


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
    start = last = _clock()
    if total > 1:
        say(f"  {label} 0/{total} started")

    def advance(n: int) -> None:
        nonlocal done, next_mark, last
        done += n
        now = _clock()
        mark = done >= next_mark or done == total
        if mark or now - last >= HEARTBEAT_S:
            say(f"  {label} {done}/{total} ({now - start:.1f}s)")
            last = now
        if mark:
            next_mark = done + step

    yield advance
