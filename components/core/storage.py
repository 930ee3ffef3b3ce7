"""One URI scheme everywhere: ``file://`` and ``s3://`` through fsspec.

``Store(uri)`` wraps an fsspec filesystem rooted at a URI. Every stage reads and writes
through it; no stage opens a local path directly. S3 endpoint and credentials come from
the usual AWS environment (``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``), never from recipes.

Writes are whole-object: on ``file://`` a file is written beside its target
(``<path>.tmp-<8 hex>``), flushed to disk (``fsync``), renamed into place and the rename
made durable (``fsync`` of the folder), so a reader never sees half a file, after a kill
or a power loss alike; a write that fails (disk full) removes its temporary file, and the runner sweeps those a
killed process left under a stage's prefix when the stage starts. On S3 a PUT is atomic
per object.

Reads are verified: a file some manifest describes (``expect``, done by
``context.read_manifest``) is checked against its size and sha256 on every
``read_bytes``/``read_table``/``read_json``/``download_dir``, and ``verify`` checks one
streamed; a difference is a one-line ``UserError`` naming the file and the stage to re-run.

``check_reachable`` sorts failures: a store that does not answer, or answers 5xx / "busy"
(a server starting or restarting) is an ``InfraError`` (retried); no such bucket, access
denied or not a folder is a ``UserError``. ``reachable_store`` is a Store that has passed
it, for a command or a DAG task that reads and writes one right after.

Time limits on S3: a small operation (``exists``, ``isdir``, ``size``, ``listdir``, a
read or write of an object of at most ``SMALL_OBJECT_BYTES``, ``create`` of one, the
probe of ``check_reachable``, a delete of one object: leases, manifests, the recipe) goes
through a client with short timeouts (``SMALL_S3_CONFIG``: 5 s to connect, 10 s to wait
for an answer, 2 attempts) and ends within ``SMALL_OP_DEADLINE_S`` (30 s) in all: a store
that accepts connections and never answers is then one
``InfraError("store", uri, "no answer within 30 s")``, not many minutes of retries
(s3fs retries a timed-out request 5 times, each of botocore's attempts waiting 60 s, and
a PUT waits for its "100 Continue" with no limit at all). Larger reads and writes,
checkpoint folders (``upload_dir``, ``download_dir``, ``hash_file``) and recursive
deletes keep the generous client (``S3_CONFIG``: 60 s per wait, 4 attempts) and no
overall limit.
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
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse, urlsplit

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.exceptions import FSTimeoutError

from components.core.errors import DataQualityError, InfraError, UserError, outage
from components.core.files import Unreadable, read_regular
from components.core.manifest import WEIGHTS

SUPPORTED_SCHEMES = ("file", "s3")


def _file_path(uri: str, field: str) -> Path:
    """The absolute path of a ``file:`` URI: ``file:///abs``, ``file://localhost/abs`` or
    ``file:/abs`` (RFC 8089). A host (``file://tmp/x``, where ``file:///tmp/x`` was meant),
    an empty or a relative path is a UserError: read as a path, each would name another
    folder than the one the user wrote."""
    rest = uri[len("file:"):]
    if rest.startswith("//"):
        host, slash, path = rest[2:].partition("/")
        if host not in ("", "localhost"):
            raise UserError(field, uri, f"a file URI with the host {host!r}: only local paths are supported",
                            f"write three slashes for a local path (file:///{host}/{path})")
        path = slash + path
    else:
        path = rest
    if not path.startswith("/"):
        raise UserError(field, uri, "a file URI needs an absolute path", "write file:///absolute/path or a bare path")
    return local_path(path, field, shown=uri)


def local_path(path: str, field: str, shown: str | None = None) -> Path:
    """``path`` with ``~`` expanded, made absolute and resolved. What cannot name a local
    path is a UserError naming ``field`` and ``shown`` (default: ``path``): a NUL character,
    ``~user`` of no such user, a symbolic-link loop (each a ValueError, RuntimeError or
    OSError from ``pathlib``, else a traceback)."""
    shown = path if shown is None else shown
    if "\0" in path:
        raise UserError(field, shown, "contains a NUL character, which no path can hold", "remove the NUL (\\0) from it")
    try:
        expanded = Path(path).expanduser()
    except RuntimeError:  # "Could not determine home directory": ~user of no such user (or no HOME)
        user = path[1:].split("/", 1)[0]
        raise UserError(field, shown, f"'~{user}' is the home of no known user" if user else "'~' but no home folder is known",
                        "write the path out in full (or set HOME for ~/...)") from None
    try:
        return expanded.resolve()
    except (RuntimeError, OSError) as exc:  # a symbolic-link loop ("Symlink loop from ...")
        raise UserError(field, shown, f"cannot be resolved ({type(exc).__name__}: {str(exc)[:160]})",
                        "point it at a folder that is not a symbolic-link loop") from None


def _short_enough(path: Path, field: str, shown: str) -> Path:
    """``path``, if each of its names fits the filesystem's limit (``NAME_MAX`` of the
    nearest folder that exists, usually 255 bytes): a longer one is a UserError here, before
    anything is made (``makedirs`` would make the folders above it, then fail)."""
    above = path
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent
    try:
        longest, whole = os.pathconf(above, "PC_NAME_MAX"), os.pathconf(above, "PC_PATH_MAX")
    except (OSError, ValueError):  # not a folder, or a filesystem that does not say: the usual limits
        longest, whole = 255, 4096
    for name in path.parts:
        if len(os.fsencode(name)) > longest:
            raise UserError(field, shown, f"has a name of {len(os.fsencode(name))} bytes, more than the "
                            f"{longest} a file or folder name may have here (File name too long)",
                            "use shorter folder names")
    if len(os.fsencode(str(path))) >= whole:
        raise UserError(field, shown, f"is {len(os.fsencode(str(path)))} bytes long, more than a path may have "
                        f"here ({whole - 1}; File name too long)", "use a shorter path")
    return path


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def scheme(uri: str) -> str:
    """The URI scheme of ``uri``, lowercase, as ``urllib.parse.urlsplit`` reads it (``""``
    for a bare path), without raising on what urlsplit refuses (``s3://[x``: an unclosed
    bracket, read as an IPv6 host)."""
    match = _SCHEME.match(uri)
    return match.group(1).lower() if match else ""


def unusable_text(text: str) -> tuple[str, str] | None:
    """(problem, fix) when ``text`` cannot name a folder anyone can type, list or log: a
    NUL, another control character, or bytes that are not UTF-8 (Python holds them as lone
    surrogates, which neither SQLite URLs nor S3 keys nor log lines can encode). None when
    it is fine."""
    if "\0" in text:
        return "contains a NUL character, which no path or URI can hold", "remove the NUL (\\0) from it"
    control = next((c for c in text if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if control is not None:  # a path may hold one, but it makes folders no one can type or see in a listing
        return (f"contains the control character U+{ord(control):04X}",
                "remove it (a pasted line break or escape sequence, most likely)")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        return "is not UTF-8 text (it holds bytes no UTF-8 text has)", "use a path whose name is UTF-8"
    return None


def normalize_uri(uri: str, field: str = "run_root") -> str:
    """Absolute URI for ``uri``; a bare path becomes ``file://<absolute path>``. Anything
    that names no store (an empty text, a NUL or other control character, bytes that are
    not UTF-8, an unknown scheme, an s3 URI
    without a bucket or whose host part ``urlsplit`` refuses, such as ``s3://[x``, or holds
    a port, and an s3 prefix ``_check_s3_key`` refuses) is a UserError naming ``field`` and
    the URI as given."""
    uri = str(uri).strip()
    if not uri:
        raise UserError(field, uri, "empty storage URI", "pass file:///path or s3://bucket/prefix")
    if (problem := unusable_text(uri)) is not None:
        raise UserError(field, uri, *problem)
    found = scheme(uri)
    if found == "" or (len(found) == 1 and os.name == "nt"):
        return "file://" + str(_short_enough(local_path(uri, field), field, uri))
    if found not in SUPPORTED_SCHEMES:
        raise UserError(
            field, uri, f"unsupported URI scheme {found!r}",
            f"use one of {', '.join(s + '://' for s in SUPPORTED_SCHEMES)}",
        )
    if found == "file":
        return "file://" + str(_short_enough(_file_path(uri, field), field, uri))
    try:
        parsed = urlparse(uri)
    except ValueError as exc:  # "Invalid IPv6 URL": a '[' or ']' in the bucket part
        raise UserError(field, uri, f"not a URI ({exc})", "write s3://bucket/prefix (a bucket name has no brackets)") from None
    if not parsed.netloc:
        raise UserError(field, uri, "s3 URI has no bucket", "write s3://bucket/prefix")
    if "@" in parsed.netloc:  # named without what came before the '@': it may be a secret
        raise UserError(field, f"s3://...@{parsed.netloc.rpartition('@')[2]}{parsed.path}",
                        "an s3 URI cannot hold credentials",
                        "pass them as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    if ":" in parsed.netloc:  # s3://host:9000/x: botocore refused the bucket "host:9000" as an endpoint problem
        raise UserError(field, uri, f"the bucket part {parsed.netloc!r} holds a ':' (a port?), which no bucket name has",
                        "put host:port in AWS_ENDPOINT_URL; write s3://bucket/prefix")
    _check_s3_key(uri[len(found) + 3 + len(parsed.netloc):], field, uri)
    return "s3://" + uri[len(found) + 3:].rstrip("/")  # the scheme as fsspec knows it: "S3://" is no protocol there


S3_WILDCARDS = "*?[]"
"""Characters s3fs (and other S3 tools) read as a pattern in a path: a delete of
``runs/r*`` would delete ``runs/rX``'s objects too."""


