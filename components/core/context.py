"""What a stage function receives: recipe, store, iteration, shard, seed and I/O helpers.

``StageContext`` is the stage contract in code. A stage reads the manifested outputs of
earlier stages of the same iteration (``upstream``/``read_records``) and writes its own
files under its prefix (``write_records``/``write_json``); the runner writes the manifest
last. Nothing passes between stages but URIs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from components import SHARDED_STAGES
from components.core.errors import UserError
from components.core.manifest import MANIFEST, InputRef, Manifest, OutputFile, Shard, stage_prefix
from components.core.recipe import Recipe
from components.core.records import from_table, to_table
from components.core.seeds import derive_seed
from components.core.storage import Store

R = TypeVar("R")


@dataclass
class StageContext:
    stage: str
    recipe: Recipe
    store: Store  # rooted at the run root
    iteration: int
    shard: Shard
    outputs: dict[str, OutputFile] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, InputRef] = field(default_factory=dict)

    @property
    def pipeline(self) -> str:
        return self.recipe.pipeline

    @property
    def config(self) -> Any:
        return getattr(self.recipe, self.stage)

    @property
    def sharded(self) -> bool:
        return self.stage in SHARDED_STAGES

    @property
    def prefix(self) -> str:
        return stage_prefix(self.pipeline, self.iteration, self.stage, self.shard if self.sharded else None)

    def seed(self, *extra: str) -> int:
        return derive_seed(self.recipe.seed, self.pipeline, self.iteration, self.stage, self.shard.index, *extra)

    def uri(self, name: str) -> str:
        return self.store.url(f"{self.prefix}/{name}")

    # -- writing -------------------------------------------------------------------------
    def write_records(self, name: str, records: list[Any], cls: type) -> str:
        rel = f"{self.prefix}/{name}.parquet"
        _, digest = self.store.write_table(rel, to_table(records, cls))
        self.outputs[name] = OutputFile(path=rel, rows=len(records), sha256=digest)
        return self.store.url(rel)

    def write_json(self, name: str, obj: Any) -> str:
        from components.core.storage import sha256_bytes

        rel = f"{self.prefix}/{name}.json"
        data = self.store.write_json(rel, obj)
        self.outputs[name] = OutputFile(path=rel, rows=1, sha256=sha256_bytes(data))
        return self.store.url(rel)

    def add_output(self, name: str, rel: str, rows: int, digest: str) -> None:
        self.outputs[name] = OutputFile(path=rel, rows=rows, sha256=digest)

    # -- reading -------------------------------------------------------------------------
    def upstream(self, stage: str, iteration: int | None = None) -> list[Manifest]:
        """Manifests of an earlier stage (all shards), or a UserError saying what to run first."""
        return read_manifests(self.store, self.pipeline, self.iteration if iteration is None else iteration, stage)

    def read_records(self, stage: str, name: str, cls: type[R], shard_only: bool = False) -> list[R]:
        """Records ``name`` from every shard of ``stage`` (or only this shard's, when the
        upstream stage is sharded the same way and ``shard_only`` is set)."""
        rows: list[R] = []
        for m in self.upstream(stage):
            if shard_only and m.shard is not None and m.shard != str(self.shard):
                continue
            rows.extend(from_table(cls, self.store.read_table(m.outputs[name].path)))
        return rows

    def depend_on(self, stage: str, shard_only: bool = False) -> list[Manifest]:
        """Record an upstream stage as an input (URI + content digest) and return its manifests."""
        manifests = self.upstream(stage)
        for m in manifests:
            if shard_only and m.shard is not None and m.shard != str(self.shard):
                continue
            key = stage if m.shard is None else f"{stage}[{m.shard}]"
            rel = stage_prefix(self.pipeline, m.iteration, stage, Shard.parse(m.shard) if m.shard else None)
            self.inputs[key] = InputRef(uri=self.store.url(f"{rel}/{MANIFEST}"), digest=m.content_digest)
        return manifests


def read_manifest(store: Store, rel_prefix: str) -> Manifest | None:
    rel = f"{rel_prefix}/{MANIFEST}"
    if not store.exists(rel):
        return None
    return Manifest.from_json(store.read_json(rel))


def read_manifests(store: Store, pipeline: str, iteration: int, stage: str) -> list[Manifest]:
    """Every manifest of a stage; for sharded stages all n shards must be present."""
    base = stage_prefix(pipeline, iteration, stage)
    single = read_manifest(store, base)
    if single is not None:
        return [single]
    shard_dirs = [d for d in store.listdir(base) if d.startswith("shard-")]
    manifests = [m for d in shard_dirs if (m := read_manifest(store, f"{base}/{d}")) is not None]
    if not manifests:
        raise UserError(
            f"stage {stage}", store.url(base), f"no manifested output for iteration {iteration}",
            f"run 'posttrain stage {stage} --iteration {iteration}' (or the whole iteration) first",
        )
    count = Shard.parse(manifests[0].shard).count
    if len(manifests) != count:
        done = sorted(m.shard or "" for m in manifests)
        raise UserError(
            f"stage {stage}", store.url(base), f"only shards {done} of {count} are manifested",
            f"run the missing shards {[f'{i}/{count}' for i in range(count) if f'{i}/{count}' not in done]} of stage {stage} first",
        )
    return manifests
