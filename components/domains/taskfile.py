"""Tasks from a user's file: Parquet, JSONL, or one JSON object, validated row by row.

``load_tasks(path_or_uri)`` reads ``.parquet``, ``.jsonl`` or ``.json`` from a local path
or any store URI (``file://``, ``s3://``) and returns ``Task`` records. Each row needs
``domain`` (a registered domain), ``prompt`` (a non-empty string) and ``reference`` (an
object, or a JSON string of one, in the shape that domain's verifier reads: see the
domain module's docstring). Optional: ``task_id`` (default: derived from domain and
prompt, as generated tasks are), ``split`` (``train``/``eval``, default ``train``),
``difficulty`` (integer >= 1, default 1), ``context_tokens`` (default: prompt length) and
``metadata`` (an object). Unknown columns are rejected, so a misspelt field is caught.

Every problem is one ``UserError`` naming the file, the row, the field, the value and
the fix. Not covered: checking that a reference is *correct* for its prompt (only its
type), CSV, and files larger than memory.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from components.core.errors import UserError
from components.core.records import Task
from components.domains.base import task_id

REQUIRED = ("domain", "prompt", "reference")
OPTIONAL = ("task_id", "split", "difficulty", "context_tokens", "metadata")
FORMATS = (".parquet", ".jsonl", ".json")


def read_bytes(path_or_uri: str) -> bytes:
    from components.core.storage import filesystem

    uri = str(path_or_uri)
    try:
        if "://" not in uri:
            return Path(uri).read_bytes()
        fs, path = filesystem(uri)
        return fs.cat_file(path)
    except (OSError, ValueError) as exc:
        raise UserError("task file", uri, f"cannot be read ({type(exc).__name__})",
                        "pass an existing .parquet, .jsonl or .json file (local path, file:// or s3:// URI)") from None


def read_rows(path_or_uri: str) -> list[Any]:
    uri = str(path_or_uri)
    suffix = next((s for s in FORMATS if uri.lower().endswith(s)), None)
    if suffix is None:
        raise UserError("task file", uri, "unknown file type", f"use one of {list(FORMATS)}")
    data = read_bytes(uri)
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(io.BytesIO(data)).to_pylist()
        except (pa.ArrowInvalid, OSError) as exc:
            raise UserError("task file", uri, f"not a readable Parquet file ({str(exc)[:80]})",
                            "write it with pandas.DataFrame.to_parquet or pyarrow.parquet.write_table") from None
    text = data.decode("utf-8", errors="replace")
    if suffix == ".json":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError("task file", uri, f"not valid JSON at line {exc.lineno}, column {exc.colno}",
                            "fix the JSON syntax there") from None
        return obj if isinstance(obj, list) else [obj]
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise UserError(f"task file line {n}", line[:60], f"not valid JSON ({exc.msg})",
                            "write one JSON object per line") from None
    return rows


def parse_task(row: Any, where: str) -> Task:
    """One row as a Task, or a UserError naming ``where`` (file and row), the field and the fix."""
    from components.domains import registry

    if not isinstance(row, dict):
        raise UserError(where, row, "a task must be a JSON object", f"write an object with {list(REQUIRED)}")
    extra = sorted(set(row) - set(REQUIRED) - set(OPTIONAL))
    if extra:
        raise UserError(f"{where}: {extra[0]}", row[extra[0]], "unknown task field",
                        f"remove it or use one of {list(REQUIRED + OPTIONAL)}")
    for name in REQUIRED:
        if row.get(name) in (None, ""):
            raise UserError(f"{where}: {name}", row.get(name), "missing required task field", f"add '{name}'")
    if row["domain"] not in registry.names():
        raise UserError(f"{where}: domain", row["domain"], "unknown domain", f"use one of {registry.names()}")
    if not isinstance(row["prompt"], str):
        raise UserError(f"{where}: prompt", row["prompt"], "must be a string", "quote the prompt text")
    reference = _object(row["reference"], f"{where}: reference")
    metadata = _object(row.get("metadata") or {}, f"{where}: metadata")
    split = row.get("split") or "train"
    if split not in ("train", "eval"):
        raise UserError(f"{where}: split", split, "unknown split", "use 'train' or 'eval'")
    difficulty = _int(row.get("difficulty", 1), f"{where}: difficulty", 1)
    context = _int(row.get("context_tokens", len(row["prompt"])), f"{where}: context_tokens", 0)
    return Task(
        task_id=str(row.get("task_id") or task_id(row["domain"], row["prompt"])), domain=row["domain"], split=split,
        difficulty=difficulty, prompt=row["prompt"], context_tokens=context, reference=reference,
        metadata=metadata,
    )


def _object(value: Any, field: str) -> dict[str, Any]:
    if isinstance(value, str):  # Parquet files written from pandas often hold JSON as text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, dict):
        raise UserError(field, value, "must be an object (or a JSON string of one)", 'write e.g. {"answer": "85"}')
    return value


def _int(value: Any, field: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < least:
        raise UserError(field, value, f"must be an integer >= {least}", f"set it to {least} or more")
    return int(value)


def load_tasks(path_or_uri: str | Path) -> list[Task]:
    """All tasks of a Parquet/JSONL/JSON file; a UserError for the first bad row."""
    uri = str(path_or_uri)
    rows = read_rows(uri)
    if not rows:
        raise UserError("task file", uri, "holds no tasks", "add at least one row")
    tasks = [parse_task(row, f"{uri} row {i}") for i, row in enumerate(rows)]
    seen: dict[str, int] = {}
    for i, t in enumerate(tasks):
        if t.task_id in seen:
            raise UserError(f"{uri} row {i}: task_id", t.task_id, f"duplicates row {seen[t.task_id]}",
                            "give each task its own id (or drop task_id to derive it from the prompt)")
        seen[t.task_id] = i
    return tasks
