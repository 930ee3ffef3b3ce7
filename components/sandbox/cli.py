"""``posttrain sandbox run FILE`` and ``posttrain sandbox doctor``.

``run`` executes one Python or bash file in the bwrap sandbox and prints the result as
Execution-like JSON (status, exit code, capped output, resource use, isolation); the
exit status is 0 when the program's status is ``ok``, else 1. ``doctor`` prints what
isolation this host supports and what is missing, each missing piece with its real
cause and fix (doctor.py), and exits 1 when the sandbox would refuse to run;
``doctor --installed`` checks only what an image must ship (no namespaces: it runs
inside an image build). The main CLI wires ``add_parser`` into its subcommands and calls
``args.handler(args)``.

Bad input is a ``UserError`` (one line, exit 2) naming the flag, the value and the fix:
a limit outside SandboxConfig's range (the range is read from its field constraints),
and a program or --stdin-file that is missing, unreadable, not a regular file (a FIFO or
a device such as /dev/zero is refused before it is read, never waited on), larger than
``MAX_INPUT_BYTES`` or not UTF-8 (rejected, not re-encoded); an empty ``--stdin-file ""``
(not "no input"); a stdout that cannot take the result (``> /dev/full``). Not covered: stdin from the
terminal (use --stdin-file) and extra files beside FILE. A value argparse itself rejects
(``--timeout abc``) is one line and exit 2 too (``components/cli.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("sandbox", help="run untrusted code in the hardened sandbox")
    sub = parser.add_subparsers(dest="sandbox_command", required=True)
    run = sub.add_parser("run", help="run one file in a fresh sandbox and print the result as JSON")
    run.add_argument("file", help="program to run (.py or .sh)")
    run.add_argument("--lang", choices=("python", "bash"), default=None, help="default: from the file suffix")
    run.add_argument("--timeout", type=float, default=5.0, help="wall-clock limit in seconds (default: %(default)s)")
    run.add_argument("--memory", type=int, default=512, help="memory limit in MiB (default: %(default)s)")
    run.add_argument("--output-cap", type=int, default=8192, help="stdout/stderr bytes kept (default: %(default)s)")
    run.add_argument("--mode", choices=("strict", "warm"), default="strict", help="fresh sandbox, or a warm worker")
    run.add_argument("--stdin-file", default=None, help="file fed to the program's stdin")
    run.add_argument("--allow-weak-isolation", action="store_true",
                     help="run even when the host cannot give full isolation (says WEAK in the output)")
    run.set_defaults(handler=handle_run)
    doctor = sub.add_parser("doctor", help="show what isolation this host supports, and what stops it")
    doctor.add_argument("--installed", action="store_true",
                        help="check only what must be installed (bwrap, setpriv, /usr/bin/python3, seccomp), "
                             "creating no namespace: for image builds")
    doctor.set_defaults(handler=handle_doctor)
    return parser


# SandboxConfig field -> (flag, unit) for the limits ``run`` takes from the command line
_LIMIT_FLAGS = {"timeout_s": ("--timeout", "seconds"), "memory_mb": ("--memory", "MiB"),
                "output_cap_bytes": ("--output-cap", "bytes")}


def _allowed(field: str) -> str:
    """SandboxConfig's range for ``field`` in words, from its constraints (gt/ge/lt/le)."""
    from components.core.recipe import SandboxConfig

    words = {"gt": "above", "ge": "at least", "lt": "below", "le": "at most"}
    parts = [f"{word} {getattr(c, attr)}" for c in SandboxConfig.model_fields[field].metadata
             for attr, word in words.items() if getattr(c, attr, None) is not None]
    return " and ".join(parts)


@contextmanager
def weak_isolation_flag() -> Iterator[None]:
    """On the command line, the executor's refusal names the ``--allow-weak-isolation``
    flag rather than the recipe field ``sandbox.allow_weak_isolation`` it names in a run."""
    from components.core.errors import UserError

    try:
        yield
    except UserError as exc:
        if exc.field != "sandbox.allow_weak_isolation":
            raise
        raise UserError("--allow-weak-isolation", "not given", exc.problem,
                        "pass --allow-weak-isolation, for trusted code only, or use the bwrap backend on a host "
                        "that has it (posttrain sandbox doctor says what is missing)") from None


