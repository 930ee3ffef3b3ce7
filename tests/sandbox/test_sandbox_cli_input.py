"""``posttrain sandbox run`` turns bad input into one stderr line and exit 2, no traceback.

Runs the real CLI as a subprocess. Bad limits, a missing / directory / non-UTF-8
--stdin-file and a non-UTF-8 program each give ``posttrain: error: FLAG='VALUE': ...;
fix: ...``; these are caught before any sandbox starts, so they need no bwrap. The valid
run needs bwrap and is skipped without it. Not covered: values argparse itself rejects
(``--timeout abc``), unreadable-permission files (root reads them anyway).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.home import REPO_ROOT
from tests.sandbox.helpers import bwrap_unavailable


def sandbox_run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "components.cli", "sandbox", "run", *argv], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "ok.py").write_text("print(6 * 7)\n")
    (tmp_path / "latin1.py").write_bytes(b"x = '\xff'\n")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "prog.rb").write_text("puts 1\n")
    return tmp_path


@pytest.mark.parametrize(("argv", "flag", "value", "fix"), [
    (["--timeout", "0", "ok.py"], "--timeout", "0.0", "at least 0.1 and at most 86400"),
    (["--timeout", "1e-9", "ok.py"], "--timeout", "1e-09", "at least 0.1 and at most 86400"),
    (["--timeout", "-1", "ok.py"], "--timeout", "-1.0", "at least 0.1 and at most 86400"),
    (["--timeout", "nan", "ok.py"], "--timeout", "nan", "at least 0.1 and at most 86400"),
    (["--memory", "0", "ok.py"], "--memory", "0", "at least 16 and at most 1048576"),
    (["--output-cap", "10", "ok.py"], "--output-cap", "10", "at least 256 and at most 1073741824"),
    (["--output-cap", "99999999999", "ok.py"], "--output-cap", "99999999999", "at least 256 and at most 1073741824"),
    (["--stdin-file", "missing.txt", "ok.py"], "--stdin-file", "'missing.txt'", "no such file"),
    (["--stdin-file", "folder", "ok.py"], "--stdin-file", "'folder'", "is a directory"),
    (["--stdin-file", "latin1.txt", "ok.py"], "--stdin-file", "'latin1.txt'", "not UTF-8"),
    (["--stdin-file", "", "ok.py"], "--stdin-file", "''", "leave --stdin-file out for no input"),  # was no input
    (["latin1.py"], "file", "'latin1.py'", "not UTF-8"),
    (["prog.rb"], "--lang", "'not given'", "pass --lang python or --lang bash"),  # was "--lang=None"
])
def test_bad_input_is_one_line_and_exit_2(files, argv, flag, value, fix):
    proc = sandbox_run(*argv, cwd=files)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"posttrain: error: {flag}={value}: "), lines[0]  # numbers bare, texts quoted
    assert "; fix: " in lines[0] and fix in lines[0], lines[0]
    assert proc.stdout == ""


def test_limit_range_comes_from_sandbox_config():
    from components.core.recipe import SandboxConfig
    from components.sandbox.cli import _allowed

    assert SandboxConfig.model_fields["memory_mb"].metadata[0].ge == 16
    assert _allowed("memory_mb") == "at least 16 and at most 1048576"


@pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"bwrap sandbox unavailable: {bwrap_unavailable()}")
def test_valid_run_still_succeeds(files):
    (files / "in.txt").write_text("café\n")
    (files / "echo.py").write_text("import sys\nprint(sys.stdin.read().upper(), end='')\n")
    proc = sandbox_run("--timeout", "10", "--memory", "256", "--output-cap", "256", "--stdin-file", "in.txt",
                       "echo.py", cwd=files)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["status"] == "ok" and out["stdout"] == "CAFÉ\n" and out["lang"] == "python"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "flag", "value", "why"), [
    (["--stdin-file", "fifo", "ok.py"], "--stdin-file", "fifo", "is not a regular file (a FIFO)"),
    (["--lang", "python", "fifo"], "file", "fifo", "is not a regular file (a FIFO)"),
    (["--stdin-file", "/dev/zero", "ok.py"], "--stdin-file", "/dev/zero", "is not a regular file (a character device)"),
    (["--stdin-file", "zero.txt", "ok.py"], "--stdin-file", "zero.txt", "is not a regular file (a character device)"),
])
def test_a_fifo_or_device_is_refused_not_waited_on(files, argv, flag, value, why):
    os.mkfifo(files / "fifo")
    (files / "zero.txt").symlink_to("/dev/zero")
    proc = subprocess.run([sys.executable, "-m", "components.cli", "sandbox", "run", *argv], capture_output=True,
                          text=True, timeout=30, cwd=files, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"posttrain: error: {flag}='{value}': {why}; fix: "
                                        + ("pass a readable text file" if flag == "--stdin-file"
                                           else "pass the path of a readable .py or .sh file")]


def test_an_input_over_the_limit_is_refused(files):
    from components.sandbox.cli import MAX_INPUT_BYTES

    with open(files / "big.txt", "wb") as fh:
        fh.truncate(MAX_INPUT_BYTES + 1)  # sparse: no disk written
    proc = sandbox_run("--stdin-file", "big.txt", "ok.py", cwd=files)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == ["posttrain: error: --stdin-file='big.txt': larger than 16 MiB; fix: pass a smaller file"]


@pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"bwrap sandbox unavailable: {bwrap_unavailable()}")
def test_a_stdout_that_cannot_take_the_result_is_one_line(files):
    """``> /dev/full`` ended in an OSError traceback from the final print."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "components.cli", "sandbox", "run", "ok.py"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120, cwd=files,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == ["posttrain: error: stdout='/dev/full': cannot take the result (No space left "
                                        "on device); fix: redirect stdout to a writable file or pipe"]
