"""The job interpreter: a mistake in ``sandbox.python`` is a UserError naming it, never
the host's isolation (``sandbox.allow_weak_isolation``)."""

from __future__ import annotations

import os

import pytest

from components.core.errors import UserError
from components.sandbox import bwrap, detect
from components.sandbox.detect import DEFAULT_PYTHON, Support
from tests.sandbox.helpers import sandbox_config

FIX = "name a Python 3 interpreter under /usr (e.g. /usr/bin/python3.11), or leave sandbox.python empty to use /usr/bin/python3"


@pytest.mark.parametrize(("python", "problem"), [
    ("/usr/bin/nope", "no such file on this host"),
    ("/usr/bin", "is not a file"),
    ("/usr/bin/true", "is not a Python 3.9 or newer (exit 0: '')"),
    ("/no/such", "is outside /usr, the only host folder the bwrap sandbox shows, so no job could start it"),
])
def test_an_interpreter_that_cannot_run_jobs_is_named(python: str, problem: str) -> None:
    """A typo (/usr/bin/nope) was "this host lacks user/pid/net/mount namespaces ...; fix:
    ... set sandbox.allow_weak_isolation: true", after bootstrap had run."""
    if not os.path.exists("/usr/bin/true"):
        pytest.skip("no /usr/bin/true")
    with pytest.raises(UserError) as err:
        bwrap.host_support(sandbox_config(python=python))
    assert (err.value.field, err.value.value, err.value.problem, err.value.fix) == ("sandbox.python", python, problem, FIX)


def test_the_default_interpreter_passes() -> None:
    if not os.path.exists(DEFAULT_PYTHON):
        pytest.skip("no /usr/bin/python3 here")
    assert detect.python_problem(DEFAULT_PYTHON) is None
    assert detect.resolve_python(sandbox_config()) == DEFAULT_PYTHON


def _support(python: str, works: bool) -> Support:
    return Support(bwrap="/usr/bin/bwrap", bwrap_version="bubblewrap 0.8.0", setpriv="/usr/bin/setpriv", python=python,
                   seccomp=True, cgroup_v1=(), cgroup_v2=False, cgroup_v2_controllers=(), landlock_abi=0,
                   drops_uid=False, namespaces_ok=works,
                   problems=() if works else ("probe sandbox failed (exit 127): error while loading shared libraries",))


@pytest.mark.parametrize("allow_weak", [False, True])
def test_an_interpreter_that_fails_only_inside_the_sandbox_is_named(allow_weak: bool, monkeypatch) -> None:
    """The host's sandbox works with /usr/bin/python3: the probe's failure is the
    interpreter's. Allowed weak isolation, the jobs had run unsandboxed for its sake."""
    other = os.path.realpath(DEFAULT_PYTHON)
    if other == DEFAULT_PYTHON or not os.path.exists(other):
        pytest.skip("no second interpreter path under /usr")
    monkeypatch.setattr(bwrap, "probe", lambda python=DEFAULT_PYTHON: _support(python, python == DEFAULT_PYTHON))
    with pytest.raises(UserError) as err:
        bwrap.host_support(sandbox_config(python=other, allow_weak_isolation=allow_weak))
    assert (err.value.field, err.value.value, err.value.fix) == ("sandbox.python", other, FIX)
    assert err.value.problem == (f"runs on the host but not inside the bwrap sandbox, where {DEFAULT_PYTHON} does "
                                 "(probe sandbox failed (exit 127): error while loading shared libraries)")


def test_a_host_without_namespaces_still_names_weak_isolation(monkeypatch) -> None:
    monkeypatch.setattr(bwrap, "probe", lambda python=DEFAULT_PYTHON: _support(python, False))
    with pytest.raises(UserError) as err:
        bwrap.host_support(sandbox_config())
    assert err.value.field == "sandbox.allow_weak_isolation"
