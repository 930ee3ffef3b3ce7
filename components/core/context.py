"""What a stage function receives: recipe, store, iteration, shard, seed and I/O helpers.

``StageContext`` is the stage contract in code. A stage reads the manifested outputs of
earlier stages of the same iteration (``upstream``/``read_records``, and their typed
facts with ``facts_of``) and writes its own files under its prefix
(``write_records``/``write_json``) and its facts on ``ctx.facts``; the runner writes the
manifest last. Nothing passes between stages but URIs and those small facts.

``ctx.recipe`` is a ``RecipeView``: the recipe as far as the stage declared it reads
it (``SECTIONS`` in its stage module, which is also its cache key). Reading an
undeclared section is an ``UndeclaredSection`` error, so a stage cannot depend on
config its cache key does not cover.

Reads are verified: reading a manifest registers what each of its outputs must hold
(size and sha256), and every read of such a file through a ``Store`` checks it; a
mismatch is a one-line ``UserError`` naming the file and the stage to re-run, raised
before the reading stage sees any of the data.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from functools import cache
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from components.core.errors import InfraError, UserError, outage
from components.core.manifest import MANIFEST, WEIGHTS, InputRef, Manifest, OutputFile, Shard, iteration_prefix, stage_prefix
from components.core.recipe import COMMON_FIELDS, Recipe
from components.core.records import from_table, to_table
from components.core.seeds import derive_seed
from components.core.stages import shard_count, spec
from components.core.storage import Expected, Store, expect, parquet_bytes, parquet_table, sha256_bytes

R = TypeVar("R")
F = TypeVar("F")
T = TypeVar("T")


class UndeclaredSection(AssertionError):
    """A stage read a recipe section it does not declare (our bug, not the user's)."""


class RecipeView:
    """A recipe seen through a stage's declared sections; records what was read."""

    def __init__(self, recipe: Recipe, stage: str, sections: tuple[str, ...]) -> None:
        self._recipe, self._stage, self._sections = recipe, stage, sections
        self.read: set[str] = set()

    @property
    def whole(self) -> Recipe:
        """The underlying recipe, for code that must see all of it (digests, replays)."""
        return self._recipe

    def __getattr__(self, name: str) -> Any:
        if name in Recipe.model_fields and name not in COMMON_FIELDS:
            if name not in self._sections:
                raise UndeclaredSection(
                    f"stage {self._stage} read recipe section {name!r} but declares only {list(self._sections)}; "
                    f"add {name!r} to SECTIONS in components/{self._stage}/stage.py (it is part of the cache key)")
            self.read.add(name)
        return getattr(self._recipe, name)


@dataclass
class StageContext:
    stage: str
    recipe: RecipeView
    store: Store  # rooted at the run root
    iteration: int
    shard: Shard
    outputs: dict[str, OutputFile] = field(default_factory=dict)
    inputs: dict[str, InputRef] = field(default_factory=dict)
    facts: Any = None  # this stage's facts for later stages (a dataclass from components.core.facts)
    mlflow_run_id: str = ""  # this stage's MLflow run, set by the runner while the stage runs
    parent_run_id: str = ""  # the iteration's MLflow parent run (empty for bootstrap)

    @property
    def pipeline(self) -> str:
        return self.recipe.pipeline

    @property
    def sharded(self) -> bool:
        return spec(self.stage).sharded

    @property
    def prefix(self) -> str:
        return stage_prefix(self.pipeline, self.iteration, self.stage, self.shard if self.sharded else None)

    def seed(self, *extra: str) -> int:
        return derive_seed(self.recipe.seed, self.pipeline, self.iteration, self.stage, self.shard.index, *extra)

    def uri(self, name: str) -> str:
        return self.store.url(f"{self.prefix}/{name}")

    # -- writing -------------------------------------------------------------------------
    def write_records(self, name: str, records: list[Any], cls: type, measured: tuple[str, ...] = ()) -> str:
        """Write ``records`` as output ``name``. ``measured``: fields that are measurements a
        re-run never reproduces (durations, memory) and no reader judges by; the output's
        ``content`` digest leaves them out, so later stages key on the rest (OutputFile)."""
        rel = f"{self.prefix}/{name}.parquet"
        table = to_table(records, cls)
        data, digest = self.store.write_table(rel, table)
        content = sha256_bytes(parquet_bytes(table.drop_columns(list(measured)))) if measured else None
        self.outputs[name] = OutputFile(path=rel, rows=len(records), sha256=digest, size=len(data), content=content)
        return self.store.url(rel)

    def write_json(self, name: str, obj: Any) -> str:
        rel = f"{self.prefix}/{name}.json"
        data = self.store.write_json(rel, obj)
        self.outputs[name] = OutputFile(path=rel, rows=1, sha256=sha256_bytes(data), size=len(data))
        return self.store.url(rel)

    def add_output(self, name: str, rel: str, rows: int, digest: str) -> None:
        """Record a file (or a checkpoint folder, digested by its weights file) written
        under this stage's prefix; its size is read back from the store."""
        out = OutputFile(path=rel, rows=rows, sha256=digest)
        self.outputs[name] = OutputFile(path=rel, rows=rows, sha256=digest, size=self.store.size(out.digested))

    def add_checkpoint(self, rel: str, rows: int, digests: dict[str, str]) -> None:
        """Record a checkpoint folder written under this stage's prefix (``digests``: {file:
        sha256}, as ``save_policy``/``upload_dir`` return them): the folder as the output
        ``checkpoint``, digested by its weights file, and each other file (config, tokenizer,
        generation config) as ``checkpoint:<file>``, so a load and a cache hit check them
        all; an edited ``config.json`` would otherwise load partly random weights silently."""
        self.add_output("checkpoint", rel, rows=rows, digest=digests[WEIGHTS])
        for name, digest in sorted(digests.items()):
            if name != WEIGHTS and posixpath.splitext(name)[1]:  # an output without an extension reads as a folder
                self.add_output(f"checkpoint:{name}", f"{rel}/{name}", rows=1, digest=digest)

    # -- reading -------------------------------------------------------------------------
    def upstream(self, stage: str, iteration: int | None = None) -> list[Manifest]:
        """Manifests of an earlier stage (all shards), or a UserError saying what to run first.
        In this stage's own iteration a sharded stage's are those of the shard count this
        recipe gives it: a shard of another count (the recipe's ``shards`` changed on a
        half-done iteration) is ignored. In another iteration the recipe's count then is not
        known, so every shard's is read (the runner keeps one count per stage and iteration)."""
        k = self.iteration if iteration is None else iteration
        count = shard_count(self.recipe.whole, stage) if k == self.iteration and spec(stage).sharded else None
        return read_manifests(self.store, self.pipeline, k, stage, count)

    def aligned(self, stage: str) -> bool:
        """True when ``stage`` is sharded exactly like this stage, so this shard needs only
        the same-numbered upstream shard; otherwise it reads every upstream shard and takes
        its own part (re-sharding through the manifests)."""
        return len(self.upstream(stage)) == self.shard.count

    def facts_of(self, stage: str, cls: type[F]) -> F:
        """The typed facts of an earlier (unsharded) stage of this iteration."""
        return self.upstream(stage)[0].facts(cls)

    def read_records(self, stage: str, name: str, cls: type[R], shard_only: bool = False) -> list[R]:
        """Records ``name`` from every shard of ``stage`` (or only this shard's, when the
        upstream stage is sharded the same way and ``shard_only`` is set)."""
        rows: list[R] = []
        for m in self._read_from(stage, shard_only):
            rows.extend(read_output_records(self.store, m, name, cls))
        return rows

    def _read_from(self, stage: str, shard_only: bool, manifests: list[Manifest] | None = None) -> list[Manifest]:
        """The manifests of ``stage`` (``manifests`` when already read) read from: every
        shard's, or only this shard's when ``shard_only`` and the upstream stage is sharded."""
        return [m for m in (self.upstream(stage) if manifests is None else manifests)
                if not (shard_only and m.shard is not None and m.shard != str(self.shard))]

    def read_joined(self, stage: str, name: str, cls: type[R], key: str, known: Container[Any],
                    shard_only: bool = False) -> list[R]:
        """``read_records``, each record's field ``key`` one of ``known`` (the ids of the
        records it joins to: a rollout's task, a rollout's reward). A record that names
        another (outputs of two iterations or runs mixed by hand, each file intact) is a
        UserError naming it, its file and the stage to re-run, not a KeyError mid-stage."""
        rows: list[R] = []
        for m in self._read_from(stage, shard_only):
            records = read_output_records(self.store, m, name, cls)
            stray = next((r for r in records if getattr(r, key) not in known), None)
            if stray is not None:
                out = m.outputs[name]
                raise UserError(f"{self.store.url(out.path)}: {cls.__name__}.{key}", getattr(stray, key),
                                f"names nothing in the records it goes with in iteration {self.iteration} (stage "
                                f"{stage}'s output is another run's or iteration's)",
                                m.remedy(self.store.url(m.prefix)))
            rows.extend(records)
        return rows

    def depend_on(self, stage: str, shard_only: bool = False) -> list[Manifest]:
        """Record an upstream stage as an input (URI + content digest) and return its manifests."""
        manifests = self.upstream(stage)
        for m in self._read_from(stage, shard_only, manifests):
            key = stage if m.shard is None else f"{stage}[{m.shard}]"
            rel = stage_prefix(self.pipeline, m.iteration, stage, Shard.parse(m.shard) if m.shard else None)
            self.inputs[key] = InputRef(uri=self.store.url(f"{rel}/{MANIFEST}"), digest=m.content_digest)
        return manifests


def expected_output(store: Store, manifest: Manifest, out: OutputFile) -> Expected:
    """What ``out`` (a file, or a folder's weights file) must hold, and the fix if it does not."""
    return Expected(sha256=out.sha256, size=out.size, stage=manifest.stage,
                    remedy=manifest.remedy(store.url(manifest.prefix)))


def read_parquet(data: bytes, url: str, expected: Expected):
    """A verified file's bytes as an Arrow table; a file that is not Parquet (written by
    an older or foreign writer) is a UserError naming it, not a raw pyarrow traceback."""
    try:
        return parquet_table(data)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise UserError("file", url, f"output of stage {expected.stage} is not readable Parquet "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})",
                        expected.remedy) from None