def _check_s3_key(key: str, field: str, uri: str) -> None:
    """The part of an s3 URI after its bucket (``/prefix``, query and fragment included:
    s3fs takes them as the key) names one prefix, the same on every S3 server: a UserError
    naming ``field`` and ``uri`` for a wildcard, a backslash (SeaweedFS turns it into a
    '/'), an empty part (``a//b``: SeaweedFS drops it, so listings under the prefix find
    nothing) and a '.' or '..' part (a key's name on S3, not a step up)."""
    if found := sorted({c for c in key if c in S3_WILDCARDS}):
        raise UserError(field, uri, f"holds {', '.join(map(repr, found))}, which S3 tools read as a wildcard (a delete under it "
                        "would also delete other prefixes' objects)", f"rename the prefix without {' '.join(S3_WILDCARDS)}")
    if "\\" in key:
        raise UserError(field, uri, "holds a backslash, which some S3 servers (SeaweedFS) turn into '/'",
                        "write the prefix with '/' between its parts")
    parts = key.rstrip("/").split("/")[1:]  # "" (no prefix) or "/a/b": what follows the bucket's '/'
    if "" in parts:
        raise UserError(field, uri, "has an empty part ('//'), which some S3 servers (SeaweedFS) drop, so nothing "
                        "under the prefix is listed", "write the prefix with one '/' between its parts")
    if any(part in (".", "..") for part in parts):
        raise UserError(field, uri, "has a '.' or '..' part, which S3 keeps as a key's name, not a step up",
                        "write the prefix without it")


