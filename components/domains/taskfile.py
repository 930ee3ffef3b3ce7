"""Tasks from a user's file: Parquet, JSONL, or JSON (one object or an array of them), validated row by row.

``load_tasks(path_or_uri)`` reads ``.parquet``, ``.jsonl`` or ``.json`` from a local path
or any store URI (``file://``, ``s3://``) and returns ``Task`` records. Each row needs
``domain`` (a registered domain), ``prompt`` (a non-empty string) and ``reference`` (an
object, or a JSON string of one, in the shape that domain's verifier reads: see the
domain module's docstring). Optional: ``task_id`` (default: derived from domain and
prompt, as generated tasks are; and from the reference too when ``metadata.hidden_reference``
is true), ``split`` (``train``/``eval``, default ``train``; taskgen trains on ``train`` rows only),
``difficulty`` (integer >= 1, default 1), ``context_tokens`` (default: the prompt's length
under the ``count`` given to ``load_tasks``: characters by default, the policy's tokens
when the taskgen stage loads the file) and
``metadata`` (an object; ``trap`` and ``hidden_reference``, when given, JSON booleans; a domain checks the keys it
reads, as terminal's boolean ``multi_step`` and ``interactive``). Unknown columns are rejected, so a misspelt field is caught.

Every problem is one ``UserError`` naming the file, the row, the field, the value and
the fix. A row is named by its line in a JSON Lines file (``line 3``: 1-based, blank lines
counted, as an editor numbers them) and by its 0-based index in a JSON array or a Parquet
file (``row 0``). Each domain checks its reference's shape here (``Domain.reference_problem``), so
a wrong-shaped reference is an error at load time, not a verifier crash mid-run. Bounds:
a file of at most ``MAX_FILE_BYTES`` (a ``.json`` file, one document parsed whole, at most
``MAX_JSON_FILE_BYTES``; JSON Lines and Parquet rows are parsed and checked one at a
time), values nested at most ``MAX_DEPTH`` deep, prompts of at most ``MAX_PROMPT_CHARS``;
values in messages are shortened with ``reprlib`` first. Running out of memory while
parsing is a UserError naming the file, never a MemoryError traceback.
A local file must be a regular file (symlinks followed): a FIFO, a device such as
``/dev/zero`` or a directory is refused before a byte is read, and at most
``MAX_FILE_BYTES + 1`` bytes are read even from a file that grows (``read_regular``).
JSON and JSONL files are UTF-8 (a leading BOM is dropped, as in recipes); any other
encoding, a string that is not valid Unicode (a lone ``\ud800`` escape) and an integer
of more than 4300 digits are each a ``UserError``. A Parquet file's nulls are absent keys:
a struct column gives each row every key any row has (null where the row has none), so
null struct fields are left out at any depth and a null top-level field is left out (a
JSON null inside an object can be written only in a JSON string column). A Parquet file
with a column name given twice is refused (as a JSON key given twice is), and so is a
value Python cannot represent (a timestamp or date past year 9999, a time zone unknown to
this machine, a struct with a field name given twice), naming its row and column.
Not covered: checking that a reference is *correct* for its prompt (only its shape),
that a prompt fits the policy's positions (taskgen counts its tokens), CSV, and files
larger than memory.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import reprlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from components.core.errors import InfraError, UserError, one_line, outage
from components.core.files import MAX_TASK_FILE_BYTES, Unreadable, read_regular
from components.core.records import Task
from components.domains.base import HIDDEN_REFERENCE, has_control_character, task_id

REQUIRED = ("domain", "prompt", "reference")
OPTIONAL = ("task_id", "split", "difficulty", "context_tokens", "metadata")
FORMATS = (".parquet", ".jsonl", ".json")
MAX_FILE_BYTES = MAX_TASK_FILE_BYTES
MAX_JSON_FILE_BYTES = 64 << 20
"""Largest ``.json`` task file: one document, parsed whole, takes up to about 20 times its
size in memory (a 420 MB ``[[],[],...]`` ran out of memory after 95 s). JSON Lines and
Parquet files are parsed a row (a batch) at a time, up to ``MAX_FILE_BYTES``."""
MAX_PROMPT_CHARS = 1_000_000
"""Longest prompt of a task (about 250k tokens of English: beyond any policy's context). A
50 MB prompt took 20 GB of memory to tokenize before this bound."""
MAX_DEPTH = 32
"""Deepest nesting of lists/objects in a task row (references are a level or two deep)."""
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlevel = 3


def printable(text: str, limit: int = 200) -> str:
    """``text`` for a field name or a fix in a message: as it is when printable, else with
    its newlines, control characters and lone surrogates escaped (``a\\nb``), so a message
    stays one line."""
    return one_line(text[:limit])


def short(value: Any) -> Any:
    """A value for an error message, shortened before it is formatted (never expands a
    huge or deeply nested value); small scalars are kept as they are."""
    if isinstance(value, str):
        return value[:80] + ("..." if len(value) > 80 else "")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<integer of {value.bit_length()} bits>"
    if value is None or isinstance(value, (bool, int, float)):
        return value
    try:
        return _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - e.g. a value whose repr fails
        return f"<{type(value).__name__}>"


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether lists/dicts in ``value`` nest deeper than ``limit`` (iterative: no recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            if depth >= limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


class JSONLimit(ValueError):
    """Valid JSON past a bound of ours or Python's: ``problem`` and ``fix`` for the message."""

    def __init__(self, problem: str, fix: str) -> None:
        self.problem, self.fix = problem, fix
        super().__init__(problem)


class DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(key)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict; ``DuplicateKey`` when a key comes twice (``json`` would
    keep the last one without a word, and other readers the first)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):  # the rare case: find which key came twice
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj


MAX_INT_DIGITS = 4300
"""Python's limit on converting decimal text to an integer (``sys.get_int_max_str_digits``)."""


def loads(text: str) -> Any:
    """``json.loads`` that turns too-deep nesting, over-long integers and a key given
    twice in one object into a ``JSONLimit`` (a ``ValueError``) instead of a crash,
    Python's own advice or a value dropped without a word."""
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except DuplicateKey as exc:
        raise JSONLimit(f"key {printable(exc.key, 60)!r} is given twice in one object",
                        "keep one of them (JSON readers disagree on which one wins)") from None
    except RecursionError:
        raise JSONLimit(f"nested deeper than {MAX_DEPTH} levels", f"nest values at most {MAX_DEPTH} levels deep") from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:
        if "integer string conversion" not in str(exc):
            raise
        raise JSONLimit(f"a number has more than {MAX_INT_DIGITS} digits",
                        f"write numbers of at most {MAX_INT_DIGITS} digits (or quote it as a string)") from None
    if too_deep(value):
        raise JSONLimit(f"nested deeper than {MAX_DEPTH} levels", f"nest values at most {MAX_DEPTH} levels deep")
    return value


def decode(data: bytes, uri: str) -> str:
    """A JSON/JSONL task file's bytes as text: UTF-8, a leading BOM dropped (as in
    recipes); any other encoding is a UserError naming the first bad byte and its line."""
    fix = "save it as UTF-8"
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise UserError("task file", uri, "UTF-16 text, not UTF-8", fix)
    try:
        return data[start:].decode("utf-8") if start else data.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = start + exc.start
        line = data.count(b"\n", 0, at) + 1
        raise UserError("task file", uri, f"not UTF-8 text (byte {data[at]:#04x} at offset {at}, line {line})", fix) from None