def _config(args: argparse.Namespace) -> SimpleNamespace:
    """The executor's config; a limit outside SandboxConfig's range is a UserError."""
    from pydantic import ValidationError

    from components.core.errors import UserError
    from components.core.recipe import SandboxConfig

    try:
        base = SandboxConfig(backend="bwrap", timeout_s=args.timeout, memory_mb=args.memory,
                             output_cap_bytes=args.output_cap, concurrency=1).model_dump()
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else ""
        if field not in _LIMIT_FLAGS:
            raise  # not from the command line: our bug, a traceback
        flag, unit = _LIMIT_FLAGS[field]
        raise UserError(flag, error["input"], str(error["msg"]).lower(),
                        f"pass {flag} in {unit}, {_allowed(field)}") from None
    base.update(mode=args.mode, allow_weak_isolation=args.allow_weak_isolation)
    return SimpleNamespace(**base)


MAX_INPUT_BYTES = 16 << 20
"""Largest program or --stdin-file ``run`` reads: 16 MiB, the largest file a job may write
(``limits.fsize_mb``)."""


def _read_text(flag: str, name: str, fix: str) -> str:
    """``name``'s text as UTF-8 (newlines translated, as ``read_text`` does); a missing,
    unreadable, non-regular (FIFO, device), too large or non-UTF-8 file is a UserError
    naming ``flag``. Reads at most ``MAX_INPUT_BYTES + 1`` bytes, even of a growing file."""
    from components.core.errors import UserError
    from components.core.files import Unreadable, read_regular

    try:
        data = read_regular(name, MAX_INPUT_BYTES)
    except Unreadable as exc:
        raise UserError(flag, name, exc.why, fix) from None
    if len(data) > MAX_INPUT_BYTES:
        raise UserError(flag, name, f"larger than {MAX_INPUT_BYTES >> 20} MiB", "pass a smaller file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(flag, name, f"is not UTF-8 text (byte {data[exc.start]:#04x})",
                        "save it as UTF-8 text") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def handle_run(args: argparse.Namespace) -> int:
    from components.core.errors import UserError
    from components.core.jobs import PYTHON, Job
    from components.sandbox.executor import get_executor

    path = Path(args.file)
    source = _read_text("file", args.file, "pass the path of a readable .py or .sh file")
    lang = args.lang or {".py": "python", ".sh": "bash"}.get(path.suffix)
    if lang is None:
        raise UserError("--lang", "not given", f"cannot tell the language of {path.name} from its suffix", "pass --lang python or --lang bash")
    name = "main.py" if lang == "python" else "main.sh"
    argv = [PYTHON, "-I", "-S", name] if lang == "python" else ["bash", name]
    config = _config(args)
    if args.stdin_file == "":  # an unset variable in a script: not "no input"
        raise UserError("--stdin-file", "", "is empty", "pass a readable text file, or leave --stdin-file out for no input")
    stdin = _read_text("--stdin-file", args.stdin_file, "pass a readable text file") if args.stdin_file is not None else ""
    job = Job(job_id=path.name, files={name: source}, argv=argv, stdin=stdin, timeout_s=args.timeout)
    with weak_isolation_flag(), get_executor(config) as executor:
        result = executor.run(job)
    out = dataclasses.asdict(result)
    out.pop("result", None)
    _write_stdout(json.dumps({"file": str(path), "lang": lang, **out}, indent=2) + "\n")
    return 0 if result.status == "ok" else 1


def _write_stdout(text: str) -> None:
    """``text`` on stdout, flushed; a stdout that cannot take it (``> /dev/full``, a closed
    pipe) is a UserError naming where stdout goes, and what is left unwritten is dropped
    (no second failure, and traceback, when the interpreter flushes at exit)."""
    import os
    import sys

    from components.core.errors import UserError

    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as exc:
        try:
            where = os.readlink(f"/proc/self/fd/{sys.stdout.fileno()}")
        except (OSError, ValueError):
            where = "fd 1"
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the buffered rest goes nowhere at exit
        os.close(devnull)
        raise UserError("stdout", where, f"cannot take the result ({exc.strerror or exc})",
                        "redirect stdout to a writable file or pipe") from None


def handle_doctor(args: argparse.Namespace) -> int:
    import sys

    from components.sandbox import doctor

    report, causes = doctor.run(installed_only=args.installed)
    print(json.dumps(report, indent=2))
    refuses = bool(causes) or bool(report.get("missing"))
    if causes:
        what = "is missing what the sandbox needs" if args.installed else "would refuse to run the sandbox"
        print(f"posttrain sandbox doctor: this {'image' if args.installed else 'host'} {what}:", file=sys.stderr)
        for cause in causes:
            print("- " + cause.line(), file=sys.stderr)
    for warning in report.get("warnings", []):
        print(f"posttrain sandbox doctor: warning: {doctor.Cause(**warning).line()}", file=sys.stderr)
    return 1 if refuses else 0