def make_folders(path: str | Path) -> None:
    """``os.makedirs(path, exist_ok=True)``, undone when it fails: the folders this call
    created are removed again (deepest first, each only if still empty), so a path refused
    part way (a name too long, a file in the way) leaves none of its parents behind."""
    missing: list[Path] = []
    cur = Path(path)
    while cur != cur.parent and not os.path.lexists(cur):
        missing.append(cur)
        cur = cur.parent
    created: list[Path] = []
    try:
        for folder in reversed(missing):
            try:
                os.mkdir(folder)
            except FileExistsError:  # another process made it meanwhile: not ours to remove
                continue
            created.append(folder)
        os.makedirs(path, exist_ok=True)  # raises as makedirs does when ``path`` is not a folder
    except BaseException:
        for folder in reversed(created):
            try:
                os.rmdir(folder)
            except OSError:
                pass
        raise


@contextmanager
def removed_if_refused(run_root: Store | str) -> Iterator[None]:
    """The folders of a local run root that did not exist before the body (the run root
    and any of its parents it made) are removed again if the body raises, each only if
    still empty, deepest first: a refused run or stage leaves no run root behind; one that
    existed before stays. A run root that is no valid URI names no folder (the body
    refuses it)."""
    made: list[Path] = []
    if isinstance(run_root, str):
        try:
            uri = normalize_uri(run_root, "--run-root")
        except UserError:
            uri = ""
        root = uri[len("file://"):] if uri.startswith("file://") else None
    else:
        root = run_root.root if run_root.uri.startswith("file://") else None
    if root is not None:
        cur = Path(root)
        while cur != cur.parent and not os.path.lexists(cur):
            made.append(cur)
            cur = cur.parent
    try:
        yield
    except BaseException:
        for folder in made:  # deepest first
            try:
                folder.rmdir()
            except FileNotFoundError:
                continue  # never made (the refusal came first)
            except OSError:
                break  # not empty (another run's files), or not ours to remove
        raise


def s3_fix(exc: BaseException) -> str:
    """What to change for an S3 store that answered but refused: the bucket, the keys, or
    (anything else) the endpoint."""
    text = f"{type(exc).__name__} {exc}"
    if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in text:  # head_bucket's 404
        return "create the bucket, or name an existing one in the run root"
    if "NoCredentialsError" in text or "Unable to locate credentials" in text:
        return "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for the S3 server"
    if "ProfileNotFound" in text:
        return "set AWS_PROFILE to a profile in ~/.aws/config, or unset it and pass AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    if any(word in text for word in ("SSLError", "SSL:", "CERTIFICATE")):
        return "match AWS_ENDPOINT_URL's scheme to the server (http:// for a plain server, https:// for TLS) and check its CA"
    if any(word in text for word in ("Forbidden", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                     "PermissionError", "403")):
        return "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE): the server refused them"
    return "point AWS_ENDPOINT_URL at the S3 server (http://host:port) and check its keys and bucket"


def s3_fix_or(exc: BaseException, otherwise: str) -> str:
    """``s3_fix(exc)`` when it names the cause (the keys, the profile, the endpoint's TLS, a
    refusal), else ``otherwise``: for a file named by the user, a missing object or bucket
    and anything unrecognised are best fixed by naming an existing file."""
    fix = s3_fix(exc)
    text = f"{type(exc).__name__} {exc}"
    if isinstance(exc, FileNotFoundError) or "NoSuch" in text or fix == s3_fix(Exception()):
        return otherwise
    return fix


RETRY_MODES = ("legacy", "standard", "adaptive")
_REGION = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*", re.ASCII)


def _check_endpoint(var: str, endpoint: str) -> None:
    """An ``http(s)://`` S3 endpoint botocore can use: text, a host, a port from 1 to 65535,
    no query or fragment (each was "store is not reachable" naming the run root)."""
    fix = "write http(s)://host:port of the S3 server"
    if (problem := unusable_text(endpoint)) is not None:
        raise UserError(var, endpoint, problem[0], fix)
    if any(c.isspace() for c in endpoint):
        raise UserError(var, endpoint, "holds a space", fix)
    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except ValueError as exc:  # an unclosed '[', a port that is no number or out of range
        raise UserError(var, endpoint, f"not a URL ({exc})", fix) from None
    if not parts.hostname:
        raise UserError(var, endpoint, "has no host", fix)
    if port == 0:
        raise UserError(var, endpoint, "port 0 is no server's port", fix)
    if parts.query or parts.fragment:
        raise UserError(var, endpoint, "has a query or fragment, which an S3 endpoint does not take", fix)


CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _check_aws_settings() -> None:
    """The AWS variables botocore would refuse deep inside the first request (then named
    as the run root being unreachable): the region's form, the retry mode, and a CA
    bundle that is a readable file."""
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        if (region := os.environ.get(var)) and not _REGION.fullmatch(region):
            raise UserError(var, region, "is not a region name (lowercase letters, digits and '-')",
                            "set it to e.g. us-east-1, or unset it")
    if (mode := os.environ.get("AWS_RETRY_MODE")) and mode not in RETRY_MODES:
        raise UserError("AWS_RETRY_MODE", mode, f"is not one of {', '.join(RETRY_MODES)}", "set it to standard, or unset it")
    for var in CREDENTIAL_VARS:  # an HTTP header or a signature holds printable ASCII only: botocore failed to encode it
        value = os.environ.get(var, "")
        if value and not (value.isascii() and value.isprintable()):
            raise UserError(var, "(hidden)" if "SECRET" in var or "TOKEN" in var else value,
                            "holds a character that is not printable ASCII (a key has letters, digits and +/=)",
                            f"set {var} to the key as the provider gave it, or unset it")
    if bundle := os.environ.get("AWS_CA_BUNDLE"):
        try:
            readable = os.path.isfile(bundle) and os.access(bundle, os.R_OK)
        except (OSError, ValueError):
            readable = False
        if not readable:
            raise UserError("AWS_CA_BUNDLE", bundle, "is not a readable file", "point it at the CA's PEM file, or unset it")


def _s3_options() -> dict[str, Any]:
    var = "AWS_ENDPOINT_URL_S3" if os.environ.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL"
    endpoint = os.environ.get(var)
    client_kwargs: dict[str, Any] = {}
    _check_aws_settings()
    if endpoint:
        if endpoint != endpoint.strip():
            raise UserError(var, endpoint, "has white space around it" if endpoint.strip() else "is only white space",
                            f"write {endpoint.strip()}" if endpoint.strip() else "set it to http(s)://host:port, or unset it")
        if not endpoint.startswith(("http://", "https://")):
            given = scheme(endpoint) if "://" in endpoint else ""
            if given:  # ftp://host: another scheme, not a missing one
                host = endpoint.split("://", 1)[1]
                raise UserError(var, endpoint, f"an S3 endpoint is http:// or https://, not {given}://",
                                f"write http://{host} or https://{host}")
            raise UserError(var, endpoint, "an S3 endpoint needs its scheme", f"write http://{endpoint} or https://{endpoint}")
        _check_endpoint(var, endpoint)
        client_kwargs["endpoint_url"] = endpoint
    return {"client_kwargs": client_kwargs, "config_kwargs": dict(S3_CONFIG)}


S3_CONFIG: dict[str, Any] = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3}}
"""botocore's settings for transfers (checkpoints, large objects): fail fast on an endpoint
that refuses connections, but wait long for a busy server's answer."""
SMALL_S3_CONFIG: dict[str, Any] = {"connect_timeout": 5, "read_timeout": 10, "retries": {"total_max_attempts": 2}}
"""botocore's settings for small operations: a request that goes unanswered (a pooled
connection the server dropped) is sent once more after 10 s."""
SMALL_S3_TRIES = 2
"""s3fs's own tries of a timed-out small request (its default is 5, each with botocore's
attempts inside): enough that a server which never answers meets ``SMALL_OP_DEADLINE_S``
first, so its error always reads the same."""
SMALL_OP_DEADLINE_S = 30
"""Most seconds a small S3 operation takes in all (every attempt and retry inside it)."""
SMALL_OBJECT_BYTES = 1 << 20
"""Objects of at most this many bytes are read and written as small operations."""


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and in-filesystem path of an absolute URI (on S3, the client
    for transfers: ``S3_CONFIG``)."""
    options = _s3_options() if scheme(uri) == "s3" else {}
    fs, path = fsspec.core.url_to_fs(uri, **options)
    return fs, path


def small_filesystem(uri: str) -> fsspec.AbstractFileSystem:
    """The fsspec filesystem for small operations on an absolute URI: on S3 a client of its
    own (``SMALL_S3_CONFIG``, ``SMALL_S3_TRIES``), elsewhere ``filesystem``'s."""
    if scheme(uri) != "s3":
        return filesystem(uri)[0]
    options = _s3_options()
    options["config_kwargs"] = dict(SMALL_S3_CONFIG)
    fs = fsspec.core.url_to_fs(uri, **options)[0]
    fs.retries = SMALL_S3_TRIES  # no constructor argument: fsspec's cache hands back this same object
    return fs


def join(uri: str, *parts: str) -> str:
    return posixpath.join(uri.rstrip("/"), *[p.strip("/") for p in parts])