def read_bytes(path_or_uri: str, whole_json: bool = False) -> bytes:
    """A task file's bytes: at most ``MAX_FILE_BYTES``, or ``MAX_JSON_FILE_BYTES`` for a
    ``.json`` document parsed whole (``whole_json``); a larger file is a UserError found
    after reading one byte past the limit."""
    from fsspec.implementations.local import LocalFileSystem

    from components.core.storage import filesystem, normalize_uri

    uri = str(path_or_uri)
    limit = MAX_JSON_FILE_BYTES if whole_json else MAX_FILE_BYTES
    if "://" not in uri:
        return _read_local(uri, uri, limit, whole_json)
    # file:// and s3:// only, as for a run root: file://rel/t.json (a host) was read as
    # the relative rel/t.json, and ftp:// was tried and named only by its exception's type
    normalized = normalize_uri(uri, "task file")
    try:
        fs, path = filesystem(normalized)
    except (OSError, ValueError) as exc:
        raise UserError("task file", uri, f"cannot be read ({type(exc).__name__})",
                        "pass an existing .parquet, .jsonl or .json file (local path, file:// or s3:// URI)") from None
    if isinstance(fs, LocalFileSystem):  # file://: the same checks as a plain path
        return _read_local(path, uri, limit, whole_json)
    try:
        data = fs.cat_file(path, start=0, end=limit + 1)  # never more than one byte past the limit
    except Exception as exc:  # noqa: BLE001 - botocore's errors are not OSErrors: an outage or the user's
        if (down := outage(exc)) is not None:  # the store, not the file: retry once it is back
            raise InfraError("store", uri, down) from None
        raise UserError("task file", uri, f"cannot be read ({type(exc).__name__})", _store_fix(exc)) from None
    if len(data) > limit:
        raise _too_large(uri, limit, whole_json)
    return data


def _store_fix(exc: BaseException) -> str:
    """The fix for an S3 store that answered but refused a task file: the keys, the
    profile, the endpoint's TLS (``storage.s3_fix``) when that is the cause; else (no
    such object or bucket, a malformed name) naming an existing file."""
    from components.core.storage import s3_fix_or

    return s3_fix_or(exc, "pass an existing .parquet, .jsonl or .json file (local path, file:// or s3:// URI)")


def _too_large(uri: str, limit: int, whole_json: bool) -> UserError:
    if whole_json:
        return UserError("task file", uri, f"larger than {limit >> 20} MiB, the limit for a .json file (one document, "
                         "parsed whole: it takes up to 20 times its size in memory)",
                         "write it as JSON Lines (.jsonl, one task per line) or Parquet, or split it into smaller files")
    return UserError("task file", uri, f"larger than {limit >> 20} MiB", "split it into smaller files")


def _read_local(path: str, uri: str, limit: int, whole_json: bool) -> bytes:
    try:
        data = read_regular(path, limit)
    except Unreadable as exc:
        why = "cannot be read: no such file" if exc.why == "no such file" else exc.why
        raise UserError("task file", uri, why,
                        "pass an existing regular .parquet, .jsonl or .json file (local path, file:// or s3:// URI)") from None
    if len(data) > limit:
        raise _too_large(uri, limit, whole_json)
    return data


def read_rows(path_or_uri: str, limit: int | None = None) -> list[Any]:
    """The rows of a task file; with ``limit``, at most that many from its start, and a
    JSON Lines or Parquet file is parsed no further (``posttrain verify`` uses row 0 of
    files up to ``MAX_FILE_BYTES``). A JSON file is parsed whole either way, so it is
    refused past ``MAX_JSON_FILE_BYTES``; running out of memory while parsing is a
    UserError naming the file, never a MemoryError traceback."""
    uri = str(path_or_uri)
    with _memory_guard(uri):
        return list(iter_rows(uri, limit))


def read_labelled_rows(path_or_uri: str, limit: int | None = None) -> list[tuple[str, Any]]:
    """``read_rows`` with each row's place for messages (``labelled_rows``: ``line <n>`` in
    a JSON Lines file, ``row <i>`` in a JSON or Parquet file)."""
    uri = str(path_or_uri)
    with _memory_guard(uri):
        return list(labelled_rows(uri, limit))


