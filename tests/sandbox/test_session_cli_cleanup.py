"""Sessions keep files across commands; the CLI prints JSON; nothing is left behind."""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.core.jobs import Job
from components.sandbox import cgroups
from components.sandbox.cli import add_parser
from components.sandbox.executor import get_executor
from components.sandbox.session import SandboxSession
from tests.sandbox.helpers import bwrap_unavailable, sandbox_config, sandbox_pids_after

pytestmark = pytest.mark.skipif(bool(bwrap_unavailable()), reason=f"bwrap sandbox unavailable: {bwrap_unavailable()}")


def test_session_keeps_files_between_commands():
    with SandboxSession(sandbox_config()) as session:
        assert session.exec("echo 'print(6 * 7)' > answer.py").status == "ok"
        result = session.exec("python3 answer.py")
        assert result.status == "ok" and result.stdout == "42\n"
        assert result.isolation.endswith("mode:session")


@pytest.mark.timeout(60)  # a command that was not cut would hold the test for its 30 s and more
def test_session_command_times_out_and_session_survives():
    with SandboxSession(sandbox_config()) as session:
        assert session.exec("sleep 30", timeout_s=0.5).status == "timeout"
        assert session.exec("echo still here").stdout == "still here\n"


def test_session_background_process_dies_with_its_command():
    with SandboxSession(sandbox_config()) as session:
        assert session.exec("sleep 300 &").status == "ok"
        listed = session.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
        assert listed.status == "ok" and "bash" in listed.stdout
        assert "sleep 300" not in listed.stdout


def test_session_expires():
    session = SandboxSession(sandbox_config(), session_timeout_s=0.5)
    time.sleep(0.8)
    result = session.exec("echo late")
    assert result.status == "timeout" and session.closed


def test_commands_after_one_that_killed_the_session_say_what_killed_it():
    """An output flood kills the session's worker with the command. Every later command
    said ``timeout`` "session is closed (ended or ran out of time)", as if the session had
    run out of time."""
    with SandboxSession(sandbox_config(mode="warm")) as session:
        assert session.exec("echo one > f").status == "ok"
        flood = session.exec("head -c 40000000 /dev/zero")
        assert (flood.status, flood.extra["reason"]) == ("killed", "output flood")
        after = [session.exec("cat f"), session.exec("echo two")]
    for result in after:
        assert (result.status, result.exit_code, result.stdout) == ("killed", -1, "")
        assert result.extra == {"reason": "output flood", "killed_with_command": 2}
        assert result.stderr == "sandbox session is closed: its sandbox was killed with command 2 (output flood)"


CHECK = ("import json, os, sys\n"
         "os.write(int(sys.argv[1]), json.dumps({'files': sorted(os.listdir('.')), 'steps': 'forged'}).encode())\n")


@pytest.mark.parametrize("backend", ["bwrap", "subprocess"])
def test_session_job_runs_steps_then_a_check_the_steps_cannot_edit(backend):
    from components.core.jobs import PYTHON, RESULT_FD, SessionJob

    job = SessionJob(
        job_id="steps", files={"seed.txt": "x"},
        steps=["touch a", "rm seed.txt; false", "echo 'print(1)' > check.py; exit 3"],
        check=Job("steps", {"check.py": CHECK}, [PYTHON, "-I", "-S", "check.py", RESULT_FD]),
    )
    executor = get_executor(sandbox_config(backend=backend, allow_weak_isolation=backend == "subprocess"))
    try:
        result = executor.run(job)
    finally:
        executor.close()
    assert result.status == "ok", result.stderr
    if backend == "bwrap":  # one session: each step's exit code, from the host (the check's own key is replaced)
        assert result.isolation.endswith("+mode:session")
        assert result.result == {"files": ["a", "check.py"],
                                 "steps": [{"exit": 0, "status": "ok"}, {"exit": 1, "status": "failed"},
                                           {"exit": 3, "status": "failed"}]}
        assert sandbox_pids_after() == []  # the session's sandbox is gone once the job is done
    else:  # one process tree: the same final state, no per-step codes
        assert result.result == {"files": [".steps", "a", "check.py"], "steps": "forged"}


