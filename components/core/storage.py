"""One URI scheme everywhere: ``file://`` and ``s3://`` through fsspec.

``Store(uri)`` wraps an fsspec filesystem rooted at a URI. Every stage reads and writes
through it; no stage opens a local path directly. S3 endpoint and credentials come from
the usual AWS environment (``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``), never from recipes.

Writes are whole-object: on ``file://`` a file is written beside its target and renamed
into place, so a reader never sees half a file; on S3 a PUT is atomic per object.
Not covered: listing consistency across buckets in other regions, and object locking.
Two writers of the same path race; the stage contract (deterministic output paths,
manifest last) makes that harmless because both write the same bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from components.core.errors import InfraError, UserError, outage

SUPPORTED_SCHEMES = ("file", "s3")


def normalize_uri(uri: str, field: str = "run_root") -> str:
    """Absolute URI for ``uri``; a bare path becomes ``file://<absolute path>``."""
    uri = str(uri).strip()
    if not uri:
        raise UserError(field, uri, "empty storage URI", "pass file:///path or s3://bucket/prefix")
    parsed = urlparse(uri)
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return "file://" + str(Path(uri).expanduser().resolve())
    if parsed.scheme not in SUPPORTED_SCHEMES:
        raise UserError(
            field, uri, f"unsupported URI scheme {parsed.scheme!r}",
            f"use one of {', '.join(s + '://' for s in SUPPORTED_SCHEMES)}",
        )
    if parsed.scheme == "file":
        path = uri[len("file://"):]
        return "file://" + str(Path(path).expanduser().resolve())
    if not parsed.netloc:
        raise UserError(field, uri, "s3 URI has no bucket", "write s3://bucket/prefix")
    return uri.rstrip("/")


