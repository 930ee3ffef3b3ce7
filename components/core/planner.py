"""Which iteration to run next: the first task of every DAG run, and ``posttrain run``.

``plan(store, recipe, holder)`` returns the iteration k this run works on and holds a
lease on it (``components.core.lease``), so two runs never work on the same k:

1. an iteration ``holder`` already holds and has not finished is resumed (a killed
   ``posttrain run`` started again, a retried plan task);
2. with ``replay=True`` (one DAG run = one iteration), the newest iteration ``holder``
   holds is returned even when finished, so clearing a finished DAG run replays the same
   k, and every stage is a cache hit; but once a later iteration has started, that k is
   over: a UserError (``check_current``), since a stage re-run on a changed recipe or code
   would train and judge again from today's champion and could move it back. A failed
   run hands its lease back; cleared so that its plan runs again (``cleared=True``), it
   looks through the lease chains for the newest iteration it held (``lease.last_held``)
   and resumes or replays that k as above, and once another run took that k after it and
   finished it, that k is over too (a UserError), rather than run a new iteration on its
   old conf;
3. otherwise k = the last iteration with an evaluation manifest + 1 (a half-done k
   resumes: its finished stages are cache hits), claimed for ``holder``. A live lease of
   another holder on k raises ``LeaseHeld``, unless ``stale(lease)`` says its holder is
   gone (``posttrain run``, holding the pipeline's writer lease, knows that every other
   ``local:`` holder is a run that stopped, and takes its iteration over).

It also writes the resolved recipe to ``<pipeline>/iter-<k>/recipe.json``, so an
iteration describes itself even if the recipe file changes later (rewritten on every
resume, as the stages read the file as it is then). Not covered: running two iterations
at once (k+1 needs checkpoint k).
"""

from __future__ import annotations

from collections.abc import Callable

from components.core import lease
from components.core.errors import UserError
from components.core.manifest import MANIFEST, iteration_prefix, stage_prefix
from components.core.recipe import Recipe
from components.core.storage import Store

RECIPE_SNAPSHOT = "recipe.json"


def finished(store: Store, pipeline: str) -> list[int]:
    """Iterations whose evaluation manifest exists, ascending. The last one's manifest is
    read too, since the next iteration starts from it: one cut short or edited is a
    UserError naming it (it was counted as finished, and the next iteration ran whole
    before its own evaluation tripped over it). Earlier ones are only looked for."""
    from components.core.context import read_manifest

    done = []
    for name in store.listdir(pipeline):
        if name.startswith("iter-") and name[5:].isdigit():
            k = int(name[5:])
            if store.exists(f"{stage_prefix(pipeline, k, 'evaluation')}/{MANIFEST}"):
                done.append(k)
    if done:
        read_manifest(store, stage_prefix(pipeline, max(done), "evaluation"))
    return sorted(done)


def started_after(store: Store, pipeline: str, iteration: int) -> int | None:
    """The newest iteration after ``iteration`` that has been planned (its folder exists), or None."""
    later = [int(n[5:]) for n in store.listdir(pipeline) if n.startswith("iter-") and n[5:].isdigit()]
    return max((k for k in later if k > iteration), default=None)


NEW_RUN_FIX = "trigger a new run (its plan picks the iteration to work on) instead of clearing this one's tasks"


def check_current(store: Store, pipeline: str, iteration: int, holder: str) -> None:
    """What a stage task of a DAG run checks before it runs (clearing a run's tasks skips
    its plan task): UserError once a later iteration has started (the iteration is over),
    or while another holder's lease on it is live; a lease that was handed back or has
    expired (a failed run whose failed tasks are cleared) is taken again for ``holder``,
    as its plan would."""
    fix = NEW_RUN_FIX
    later = started_after(store, pipeline, iteration)
    if later is not None:
        raise UserError("iteration", iteration, f"iteration {iteration} of pipeline {pipeline!r} is over: iteration "
                        f"{later} has started since, and re-running its stages on today's recipe and code could "
                        "move the champion back", fix)
    cur = lease.current(store, pipeline, iteration)
    if cur is not None and cur.holder == holder:
        return
    if cur is not None and cur.live():
        raise UserError("iteration", iteration, f"iteration {iteration} of pipeline {pipeline!r} is held by "
                        f"{cur.holder!r}, not by this run ({holder!r})",
                        "wait for that run to finish; " + fix)
    lease.acquire(store, pipeline, iteration, holder)


def handed_back(store: Store, pipeline: str, holder: str, done: set[int]) -> int | None:
    """The newest iteration ``holder`` held and no longer holds (a failed DAG run hands its
    lease back), for its cleared run to resume or replay; None when it held none (its plan
    failed before it leased one). A UserError once another run took that iteration after it
    and finished it: re-running its stages on this run's conf (an old one-off recipe, say)
    and today's code could move the champion back."""
    found = lease.last_held(store, pipeline, holder)
    if found is None:
        return None
    k, taker = found
    if k in done and taker:
        raise UserError("iteration", k, f"iteration {k} of pipeline {pipeline!r} is over: {taker!r} took it after "
                        "this run handed it back and finished it, and re-running its stages on this run's recipe and "
                        "today's code could move the champion back", NEW_RUN_FIX)
    return k


def plan(store: Store, recipe: Recipe, holder: str, replay: bool = False, ttl_s: float = lease.DEFAULT_TTL_S,
         stale: Callable[[lease.Lease], bool] | None = None, cleared: bool = False) -> int:
    pipeline = recipe.pipeline
    done = set(finished(store, pipeline))
    k = next((k for k in lease.held_by(store, pipeline, holder) if replay or k not in done), None)
    if k is None and replay and cleared:  # reads every lease record: only for a cleared run
        k = handed_back(store, pipeline, holder, done)
    if k is not None:
        check_current(store, pipeline, k, holder)
    else:
        k = max(done, default=0) + 1
    lease.acquire(store, pipeline, k, holder, ttl_s, stale)
    store.write_json(f"{iteration_prefix(pipeline, k)}/{RECIPE_SNAPSHOT}", recipe.model_dump(mode="json"))
    return k
