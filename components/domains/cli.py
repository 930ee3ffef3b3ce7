"""``posttrain verify``: score one completion for one task, as the reward stage would.

    posttrain verify --domain terminal --task task.json --completion out.txt

``--task`` is a JSON file of one Task (or a ``.jsonl``/``.parquet`` file, whose first row
is used), a regular UTF-8 file read and validated by :mod:`components.domains.taskfile`;
``--domain`` fills in a row without a ``domain`` field and must agree with one that has
it. ``--completion`` is a regular text file holding the completion exactly as the policy
would produce it (a FIFO or a device such as ``/dev/zero`` is refused before it is read).
Domains that execute (code, terminal) run their plan in the sandbox: ``--backend`` (default: the
recipe default, the hardened ``bwrap``); ``subprocess`` needs ``--allow-weak-isolation``,
as in a recipe. Prints one JSON object
with ``score``, ``passed``, ``status``, ``components`` and ``detail``; exits 0 whenever a
verdict was reached (pass or fail), 2 on a user mistake (bad file, unknown domain,
wrong-shaped reference), always with one line and no traceback.

The completion is read as bytes: bytes that are not UTF-8 are kept (as surrogate escapes)
and judged ``malformed`` (score 0), as is a completion over the size limit or nested too
deep; a verifier's own failure is the verdict ``verifier_error``.

Not covered: verifying many completions at once (use ``posttrain replay``), or sandbox
limits other than the recipe defaults and ``--timeout``.
"""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("verify", help="score one completion for one task and print the verdict as JSON")
    parser.add_argument("--domain", required=True, help="domain name, e.g. math or terminal")
    parser.add_argument("--task", required=True,
                        help="task file: JSON of one task, or the first row of a .jsonl/.parquet")
    parser.add_argument("--completion", required=True, help="text file with the completion ('-': standard input)")
    parser.add_argument("--backend", default=None,
                        help="sandbox backend for executing domains (default: the recipe default, bwrap)")
    parser.add_argument("--allow-weak-isolation", action="store_true",
                        help="allow the 'subprocess' backend or a host without full isolation (trusted completions only)")
    parser.add_argument("--timeout", type=float, default=5.0, help="sandbox wall-clock limit in seconds (default: %(default)s)")
    parser.set_defaults(handler=handle_verify)
    return parser


def handle_verify(args: argparse.Namespace) -> int:
    from components.core.errors import UserError
    from components.domains import registry
    from components.domains.taskfile import parse_task, printable, read_labelled_rows, short

    domain = registry.get(args.domain, "--domain")  # unknown name -> UserError listing the registered ones
    rows = read_labelled_rows(args.task, limit=1)  # ("line <n>" in a JSON Lines file, else "row 0", row)
    if not rows:
        raise UserError("--task", args.task, "holds no task", "write one task object into the file")
    label, row = rows[0]
    if isinstance(row, dict):
        row = {"domain": args.domain, **row}
        if row["domain"] != args.domain:
            theirs = row["domain"]  # any JSON value: shown escaped and short, named in the fix only if registered
            shown = printable(repr(short(theirs)) if isinstance(theirs, str) else str(short(theirs)))
            fix = (f"pass --domain {theirs} or a task of domain {args.domain}" if isinstance(theirs, str) and theirs in registry.names()
                   else f"set the task's domain to {args.domain!r} (or drop it: --domain fills it in)")
            raise UserError("--domain", args.domain, f"the task's domain is {shown}", fix)
    task = parse_task(row, f"{printable(args.task, limit=10_000)} {label}")
    completion = read_completion(args.completion)
    from pydantic import ValidationError

    from components.core.plugins import BACKENDS
    from components.core.recipe import SandboxConfig

    overrides = {"backend": args.backend} if args.backend else {}
    if args.backend:
        BACKENDS.check(args.backend, "--backend")
    try:
        config = SandboxConfig(**overrides, timeout_s=args.timeout, concurrency=1,
                               allow_weak_isolation=args.allow_weak_isolation)
    except ValidationError as exc:
        raise UserError("--timeout", args.timeout, str(exc.errors()[0]["msg"]).lower(),
                        "pass a number of seconds, at least 0.1 and at most 86400") from None
    # judge() makes every number finite: allow_nan=False keeps a NaN from ever being printed as JSON
    print(json.dumps(verdict_json(domain, task, completion, config), indent=2, sort_keys=True, allow_nan=False))
    return 0


def read_completion(name: str) -> str:
    """The completion file's text (``-``: standard input's); undecodable bytes kept as surrogate escapes (judged
    ``malformed``), a file over the size limit cut just past it (also ``malformed``)."""
    from components.core.errors import UserError
    from components.core.files import Unreadable, read_regular
    from components.domains.base import MAX_COMPLETION_CHARS

    limit = 4 * MAX_COMPLETION_CHARS + 3  # at most 4 bytes a character: enough to tell a completion over the limit
    if name == "-":  # standard input, as a pipe gives it: read to its end or just past the limit
        data = _read_stdin(limit + 1)
    else:
        try:
            data = read_regular(name, limit)
        except Unreadable as exc:
            raise UserError("--completion", name, exc.why, "pass a text file holding the completion") from None
    return data.decode("utf-8", errors="surrogateescape")[: MAX_COMPLETION_CHARS + 1]


def _read_stdin(at_most: int) -> bytes:
    """Standard input's bytes, to its end or ``at_most`` of them."""
    import sys

    chunks, size = [], 0
    while size < at_most and (chunk := sys.stdin.buffer.read(min(1 << 20, at_most - size))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def verdict_json(domain, task, completion: str, sandbox_config) -> dict:
    """Run the domain's plan (if any) in the sandbox and its verifier; the verdict as a
    JSON-able dict. Total: malformed completions are not run, and a failing plan or
    verifier gives the verdict ``verifier_error``."""
    from components.domains.base import Verdict, error_text, judge, malformed
    from components.sandbox.cli import weak_isolation_flag
    from components.sandbox.executor import get_executor

    result = None
    if malformed(completion) is None:
        try:
            job = domain.execution_plan(task, completion)
        except Exception as exc:  # noqa: BLE001 - a plan's bug is a verdict, not a traceback
            v = Verdict(0.0, False, status="verifier_error", detail=f"execution plan failed: {error_text(exc)}")
            return _as_json(task, v, None)
        if job is not None:
            with weak_isolation_flag(), get_executor(sandbox_config) as executor:
                result = executor.run(job)
    return _as_json(task, judge(domain, task, completion, result), result)


def _as_json(task, v, result) -> dict:
    return {
        "domain": task.domain, "task_id": task.task_id, "score": v.score, "passed": v.passed, "status": v.status,
        "components": v.components, "detail": v.detail, "execution": result.status if result is not None else "none",
    }