def read_output(store: Store, manifest: Manifest, name: str, parse: Callable[[bytes, str, Expected], T]) -> T:
    """Output ``name`` of ``manifest``, read verified and parsed by ``parse(data, url,
    expected)``. Bytes that match the manifest's sha256 can still not be what the stage
    writes (a manifest rewritten by hand with the new digest, another writer): a
    ``ValueError`` from ``parse`` (``LayoutError``, pydantic's ``ValidationError``) is a
    UserError naming the file, the problem and the stage to re-run, not a traceback in
    whatever later trips over it. Checks the shape, not what the values mean."""
    out = manifest.outputs.get(name)
    url = store.url(out.path) if out else store.url(f"{manifest.prefix}/{MANIFEST}")
    remedy = manifest.remedy(store.url(manifest.prefix))
    if out is None:
        raise UserError("file", url, f"manifest of stage {manifest.stage} lists no output {name!r}", remedy)
    expected = expected_output(store, manifest, out)
    data = store.read_bytes(out.path, expected)
    try:
        return parse(data, url, expected)
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            first = exc.errors()[0]
            detail = f"{'.'.join(map(str, first['loc'])) or 'top level'}: {first['msg']}"
        else:
            detail = str(exc)
        raise UserError("file", url, f"output of stage {manifest.stage} is not what it writes ({detail[:200]})",
                        remedy) from None


