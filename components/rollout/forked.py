"""Map a function over independent items in forked processes, results in the items' order.

``forked_map(fn, n, workers)`` runs ``fn(k)`` for k in 0..n-1: this process takes
k = 0, workers, 2*workers, ... and each of ``workers - 1`` forked children the items
``k % workers == w``. A child inherits the caller's memory (the loaded policy) copy on
write, sends its results back pickled through a pipe, and exits. The HF engine spreads
its generation batches this way (each batch is seeded by its own index, so the output
does not depend on which process ran it), which gives a stage the machine's other cores
when the orchestrator runs shards one after the other (``posttrain run``).

A child that raises sends the error's text and the caller raises ``RuntimeError`` with
it; a child that dies without answering (killed, out of memory) is a ``RuntimeError``
naming its exit code. Not covered: platforms without ``fork`` (``workers`` must stay 1
there), and anything ``fn`` does that a forked child cannot (threads it expects to find,
open network connections): ``fn`` should compute, not talk.
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def forked_map(fn: Callable[[int], T], n: int, workers: int,
               done: Callable[[int], None] | None = None) -> list[T]:
    """``[fn(0), ..., fn(n-1)]``, computed by ``workers`` processes (this one included);
    ``done(k)`` is called in this process for every finished item."""
    workers = max(1, min(workers, n))
    if workers == 1:
        out = []
        for k in range(n):
            out.append(fn(k))
            if done:
                done(k)
        return out
    ctx = multiprocessing.get_context("fork")
    children = []
    for w in range(1, workers):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(fn, range(w, n, workers), send), daemon=True)
        proc.start()
        send.close()
        children.append((proc, recv))
    results: dict[int, T] = {}
    try:
        for k in range(0, n, workers):
            results[k] = fn(k)
            if done:
                done(k)
        for proc, recv in children:
            try:
                ok, payload = recv.recv()
            except EOFError:
                proc.join()
                raise RuntimeError(f"a forked generation worker died without answering (exit code {proc.exitcode})") from None
            if not ok:
                raise RuntimeError(f"a forked generation worker failed:\n{payload}")
            for k, value in payload:
                results[k] = value
                if done:
                    done(k)
    finally:
        for proc, recv in children:
            recv.close()
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[k] for k in range(n)]


def _child(fn: Callable[[int], T], items: range, send) -> None:
    try:
        payload = [(k, fn(k)) for k in items]
        send.send((True, payload))
    except BaseException:
        send.send((False, traceback.format_exc()[-4000:]))
    finally:
        send.close()
