"""A ``POSTTRAIN_HOME`` that cannot be a folder is one line naming it, exit 2, from the
commands that use the home (``run``, and ``stage`` with the default run root in it);
before, ``posttrain run`` printed a FileExistsError traceback and ``posttrain stage``
named ``--run-root``, which the user had not passed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.runs import TINY, cli_env, run_posttrain


@pytest.mark.parametrize("command", [["run", "--recipe", str(TINY), "--iterations", "1"],
                                     ["stage", "taskgen", "--recipe", str(TINY)]])
@pytest.mark.parametrize(("make", "why"), [("file", "File exists"), ("under-a-file", "Not a directory"),
                                           ("/proc", "No such file or directory")])
def test_a_home_that_cannot_be_a_folder_is_named(command: list[str], make: str, why: str, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    home = {"file": tmp_path / "afile", "under-a-file": tmp_path / "afile" / "home", "/proc": Path("/proc/posttrain")}[make]
    proc = run_posttrain(command, tmp_path, cli_env(home), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"posttrain: error: POSTTRAIN_HOME='{home}': cannot be a folder ({why}); fix: point POSTTRAIN_HOME at a "
        "folder this user can write (default: ./.posttrain)"]
    assert (tmp_path / "afile").read_text() == "x"
