"""containers/constraints.txt, the image's lock, agrees with the venv the tests run in.

    pytest tests/containers/test_lock.py

The image installs pyproject.toml's dependencies at the lock's versions; this checks that
every package of that closure (read from this venv's metadata, pyproject's own pins read
from pyproject.toml, so moving a pin there fails here until ``make setup`` and
``containers/lock.sh`` have run) has exactly the lock's version, and that the lock names
nothing the image does not install. Not covered: the CUDA build's extra wheels.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("containers_lock", REPO / "containers" / "lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)


def test_lock_agrees_with_the_tested_venv_for_everything_the_image_installs():
    problems = lock.diff(lock.read(), lock.pins(lock.closure()))
    assert not problems, "containers/constraints.txt is stale (regenerate: containers/lock.sh):\n" + "\n".join(problems)


def test_lock_pins_torch_without_the_local_cpu_label_and_leaves_posttrain_out():
    pinned = lock.read()
    assert pinned["torch"] == "2.13.0"
    assert "posttrain" not in pinned
    assert not [f"{n}=={v}" for n, v in pinned.items() if "+" in v]
    # pyproject's direct dependencies are all in the lock
    assert {lock.canonicalize_name(r.name) for r in lock.top_level()} <= pinned.keys()


def test_lock_file_is_what_lock_py_writes():
    assert (REPO / "containers" / "constraints.txt").read_text() == lock.render(lock.closure())


def test_diff_names_a_moved_pin_a_missing_and_an_extra_package():
    assert lock.diff({"a": "1", "b": "2", "old": "1"}, {"a": "1", "b": "3", "new": "5"}) == [
        "b: lock 2, venv 3", "new: venv 5, not in the lock", "old: lock 1, not installed by the image"]


def test_closure_follows_extras_and_markers_and_refuses_an_unsatisfied_pin():
    found = lock.closure([Requirement("requests>=2"), Requirement("nonexistent-thing; python_version < '3'")])
    assert {"requests", "urllib3", "idna", "certifi", "charset-normalizer"} <= found.keys()
    assert "nonexistent-thing" not in found
    with pytest.raises(LookupError, match="make setup"):
        lock.closure([Requirement("requests<0.1")])
    with pytest.raises(LookupError, match="not installed"):
        lock.closure([Requirement("surely-not-installed-package")])


def test_pins_drop_local_labels():
    assert lock.pins({"torch": "2.13.0+cpu", "posttrain": "0.1.0", "numpy": "2.4.6"}) == {"numpy": "2.4.6", "torch": "2.13.0"}
