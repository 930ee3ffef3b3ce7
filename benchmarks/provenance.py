"""Where, when and on what code a benchmark ran: one dict that every results writer records.

Claims say where a ratio was measured (machine, thread count, commit) with its spread;
this puts those facts beside the numbers. A results .json gets it as ``"provenance"`` and
its .md one line from ``provenance_line``. Scripts run as ``python benchmarks/<x>.py`` or
``python benchmarks/<dir>/<x>.py`` import it with the repository root on ``sys.path``
(``benchmarks/`` is not an installed package)::

    sys.path.insert(0, str(REPO))
    from benchmarks.provenance import provenance, provenance_line

Only the standard library: it works from a fresh clone, and without git (commit and dirty
are then None).
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    """``git args`` in the repository: its stdout, or None without git or outside a git checkout."""
    try:  # --no-optional-locks: status must not take the index lock (or refresh it) under other work
        proc = subprocess.run(["git", "--no-optional-locks", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def cpu_model() -> str | None:
    """``model name`` from /proc/cpuinfo (Linux on x86), else what ``platform`` knows, else None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def load_1min() -> float | None:
    """The 1-minute load average now (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _one_minute(load: float | Sequence[float] | None) -> float | None:
    """A 1-minute load average from a number or an ``os.getloadavg()`` triple."""
    if load is None:
        return None
    return round(float(load if isinstance(load, int | float) else load[0]), 2)


def provenance(torch_threads: int | str | dict | None = None, load_start: float | Sequence[float] | None = None,
               load_end: float | Sequence[float] | None = None) -> dict:
    """UTC date-time (now), commit and whether the working tree differs from it, CPU model and
    count, torch threads (as the script set them; None where it sets none) and the 1-minute
    load average at the start and end of the measurement (where the script measured them; a
    number or an ``os.getloadavg()`` triple)."""
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain") if head else None
    return {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": head.strip() if head else None,
        "dirty": bool(status.strip()) if status is not None else None,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "torch_threads": torch_threads,
        "load_1min_start": _one_minute(load_start),
        "load_1min_end": _one_minute(load_end),
    }


def provenance_line(p: dict | None) -> str:
    """One line for a results .md: ``Provenance: commit ..., date, CPU, threads, load``."""
    if not p:
        return "Provenance: not recorded (these results were written before the benchmarks recorded it)."
    commit = (f"commit {p['commit'][:7]}" + {True: " plus uncommitted changes", False: "", None: ""}[p.get("dirty")]
              if p.get("commit") else "commit unknown (no git)")
    parts = [commit, p["date_utc"].replace("T", " ").replace("Z", " UTC"),
             f"{p.get('cpu_model') or 'CPU model unknown'} ({p.get('machine') or '?'}, {p.get('cpu_count')} CPUs)"]
    threads = p.get("torch_threads")
    if isinstance(threads, dict):
        parts.append("torch threads " + ", ".join(f"{k} {v}" for k, v in threads.items()))
    elif threads is not None:
        parts.append(f"{threads} torch thread(s)")
    start, end = p.get("load_1min_start"), p.get("load_1min_end")
    if start is not None or end is not None:
        parts.append("1-minute load average " + " -> ".join(f"{x:.2f}" for x in (start, end) if x is not None)
                     + (" (start -> end)" if start is not None and end is not None else
                        " at the start" if start is not None else " at the end"))
    return "Provenance: " + ", ".join(parts) + "."