@contextlib.contextmanager
def _memory_guard(uri: str) -> Iterator[None]:
    """A MemoryError in the body (parsing a file too large for this machine's memory) as
    a UserError naming the file and the fix."""
    try:
        yield
    except MemoryError:
        json_file = uri.lower().endswith(".json")
        raise UserError("task file", uri, "too large to parse in this machine's memory (MemoryError)",
                        "split it into smaller files" + (", or write it as JSON Lines (.jsonl, one task per line) "
                                                         "or Parquet" if json_file else "")) from None


def iter_rows(path_or_uri: str, limit: int | None = None) -> Iterator[Any]:
    """``read_rows``, one row at a time: a JSON Lines or Parquet file's rows are parsed
    as they are taken, so a caller that stops at a bad row parses no further. Wrap a
    caller in ``_memory_guard`` (``read_rows`` and ``load_tasks`` do)."""
    for _, row in labelled_rows(path_or_uri, limit):
        yield row


def labelled_rows(path_or_uri: str, limit: int | None = None) -> Iterator[tuple[str, Any]]:
    """``iter_rows`` with where each row is, for messages: ``line <n>`` in a JSON Lines
    file (1-based, counting blank lines, as an editor does) and ``row <i>`` in a JSON or
    Parquet file (0-based)."""
    uri = str(path_or_uri)
    shown = printable(uri, limit=10_000)
    suffix = next((s for s in FORMATS if uri.lower().endswith(s)), None)
    if suffix is None:
        raise UserError("task file", uri, "unknown file type", f"use one of {list(FORMATS)}")
    data = read_bytes(uri, whole_json=suffix == ".json")
    if suffix == ".parquet":
        import pyarrow as pa

        from components.core.storage import parquet_table

        try:
            table = parquet_table(data)
            del data
            batches = (table if limit is None else table.slice(0, limit)).to_batches()
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise UserError("task file", uri, f"not a readable Parquet file ({str(exc)[:80]})",
                            "write it with pandas.DataFrame.to_parquet or pyarrow.parquet.write_table") from None
        names = table.column_names
        if (twice := next((name for i, name in enumerate(names) if name in names[:i]), None)) is not None:
            # to_pylist keeps the last one without a word (and JSON's duplicate keys are refused too)
            raise UserError("task file", uri, f"has the column {printable(str(twice), 60)!r} twice",
                            "keep one of them (Parquet readers disagree on which one wins)")
        start = 0
        for batch in batches:  # a batch's rows as Python objects at a time, not the whole table's
            yield from ((f"row {start + i}", without_nulls(row)) for i, row in enumerate(_batch_rows(batch, uri, start)))
            start += batch.num_rows
        return
    text = decode(data, uri)
    del data  # the file's bytes: the text holds them now
    if suffix == ".json":
        try:
            obj = loads(text)
        except json.JSONDecodeError as exc:
            raise UserError("task file", uri, f"not valid JSON at line {exc.lineno}, column {exc.colno}",
                            "fix the JSON syntax there") from None
        except JSONLimit as exc:
            raise UserError("task file", uri, exc.problem, exc.fix) from None
        del text
        rows = obj if isinstance(obj, list) else [obj]
        yield from ((f"row {i}", row) for i, row in enumerate(rows if limit is None else rows[:limit]))
        return
    count = 0
    for n, line in enumerate(_lines(text), start=1):
        if limit is not None and count >= limit:
            break
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            row = loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{shown} line {n}", line[:60], f"not valid JSON ({exc.msg})",
                            "write one JSON object per line") from None
        except JSONLimit as exc:
            raise UserError(f"{shown} line {n}", line[:60], exc.problem, exc.fix) from None
        count += 1
        yield f"line {n}", row