def parquet_table(data: bytes) -> pa.Table:
    """A whole Parquet file's bytes as a table, decoded on this thread from a buffer in
    memory. ``pq.read_table`` goes through pyarrow's dataset layer, which reads a Python
    file object on pyarrow's I/O pool even with ``use_threads=False``: a command that
    exited right after such a read (an error found in the rows it just read) was
    sometimes aborted while that thread wound down (exit 134, "terminate called without
    an active exception", pyarrow 25). ``ParquetFile`` on a ``BufferReader`` starts no
    thread. Files here are a stage's records, so one thread is fast enough."""
    return pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False)


def parquet_bytes(table: pa.Table) -> bytes:
    """``table`` as the Parquet file a stage writes (the same bytes for the same table and pyarrow)."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


CHUNK = 1 << 20  # streamed hashing and copying: one MiB at a time, never a whole file twice


@dataclass(frozen=True)
class Expected:
    """What a manifest says a file holds: its sha256, its size (None when the manifest
    predates sizes) and what to do when it does not (delete which manifest, re-run which
    stage)."""

    sha256: str
    size: int | None
    stage: str
    remedy: str


# Every manifested file this process has seen a manifest for, by full URL. ``read_bytes``
# (and ``read_table``/``read_json``) of such a file checks it against its manifest, whoever
# reads it; a write or delete through a Store drops the expectation (the writer is making
# a new version, and its new manifest will bring a new expectation).
_EXPECTED: dict[str, Expected] = {}


def expect(url: str, expected: Expected) -> None:
    _EXPECTED[url.rstrip("/")] = expected


def expected_for(url: str) -> Expected | None:
    return _EXPECTED.get(url.rstrip("/"))


def forget(url: str) -> None:
    url = url.rstrip("/")
    for key in [k for k in _EXPECTED if k == url or k.startswith(url + "/")]:
        _EXPECTED.pop(key, None)


def mismatch(url: str, expected: Expected, size: int | None, digest: str | None) -> UserError:
    """The one-line error for a manifested file that is missing or differs from its manifest."""
    if size is None:
        problem = f"manifested output of stage {expected.stage} is missing"
    elif expected.size is not None and size != expected.size:
        problem = (f"manifested output of stage {expected.stage} has {size} bytes, its manifest says "
                   f"{expected.size} (truncated or overwritten)")
    else:
        problem = (f"manifested output of stage {expected.stage} is corrupt: sha256 {(digest or '')[:12]}..., "
                   f"its manifest says {expected.sha256[:12]}...")
    return UserError("file", url, problem, expected.remedy)


MAX_UNSIZED_READ = 64 << 30
"""Most bytes ``Store.read_bytes`` reads of a local manifested file whose manifest gives
no size (every manifest this version writes gives one)."""
CONDITIONAL_CONFLICT_TRIES = 5
TMP_MARK = ".tmp-"  # file:// writes go to <path>.tmp-<8 hex> and are renamed into place


def _write_local(path: str, data: bytes) -> None:
    """``data`` at ``path``, on disk before this returns (a power loss after a rename of an
    unsynced file can leave the new name holding no bytes)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _sync_folder(path: str) -> None:
    """Make a rename or link into ``path``'s folder durable."""
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _in_the_way(path: str, root: str) -> UserError:
    """The UserError for a local write that something else blocks: a folder where the file
    goes, or a file (or link to one) where one of its folders goes. Names the first such
    path below ``root``; posttrain made neither, so the fix is to move it away."""
    if os.path.isdir(path) and not os.path.islink(path):
        return UserError("file", path, "is a folder where posttrain writes a file",
                         "move that folder out of the run root (posttrain never makes it) and run again")
    at = Path(root)
    for part in Path(path).relative_to(root).parts[:-1]:
        at = at / part
        if os.path.lexists(at) and not os.path.isdir(at):
            return UserError("file", str(at), "is a file where posttrain needs a folder",
                             "move that file out of the run root (posttrain never makes it) and run again")
    return UserError("file", path, "cannot be written: something in the run root is in its way",
                     "move what is at that path out of the run root and run again")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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
    """An fsspec filesystem rooted at ``uri``; paths passed to methods are relative to it.
    ``fs`` serves small operations, ``bulk`` transfers (two S3 clients with other time
    limits; one local filesystem)."""

    def __init__(self, uri: str, field: str = "run_root") -> None:
        self.uri = normalize_uri(uri, field)
        self.field = field
        self.bulk, self.root = filesystem(self.uri)
        self.fs = small_filesystem(self.uri) if self.uri.startswith("s3://") else self.bulk

    def _small(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``self.fs.<method>(*args, **kwargs)``; on S3 cut off after ``SMALL_OP_DEADLINE_S``
        (fsspec's ``timeout``: the request is cancelled), which is then an InfraError
        naming the store: it accepted the connection and did not answer."""
        if not self.uri.startswith("s3://"):
            return getattr(self.fs, method)(*args, **kwargs)
        try:
            return getattr(self.fs, method)(*args, timeout=SMALL_OP_DEADLINE_S, **kwargs)
        except FSTimeoutError:
            raise InfraError("store", self.uri, f"no answer within {SMALL_OP_DEADLINE_S} s") from None

    def _get(self, path: str, size: int) -> bytes:
        """The object at ``path``, ``size`` bytes long by its HEAD: a small operation, or a
        transfer for a larger one."""
        return self._small("cat_file", path) if size <= SMALL_OBJECT_BYTES else self.bulk.cat_file(path)

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
                make_folders(self.root)  # a path refused part way (a name too long) leaves no parents behind
            else:  # some servers (SeaweedFS) create a missing bucket on the first PUT: ask first
                bucket = urlparse(self.uri).netloc
                try:
                    self._small("call_s3", "head_bucket", Bucket=bucket)
                except PermissionError:
                    pass  # may write objects without listing the bucket: the probe below decides
                except FileNotFoundError as exc:  # said "(FileNotFoundError: Not Found)", naming no bucket
                    raise UserError(self.field, self.uri, f"store is not reachable or not writable (the S3 server "
                                    f"has no bucket {bucket!r})", s3_fix(exc)) from None
            self.write_bytes(probe, b"ok")
            self.delete(probe)
        except Exception as exc:
            if (down := outage(exc)) is not None:  # not there right now: retry, not a mistake
                raise InfraError("store", self.uri, down) from None
            if isinstance(exc, UserError):
                raise
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            fix = "pass a writable folder"
            if self.uri.startswith("s3://"):
                fix = s3_fix(exc)
            raise UserError(self.field, self.uri, f"store is not reachable or not writable ({reason})", fix) from None

    def _fresh(self, path: str) -> str:
        """``path``, with the filesystem's cached listings of it, its folders and everything
        under it dropped. s3fs caches every listing for the life of the (shared) filesystem
        object and refreshes it only on its own writes, so without this a process would not
        see objects other processes wrote since it last listed (a lease generation, a
        finished stage), and ``exists`` could answer from a stale listing."""
        if not self.uri.startswith("file://"):
            stripped = path.rstrip("/")
            for fs in (self.fs, self.bulk):  # each S3 client keeps listings of its own
                for key in [k for k in list(fs.dircache) if k == stripped or k.startswith(stripped + "/")]:
                    fs.dircache.pop(key, None)
                fs.invalidate_cache(stripped)
        return path

    # -- bytes ---------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return bool(self._small("exists", self._fresh(self._path(rel))))

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        forget(self.url(rel))
        if self.uri.startswith("file://"):
            try:
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise _in_the_way(path, self.root) from None
            tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex[:8]}"
            try:
                _write_local(tmp, data)
                os.replace(tmp, path)
                _sync_folder(path)
            except IsADirectoryError:
                _unlink_quietly(tmp)
                raise _in_the_way(path, self.root) from None
            except BaseException:  # disk full, killed mid-write: leave no half file behind
                _unlink_quietly(tmp)
                raise
        elif len(data) <= SMALL_OBJECT_BYTES:
            self._small("pipe_file", path, data)
        else:
            self.bulk.pipe_file(path, data)

    def sweep_temporary(self, rel: str) -> list[str]:
        """Remove the ``.tmp-`` files under ``rel`` that interrupted writes left (a process
        killed between writing and renaming); returns the removed paths. Only file:// has
        them (an S3 PUT is whole or absent). Call it only where no other writer is busy:
        the runner does, under a stage's own prefix, when the stage starts."""
        if not self.uri.startswith("file://"):
            return []
        base = Path(self._path(rel))
        if not base.is_dir():
            return []
        removed = []
        for tmp in sorted(base.rglob(f"*{TMP_MARK}*")):
            if tmp.is_file() and re.fullmatch(r"[0-9a-f]{8}", tmp.name.rsplit(TMP_MARK, 1)[1]):
                _unlink_quietly(str(tmp))
                removed.append(str(tmp))
        return removed

    def create(self, rel: str, data: bytes) -> bool:
        """Write ``rel`` only if it does not exist yet, atomically: True if this call
        created it, False if it was already there (another writer won). On ``file://`` the
        bytes are written beside the target and hard-linked into place (``link`` fails on
        an existing name); on S3 a conditional PUT (``If-None-Match: *``), refused with 412
        when the object exists (AWS S3; SeaweedFS, tested in tests/core/test_lease.py)."""
        path = self._path(rel)
        if self.uri.startswith("file://"):
            try:
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            except (FileExistsError, NotADirectoryError):  # a file where a folder goes (a lease's folder)
                raise _in_the_way(path, self.root) from None
            tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex[:8]}"
            try:
                _write_local(tmp, data)
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                _unlink_quietly(tmp)
            _sync_folder(path)
            forget(self.url(rel))
            return True
        put = partial(self._small, "pipe_file") if len(data) <= SMALL_OBJECT_BYTES else self.bulk.pipe_file
        for _ in range(CONDITIONAL_CONFLICT_TRIES):
            try:
                put(path, data, mode="create")
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

    def read_bytes(self, rel: str, expected: Expected | None = None) -> bytes:
        """The file's bytes; checked against its manifest (``expected``, or the one this
        process read for it) when it is a manifested output: a UserError naming the file
        and the stage to re-run if it is missing, truncated or corrupt."""
        url = self.url(rel)
        expected = expected or expected_for(url)
        if expected is None:
            if self.uri.startswith("file://"):  # not a FIFO or a device: an OSError, as for a missing file
                return self.read_small(rel, MAX_UNSIZED_READ)
            path = self._fresh(self._path(rel))
            return self._get(path, int(self._small("size", path)))  # a HEAD first: small or a transfer
        path = self._fresh(self._path(rel))
        try:
            if self.uri.startswith("file://"):  # a FIFO or /dev/zero in its place: refused, not waited on or read on
                data = read_regular(path, expected.size if expected.size is not None else MAX_UNSIZED_READ)
            else:
                found = int(self._small("size", path))  # a HEAD: how to read it, if at all
                if expected.size is not None and found != expected.size:
                    raise mismatch(url, expected, found, None)  # not read: it may be any size
                data = self._get(path, found)
        except FileNotFoundError:
            raise mismatch(url, expected, None, None) from None
        except Unreadable as exc:
            if exc.why == "no such file":
                raise mismatch(url, expected, None, None) from None
            raise UserError("file", url, f"manifested output of stage {expected.stage} {exc.why}", expected.remedy) from None
        if (expected.size is not None and len(data) != expected.size) or sha256_bytes(data) != expected.sha256:
            raise mismatch(url, expected, len(data), sha256_bytes(data))
        return data

    def read_small(self, rel: str, limit: int) -> bytes:
        """A small stored file no manifest covers (a lease, a manifest, a config), of at
        most ``limit`` bytes: a larger one is an ``OSError`` (a local file after reading one
        byte past the limit, a remote object from its HEAD, never read), and so is a local
        FIFO, device or folder, before a byte is read."""
        path = self._fresh(self._path(rel))
        if self.uri.startswith("file://"):
            try:
                data = read_regular(path, limit)
            except Unreadable as exc:
                raise (FileNotFoundError if exc.why == "no such file" else OSError)(f"{path}: {exc.why}") from None
            if len(data) > limit:
                raise OSError(f"more than {limit} bytes, the most read here")
            return data
        if (size := int(self._small("size", path))) > limit:  # not read: it may be any size
            raise OSError(f"{size} bytes, more than the {limit} read here")
        return self._get(path, size)

    def size(self, rel: str) -> int:
        return int(self._small("size", self._fresh(self._path(rel))))

    def isdir(self, rel: str) -> bool:
        return bool(self._small("isdir", self._fresh(self._path(rel))))

    def hash_file(self, rel: str, sink: IO[bytes] | None = None) -> tuple[int, str]:
        """(size, sha256) of a stored file, streamed in chunks (copied to ``sink`` on the
        way when given); FileNotFoundError if it is not there."""
        h, size = hashlib.sha256(), 0
        with self.bulk.open(self._fresh(self._path(rel)), "rb", block_size=CHUNK) as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
                size += len(chunk)
                if sink is not None:
                    sink.write(chunk)
        return size, h.hexdigest()

    def verify(self, rel: str, expected: Expected) -> None:
        """Check a stored file against its manifest without holding it in memory: a cheap
        size check first, then the streamed sha256; a UserError naming the file and the
        stage to re-run on any difference."""
        url = self.url(rel)
        try:
            if expected.size is not None and (size := self.size(rel)) != expected.size:
                raise mismatch(url, expected, size, None)
            size, digest = self.hash_file(rel)
        except FileNotFoundError:
            raise mismatch(url, expected, None, None) from None
        if digest != expected.sha256:
            raise mismatch(url, expected, size, digest)

    def write_json(self, rel: str, obj: Any) -> bytes:
        data = json.dumps(obj, indent=2, sort_keys=True, default=str).encode()
        self.write_bytes(rel, data)
        return data

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def delete(self, rel: str, recursive: bool = False) -> None:
        """Remove the file ``rel`` (with ``recursive``, a folder and everything under it);
        nothing if it is not there. Literal on every backend: on S3 each object is deleted
        by its own name (``rm_file``), those of a folder listed first (``find``), because
        s3fs's ``rm`` reads ``*``, ``?`` and ``[`` in a path as a pattern and would delete
        another prefix's objects (``normalize_uri`` refuses such a run root, too)."""
        forget(self.url(rel))
        path = self._fresh(self._path(rel))
        if self.uri.startswith("file://"):  # LocalFileSystem.rm takes its path as it is
            if self.fs.exists(path):
                self.fs.rm(path, recursive=recursive)
            return
        for key in self._objects(path, recursive):
            self._small("rm_file", key)

    def _objects(self, path: str, recursive: bool) -> list[str]:
        """The S3 objects a delete of ``path`` removes, each by its full name: the object at
        ``path`` (with ``recursive``, every object under it, too); none where there is none,
        nor a bucket. An outage propagates (``fs.isfile`` would answer False to it, and the
        delete be skipped without a word)."""
        try:
            if recursive:
                return list(self.bulk.find(path))
            return [path] if self._small("info", path)["type"] == "file" else []
        except FileNotFoundError:
            return []

    def listdir(self, rel: str = "") -> list[str]:
        path = self._fresh(self._path(rel))
        if not self._small("exists", path):
            return []
        listed = self._small("ls", path, detail=False)
        return sorted(posixpath.basename(p.rstrip("/")) for p in listed if p.rstrip("/") != path.rstrip("/"))

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
        data = parquet_bytes(table)
        self.write_bytes(rel, data)
        return data, sha256_bytes(data)

    def read_table(self, rel: str) -> pa.Table:
        return parquet_table(self.read_bytes(rel))

    # -- folders (checkpoints) -----------------------------------------------------------
    def upload_dir(self, local_dir: Path, rel: str, replace: bool = True) -> dict[str, str]:
        """Copy a local folder's files under ``rel``; returns {relative file: sha256}. With
        ``replace`` (the default) whatever was under ``rel`` is removed first, so a re-run
        leaves no file of an earlier one beside its own (a stale ``chat_template.jinja``
        that a load would read although no manifest lists it)."""
        if not rel.strip("/"):  # an assert would vanish under ``python -O`` and the delete below take the whole store
            raise ValueError(f"upload_dir replaces a folder, never the store's root (got {rel!r})")
        if replace:
            self.delete(rel, recursive=True)
        digests: dict[str, str] = {}
        for file in sorted(Path(local_dir).rglob("*")):
            if file.is_file():
                name = file.relative_to(local_dir).as_posix()
                data = file.read_bytes()
                self.write_bytes(f"{rel}/{name}", data)
                digests[name] = sha256_bytes(data)
        return digests

    def download_dir(self, rel: str, local_dir: Path, expected: dict[str, Expected] | None = None,
                     skip: tuple[str, ...] = (), folders: tuple[str, ...] | None = None) -> dict[str, str]:
        """Copy the files under ``rel`` into ``local_dir``, streamed and hashed on the way;
        returns {relative file: sha256}. Each file named in ``expected`` (or with a manifest
        this process read) must match it, else a UserError naming the file (raised after
        the copy, before anyone loads it). Files named in ``skip`` are not copied, nor,
        with ``folders``, those in sub-folders other than these, one level down (a model
        folder's ``checkpoint-*/`` or ``runs/``, which a model load never reads). When
        ``expected`` lists the folder's files (more than its weights: every manifest since
        each checkpoint file became an output), a copied file it does not list is a
        UserError naming it, before it is copied: a file an earlier run left, or one put
        there by hand, that a load would read unchecked. A manifest that lists only the
        weights (written before that) leaves the other files unchecked."""
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        base = self._fresh(self._path(rel)).rstrip("/")
        root = self.root.rstrip("/") + "/"
        digests: dict[str, str] = {}
        def kept(name: str) -> bool:
            folder = name.rpartition("/")[0]
            return folders is None or not folder or folder in folders

        wanted = {k: v for k, v in (expected or {}).items() if kept(k)}
        listed = set(expected or {}) - {WEIGHTS}  # the folder's files, not only its weights
        for path in self.bulk.find(base):
            name = path[len(base) + 1:]
            if name in skip or not kept(name):
                continue
            target = local_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            inner = path[len(root):] if path.startswith(root) else f"{rel}/{name}".strip("/")
            want = wanted.pop(name, None) or expected_for(self.url(inner))
            if listed and name not in (expected or {}):
                some = next(iter((expected or {}).values()))
                raise UserError("file", self.url(inner), f"is in the folder {self.url(rel)}, but the manifest of stage "
                                f"{some.stage} that wrote the folder does not list it (left by an earlier run, or put "
                                "there by hand)", f"delete that file; or {some.remedy}")
            if self.uri.startswith("file://") and not os.path.isfile(path):  # a FIFO or device: never copied
                raise UserError("file", self.url(inner), "is not a regular file (a FIFO, a device or a socket)",
                                want.remedy if want else f"remove it from {self.url(rel)}")
            if want is not None and want.size is not None and (found := int(self.bulk.size(path))) != want.size:
                raise mismatch(self.url(inner), want, found, None)  # not copied: it may be any size
            with open(target, "wb") as out:
                size, digest = self.hash_file(inner, sink=out)
            digests[name] = digest
            if want is not None and (digest != want.sha256 or (want.size is not None and size != want.size)):
                raise mismatch(self.url(inner), want, size, digest)
        for name, want in wanted.items():  # a manifested file that is not there at all
            raise mismatch(self.url(f"{rel}/{name}".strip("/")), want, None, None)
        return digests


@contextmanager
def reachable_store(run_root: str, field: str = "--run-root") -> Iterator[Store]:
    """The run root's store, once it has answered and taken a write (``check_reachable``):
    wrong keys, a missing bucket or a folder that cannot be written are one UserError
    naming ``field`` and the run root (exit 2, never retried), a store that does not answer
    one InfraError (exit 1, retried), and so is an outage inside the body (the store gone
    after the check); never a traceback from the first read. A local run root this made
    is removed again if the body refuses (a release with no lease to release leaves no
    folder behind). The CLI's ``--run-root`` and the DAG's stage tasks (``run_root``)
    use it."""
    from components.core.lease import LeaseHeld  # imports this module

    store = Store(run_root, field)
    with removed_if_refused(store):
        store.check_reachable()
        try:
            yield store
        except (UserError, InfraError, DataQualityError, LeaseHeld):
            raise
        except Exception as exc:
            if (down := outage(exc)) is None:
                raise
            raise InfraError("store", store.uri, down) from exc
