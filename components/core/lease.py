"""Leases on iterations: one writer per iteration, kept in the store itself.

A lease says "holder H works on iteration k until time T". It is a chain of small JSON
objects, ``<pipeline>/_leases/iter-<k:06d>/<gen:06d>.json``; the one with the highest
generation is current. Every change (take, renew, release) creates the *next*
generation with a create-if-absent write (``Store.create``: a hard link on ``file://``,
a conditional PUT on S3), so of two writers racing for the same generation exactly one
wins, on any backend, without locks or deletes. The loser re-reads the chain and finds
the lease held.

Besides one lease per iteration, a pipeline has one *writer* lease
(``<pipeline>/_leases/writer/``, ``iteration == WRITER``) that ``posttrain run`` holds
for as long as it drives the pipeline, renewed every minute (time to live
``WRITER_TTL_S``); its holder names the host, pid, start time and home of the run.

A lease expires at ``expires_at`` unless renewed, so a holder that died (a killed
worker, a lost machine) does not block the iteration for ever; a released lease (a
failed DAG run hands it back) can be taken at once. Not covered: clock skew between
machines larger than the lease's time to live, and compaction of old generations (a few
hundred bytes per change).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from components.core.errors import InfraError, UserError, outage
from components.core.storage import Store

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 6 * 3600.0
WRITER = -1
"""The ``iteration`` of the pipeline's writer lease (``<pipeline>/_leases/writer/``): the
one ``posttrain run`` that may drive the pipeline, whatever iteration it is on."""
MAX_TTL_S = 7 * 24 * 3600.0
"""The longest a lease record may run (from its ``acquired_at``), and how far ahead of this
machine's clock it may start: past either it is no lease's record."""
WRITER_TTL_S = 300.0
"""The writer lease's time to live; its holder renews it every ``WRITER_TTL_S / 5``."""


@dataclass(frozen=True)
class Lease:
    iteration: int
    holder: str  # "" once released
    generation: int
    acquired_at: float
    expires_at: float

    def live(self, now: float | None = None) -> bool:
        return bool(self.holder) and (time.time() if now is None else now) < self.expires_at


class LeaseHeld(Exception):
    """Another holder has a live lease on the iteration. Not the user's mistake, and not an
    outage: wait for it to finish (or its lease to expire), or stop that run."""

    def __init__(self, lease: Lease, pipeline: str) -> None:
        self.lease = lease
        left = max(0.0, lease.expires_at - time.time())
        super().__init__(f"iteration {lease.iteration} of pipeline {pipeline!r} is held by {lease.holder!r} "
                         f"(lease expires in {left:.0f} s); wait for that run to finish, or stop it and release "
                         f"its lease: posttrain release --iteration {lease.iteration} --holder {shlex.quote(lease.holder)} "
                         "(with that run's --recipe and --run-root)")


def _folder(pipeline: str, iteration: int) -> str:
    return f"{pipeline}/_leases/iter-{iteration:06d}"


def _writer_folder(pipeline: str) -> str:
    return f"{pipeline}/_leases/writer"


def _folder_of(pipeline: str, iteration: int) -> str:
    return _writer_folder(pipeline) if iteration == WRITER else _folder(pipeline, iteration)


def current(store: Store, pipeline: str, iteration: int) -> Lease | None:
    folder = _folder_of(pipeline, iteration)
    names = [n for n in store.listdir(folder) if n.endswith(".json") and n[:-5].isdigit()]
    if not names:
        return None
    rel = f"{folder}/{max(names, key=lambda n: int(n[:-5]))}"
    try:
        lease = _parse(store.read_small(rel, MAX_LEASE_BYTES))
    except FileNotFoundError:
        raise
    except OSError as exc:  # s3fs raises a 5xx answer as an OSError: an outage, not a bad record
        if (down := outage(exc)) is not None:
            raise InfraError("store", store.uri, down) from exc
        lease = None  # past MAX_LEASE_BYTES, a FIFO in its place: written by something else
    except (ValueError, TypeError, RecursionError):  # not a lease's JSON: written by something else
        lease = None
    if lease is not None and (lease.iteration, lease.generation) != (iteration, int(rel.rsplit("/", 1)[1][:-5])):
        lease = None  # another slot's record: a taker would write a generation that is already there, for ever
    if lease is None:
        raise UserError("lease", store.url(rel), "is not a lease record (corrupted or written by another tool)",
                        "stop any run of this pipeline, then delete that object; the next run takes the lease anew")
    return lease


