"""The cyclic garbage collector's policy in a ``posttrain run`` or ``posttrain stage`` process.

Airflow, MLflow, torch and transformers leave about 1.4 million objects alive, and each
full pass of the cyclic collector walks all of them. Measured on one demo iteration
(2 cores): the collector's passes took 4.8 s, and the interpreter's last pass at exit
took 4 s more, after the last line was printed. Most of those objects live until the
process ends, so the passes find almost nothing to free. The policy:

- ``start()``: no cyclic collection while the process imports its libraries and sets up
  (imports make little cyclic garbage);
- ``settle()``: at each stage's start and end, one collection of what is not frozen (the
  garbage of the stage that just ended), then ``gc.freeze()`` of the survivors, and the
  collector back on. Later passes walk only what is newer. A stage's own cycles are
  collected at its end, before the freeze, so a model or a batch a stage dropped is not
  kept. The first ``settle()`` after ``start()`` freezes without collecting: that pass
  would walk every object the imports made (0.4-0.5 s) to free the set-up's few cycles;
- ``before_exit()``: ``gc.freeze()`` before the interpreter ends, so its final pass walks
  nothing; the OS reclaims the memory.

This is the pattern the ``gc.freeze`` documentation describes for forking servers (the
real scheduler's forked task processes share their parent's pages longer too). Only a
process that ``start()`` activated does any of this: a library caller (a test calling
``run_stage``) keeps its own collector untouched. Not covered: an object frozen while
alive that later becomes part of a dropped cycle is not freed until the process ends
(the set-up's own cycles included: tens of thousands of small objects on the demo);
``POSTTRAIN_GC=default`` turns the policy off.
"""

from __future__ import annotations

import gc
import os

_active = False
_collect = False  # whether settle() collects before freezing (not until the first settle after start)


def enabled() -> bool:
    """Whether this process runs the policy (``start()`` ran, and ``POSTTRAIN_GC`` is not ``default``)."""
    return _active


def start() -> None:
    """Activate the policy in this process (a CLI entry, before its imports): collector off until ``settle()``."""
    global _active, _collect
    if os.environ.get("POSTTRAIN_GC", "").strip().lower() == "default":
        return
    _active, _collect = True, False
    gc.disable()


def settle() -> None:
    """At a stage boundary: collect what is not frozen, freeze the survivors, collector on."""
    global _collect
    if not _active:
        return
    if _collect:
        gc.collect()
    _collect = True
    gc.freeze()
    gc.enable()


def before_exit() -> None:
    """Skip the interpreter's final full collection (the process is about to end)."""
    if _active:
        gc.freeze()


def stop() -> None:
    """Deactivate the policy and leave the collector on (a caller that keeps running)."""
    global _active
    _active = False
    gc.enable()
