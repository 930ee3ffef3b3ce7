"""The bwrap backend refuses weak isolation unless the recipe allows it, and says what it gave."""

from __future__ import annotations

import dataclasses

import pytest

from components.core.errors import UserError
from components.sandbox import bwrap
from components.sandbox.detect import probe
from components.sandbox.job import Job
from tests.sandbox.helpers import sandbox_config


def weakened(**changes):
    return dataclasses.replace(probe(), **changes)


def test_missing_bwrap_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.setattr(bwrap, "probe", lambda python: weakened(bwrap=None, namespaces_ok=False))
    with pytest.raises(UserError) as err:
        bwrap.BwrapExecutor(sandbox_config())
    assert err.value.field == "sandbox.allow_weak_isolation"
    assert "bubblewrap" in err.value.problem and "allow_weak_isolation: true" in err.value.fix


def test_missing_seccomp_is_refused(monkeypatch):
    monkeypatch.setattr(bwrap, "probe", lambda python: weakened(seccomp=False))
    with pytest.raises(UserError, match="seccomp"):
        bwrap.BwrapExecutor(sandbox_config())


def test_allowed_weak_isolation_runs_and_says_weak(monkeypatch):
    monkeypatch.setattr(bwrap, "probe", lambda python: weakened(bwrap=None, namespaces_ok=False))
    executor = bwrap.BwrapExecutor(sandbox_config(allow_weak_isolation=True))
    result = executor.run(Job("w", {"main.py": "print(2)"}, ["{python}", "-I", "-S", "main.py"]))
    assert result.status == "ok" and "WEAK" in result.isolation and "WEAK" in executor.isolation


def test_interpreter_outside_usr_is_refused():
    with pytest.raises(UserError) as err:
        bwrap.BwrapExecutor(sandbox_config(python="/root/.pyenv/versions/3.11.7/bin/python"))
    assert err.value.field == "sandbox.python"


def test_paths_escaping_the_work_folder_are_rejected():
    with pytest.raises(ValueError, match="inside the work folder"):
        bwrap.check_paths(Job("p", {"../evil.py": ""}, ["true"]))
