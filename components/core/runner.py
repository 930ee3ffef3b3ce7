"""Run one stage under the stage contract: inputs, cache check, tracking, manifest last.

``run_stage`` is what ``posttrain stage <id>`` calls and what every orchestrator task
calls. Each stage package has a ``stage`` module with:

- ``SECTIONS``: the recipe sections the stage reads (besides ``recipe.COMMON_FIELDS``:
  pipeline, seed, domains, timeouts and resources); they make its cache key, and
  ``ctx.recipe`` refuses any other section;
- optionally ``FIELDS``: single fields of other sections (``"evaluation.max_new_tokens"``)
  the stage reads through ``ctx.recipe.whole``; each is in its cache key too, and the rest
  of that section is not (``keyed_config``);
- ``inputs(ctx)``: declare inputs (upstream manifests, policy URI) on ``ctx.inputs``;
- ``run(ctx) -> dict[str, float]``: do the work, write outputs through ``ctx`` (and its
  facts on ``ctx.facts``), return summary metrics (namespaced ``<stage>/...`` when logged);
- optionally ``follow(ctx)``: a stage placed on several nodes (the trainer under a
  PyTorchJob; ``nodes.this_node()`` from the ``PET_*`` variables) runs ``run`` on node 0
  only; every other node runs ``follow``, which does its share of the work and writes
  nothing: no manifest, no outputs, no MLflow run, no sweep of the stage's prefix. A
  follower whose stage is already a cache hit does nothing.

If a manifest already exists with the same inputs, config digest and code version (with
the name and version of each plug-in package the stage can run: ``stage_code_version``), and
every output it lists still has its recorded size and sha256, the stage is a cache hit
and returns that manifest without doing anything; an output that no longer matches is a
``UserError`` naming the file and the stage to re-run (nothing runs on bad data).
Otherwise the old manifest is deleted *first*, ``.tmp-`` files that killed writes left
under the stage's prefix are swept, the stage runs, and the new manifest is written
*last*; a run killed half-way leaves no manifest and is simply run again.

A shard of a sharded stage first deletes the manifests of that stage's shards of another
count in its iteration (the recipe's ``shards`` changed on a half-done iteration), hit or
not, so every reader sees the one count the stage last ran under; their files stay, unread.
Not covered: two runs of different shard counts on one iteration at once
(the iteration's lease keeps a second run off it).

The stage's MLflow run (``trainer · iter-000002``, ``rollout[1/2] · iter-000002``) ends
FINISHED only once the manifest is written, so a FINISHED stage run always has its
manifest. A stage told to stop (``stop_on_sigterm``: SIGTERM raises
``tracking.Terminated`` inside it) ends its run KILLED, an error FAILED; a SIGKILLed one
stays RUNNING until the next attempt of the same stage, iteration, shard and run root
(or of the stage under another shard count) marks it KILLED, or the iteration ends.
After the last registered stage (evaluation) the iteration's timeline is logged
(``components.core.timeline``), its stage runs still RUNNING end KILLED and its parent
run ends FINISHED, also when an orchestrator had ended it FAILED; a rerun that hits the
cache does all of it again, idempotently.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from importlib import import_module
from pathlib import Path
from types import ModuleType
from typing import Any

from components import __version__
from components.core import gcpolicy, planner, preflight, timeline, tracking
from components.core.context import RecipeView, StageContext, drop_other_counts, read_manifest, verify_outputs
from components.core.errors import DataQualityError, InfraError, UserError, outage
from components.core.facts import StartingPolicy, to_json
from components.core.manifest import MANIFEST, Manifest, Shard, check_not_past_max, stage_prefix
from components.core.nodes import this_node
from components.core.progress import say
from components.core.recipe import Recipe, load_recipe
from components.core.stages import registered, shard_count, spec
from components.core.storage import Store, removed_if_refused

_CODE_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}", re.ASCII)


def code_version() -> str:
    """``POSTTRAIN_CODE_VERSION`` (an image's build sets it; default: the package
    version), part of every stage's cache key and manifest: a version or commit, not any
    text (a UserError for control characters, spaces or more than 128 characters). An
    empty setting is an unset one, as for every setting."""
    from components.core.settings import env_text

    value = env_text("POSTTRAIN_CODE_VERSION") or __version__
    if not _CODE_VERSION.fullmatch(value):
        raise UserError("POSTTRAIN_CODE_VERSION", value, "is not a version (letters, digits, '.', '_', '+', '-'; at "
                        "most 128)", f"set it to the code's version or commit, e.g. {__version__}, or unset it")
    return value


def plugin_distributions(recipe: Recipe, stage: str) -> list[tuple[str, str]]:
    """(name, version) of each installed distribution whose plug-in ``stage`` can run under
    ``recipe``, sorted: the domains the recipe lists (every stage may read ``domains``), its
    ``rollout.engine`` and ``sandbox.backend`` for a stage that declares that section (no
    other stage can read the field that names them), and ``stage`` itself when it is a
    plug-in stage (``posttrain.stages``). Built-ins are posttrain's own code, covered by
    ``code_version``: a recipe of built-ins only has none."""
    from importlib.metadata import entry_points

    from components.core.plugins import BACKENDS, DOMAINS, ENGINES
    from components.core.stages import BUILTIN

    sections = stage_module(stage).SECTIONS
    named = [(DOMAINS, name) for name in recipe.domains]
    if "rollout" in sections:
        named.append((ENGINES, recipe.rollout.engine))
    if "sandbox" in sections:
        named.append((BACKENDS, recipe.sandbox.backend))
    found = {dist for registry, name in named if (dist := registry.distribution(name)) is not None}
    if stage not in {s.id for s in BUILTIN}:
        found |= {(ep.dist.name, ep.dist.version) for ep in entry_points(group="posttrain.stages", name=stage)
                  if ep.dist is not None}
    return sorted(found)


def stage_code_version(recipe: Recipe, stage: str) -> str:
    """The code version in ``stage``'s cache key and manifest: ``code_version()``, followed
    by ``with <distribution>==<version>, ...`` for the plug-in packages the stage can run
    (``plugin_distributions``), so upgrading one re-runs the stages that can use it instead
    of reusing what its old code made. Only ``code_version()`` for a recipe of built-ins."""
    version = code_version()
    if dists := plugin_distributions(recipe, stage):
        version += " with " + ", ".join(f"{name}=={v}" for name, v in dists)
    return version


def stage_module(stage: str) -> ModuleType:
    """The ``components.<stage>.stage`` module (``inputs``, ``run``, ``SECTIONS``)."""
    return import_module(spec(stage).module)


def keyed_config(recipe: Recipe, stage: str) -> dict[str, Any]:
    """The config in ``stage``'s cache key (and its MLflow run's params): the common fields,
    its ``SECTIONS`` whole, and each of its ``FIELDS`` (``"section.field"``: one field of a
    section it does not declare, read through ``ctx.recipe.whole``)."""
    module = stage_module(stage)
    config = recipe.section(module.SECTIONS)
    for dotted in getattr(module, "FIELDS", ()):
        section, name = dotted.split(".")
        if section not in module.SECTIONS:
            config.setdefault(section, {})[name] = getattr(recipe, section).model_dump()[name]
    return config


def config_digest(recipe: Recipe, stage: str) -> str:
    """The digest of the config ``stage`` reads: the config half of its cache key (for a
    stage without ``FIELDS``, ``recipe.digest(SECTIONS)``)."""
    return hashlib.sha256(json.dumps(keyed_config(recipe, stage), sort_keys=True).encode()).hexdigest()


def make_context(stage: str, recipe: Recipe | str | Path, run_root: str, iteration: int, shard: str | None = None) -> StageContext:
    sharded = spec(stage).sharded  # UserError for an unknown stage
    if isinstance(recipe, (str, Path)):
        recipe = load_recipe(recipe)
    if iteration < 0 or (stage != "bootstrap" and iteration < 1):
        raise UserError("--iteration", iteration, "iterations count from 1", "pass --iteration 1 or higher")
    check_not_past_max("--iteration", iteration)
    parsed = Shard.parse(shard)
    if not sharded and parsed.count != 1:
        raise UserError("--shard", shard, f"stage {stage} is not sharded", "leave --shard out")
    if sharded and parsed.count != (n := shard_count(recipe, stage)):
        raise UserError("--shard", shard if shard is not None else "not given", f"the recipe shards this stage {n} ways",
                        f"pass --shard i/{n}, i from 0 to {n - 1}")
    store = Store(run_root, "--run-root")
    store.check_reachable()
    view = RecipeView(recipe, stage, stage_module(stage).SECTIONS)
    return StageContext(stage=stage, recipe=view, store=store, iteration=0 if stage == "bootstrap" else iteration, shard=parsed)


def _check_in_order(ctx: StageContext) -> None:
    """Taskgen of iteration k starts from what iteration k - 1 promoted: refuse it while
    k - 1 has not finished (no evaluation manifest), naming the iteration that is next."""
    if ctx.iteration <= 1 or (ctx.iteration - 1) in (done := planner.finished(ctx.store, ctx.pipeline)):
        return
    last = max(done, default=0)
    raise UserError("--iteration", ctx.iteration, f"iteration {ctx.iteration - 1} has not finished in "
                    f"{ctx.store.url(ctx.pipeline)} (the last finished one is {last or 'none'})",
                    f"pass --iteration {last + 1}, or let 'posttrain run' pick the next iteration")


def _parent_run(ctx: StageContext, orchestrator_run_id: str) -> str | None:
    if ctx.stage == "bootstrap":
        return None
    if ctx.stage == "taskgen":
        return tracking.iteration_run(ctx.pipeline, ctx.iteration, ctx.store.uri, orchestrator_run_id)
    # taskgen's recorded run, unless it was deleted in the UI: then the iteration's live one
    return tracking.live_iteration_run(ctx.facts_of("taskgen", StartingPolicy).parent_run_id, ctx.pipeline,
                                       ctx.iteration, ctx.store.uri, orchestrator_run_id)


def _end_iteration(ctx: StageContext, orchestrator_run_id: str) -> None:
    """After the last registered stage, the iteration's timeline is logged, its stage runs
    still RUNNING end KILLED and its parent run ends FINISHED, also one that an
    orchestrator ended FAILED or KILLED (``tracking.finish_iteration``). The timeline logs
    only what changed, and ending is a no-op when the run has ended FINISHED: a rerun that
    hits the cache."""
    if ctx.stage == registered()[-1].id and ctx.stage != "bootstrap":
        parent = ctx.parent_run_id or _parent_run(ctx, orchestrator_run_id) or ""
        timeline.record(ctx.store, ctx.pipeline, ctx.iteration, parent)
        tracking.finish_iteration(parent)


def close_finished_iterations(store: Store, pipeline: str) -> list[int]:
    """End the iterations that finished (evaluation's manifest is in the store) while their
    parent run is still RUNNING, FAILED or KILLED: a process killed between that manifest
    and the end of ``_end_iteration`` leaves them RUNNING, an orchestrator that gave up on
    an iteration later finished by hand (``posttrain stage``) FAILED, and a later run
    skips finished iterations. Their evaluation run ends FINISHED (it has its manifest),
    other stage runs still RUNNING (killed attempts) KILLED, the timeline is logged and
    the parent ends FINISHED. Returns the iterations it ended."""
    last = registered()[-1].id
    closed = []
    for k, parent in sorted(tracking.unfinished_iteration_runs(pipeline, store.uri).items()):
        done = read_manifest(store, stage_prefix(pipeline, k, last))
        if done is None:
            continue  # still under way (or resumed next): its own last stage ends it
        tracking.end_if_running(done.mlflow_run_id)
        tracking.end_children(parent, "KILLED")
        timeline.record(store, pipeline, k, parent)
        tracking.finish_iteration(parent)
        closed.append(k)
    return closed


def end_failed_run(recipe: str, run_root: str, holder: str, given_holder: bool) -> list[str]:
    """After an orchestrator's run failed (the DAG's failure callback, the Kubeflow
    pipeline's exit task): the MLflow runs of the iterations ``holder`` leased end FAILED
    (their RUNNING stage runs KILLED), and the leases are handed back so the next run
    resumes the iteration at once, unless the run was given its holder (``posttrain run``,
    ``posttrain kfp-local``: that command resumes it itself). Returns what it did, a line
    each; never raises (a run refused for its params leased nothing, and an outage leaves
    the lease to expire on its own, 6 hours)."""
    from components.core import lease, settings
    from components.core.errors import one_line

    try:
        settings.check_run_params({"recipe": recipe, "run_root": run_root, "holder": holder if given_holder else ""})
        conf = settings.resolve(recipe or None, run_root or None)
        pipeline = load_recipe(conf.recipe).pipeline
        store = Store(conf.run_root, "run_root")
        held = lease.held_by(store, pipeline, holder)
    except Exception as exc:  # a bad recipe or run root (the plan said so), or an outage
        return [f"no lease to hand back ({one_line(str(exc))[:500]})"]
    done = []
    for k in held:
        try:
            if (parent := tracking.find_iteration_run(pipeline, k, store.uri)) is not None:
                killed = tracking.fail_iteration(parent.info.run_id)
                done.append(f"iteration {k}'s MLflow run ended FAILED ({len(killed)} stage run(s) KILLED)")
        except Exception as exc:  # the tracking server may be what failed
            done.append(f"could not end iteration {k}'s MLflow run ({one_line(str(exc))[:500]})")
        if given_holder:
            continue
        try:
            released = lease.release(store, pipeline, k, holder)
            done.append(f"released the lease on iteration {k} of {pipeline}: {released}")
        except Exception as exc:  # the store may be what failed
            done.append(f"could not release the lease on iteration {k} of {pipeline} ({one_line(str(exc))[:500]})")
    return done


_stop_signals: list[int] = []  # the signals that stopped this process, first one first


def _terminate(signum: int, frame) -> None:
    _stop_signals.append(signum)
    raise tracking.Terminated(f"stopped by {signal.Signals(signum).name}")


def stop_on_sigterm(sigint: bool = False) -> bool:
    """Make SIGTERM (a container or pod being stopped, Airflow stopping a task, ``kill``)
    raise ``tracking.Terminated`` in the main thread, so the running stage's MLflow run
    ends KILLED instead of staying RUNNING; with ``sigint``, SIGINT too (Ctrl-C on a
    command that is its own process: otherwise Airflow's task runner catches the
    ``KeyboardInterrupt`` as a task failure and retries the task). Only the main thread
    can install a handler: elsewhere this does nothing and returns False."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _terminate)
    if sigint:
        signal.signal(signal.SIGINT, _terminate)
    return True


def _record(signum: int, frame) -> None:
    _stop_signals.append(signum)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_signals_recorded() -> Iterator[None]:
    """Within: a SIGTERM, and a SIGINT this process stops on (``stop_on_sigterm(sigint=True)``),
    is only recorded (``stopping()`` turns true), not raised where it lands. For code that
    must not be cut off at any line: ``posttrain run``'s ``dag.test()`` between its tasks,
    each of which raises again while its stage runs (``stop_signals_raised``) and refuses
    to start once the process was told to stop. Main thread only (elsewhere: nothing)."""
    with handlers_put_back() as before:
        for sig in before:
            if sig == signal.SIGTERM or before[sig] is _terminate:
                signal.signal(sig, _record)
        yield


@contextlib.contextmanager
def stop_signals_raised() -> Iterator[None]:
    """Within: SIGTERM raises ``tracking.Terminated`` (``stop_on_sigterm``), and so does a
    SIGINT that was being recorded (``stop_signals_recorded``); the handlers before are
    put back after. Main thread only (elsewhere: nothing)."""
    with handlers_put_back() as before:
        if before:
            stop_on_sigterm(sigint=before[signal.SIGINT] is _record)
        yield


@contextlib.contextmanager
def handlers_put_back() -> Iterator[dict[int, Any]]:
    """``STOP_SIGNALS``' handlers as they are, put back after the block; {} off the main
    thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        yield {}
        return
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield before
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def stopping() -> bool:
    """Whether this process has received SIGTERM (or, where handled, SIGINT) since ``stop_on_sigterm``."""
    return bool(_stop_signals)


def stop_signal() -> signal.Signals:
    """The signal that stopped this process (SIGTERM when none did)."""
    return signal.Signals(_stop_signals[0] if _stop_signals else signal.SIGTERM)


def _failpoint(label: str) -> None:
    """Fault injection for crash tests: ``POSTTRAIN_FAILPOINT=before-manifest:<label>``
    blocks the stage after its data files are written and before its manifest, so a test
    can kill the process exactly mid-stage. Unset in normal use."""
    if os.environ.get("POSTTRAIN_FAILPOINT") == f"before-manifest:{label}":
        say(f"failpoint before-manifest:{label} reached; waiting to be killed")
        time.sleep(3600)


def run_stage(stage: str, recipe: Recipe | str | Path, run_root: str, iteration: int, shard: str | None = None,
              orchestrator_run_id: str = "", in_order: bool = False) -> Manifest | None:
    """Run one stage (or find it cached). An outage anywhere inside (the store, the
    tracking server, an inference endpoint) surfaces as ``InfraError``, which callers
    retry; a user's mistake stays a ``UserError``, and the tracking server refusing
    MLflow's credentials (HTTP 401/403: ``tracking.credentials_refused``) becomes one.
    ``None`` on a follower node of a stage placed on several nodes (see the module
    docstring), which writes no manifest.

    ``in_order`` (``posttrain stage``): taskgen of iteration k > 1 is refused until
    iteration k - 1 has finished, so a typed ``--iteration`` cannot open a gap (the
    orchestrators plan k as the last finished iteration + 1 themselves; library callers,
    the tests among them, may run any iteration's taskgen)."""
    gcpolicy.settle()  # the set-up's garbage, before this stage allocates
    try:
        with removed_if_refused(run_root):  # a stage refused before it wrote anything leaves no run root it made
            manifest = _run_stage(stage, recipe, run_root, iteration, shard, orchestrator_run_id, in_order)
    except (UserError, InfraError, DataQualityError):
        raise
    except Exception as exc:
        if (refused := tracking.credentials_refused(exc)) is not None:  # HTTP 401/403 from the tracking server
            raise refused from exc
        if (down := outage(exc)) is None:  # unreachable, timed out, or an S3 5xx/busy reply
            raise
        raise InfraError(_service(exc), _where(exc, run_root), down) from exc
    gcpolicy.settle()  # the stage's own cycles are freed now, and what outlives it is frozen
    return manifest


def _service(exc: BaseException) -> str:
    """Which dependency an outage came from, judged by the modules in its cause chain."""
    modules = []
    cur: BaseException | None = exc
    while cur is not None and len(modules) < 20:
        modules.append(type(cur).__module__)
        cur = cur.__cause__ or cur.__context__
    if any(m.startswith("mlflow") for m in modules):
        return "tracking server"
    if any(m.startswith(("botocore", "s3fs", "aiobotocore", "aiohttp", "fsspec")) for m in modules):
        return "store"
    return "a service"


def _where(exc: BaseException, run_root: str) -> str:
    service = _service(exc)
    if service == "tracking server":
        return tracking.tracking_uri()
    return str(run_root) if service == "store" else type(exc).__name__


def number(value: float) -> str:
    """A metric for a person: counts as integers (``1100``, not ``1.1e+03``), others to 3
    significant digits."""
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.3g}"


def headline(named: dict[str, float], most: int = 4) -> str:
    """A stage's first ``most`` overall metrics (``<stage>/<name>``) for its progress line,
    then its status counts (``<stage>/status/<status>``: how the sandbox's jobs ended) as
    one part; the per-domain and other nested ones (``<stage>/<domain>/<name>``) are in MLflow."""
    top = [(k.split("/", 1)[1], v) for k, v in named.items() if k.count("/") == 1 and not k.endswith("/duration_s")]
    parts = [f"{k} {number(v)}" for k, v in top[:most]]
    statuses = [(k.rsplit("/", 1)[1], v) for k, v in named.items() if k.count("/") == 2 and k.split("/")[1] == "status"]
    if statuses:
        parts.append(", ".join(f"{s} {number(v)}" for s, v in statuses))
    return " | ".join(parts)


def _run_stage(stage: str, recipe: Recipe | str | Path, run_root: str, iteration: int, shard: str | None,
               orchestrator_run_id: str, in_order: bool = False) -> Manifest | None:
    code_version()  # a bad POSTTRAIN_CODE_VERSION before any work, not when the manifest is written
    ctx = make_context(stage, recipe, run_root, iteration, shard)
    version = stage_code_version(ctx.recipe.whole, stage)  # with the plug-in packages the stage can run
    if in_order and stage == "taskgen":
        _check_in_order(ctx)
    label = f"{stage}[{ctx.shard}]" if ctx.sharded else stage
    if ctx.sharded and (dropped := drop_other_counts(ctx.store, ctx.pipeline, ctx.iteration, stage, ctx.shard.count)):
        say(f"iter {ctx.iteration} | {label} | the recipe now shards {stage} {ctx.shard.count} ways: removed the "
            f"manifests of {len(dropped)} shard(s) of another count ({', '.join(p.rsplit('/', 1)[1] for p in dropped)})")
    module = stage_module(stage)
    module.inputs(ctx)
    digest = config_digest(ctx.recipe.whole, stage)
    existing = read_manifest(ctx.store, ctx.prefix)
    hit = existing is not None and existing.matches(ctx.inputs, digest, version)
    # only a stage that can follow reads the PET_* placement (a bad value there is its error alone)
    node = this_node() if hasattr(module, "follow") else None
    if node is not None and node.multi and not node.leader:
        if hit:
            say(f"iter {ctx.iteration} | {label} | node {node.rank} of {node.count} | cache hit, nothing to follow")
            return existing
        module.follow(ctx)  # writes nothing; node 0 writes the manifest
        return None
    if hit:
        verify_outputs(ctx.store, existing)  # a hit only if every output is still what it recorded
        if stage == "bootstrap":  # a hit registers nothing: under another tracking database nothing would have a champion
            preflight.registered_here(ctx.recipe.whole, ctx.store)
        # killed between its manifest and the end of its run: the work is done, so is the run
        tracking.end_if_running(existing.mlflow_run_id)
        _end_iteration(ctx, orchestrator_run_id)
        say(f"iter {ctx.iteration} | {label} | cache hit | {ctx.store.url(ctx.prefix)}")
        return existing
    if stage == "bootstrap":  # it registers a version: another run root's model is refused before the SFT writes
        preflight.registry_owner(ctx.recipe.whole, ctx.store.uri)
    ctx.store.delete(f"{ctx.prefix}/{MANIFEST}")
    if swept := ctx.store.sweep_temporary(ctx.prefix):
        say(f"iter {ctx.iteration} | {label} | removed {len(swept)} temporary file(s) an interrupted write left")

    ctx.parent_run_id = _parent_run(ctx, orchestrator_run_id) or ""
    started = time.time()
    tags = {tracking.TAG_ITERATION: str(ctx.iteration), tracking.TAG_RUN_ROOT: ctx.store.uri,
            tracking.TAG_ORCH: orchestrator_run_id, **({tracking.TAG_SHARD: str(ctx.shard)} if ctx.sharded else {})}
    name = tracking.stage_run_name(label, ctx.iteration)
    with tracking.stage_run(ctx.pipeline, stage, name, ctx.parent_run_id or None, keyed_config(ctx.recipe.whole, stage),
                            tags=tags) as run_id:
        ctx.mlflow_run_id = run_id
        metrics = module.run(ctx)
        named = {f"{stage}/{k}": float(v) for k, v in metrics.items()}
        named[f"{stage}/duration_s"] = time.time() - started
        tracking.log_metrics(run_id, named, step=ctx.iteration)
        if ctx.inputs:
            tracking.log_datasets(run_id, {k: (v.uri, v.digest) for k, v in ctx.inputs.items()}, context="input")
        finished = time.time()
        manifest = Manifest(
            stage=stage, pipeline=ctx.pipeline, iteration=ctx.iteration, shard=str(ctx.shard) if ctx.sharded else None,
            inputs=dict(ctx.inputs), config_digest=digest, code_version=version, outputs=dict(ctx.outputs),
            metrics=named, info=to_json(ctx.facts) if ctx.facts is not None else {},
            timings={"start": started, "end": finished, "duration_s": finished - started}, mlflow_run_id=run_id,
        )
        _failpoint(label)
        ctx.store.write_json(f"{ctx.prefix}/{MANIFEST}", manifest.to_json())  # last: readers trust only this
    # the run ends FINISHED here, after its manifest: a FINISHED stage run always has one
    _end_iteration(ctx, orchestrator_run_id)
    say(f"iter {ctx.iteration} | {label} | {headline(named)} | {finished - started:.1f}s")
    return manifest