def _batch_rows(batch: Any, uri: str, start: int) -> list[dict[str, Any]]:
    """A Parquet record batch's rows as Python dicts, or one UserError naming the file, the
    row and the column when a value has no Python form: a timestamp or date past year
    9999, a time zone this machine does not know, a struct with a field name given twice."""
    import pyarrow as pa

    try:
        return batch.to_pylist()
    except (pa.ArrowException, ValueError, OverflowError) as exc:
        cause = exc
    what = f"{type(cause).__name__}: {printable(str(cause), 100)}"
    fix = ("give each field of the struct its own name" if "duplicate field names" in str(cause)
           else "store dates and times as ISO 8601 strings (e.g. '2024-05-01T12:00:00Z'), with a UTC offset or a "
                "time zone name this machine's tz database knows")
    for name, values in zip(batch.schema.names, batch.columns, strict=True):  # which column, then which row
        if _unconvertible(values):
            row = next((i for i in range(len(values)) if _unconvertible(values.slice(i, 1))), 0)
            raise UserError(f"{printable(uri, limit=10_000)} row {start + row}: {printable(str(name), 60)}",
                            str(values.type)[:80], f"holds a value Python cannot represent ({what})", fix) from None
    raise UserError("task file", uri, f"has a value Python cannot represent ({what})", fix) from None


def _unconvertible(values: Any) -> bool:
    import pyarrow as pa

    try:
        values.to_pylist()
    except (pa.ArrowException, ValueError, OverflowError):
        return True
    return False


def without_nulls(value: Any, depth: int = 0) -> Any:
    """A Parquet row's value with every dict key whose value is None left out, at any depth
    (inside lists too; a list's None items are kept). Past ``MAX_DEPTH`` the value is kept
    as it is: ``parse_task`` refuses it as too deep."""
    if depth > MAX_DEPTH:
        return value
    if isinstance(value, dict):
        return {k: without_nulls(v, depth + 1) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v, depth + 1) for v in value]
    return value


def _lines(text: str) -> Iterator[str]:
    """The lines of ``text`` one at a time. JSON Lines rows end at "\n" (a "\r\n" too);
    not str.splitlines(), which would also end one at U+2028, U+0085 and other characters
    JSON allows raw inside a string."""
    start = 0
    while (end := text.find("\n", start)) != -1:
        yield text[start:end]
        start = end + 1
    yield text[start:]


def not_unicode(row: dict[str, Any]) -> tuple[str, Any] | None:
    """The path (``reference.cases[0]``) and value of the first string in ``row`` (a key or
    a value, at any depth) that is not valid Unicode text, so cannot be written as UTF-8:
    a lone surrogate, as a JSON ``\\ud800`` escape decodes to. None if there is none."""
    return first_item(row, lambda item: isinstance(item, str) and not _encodable(item))


JSON_TYPES = (str, int, float, bool, type(None), dict, list)


def not_json(row: dict[str, Any]) -> tuple[str, Any] | None:
    """The path and value of the first item in ``row`` that JSON cannot hold (a Parquet
    file's timestamp, bytes or decimal; a key that is not text). None if there is none."""
    return first_item(row, lambda item: not isinstance(item, JSON_TYPES), lambda key: not isinstance(key, str))


def first_item(row: dict[str, Any], bad: Callable[[Any], bool],
               bad_key: Callable[[Any], bool] | None = None) -> tuple[str, Any] | None:
    """The path (``reference.cases[0]``) and value of the first value in ``row``, at any
    depth, for which ``bad`` is true, or key for which ``bad_key`` is (``bad`` when None).
    Iterative, like ``too_deep``; a path is spelt out only for the item it reports."""
    bad_key = bad_key or bad
    stack: list[tuple[Any, Any]] = [(None, row)]  # (where: (parent's where, key or index) or None, value)
    while stack:
        where, item = stack.pop()
        if where is not None and bad(item):
            return _path(where), item
        if isinstance(item, dict):
            for k, v in item.items():
                if bad_key(k):
                    return _path((where, str(k))), k
                stack.append(((where, k), v))
        elif isinstance(item, (list, tuple)):
            stack.extend(((where, i), v) for i, v in enumerate(item))
    return None