def _s3_options() -> dict[str, Any]:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    client_kwargs: dict[str, Any] = {}
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    # Fail fast on an unreachable endpoint instead of botocore's long default retries.
    config_kwargs = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3}}
    return {"client_kwargs": client_kwargs, "config_kwargs": config_kwargs}


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and in-filesystem path of an absolute URI."""
    scheme = urlparse(uri).scheme
    options = _s3_options() if scheme == "s3" else {}
    fs, path = fsspec.core.url_to_fs(uri, **options)
    return fs, path


def join(uri: str, *parts: str) -> str:
    return posixpath.join(uri.rstrip("/"), *[p.strip("/") for p in parts])


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


CONDITIONAL_CONFLICT_TRIES = 5


def _conditional_refusal(exc: BaseException) -> str | None:
    """Why S3 refused a conditional PUT (``If-None-Match: *``): "exists" (412
    PreconditionFailed: the object is there), "conflict" (409 ConditionalRequestConflict:
    AWS saw another conditional write to the key in flight; ask again), or None (another
    error). s3fs turns a 412 into FileExistsError only when the reply names the
    ``If-None-Match`` condition, as AWS's does; SeaweedFS (and MinIO) send a plain 412,
    which s3fs raises as ``OSError(EINVAL)`` with the botocore error as its cause."""
    cur: BaseException | None = exc
    for _ in range(5):
        if cur is None:
            break
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                return "exists"
            if code == "ConditionalRequestConflict":
                return "conflict"
            return None
        cur = cur.__cause__
    return None


class Store:
    """An fsspec filesystem rooted at ``uri``; paths passed to methods are relative to it."""

    def __init__(self, uri: str, field: str = "run_root") -> None:
        self.uri = normalize_uri(uri, field)
        self.field = field
        self.fs, self.root = filesystem(self.uri)

    # -- paths ---------------------------------------------------------------------------
    def url(self, rel: str = "") -> str:
        return join(self.uri, rel) if rel else self.uri

    def _path(self, rel: str) -> str:
        return posixpath.join(self.root, rel.strip("/")) if rel else self.root

    # -- checks --------------------------------------------------------------------------
    def check_reachable(self) -> None:
        """Raise an InfraError if the store's server cannot be reached, a UserError if the
        store can be reached but not written (no bucket, no permission, not a folder)."""
        probe = f"_probe-{uuid.uuid4().hex}"  # a file, not a folder: leaves nothing behind on any backend
        try:
            if self.uri.startswith("file://"):
                self.fs.makedirs(self.root, exist_ok=True)
            self.write_bytes(probe, b"ok")
            self.delete(probe)
        except Exception as exc:
            if (down := outage(exc)) is not None:  # the server is not there right now: retry, not a mistake
                raise InfraError("store", self.uri, down) from None
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            fix = (
                "start the S3 server or set AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "and create the bucket"
                if self.uri.startswith("s3://")
                else "pass a writable folder"
            )
            raise UserError(self.field, self.uri, f"store is not reachable or not writable ({reason})", fix) from None

    def _fresh(self, path: str) -> str:
        """``path``, with the filesystem's cached listings of it, its folders and everything
        under it dropped. s3fs caches every listing for the life of the (shared) filesystem
        object and refreshes it only on its own writes, so without this a process would not
        see objects other processes wrote since it last listed (a lease generation, a
        finished stage), and ``exists`` could answer from a stale listing."""
        if not self.uri.startswith("file://"):
            stripped = path.rstrip("/")
            for key in [k for k in list(self.fs.dircache) if k == stripped or k.startswith(stripped + "/")]:
                self.fs.dircache.pop(key, None)
            self.fs.invalidate_cache(stripped)
        return path

    # -- bytes ---------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._fresh(self._path(rel))))

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        if self.uri.startswith("file://"):
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with self.fs.open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def create(self, rel: str, data: bytes) -> bool:
        """Write ``rel`` only if it does not exist yet, atomically: True if this call
        created it, False if it was already there (another writer won). On ``file://`` the
        bytes are written beside the target and hard-linked into place (``link`` fails on
        an existing name); on S3 a conditional PUT (``If-None-Match: *``), refused with 412
        when the object exists (AWS S3; SeaweedFS, tested in tests/core/test_lease.py)."""
        path = self._path(rel)
        if self.uri.startswith("file://"):
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as fh:
                fh.write(data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            return True
        for _ in range(CONDITIONAL_CONFLICT_TRIES):
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            except OSError as exc:
                refused = _conditional_refusal(exc)
                if refused == "exists":
                    return False
                if refused != "conflict":
                    raise
                continue  # another conditional write to this key is in flight: ask again
            return True
        raise OSError(f"conditional PUT of {self.url(rel)}: {CONDITIONAL_CONFLICT_TRIES} conflicts in a row")

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self._path(rel))

    def write_json(self, rel: str, obj: Any) -> bytes:
        data = json.dumps(obj, indent=2, sort_keys=True, default=str).encode()
        self.write_bytes(rel, data)
        return data

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def delete(self, rel: str, recursive: bool = False) -> None:
        path = self._fresh(self._path(rel))
        if self.fs.exists(path):
            self.fs.rm(path, recursive=recursive)

    def listdir(self, rel: str = "") -> list[str]:
        path = self._fresh(self._path(rel))
        if not self.fs.exists(path):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False) if p.rstrip("/") != path.rstrip("/"))

    def glob(self, pattern: str) -> list[str]:
        """Relative paths under the root matching ``pattern``."""
        fixed = pattern.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]  # the part before any wildcard
        self._fresh(self._path(posixpath.dirname(fixed)))
        hits = self.fs.glob(self._path(pattern))
        root = self.root.rstrip("/") + "/"
        return sorted(h[len(root):] if h.startswith(root) else h for h in hits)

    # -- tables --------------------------------------------------------------------------
    def write_table(self, rel: str, table: pa.Table) -> tuple[bytes, str]:
        """Write a Parquet file; returns (bytes, sha256) for the manifest."""
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        data = buf.getvalue()
        self.write_bytes(rel, data)
        return data, sha256_bytes(data)

    def read_table(self, rel: str) -> pa.Table:
        return pq.read_table(io.BytesIO(self.read_bytes(rel)))

    # -- folders (checkpoints) -----------------------------------------------------------
    def upload_dir(self, local_dir: Path, rel: str) -> dict[str, str]:
        """Copy a local folder's files under ``rel``; returns {relative file: sha256}."""
        digests: dict[str, str] = {}
        for file in sorted(Path(local_dir).rglob("*")):
            if file.is_file():
                name = file.relative_to(local_dir).as_posix()
                data = file.read_bytes()
                self.write_bytes(f"{rel}/{name}", data)
                digests[name] = sha256_bytes(data)
        return digests

    def download_dir(self, rel: str, local_dir: Path) -> None:
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        base = self._fresh(self._path(rel)).rstrip("/")
        for path in self.fs.find(base):
            name = path[len(base) + 1:]
            target = local_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.fs.cat_file(path))
