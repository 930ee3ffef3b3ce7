"""Progress: rich bars on a terminal, plain lines in logs.

``say`` prints one line (the per-stage progress line). ``bar`` yields an ``advance(n)``
callable: on a terminal it drives a rich progress bar; elsewhere (Airflow logs, CI) it
prints a plain line every 25% of the work (once, at the end, for small jobs), so logs stay readable,
plus a start line (``  <label> 0/<total> started``, for more than one item) and a line
whenever an item finishes ``HEARTBEAT_S`` or more after the last line, so a job of a few
slow items is not silent until its end.

``heartbeat`` is for a wait with nothing to count (a trainer node other than the leader,
which cannot see the steps done): it yields a ``beat()`` to call as the wait polls, which
prints ``  <label> <doing>, <elapsed>`` every ``every_s`` (on a terminal too), so a long
wait is not silent.

Not covered: a line while one item of a ``bar`` runs (lines are printed as items finish).
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


HEARTBEAT_WAIT_S = HEARTBEAT_S * 10
"""``heartbeat``'s default interval: a line every 5 minutes of a wait."""


def _elapsed(seconds: float) -> str:
    minutes = int(seconds // 60)
    if minutes < 1:
        return f"{seconds:.0f}s"
    return f"{minutes // 60}h {minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"


@contextmanager
def heartbeat(label: str, every_s: float = HEARTBEAT_WAIT_S, doing: str = "still running") -> Iterator[Callable[[], None]]:
    """Yields ``beat()``: called as a wait polls, it prints ``  <label> <doing>, <elapsed>``
    once ``every_s`` has passed since the start or the last such line. ``every_s`` <= 0:
    a no-op."""
    if every_s <= 0:
        yield lambda: None
        return
    start = _clock()
    next_at = start + every_s

    def beat() -> None:
        nonlocal next_at
        now = _clock()
        if now >= next_at:
            say(f"  {label} {doing}, {_elapsed(now - start)}")
            next_at = now + every_s

    yield beat