def _path(where: Any) -> str:
    parts: list[str] = []
    while where is not None:
        where, key = where
        parts.append(f"[{key}]" if isinstance(key, int) else f".{printable(str(key), 60)}")
    text = "".join(reversed(parts))
    return text[1:] if text.startswith(".") else text


def _check_unicode(row: dict[str, Any], where: str) -> None:
    bad = not_unicode(row)
    if bad is not None:
        name, value = bad
        raise UserError(f"{where}: {name}", short(value), "is not valid Unicode text (a lone surrogate, e.g. a \\ud800 escape)",
                        "write the character itself, or both halves of its \\u surrogate pair")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_task(row: Any, where: str, count: Callable[[str], int] = len) -> Task:
    """One row as a Task, or a UserError naming ``where`` (file and row), the field and the fix;
    ``count(prompt)`` is its ``context_tokens`` unless the row states them."""
    from components.domains import registry

    if not isinstance(row, dict):
        raise UserError(where, short(row), "a task must be a JSON object", f"write an object with {list(REQUIRED)}")
    where = printable(where, limit=10_000)
    if too_deep(row):
        raise UserError(where, short(row), f"nested deeper than {MAX_DEPTH} levels", "flatten the reference and metadata")
    _check_unicode(row, where)
    extra = sorted(str(k) for k in set(row) - set(REQUIRED) - set(OPTIONAL))
    if extra:
        name = extra[0][:60] if extra[0].isprintable() else extra[0][:60].encode("unicode_escape").decode("ascii")
        raise UserError(f"{where}: {name}", short(row.get(extra[0])), "unknown task field",
                        f"remove it or use one of {list(REQUIRED + OPTIONAL)}")
    for name in REQUIRED:
        if isinstance(row.get(name), (type(None), str)) and row.get(name) in (None, ""):
            raise UserError(f"{where}: {name}", short(row.get(name)), "missing required task field", f"add '{name}'")
    if not isinstance(row["domain"], str) or row["domain"] not in registry.names():
        raise UserError(f"{where}: domain", short(row["domain"]), "unknown domain", f"use one of {registry.names()}")
    if not isinstance(row["prompt"], str):
        raise UserError(f"{where}: prompt", short(row["prompt"]), "must be a string", "quote the prompt text")
    if len(row["prompt"]) > MAX_PROMPT_CHARS:
        raise UserError(f"{where}: prompt", short(row["prompt"]),
                        f"is {len(row['prompt']):,} characters, more than {MAX_PROMPT_CHARS:,}",
                        "shorten it: no policy reads a prompt that long, and tokenizing it alone takes gigabytes")
    reference = _object(row["reference"], f"{where}: reference")
    metadata = _object(row["metadata"] if row.get("metadata") not in (None, "") else {}, f"{where}: metadata")
    _check_unicode({"reference": reference, "metadata": metadata}, where)  # either may have been a JSON string
    if (bad := not_json({"reference": reference, "metadata": metadata})) is not None:  # a Parquet file's types
        name, value = bad
        raise UserError(f"{where}: {name}", short(value), f"is a {type(value).__name__}, which a JSON value cannot be",
                        "store it as text or a number (a date as an ISO 8601 string, bytes as base64 text)")
    if "trap" in metadata and not isinstance(metadata["trap"], bool):  # every domain's, read by the eval reports
        raise UserError(f"{where}: metadata.trap", short(metadata["trap"]),
                        "must be true or false without quotes (a JSON boolean: the eval reports would count the "
                        "string 'no' as a trap task)", "write true or false, or leave the key out")
    if HIDDEN_REFERENCE in metadata and not isinstance(metadata[HIDDEN_REFERENCE], bool):  # read by ids and exclusion
        raise UserError(f"{where}: metadata.{HIDDEN_REFERENCE}", short(metadata[HIDDEN_REFERENCE]),
                        "must be true or false without quotes (a JSON boolean: true when the prompt does not "
                        "determine the reference)", "write true or false, or leave the key out")
    domain = registry.get(row["domain"])
    problem = domain.task_problem(reference, metadata)
    if problem is not None:
        source = type(domain).__module__.replace(".", "/") + ".py"  # components/domains/terminal.py, or a plug-in's module
        name, what = problem
        if name.startswith("metadata."):  # a metadata value the domain reads (terminal's metadata.multi_step)
            raise UserError(f"{where}: {name}", short(metadata.get(name.removeprefix("metadata."))),
                            f"{what} for domain {row['domain']}",
                            f"see the metadata keys in {source}")
        raise UserError(f"{where}: reference.{name}", short(field_value(reference, name)), f"{what} for domain {row['domain']}",
                        f"see the reference shape in {source}")
    task_id_value = row.get("task_id")
    if task_id_value is not None and (isinstance(task_id_value, bool) or not isinstance(task_id_value, (str, int))
                                      or len(str(task_id_value)) > 200
                                      or has_control_character(str(task_id_value))):
        raise UserError(f"{where}: task_id", short(task_id_value),
                        "must be a string of at most 200 characters without control characters (NUL, newline, ...)",
                        "drop task_id to derive it from the prompt")
    split = row["split"] if row.get("split") not in (None, "") else "train"
    if not isinstance(split, str) or split not in ("train", "eval"):
        raise UserError(f"{where}: split", short(split), "unknown split", "use 'train' or 'eval'")
    difficulty = _int(row.get("difficulty", 1), f"{where}: difficulty", 1)
    context = _int(row["context_tokens"] if "context_tokens" in row else count(row["prompt"]), f"{where}: context_tokens", 0)
    return Task(
        task_id=(str(task_id_value) if task_id_value not in (None, "") else
                 task_id(row["domain"], row["prompt"], reference if metadata.get(HIDDEN_REFERENCE) is True else None)),
        domain=row["domain"], split=split,
        difficulty=difficulty, prompt=row["prompt"], context_tokens=context, reference=reference,
        metadata=metadata,
    )