MAX_LEASE_BYTES = 64 << 10  # a lease record is about 150 bytes


def _parse(data: bytes) -> Lease | None:
    """The lease in ``data``, or None when it is not one (another shape, wrong-typed fields,
    times past ``MAX_TTL_S``)."""
    fields = json.loads(data)
    if not isinstance(fields, dict) or set(fields) != {f.name for f in dataclasses.fields(Lease)}:
        return None
    whole = all(isinstance(fields[k], int) and not isinstance(fields[k], bool) for k in ("iteration", "generation"))
    times = all(isinstance(fields[k], (int, float)) and not isinstance(fields[k], bool)
                for k in ("acquired_at", "expires_at"))
    if not (whole and times and isinstance(fields["holder"], str) and fields["generation"] >= 0):
        return None
    if not (0 <= fields["expires_at"] - fields["acquired_at"] <= MAX_TTL_S and fields["acquired_at"] < time.time() + MAX_TTL_S):
        return None  # no holder takes a lease this long, or from that far ahead: it would block the pipeline for good
    return Lease(**fields)


def _write_next(store: Store, pipeline: str, iteration: int, after: Lease | None, holder: str, ttl_s: float) -> Lease | None:
    now = time.time()
    lease = Lease(iteration=iteration, holder=holder, generation=0 if after is None else after.generation + 1,
                  acquired_at=now, expires_at=now + ttl_s if holder else now)
    data = json.dumps(asdict(lease), sort_keys=True).encode()
    return lease if store.create(f"{_folder_of(pipeline, iteration)}/{lease.generation:06d}.json", data) else None


def acquire(store: Store, pipeline: str, iteration: int, holder: str, ttl_s: float = DEFAULT_TTL_S,
            stale: Callable[[Lease], bool] | None = None) -> Lease:
    """Take (or renew) the lease on ``iteration`` for ``holder``; ``LeaseHeld`` when another
    holder's lease is live, unless ``stale(lease)`` says that holder is known to be gone
    (then it is taken over with the next generation: of two takers exactly one wins)."""
    assert holder, "a lease needs a holder"
    for _ in range(20):  # each round either wins a generation or sees who did
        cur = current(store, pipeline, iteration)
        if cur is not None and cur.live() and cur.holder != holder and not (stale and stale(cur)):
            raise LeaseHeld(cur, pipeline)
        won = _write_next(store, pipeline, iteration, cur, holder, ttl_s)
        if won is not None:
            return won
    raise RuntimeError(f"lease on iteration {iteration}: 20 generations lost in a row; the store is not consistent")


def release(store: Store, pipeline: str, iteration: int, holder: str) -> bool:
    """Hand the lease back if ``holder`` has it; True if it did."""
    cur = current(store, pipeline, iteration)
    if cur is None or cur.holder != holder:
        return False
    return _write_next(store, pipeline, iteration, cur, "", 0.0) is not None


def held_by(store: Store, pipeline: str, holder: str) -> list[int]:
    """Iterations whose current lease (live or expired, not released) is ``holder``'s, newest first."""
    out = []
    for name in store.listdir(f"{pipeline}/_leases"):
        if name.startswith("iter-") and name[5:].isdigit():
            cur = current(store, pipeline, int(name[5:]))
            if cur is not None and cur.holder == holder:
                out.append(cur.iteration)
    return sorted(out, reverse=True)