def read_output_records(store: Store, manifest: Manifest, name: str, cls: type[R]) -> list[R]:
    """Records ``name`` of ``manifest`` (Parquet, read verified, checked against ``cls``'s layout)."""
    return read_output(store, manifest, name, lambda data, url, expected: from_table(cls, read_parquet(data, url, expected)))


@cache
def _adapter(shape: Any) -> TypeAdapter:
    return TypeAdapter(shape)


def read_output_json(store: Store, manifest: Manifest, name: str, shape: type[T]) -> T:
    """JSON output ``name`` of ``manifest``, read verified and validated as ``shape`` (a
    pydantic model or any type pydantic validates), strictly: ``"1"`` is no number and
    ``"yes"`` no boolean, since the stage wrote the exact types."""
    return read_output(store, manifest, name,
                       lambda data, url, expected: _adapter(shape).validate_json(data, strict=True))


def verify_outputs(store: Store, manifest: Manifest) -> None:
    """Check every output of ``manifest`` against its size and sha256 (streamed); a
    UserError naming the first file that differs and the stage to re-run."""
    for out in manifest.outputs.values():
        store.verify(out.digested, expected_output(store, manifest, out))


MAX_MANIFEST_BYTES = 64 << 20
"""Largest manifest read (a stage's manifest is a few kilobytes; its facts a few megabytes at most)."""