def field_value(reference: dict[str, Any], name: str) -> Any:
    """The value a domain's ``task_problem`` names in ``reference``: a key (``answer``), an
    item of a list under one, as ``answer[1]``, or an entry of an object under one, as
    ``start['a/b']`` (the key's repr, cut after 40 characters for a long one: the first
    key whose repr begins so is taken). None when ``name`` names nothing there."""
    if name in reference:
        return reference[name]
    head, bracket, rest = name.partition("[")
    container = reference.get(head)
    if bracket and rest.endswith("]") and isinstance(container, list) and rest[:-1].isdecimal():
        index = int(rest[:-1])
        return container[index] if index < len(container) else None
    if not bracket or not rest.endswith("]") or not isinstance(container, dict):
        return None
    shown = rest[:-1]
    found = [key for key in container if repr(key)[:len(shown)] == shown]
    exact = [key for key in found if repr(key) == shown]
    return container[(exact or found)[0]] if found else None


def _object(value: Any, field: str) -> dict[str, Any]:
    if isinstance(value, str):  # Parquet files written from pandas often hold JSON as text
        try:
            value = loads(value)
        except JSONLimit as exc:  # valid JSON past a bound: say which (a key twice, a huge number, too deep)
            raise UserError(field, short(value), exc.problem, exc.fix) from None
        except ValueError:  # JSONDecodeError: not an object
            pass
    if not isinstance(value, dict):
        raise UserError(field, short(value), "must be an object (or a JSON string of one)", 'write e.g. {"answer": "85"}')
    if any(not isinstance(k, str) for k in value):
        raise UserError(field, short(value), "keys must be strings", 'write e.g. {"answer": "85"}')
    return value


