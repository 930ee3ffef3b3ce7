"""The collector policy of a ``posttrain`` process (``components/core/gcpolicy.py``).

In this (pytest) process the policy is started and stopped by hand, and every test
leaves the collector as it found it: on, nothing frozen.
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest

from components import cli
from components.core import gcpolicy, settings
from tests.fixtures.home import TINY_RECIPE
from tests.fixtures.runs import TINY, cli_env, run_posttrain


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> tuple[Node, weakref.ref]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a, weakref.ref(b)


@pytest.fixture(autouse=True)
def restore_collector():
    gc.unfreeze()
    yield
    gcpolicy.stop()
    gc.unfreeze()
    assert gc.isenabled()


def test_inactive_policy_leaves_the_collector_alone() -> None:
    gcpolicy.settle()
    gcpolicy.before_exit()
    assert (gcpolicy.enabled(), gc.isenabled(), gc.get_freeze_count()) == (False, True, 0)


def test_start_turns_the_collector_off_until_the_first_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POSTTRAIN_GC", raising=False)
    gcpolicy.start()
    assert (gcpolicy.enabled(), gc.isenabled()) == (True, False)
    gcpolicy.settle()  # the set-up's: frozen without a pass over everything the imports made
    assert gc.isenabled() and gc.get_freeze_count() > 1000
    a, dead = cycle()
    del a
    gcpolicy.settle()  # a stage boundary
    assert dead() is None, "a dropped cycle must be freed before the survivors are frozen"


def test_settle_freezes_what_is_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POSTTRAIN_GC", raising=False)
    gcpolicy.start()
    gcpolicy.settle()
    kept, alive = cycle()
    gcpolicy.settle()
    frozen = gc.get_freeze_count()
    assert frozen > 1000 and alive() is kept.other
    # a later collection walks only what is newer than the freeze
    dead = cycle()[1]
    gc.collect()
    assert dead() is None and gc.get_freeze_count() == frozen


def test_posttrain_gc_default_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTTRAIN_GC", "default")
    gcpolicy.start()
    gcpolicy.settle()
    assert (gcpolicy.enabled(), gc.isenabled(), gc.get_freeze_count()) == (False, True, 0)


def stage_argv(tmp_path: Path) -> list[str]:
    return ["stage", "bootstrap", "--recipe", str(TINY_RECIPE), "--run-root", f"file://{tmp_path / 'store'}",
            "--iteration", "0"]


def test_the_process_entry_runs_the_policy_around_a_stage(posttrain_home: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    monkeypatch.delenv("POSTTRAIN_GC", raising=False)
    monkeypatch.setattr(sys, "argv", ["posttrain", *stage_argv(tmp_path)])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert cli.main() == 0  # as the process's own entry, it takes SIGINT and SIGTERM for the stage
    finally:
        for sig, handler in handlers.items():  # the next test in this process keeps pytest's
            signal.signal(sig, handler)
    assert gcpolicy.enabled() and gc.isenabled() and gc.get_freeze_count() > 1000


def test_a_library_call_of_main_keeps_the_callers_collector(posttrain_home: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POSTTRAIN_GC", raising=False)
    assert cli.main(stage_argv(tmp_path)) == 0
    assert (gcpolicy.enabled(), gc.isenabled(), gc.get_freeze_count()) == (False, True, 0)


@pytest.mark.parametrize(("value", "on"), [("", True), ("posttrain", True), ("default", False), ("Default", False)])
def test_the_setting(value: str, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSTTRAIN_GC", value)
    assert settings.gc_policy() is on


def test_a_setting_with_spaces_around_it_is_refused_not_stripped(monkeypatch: pytest.MonkeyPatch) -> None:
    from components.core.errors import UserError

    monkeypatch.setenv("POSTTRAIN_GC", " default ")
    with pytest.raises(UserError) as info:
        settings.gc_policy()
    assert info.value.line() == "POSTTRAIN_GC=' default ': has white space around it; fix: remove the spaces around it"


@pytest.mark.parametrize("command", [["run", "--recipe", str(TINY), "--iterations", "1"],
                                     ["stage", "taskgen", "--recipe", str(TINY)]])
def test_an_unknown_setting_is_one_line_and_exit_2(command: list[str], tmp_path: Path) -> None:
    proc = run_posttrain(command, tmp_path, cli_env(tmp_path / "home", POSTTRAIN_GC="of"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["posttrain: error: POSTTRAIN_GC='of': unknown collector policy; fix: set it "
                                                "to 'default' for Python's own collector, or unset it"]
