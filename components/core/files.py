"""Reading a local file that a user or another process names, without trusting what it
is: ``read_regular`` refuses a FIFO, a device, a socket or a folder before a byte is read
(a FIFO blocks until a writer comes, ``/dev/zero`` never ends) and reads at most one byte
past a limit, even from a file that grows. Used for task files, completions, the sandbox
CLI's inputs, the docker mode's flags file and the run root's manifested files.

Not covered: a file that is replaced by another between the checks and the read other
than by a FIFO (opened non-blocking, checked again on the descriptor); remote stores
(their callers bound the read with a size or a range).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_TASK_FILE_BYTES = 1 << 30
"""Largest task file (``taskgen.task_file``) read: the preflight and the task-file loader
(``components/domains/taskfile.py``) share it."""


class Unreadable(Exception):
    """``read_regular`` could not read the file; ``why`` says so in words (``no such file``,
    ``is a directory``, ``is not a regular file (a FIFO)``, ``cannot be read (...)``)."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(why)


_KINDS = ((stat.S_ISDIR, None), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _not_regular(mode: int) -> Unreadable:
    for test, kind in _KINDS:
        if test(mode):
            return Unreadable("is a directory" if kind is None else f"is not a regular file ({kind})")
    return Unreadable("is not a regular file")


def not_a_folder(name: str | Path) -> str | None:
    """Why local ``name`` is no folder, in words (``no such folder``, ``is a file, not a
    folder``, ``is not a folder (a FIFO)``), or None for a folder (symlinks followed)."""
    try:
        mode = os.stat(name).st_mode
    except FileNotFoundError:
        return "no such folder"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or type(exc).__name__})"
    if stat.S_ISDIR(mode):
        return None
    if stat.S_ISREG(mode):
        return "is a file, not a folder"
    kind = next((k for test, k in _KINDS if test(mode)), None)
    return f"is not a folder ({kind})" if kind else "is not a folder"


def read_regular(name: str | Path, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of the regular file ``name`` (symlinks followed): a
    result longer than ``limit`` means "too large", even for a file that grows while it is
    read. Anything else raises ``Unreadable`` before a byte is read: a FIFO (which would
    block until a writer comes), a device (``/dev/zero`` never ends), a socket, a
    directory, a missing or unreadable file. Opened non-blocking, so a FIFO swapped in
    after the check cannot hang the open; checked again on the open descriptor."""
    try:
        mode = os.stat(name).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(mode)
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise Unreadable("no such file") from None
    except OSError as exc:
        raise Unreadable(f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    except ValueError:  # a NUL byte in the path
        raise Unreadable("is not a valid path (it holds a NUL byte)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(info.st_mode)
        chunks: list[bytes] = []
        got = 0
        while got <= limit:
            # the whole file in one read (its size + 1), then 1 MiB at a time if it grew
            chunk = os.read(fd, min(limit + 1 - got, max(info.st_size + 1 - got, 1 << 20)))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as exc:
        raise Unreadable(f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    finally:
        os.close(fd)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
