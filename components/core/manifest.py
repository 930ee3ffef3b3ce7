"""Stage manifests: the only output a reader trusts, written last.

Layout under a run root::

    <run-root>/<pipeline>/bootstrap/_MANIFEST.json
    <run-root>/<pipeline>/iter-<k:06d>/<stage>/_MANIFEST.json
    <run-root>/<pipeline>/iter-<k:06d>/<stage>/shard-<i:05d>-of-<n:05d>/_MANIFEST.json

A manifest records the stage, iteration, shard, input URIs with digests, the config
digest, the code version, each output file with its row count and sha256, summary
metrics, timings and the MLflow run id. Its ``content_digest`` is what a later stage keys
on: the data the stage hands on (its outputs and facts) and the digests of the inputs it
was made from (so a change upstream of it, in facts a later stage reads past it, still
reaches that stage). Not the config digest, the code version, metrics or timings: a
re-run under another config (another ``sandbox.concurrency``, ``evaluation.*`` field,
code version) that reproduces the same outputs has the same digest and does not
invalidate later stages, whose own config and code version are in their own keys. An
output may carry a ``content`` digest that leaves measurements out (the sandbox's
durations); the digest uses it in place of the file's sha256.

Every output records its sha256 and size; readers and cache hits check them (see
``expectations``). An output whose path has no extension is a folder (a checkpoint): its
digest and size are those of its weights file ``model.safetensors`` (``WEIGHTS``).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

F = TypeVar("F")

MANIFEST = "_MANIFEST.json"
WEIGHTS = "model.safetensors"  # the file a folder output's (a checkpoint's) digest covers


SHARD_TEXT = re.compile(r"([0-9]{1,6})/([0-9]{1,6})")


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str | None) -> Shard:
        from components.core.errors import UserError

        if text in (None, ""):
            return cls(0, 1)
        # The form the DAG writes, in ASCII digits: int() alone would also take " 0", "+1",
        # "1_0" and other scripts' digits, which no caller means.
        match = SHARD_TEXT.fullmatch(str(text))
        if match is None:
            raise UserError("--shard", text, "not of the form i/n (two whole numbers of at most 6 digits)",
                            "pass e.g. --shard 0/2")
        i, n = int(match[1]), int(match[2])
        if n < 1 or not 0 <= i < n:
            raise UserError("--shard", text, "index out of range", f"use 0 <= i < n, e.g. --shard 0/{max(n, 1)}")
        return cls(i, n)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def folder(self) -> str:
        return f"shard-{self.index:05d}-of-{self.count:05d}"


MAX_ITERATION = 999_999
"""The highest iteration posttrain numbers: a run root's folders are ``iter-NNNNNN``
(six digits; a nightly run reaches it in 2,700 years)."""


def check_not_past_max(flag: str, iteration: int) -> None:
    """A UserError for an iteration (or a count of them) past ``MAX_ITERATION``."""
    from components.core.errors import UserError

    if iteration > MAX_ITERATION:
        raise UserError(flag, iteration, f"is more than {MAX_ITERATION}, the highest iteration a run root numbers",
                        f"pass {flag} from 1 to {MAX_ITERATION}")


def iteration_prefix(pipeline: str, iteration: int) -> str:
    return f"{pipeline}/iter-{iteration:06d}"


def stage_prefix(pipeline: str, iteration: int, stage: str, shard: Shard | None = None) -> str:
    base = f"{pipeline}/bootstrap" if stage == "bootstrap" else f"{iteration_prefix(pipeline, iteration)}/{stage}"
    return f"{base}/{shard.folder}" if shard is not None else base


@dataclass(frozen=True)
class OutputFile:
    path: str  # relative to the run root
    rows: int
    sha256: str
    size: int | None = None  # bytes; None in manifests written before sizes were recorded
    content: str | None = None
    """A digest of the records without their measurements (``write_records(measured=...)``:
    the sandbox's durations, CPU time and memory), which a re-run never reproduces and no
    reader judges by. ``content_digest`` uses it in place of ``sha256``, so a re-run that
    gives every job the same result keys later stages the same. None: the file's sha256."""

    @property
    def digested(self) -> str:
        """The file ``sha256`` and ``size`` describe: the output itself, or a folder's weights."""
        return self.path if posixpath.splitext(self.path)[1] else f"{self.path}/{WEIGHTS}"


@dataclass(frozen=True)
class InputRef:
    uri: str
    digest: str


@dataclass
class Manifest:
    stage: str
    pipeline: str
    iteration: int
    shard: str | None
    inputs: dict[str, InputRef]
    config_digest: str
    code_version: str
    outputs: dict[str, OutputFile] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # the stage's typed facts as JSON (components.core.facts)
    timings: dict[str, float] = field(default_factory=dict)
    mlflow_run_id: str = ""

    @property
    def content_digest(self) -> str:
        """The digest later stages key on (module docstring): inputs, outputs and facts;
        not the config digest or code version, each already in every stage's own key."""
        body = {
            "inputs": {k: asdict(v) for k, v in sorted(self.inputs.items())},
            # size is left out: the sha256 already fixes it, and manifests from before sizes keep their digest
            "outputs": {k: {"path": v.path, "rows": v.rows, "sha256": v.content or v.sha256}
                        for k, v in sorted(self.outputs.items())},
            "info": self.info,
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()

    def facts(self, cls: type[F]) -> F:
        """This manifest's facts as ``cls`` (a UserError naming the stage to re-run if they do not fit)."""
        from components.core.facts import from_json

        where = stage_prefix(self.pipeline, self.iteration, self.stage, Shard.parse(self.shard) if self.shard else None)
        return from_json(cls, self.info, self.stage, where)

    @property
    def prefix(self) -> str:
        """This manifest's folder, relative to the run root."""
        return stage_prefix(self.pipeline, self.iteration, self.stage, Shard.parse(self.shard) if self.shard else None)

    def remedy(self, prefix_url: str) -> str:
        """What an operator does when one of this stage's outputs is missing or corrupt."""
        where = f" --iteration {self.iteration}" if self.stage != "bootstrap" else ""
        shard = f" --shard {self.shard}" if self.shard else ""
        return (f"delete {prefix_url}/{MANIFEST} and re-run stage {self.stage} "
                f"('posttrain stage {self.stage}{where}{shard}', or the whole iteration)")

    def matches(self, inputs: dict[str, InputRef], config_digest: str, code_version: str) -> bool:
        return self.inputs == inputs and self.config_digest == config_digest and self.code_version == code_version

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["content_digest"] = self.content_digest
        return data

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """The manifest in ``data`` (parsed JSON); a ``ValueError`` saying which field when it
        is not one (another shape, a field of the wrong type: tampered with, or written by
        something else), so no later read trips over it."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        data = dict(data)
        data.pop("content_digest", None)
        _check(data, _MANIFEST_FIELDS, "")
        if data.get("shard") is not None:
            match = SHARD_TEXT.fullmatch(data["shard"])  # ASCII digits, as Shard.parse takes them
            if not match:
                raise ValueError(f"shard {data['shard'][:40]!r} is not i/n")
            if not 0 <= int(match[1]) < int(match[2]):
                raise ValueError(f"shard {data['shard']!r} is out of range (0 <= i < n)")
        for name in ("metrics", "timings"):  # numbers, as the runner writes them (NaN too: a diverged loss)
            for key, value in data.get(name, {}).items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"field {name}.{str(key)[:40]} is a {type(value).__name__}, not a number")
        for name, field_types in (("inputs", _INPUT_FIELDS), ("outputs", _OUTPUT_FIELDS)):
            for key, value in data[name].items():
                if not isinstance(value, dict):
                    raise ValueError(f"{name}.{str(key)[:40]} is not an object")
                _check(value, field_types, f"{name}.{str(key)[:40]}.")
        for key, value in data["outputs"].items():
            if (problem := _path_problem(value["path"])) is not None:
                raise ValueError(f"outputs.{str(key)[:40]}.path {value['path'][:80]!r} {problem}")
        data["inputs"] = {k: InputRef(**v) for k, v in data["inputs"].items()}
        data["outputs"] = {k: OutputFile(**v) for k, v in data["outputs"].items()}
        return cls(**data)


_MANIFEST_FIELDS: dict[str, tuple[type, ...]] = {
    "stage": (str,), "pipeline": (str,), "iteration": (int,), "shard": (str, type(None)), "inputs": (dict,),
    "config_digest": (str,), "code_version": (str,), "outputs": (dict,), "metrics": (dict,), "info": (dict,),
    "timings": (dict,), "mlflow_run_id": (str,),
}
_INPUT_FIELDS: dict[str, tuple[type, ...]] = {"uri": (str,), "digest": (str,)}
_OUTPUT_FIELDS: dict[str, tuple[type, ...]] = {"path": (str,), "rows": (int,), "sha256": (str,), "size": (int, type(None)),
                                                "content": (str, type(None))}
_OPTIONAL = {"outputs", "metrics", "info", "timings", "mlflow_run_id", "size", "content"}


def _path_problem(path: str) -> str | None:
    """Why an output's ``path`` cannot be one (it must name a file inside the run root:
    a relative path without ``.``, ``..`` or empty parts and without control characters),
    or None. A stage writes only such paths; another one is an edited manifest, which must
    not make a reader open a file elsewhere on the machine."""
    if not path or path.startswith("/") or "\\" in path:
        return "is not a relative path"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "leaves the run root (or has an empty part)"
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        return "holds a control character"
    return None


def _check(data: dict[str, Any], types: dict[str, tuple[type, ...]], where: str) -> None:
    """Every key of ``data`` is one of ``types`` and of its type (a bool is no int), and every
    key not in ``_OPTIONAL`` is there; a ``ValueError`` naming the first that is not."""
    for key in data:
        if key not in types:
            raise ValueError(f"unknown field {where}{str(key)[:40]}")
    for key, allowed in types.items():
        if key not in data:
            if key in _OPTIONAL:
                continue
            raise ValueError(f"no field {where}{key}")
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise ValueError(f"field {where}{key} is a {type(value).__name__}, not {'/'.join(t.__name__ for t in allowed)}")