def read_manifest(store: Store, rel_prefix: str) -> Manifest | None:
    """The manifest under ``rel_prefix`` (None if there is none). Its outputs become
    expectations: any later read of them through a Store in this process is checked. A
    manifest that cannot be read as one is a UserError naming it and the stage to re-run;
    a store that fails the read with an outage (5xx, busy, unreachable) is an InfraError."""
    rel = f"{rel_prefix}/{MANIFEST}"
    if not store.exists(rel):
        return None
    parts = rel_prefix.strip("/").split("/")
    stage = parts[-2] if parts[-1].startswith("shard-") and len(parts) > 1 else parts[-1]
    try:
        manifest = Manifest.from_json(json.loads(store.read_small(rel, MAX_MANIFEST_BYTES)))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OSError) as exc:  # cut short, not a manifest
        # s3fs raises a 503 SlowDown / 500 as a bare OSError(EBUSY/EREMOTEIO): the store, not the file
        if isinstance(exc, OSError) and (down := outage(exc)) is not None:
            raise InfraError("store", store.uri, down) from None
        detail = f"{type(exc).__name__}: {str(exc)[:120]}" if str(exc) and not isinstance(exc, RecursionError) \
            else type(exc).__name__
        raise UserError("file", store.url(rel), f"manifest is unreadable ({detail})",
                        f"delete it and re-run stage {stage}") from None
    if manifest.prefix != rel_prefix.strip("/"):  # edited, or copied from another folder: its outputs are not this one's
        raise UserError("file", store.url(rel), f"manifest is of {manifest.prefix}, not of the folder it lies in",
                        f"delete it and re-run stage {stage}")
    for out in manifest.outputs.values():
        expect(store.url(out.digested), expected_output(store, manifest, out))
    return manifest


SHARD_FOLDER = re.compile(r"shard-(\d+)-of-(\d+)", re.ASCII)
"""A shard's folder (``Shard.folder``): index and count."""


def _folder_count(name: str) -> int | None:
    """The shard count a ``shard-*`` folder's name says (None for a name not of that form)."""
    match = SHARD_FOLDER.fullmatch(name)
    return int(match[2]) if match else None


def _of_count(name: str, count: int) -> bool:
    """Whether ``name`` is the folder of one of the ``count`` shards ``0/count`` .. ``count-1/count``."""
    match = SHARD_FOLDER.fullmatch(name)
    return match is not None and int(match[2]) == count and int(match[1]) < count


def other_count_shards(store: Store, pipeline: str, iteration: int, stage: str, count: int) -> list[str]:
    """The shard folders (relative paths) of ``stage`` in ``iteration`` that hold a manifest
    of another shard count than ``count``: left by a run under an earlier recipe."""
    base = stage_prefix(pipeline, iteration, stage)
    return [f"{base}/{d}" for d in store.listdir(base)
            if (n := _folder_count(d)) is not None and n != count and store.exists(f"{base}/{d}/{MANIFEST}")]


