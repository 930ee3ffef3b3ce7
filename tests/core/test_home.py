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


@pytest.mark.parametrize(("name", "problem"), [("h\udcff", "is not UTF-8 text (it holds bytes no UTF-8 text has)"),
                                               ("h\x01\x1b[31mRED", "contains the control character U+0001")])
def test_a_home_no_one_can_type_is_refused_even_with_a_run_root(name: str, problem: str, tmp_path: Path) -> None:
    """Non-UTF-8 bytes (``$'\\xff'``) crashed every stage in SQLAlchemy's URL with a
    UnicodeEncodeError traceback; a control character was taken as is when --run-root was
    given. Both are one line now, and no folder is made."""
    home = tmp_path / name
    proc = run_posttrain(["stage", "bootstrap", "--recipe", str(TINY), "--run-root", str(tmp_path / "store")],
                         tmp_path, cli_env(home), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("posttrain: error: POSTTRAIN_HOME=") and problem in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing made"


@pytest.mark.parametrize(("raw", "problem", "fix"), [
    (" ", "is only white space", "point POSTTRAIN_HOME at a local folder, e.g. /var/lib/posttrain (default: ./.posttrain)"),
    ("  /tmp/h", "has white space around it", "remove the spaces around the path"),
    ("file:///tmp/h", "is a URI, but the home is a local folder (MLflow's database, locks)",
     "point POSTTRAIN_HOME at a local folder, e.g. /var/lib/posttrain (default: ./.posttrain); the run root can be a "
     "URI (POSTTRAIN_RUN_ROOT)"),
    ("s3://bucket/h", "is a URI", "the run root can be a URI"),
    ("~nosuchuser-posttrain/h", "'~nosuchuser-posttrain' is the home of no known user", "write the path out in full"),
])
def test_a_home_that_names_no_local_folder_is_refused(raw: str, problem: str, fix: str, monkeypatch, tmp_path) -> None:
    """Before, each of these became a folder under the working folder: ``./ /``,
    ``./   /tmp/h``, ``./file:/tmp/h``, ``./s3:/bucket/h``, ``./~nosuchuser-posttrain/h``."""
    from components.core import settings
    from components.core.errors import UserError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSTTRAIN_HOME", raw)
    with pytest.raises(UserError) as info:
        settings.check_home()
    line = info.value.line()
    assert line.startswith(f"POSTTRAIN_HOME={raw!r}: ") and problem in line and fix in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_home_with_a_tilde_is_under_the_users_home_folder(monkeypatch, tmp_path) -> None:
    """``~/ph`` was a folder named ``~`` in the working folder."""
    from components.core import settings

    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("POSTTRAIN_HOME", "~/ph")
    assert settings.home() == tmp_path / "user" / "ph"


def test_a_home_that_is_a_link_loop_is_one_line(tmp_path: Path) -> None:
    """Before: a ``RuntimeError: Symlink loop`` traceback, exit 1."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    proc = run_posttrain(["run", "--recipe", str(TINY), "--iterations", "1"], tmp_path, cli_env(tmp_path / "loop" / "h"),
                         timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"posttrain: error: POSTTRAIN_HOME='{tmp_path / 'loop' / 'h'}': cannot be resolved (RuntimeError: Symlink loop "
        f"from '{tmp_path / 'loop' / 'h'}'); fix: point it at a folder that is not a symbolic-link loop"]