def test_cli_run_prints_execution_json(tmp_path, capsys):
    program = tmp_path / "hello.py"
    program.write_text("print('hello from the sandbox')")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sandbox", "run", "--timeout", "2", "--memory", "256", str(program)])
    assert args.handler(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "ok" and out["stdout"] == "hello from the sandbox\n" and out["backend"] == "bwrap"
    assert out["isolation"].startswith("bwrap:")


def test_cli_bash_timeout_exit_status(tmp_path, capsys):
    program = tmp_path / "spin.sh"
    program.write_text("while :; do :; done")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sandbox", "run", "--timeout", "0.5", str(program)])
    assert args.handler(args) == 1
    assert json.loads(capsys.readouterr().out)["status"] == "timeout"


BATTERY = {
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "memory_bomb": "x = bytearray(4 * 1024**3)",
    "loop": "while True:\n    pass",
    "disk": "f = open('/tmp/x', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))",
    "flood": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
    "daemon": "import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '600'])\n",
}


@pytest.mark.parametrize("mode", ["strict", "warm"])
def test_battery_leaves_nothing_behind(mode):
    before_dirs = set(glob.glob("/tmp/posttrain-result-*"))
    executor = get_executor(sandbox_config(mode=mode, timeout_s=1.5))
    try:
        jobs = [Job(name, {"main.py": src}, ["{python}", "-I", "-S", "main.py"]) for name, src in BATTERY.items()]
        from components.sandbox.executor import run_many

        results = run_many(executor, jobs, concurrency=2)
        assert all(r.status != "infra_error" for r in results), [(r.status, r.stderr[-200:]) for r in results]
    finally:
        executor.close()
    assert sandbox_pids_after() == []
    assert cgroups.leftovers(mine_only=True) == []
    assert set(glob.glob("/tmp/posttrain-result-*")) <= before_dirs


def test_warm_executor_session_worker_carries_nothing_into_the_next_session():
    """A warm executor keeps its session workers; each is reset between sessions, so the
    next session finds empty /work, /tmp and /dev/shm, and a leftover mount or file in any
    is gone (the worker itself is the same one: same uid)."""
    from components.core.jobs import PYTHON, RESULT_FD, SessionJob

    lister = ("import json, os, sys\n"
              "os.write(int(sys.argv[1]), json.dumps({'work': sorted(os.listdir('/work')), "
              "'tmp': sorted(os.listdir('/tmp')), 'shm': sorted(os.listdir('/dev/shm'))}).encode())\n")
    check = Job("check", {"list.py": lister}, [PYTHON, "-I", "-S", "list.py", RESULT_FD])
    dirty = SessionJob("dirty", {"secret.txt": "s3cret"},
                       ["echo left > /tmp/left; echo s > /dev/shm/sem.left; mkdir -p deep/er; echo x > deep/er/f",
                        "chmod 000 deep"], check)
    clean = SessionJob("clean", {}, ["true"], check)
    config = sandbox_config(mode="warm", concurrency=1)
    executor = get_executor(config)
    try:
        first = executor.run(dirty)
        second = executor.run(clean)
        third = executor.run(dirty)
    finally:
        executor.close()
    assert first.status == "ok", first.stderr
    assert first.result["work"] == ["deep", "list.py", "secret.txt"] and first.result["tmp"] == ["left"]
    assert first.result["shm"] == ["sem.left"]
    assert second.status == "ok", second.stderr
    assert second.result == {"work": ["list.py"], "tmp": [], "shm": [], "steps": [{"exit": 0, "status": "ok"}]}
    assert third.result == first.result
    assert second.extra["uid"] == first.extra["uid"] == third.extra["uid"]  # one kept worker served all three
    assert sandbox_pids_after() == []


def test_kept_session_worker_frees_each_sessions_files():
    """A session that fills /work and /tmp to their caps leaves nothing behind: the reset
    detaches both tmpfs (their memory counts against the worker's cgroup), so session
    after session on one kept worker still has the full space."""
    from components.core.jobs import PYTHON, RESULT_FD, SessionJob

    check = Job("check", {"df.py": "import os, sys\nos.write(int(sys.argv[1]), b'{\"ok\": true}')\n"},
                [PYTHON, "-I", "-S", "df.py", RESULT_FD])
    fill = SessionJob("fill", {}, ["set -e; for d in /work /tmp; do for i in 1 2 3 4; do "  # files of 15 MB: under RLIMIT_FSIZE
                                   "head -c 15000000 /dev/zero > $d/big$i; done; done"], check)
    executor = get_executor(sandbox_config(mode="warm", concurrency=1, memory_mb=256))
    try:
        results = [executor.run(fill) for _ in range(8)]  # 8 x 120 MB: past the worker cgroup's 512 MB if kept
    finally:
        executor.close()
    assert [r.result for r in results] == [{"ok": True, "steps": [{"exit": 0, "status": "ok"}]}] * 8, \
        [(r.status, r.result, r.stderr[-300:]) for r in results]
    assert len({r.extra["uid"] for r in results}) == 1  # one kept worker served them all


def test_ctrl_c_on_sandbox_run_is_one_line_and_leaves_no_process(tmp_path):
    """SIGINT to the command's process group, as a terminal sends Ctrl-C, while the job runs."""
    program = tmp_path / "wait.sh"
    program.write_text("sleep 37.125\n")
    proc = subprocess.Popen([sys.executable, "-m", "components.cli", "sandbox", "run", "--timeout", "60", str(program)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=Path(__file__).resolve().parents[2])

    def sleepers() -> list[str]:
        found = []
        for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                if Path(cmdline).read_bytes() == b"sleep\x0037.125\x00":
                    found.append(cmdline)
            except OSError:
                pass
        return found

    try:
        deadline = time.monotonic() + 60
        while not sleepers() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert sleepers(), "the job never started"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err.splitlines() == ["posttrain: interrupted (Ctrl-C)"]
    deadline = time.monotonic() + 10
    while sleepers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sleepers() == []
