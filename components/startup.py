"""Ctrl-C while the ``posttrain`` command imports its modules (about a second).

Importing this module (``components.cli`` does it first) makes SIGINT print the line the
command prints for Ctrl-C later, ``posttrain: interrupted (Ctrl-C)``, and exit 130, instead
of a ``KeyboardInterrupt`` traceback from inside whichever import it hit. ``done()``, after
the imports, puts the handler that was there before back, so a process that imports the
command's module (a test) keeps its own. Only in the main thread (elsewhere no handler can
be set). Not covered: the interpreter's own start-up before this module runs.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


def _interrupted(signum: int, frame: object) -> None:
    os.write(2, b"posttrain: interrupted (Ctrl-C)\n")
    os._exit(128 + int(signal.SIGINT))


_before: Any = None
if threading.current_thread() is threading.main_thread():
    _before = signal.signal(signal.SIGINT, _interrupted)


def done() -> None:
    """The imports are over: SIGINT gets the handler it had before this module was imported."""
    global _before
    if _before is not None and signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, _before)
    _before = None