def last_held(store: Store, pipeline: str, holder: str) -> tuple[int, str] | None:
    """The newest iteration whose lease chain names ``holder`` in any generation (also one
    it has handed back since, or lost when it expired), with the newest other holder that
    took it after (``""`` when none did); None when ``holder`` never held one. It reads
    every record of the pipeline's chains, so callers keep it to a rare case (a cleared DAG
    run: ``planner.plan``); a record that is not a lease's is passed over."""
    names = [n for n in store.listdir(f"{pipeline}/_leases") if n.startswith("iter-") and n[5:].isdigit()]
    for k in sorted((int(n[5:]) for n in names), reverse=True):
        folder = _folder(pipeline, k)
        gens = [n for n in store.listdir(folder) if n.endswith(".json") and n[:-5].isdigit()]
        taker = ""
        for name in sorted(gens, key=lambda n: int(n[:-5]), reverse=True):
            try:
                record = _parse(store.read_small(f"{folder}/{name}", MAX_LEASE_BYTES))
            except (ValueError, TypeError, RecursionError, OSError):
                record = None
            if record is None or record.iteration != k:
                continue
            if record.holder == holder:
                return k, taker
            taker = taker or record.holder
    return None


def acquire_writer(store: Store, pipeline: str, holder: str, stale: Callable[[Lease], bool] | None = None,
                   ttl_s: float = WRITER_TTL_S) -> Lease:
    """Take the pipeline's writer lease for ``holder``; ``LeaseHeld`` while another holder's
    lease is live, unless ``stale(lease)`` says that holder is gone (e.g. a process of this
    machine that no longer exists): then the next generation is written after it, so of
    two runs taking over the same stale lease exactly one wins."""
    return acquire(store, pipeline, WRITER, holder, ttl_s, stale)


def renew(store: Store, pipeline: str, iteration: int, holder: str, ttl_s: float = DEFAULT_TTL_S) -> bool:
    """Extend ``holder``'s lease on ``iteration`` by ``ttl_s`` from now; False when it is no
    longer ``holder``'s (released, or taken over after it expired)."""
    cur = current(store, pipeline, iteration)
    if cur is None or cur.holder != holder:
        return False
    return _write_next(store, pipeline, iteration, cur, holder, ttl_s) is not None


def renew_writer(store: Store, pipeline: str, holder: str, ttl_s: float = WRITER_TTL_S) -> bool:
    """Extend ``holder``'s writer lease; False when it is no longer ``holder``'s (taken over)."""
    return renew(store, pipeline, WRITER, holder, ttl_s)


@contextlib.contextmanager
def renewed(store: Store, pipeline: str, iteration: int, holder: str, every_s: float | None = None) -> Iterator[None]:
    """Within: ``holder``'s lease on ``iteration`` is renewed every ``every_s`` (a sixth of
    ``DEFAULT_TTL_S`` unless given) by a background thread, so a stage that runs longer than
    the lease's lifetime keeps it. A renewal that fails (an outage) is logged and tried at
    the next beat; one that finds the lease no longer ``holder``'s stops renewing and says
    so. Not covered: stopping the stage when the lease is lost (``posttrain run``'s writer
    lease does that for its own runs: ``dags.orchestrate.writer_lease``)."""
    beat_s = DEFAULT_TTL_S / 6 if every_s is None else every_s
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(beat_s):
            try:
                if not renew(store, pipeline, iteration, holder):
                    log.warning("the lease on iteration %d of %s is no longer %s's; not renewed", iteration, pipeline, holder)
                    return
            except Exception as exc:  # an outage: the next beat tries again
                log.warning("could not renew the lease on iteration %d of %s (%s); retrying", iteration, pipeline,
                            type(exc).__name__)

    thread = threading.Thread(target=beat, name=f"posttrain-lease-{iteration}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def release_writer(store: Store, pipeline: str, holder: str) -> bool:
    return release(store, pipeline, WRITER, holder)