def _int(value: Any, field: str, least: int) -> int:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf"))
            or int(value) != value or value < least):
        raise UserError(field, short(value), f"must be an integer >= {least}", f"set it to {least} or more")
    if value > 10**9:
        raise UserError(field, short(value), "must be at most 10**9", "set it to a realistic value")
    return int(value)


def load_tasks(path_or_uri: str | Path, count: Callable[[str], int] = len) -> list[Task]:
    """All tasks of a Parquet/JSONL/JSON file; a UserError for the first bad row. Rows
    without ``context_tokens`` get ``count(prompt)`` (characters by default)."""
    uri = str(path_or_uri)
    shown = printable(uri, limit=10_000)
    with _memory_guard(uri):  # each row is checked as it is parsed: a bad row 0 of a huge file ends the read there
        labelled = [(label, parse_task(row, f"{shown} {label}", count)) for label, row in labelled_rows(uri)]
    if not labelled:
        raise UserError("task file", uri, "holds no tasks", "add at least one row")
    seen: dict[str, str] = {}
    for label, t in labelled:
        if t.task_id in seen:
            raise UserError(f"{shown} {label}: task_id", t.task_id, f"duplicates {seen[t.task_id]}",
                            "give each task its own id (or drop task_id to derive it from the prompt)")
        seen[t.task_id] = label
    return [t for _, t in labelled]


def check_domains(tasks: list[Task], domains: list[str], path: str) -> None:
    """A UserError if a task's domain is not one the recipe trains on."""
    for t in tasks:
        if t.domain not in domains:
            raise UserError("taskgen.task_file", path, f"has tasks of domain {t.domain!r}, which is not in 'domains'",
                            f"add {t.domain!r} to 'domains' or remove those rows")


def train_pools(tasks: list[Task], exclude: set[str] = frozenset()) -> dict[str, list[Task]]:
    """Each domain's train rows: rows marked ``split: "eval"`` left out, and so are train rows
    sharing an id or prompt with one of them or with a task in ``exclude`` (the eval suite's
    ``exclusion``). A domain without such rows is absent."""
    from components.domains.base import excluded, exclusion

    exclude = set(exclude) | exclusion([t for t in tasks if t.split == "eval"])
    pools: dict[str, list[Task]] = {}
    for t in tasks:
        if t.split == "train" and not excluded(t, exclude):
            pools.setdefault(t.domain, []).append(t)
    return pools


def check_weighted(tasks: list[Task], pools: dict[str, list[Task]], weights: dict[str, float], path: str,
                   when: str = "in this iteration") -> None:
    """A UserError naming the first domain of ``weights`` with weight > 0 (``when``) that has
    no train rows in ``pools``: its share would silently go to the other domains. A domain
    of weight 0 needs no rows."""
    for name, weight in weights.items():
        if weight > 0 and not pools.get(name):
            rows = sum(t.domain == name for t in tasks)
            which = "its only row is split 'eval' or repeats" if rows == 1 else f"all its {rows} rows are split 'eval' or repeat"
            problem = (f"has no rows of domain {name!r}" if not rows else
                       f"has no train tasks of domain {name!r} ({which} an eval task's id or prompt)")
            raise UserError("taskgen.task_file", path, f"{problem}, which has weight {weight:g} {when}",
                            f"add train rows of domain {name!r} to the file, or give it weight 0 (taskgen.domain_weights "
                            "or the curriculum step) or remove it from 'domains'")


def check_task_file(source: str, domains: list[str]) -> list[Task]:
    """Every row of a recipe's task file, as taskgen will read it, before any work: a bad
    row is one UserError at the orchestrator's preflight, not a failed taskgen after the
    bootstrap. Prompt lengths are counted in characters here; taskgen counts the policy's
    tokens. No task file (``""``) is nothing to check. The tasks ([] without a file), for
    ``check_weighted`` once the iterations to run are known."""
    if not source:
        return []
    tasks = load_tasks(source)
    check_domains(tasks, domains, source)
    return tasks