def drop_other_counts(store: Store, pipeline: str, iteration: int, stage: str, count: int) -> list[str]:
    """Delete the manifests (only: their files stay, unread) of ``stage``'s
    shards of another count than ``count`` in ``iteration``, so every reader, with or
    without the recipe, sees one shard count there: the one it last ran under. Returns
    the folders whose manifest it deleted. What reads them next sees other inputs (a
    downstream stage's inputs name each upstream shard, ``sandbox[0/4]``, with its digest),
    so no stage's cached output made from them is reused."""
    folders = other_count_shards(store, pipeline, iteration, stage, count)
    for rel in folders:
        try:
            store.delete(f"{rel}/{MANIFEST}")
        except FileNotFoundError:  # another shard of this stage, starting beside this one, deleted it first
            pass
    return folders


def _shard_order(m: Manifest) -> tuple[int, int]:
    shard = Shard.parse(m.shard)
    return shard.count, shard.index


def read_manifests(store: Store, pipeline: str, iteration: int, stage: str, count: int | None = None) -> list[Manifest]:
    """Every manifest of a stage; for sharded stages all n shards must be present. With
    ``count`` (the shard count the recipe gives a sharded stage), only the shards of that
    count are read, those of another count ignored; without it every shard is read, and
    shards of more than one count are a UserError (which shards to run). Not covered: a
    ``shard-*`` folder whose name is not ``Shard.folder``'s form is read only without
    ``count``."""
    base = stage_prefix(pipeline, iteration, stage)
    single = read_manifest(store, base)
    if single is not None:
        return [single]
    shard_dirs = [d for d in store.listdir(base) if d.startswith("shard-") and (count is None or _of_count(d, count))]
    manifests = sorted((m for d in shard_dirs if (m := read_manifest(store, f"{base}/{d}")) is not None), key=_shard_order)
    where = "" if stage == "bootstrap" else f" --iteration {iteration}"
    if not manifests and stage != "bootstrap":
        from components.core.planner import finished

        # nothing of the iteration yet, and not the next one: the stage's fix below could not be followed
        if not store.listdir(iteration_prefix(pipeline, iteration)) and \
                iteration > (last := max(finished(store, pipeline), default=0)) + 1:
            raise UserError("--iteration", iteration, f"iteration {iteration} has not started in {store.url(pipeline)} "
                            f"(the last finished one is {last or 'none'})",
                            f"pass --iteration {last + 1} or lower, or let 'posttrain run' bring the pipeline there")
    if not manifests:
        shard = " --shard i/n" if spec(stage).sharded else ""
        each = " for each of the recipe's n shards i" if shard else ""
        raise UserError(
            f"stage {stage}", store.url(base), f"no manifested output for iteration {iteration}",
            f"run 'posttrain stage {stage}{where}{shard} --run-root {shlex.quote(store.uri)}'{each}, with this run's "
            "--recipe, first (or the whole iteration: 'posttrain run')",
        )
    counts = sorted({Shard.parse(m.shard).count for m in manifests})
    done = [m.shard or "" for m in manifests]
    if len(counts) > 1:  # only without ``count``: a store written before the runner kept one count per stage
        raise UserError(
            f"stage {stage}", store.url(base), f"shards of {len(counts)} shard counts {counts} are manifested ({done})",
            f"run 'posttrain stage {stage}{where} --shard S --run-root {shlex.quote(store.uri)}', with this run's "
            f"--recipe, for each of its shards S (a shard run removes the manifests of another count) first",
        )
    count = counts[0]
    if len(manifests) != count:
        missing = [f"{i}/{count}" for i in range(count) if f"{i}/{count}" not in done]
        raise UserError(
            f"stage {stage}", store.url(base), f"only shards {done} of {count} are manifested",
            f"run 'posttrain stage {stage}{where} --shard S --run-root {shlex.quote(store.uri)}', with this run's "
            f"--recipe, for each missing shard S in {missing} first",
        )
    return manifests
