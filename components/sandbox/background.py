"""A long-lived daemon thread that runs submitted calls one at a time, in order.

The sandbox needs threads that outlive their callers twice. Starting sandboxes: bwrap's
``--die-with-parent`` and setpriv's ``--pdeathsig`` use PR_SET_PDEATHSIG, which fires
when the *thread* that forked exits, so a sandbox started from a short-lived thread (a
prestart thread, a ``run_many`` pool thread) would be killed with it; ``SPAWNER`` starts
warm workers and parked strict launches. And removing job cgroups off the job's critical
path (``cgroups.REAPER``). The thread starts on first use.

Not covered: running calls in parallel, cancelling a call, stopping the thread (it is a
daemon and ends with the process).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait


class Background:
    def __init__(self, name: str) -> None:
        self.name = name
        self._todo: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last: Future | None = None

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        future: Future = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._last = future
            self._todo.put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the thread; its result, or its exception raised here."""
        return self.submit(fn, *args, **kwargs).result()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every call submitted so far has run (tests, executor close)."""
        if self._last is not None:
            wait([self._last], timeout=timeout_s)

    def _loop(self) -> None:
        while True:
            future, fn, args, kwargs = self._todo.get()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)


SPAWNER = Background("sandbox-spawner")
