"""A Python unit-test harness whose result channel untrusted code cannot write.

``python_tests_job(job_id, solution_src, func_name, inputs)`` builds a ``Job`` that runs
``HARNESS``. The harness process (trusted, it never imports the solution) reads the
inputs, makes itself non-dumpable, then forks a child that closes the result fd, loads
``solution.py`` and calls ``func_name(x)`` for each input, streaming one JSON line per
test back over a private pipe. The parent validates and re-serialises those lines and
alone writes ``{"values": [...]}`` to the executor's result pipe (``{result_fd}``).

Why the solution cannot forge the verdict: the result fd is closed in its process and
the parent's copy is unreachable (non-dumpable: its /proc/<ppid>/fd entries, mem and environ cannot be opened; in warm
mode, where the job owns its user namespace, the fd numbers can be listed; ptrace and
process_vm_* are blocked by seccomp); results.json, stdout, exit codes and the test
files carry no weight; killing or stopping the parent yields no result (score 0); and
expected answers never enter the sandbox — the verifier compares values outside. The
values a child sends are only what the solution returned: an ``int`` subclass is
serialised by its real value, any other object by its ``repr`` string.

The result shape is the one ``components/domains/code.py`` verifies.

Not covered: functions of several arguments (each input is one positional argument),
per-test timeouts (the job's wall clock bounds all tests), and performance tests.
"""

from __future__ import annotations

import json
from typing import Any

from components.core.jobs import PYTHON, RESULT_FD, Job

HARNESS = r'''
import json, os, sys

RESULT_FD = int(sys.argv[1])
FUNC = sys.argv[2]
LIMIT = 1 << 20
with open("tests.json") as fh:
    INPUTS = json.load(fh)  # read before any untrusted code exists
import ctypes
if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0: our fds and memory stay ours
    raise SystemExit("harness: cannot make itself non-dumpable")
PLAIN = (int, float, str, bool, type(None))

read_end, write_end = os.pipe()
sys.stdout.flush()
sys.stderr.flush()
pid = os.fork()
if pid == 0:
    # ---- untrusted territory: nothing below can reach RESULT_FD ----
    os.close(read_end)
    os.close(RESULT_FD)
    def send(entry):
        os.write(write_end, (json.dumps(entry) + "\n").encode())
    try:
        # Loaded as importlib would load solution.py, without importing importlib.util
        # (~2 ms per job): a module named "solution", its source compiled with its path.
        module = type(sys)("solution")
        module.__file__ = "solution.py"
        sys.modules["solution"] = module
        with open("solution.py", "rb") as fh:
            source = fh.read()
        exec(compile(source, "solution.py", "exec"), module.__dict__)
        func = getattr(module, FUNC)
    except BaseException as exc:
        send({"ok": False, "error": "import: " + type(exc).__name__})
        os._exit(1)
    for x in INPUTS:
        try:
            value = func(x)
            if isinstance(value, PLAIN) and type(value) is not bool and isinstance(value, int):
                value = int.__int__(value)  # an int subclass travels as its real value
            elif type(value) not in PLAIN:
                value = repr(value)
            send({"ok": True, "value": value})
        except BaseException as exc:
            send({"ok": False, "error": type(exc).__name__})
    sys.stdout.flush()
    os._exit(0)

# ---- trusted parent ----
os.close(write_end)
data = bytearray()
while True:
    chunk = os.read(read_end, 65536)
    if not chunk:
        break
    if len(data) < LIMIT:
        data += chunk[: LIMIT - len(data)]
os.waitpid(pid, 0)
values = []
for line in bytes(data).split(b"\n")[: len(INPUTS)]:
    try:
        entry = json.loads(line)
    except ValueError:
        break
    if not isinstance(entry, dict) or not isinstance(entry.get("ok"), bool):
        break
    if entry["ok"]:
        value = entry.get("value")
        values.append({"ok": True, "value": value if type(value) in PLAIN else repr(value)})
    else:
        values.append({"ok": False, "error": str(entry.get("error", "error"))[:200]})
while len(values) < len(INPUTS):
    values.append({"ok": False, "error": "no result"})
os.write(RESULT_FD, json.dumps({"values": values}).encode())
os.close(RESULT_FD)
'''


def python_tests_job(job_id: str, solution_src: str, func_name: str, inputs: list[Any],
                     timeout_s: float | None = None) -> Job:
    """A Job calling ``func_name(x)`` from ``solution_src`` for each JSON-able ``x`` in ``inputs``."""
    assert func_name.isidentifier(), func_name
    return Job(
        job_id=job_id,
        files={"solution.py": solution_src, "harness.py": HARNESS, "tests.json": json.dumps(list(inputs))},
        argv=[PYTHON, "-I", "-S", "harness.py", RESULT_FD, func_name],
        timeout_s=timeout_s,
    )
