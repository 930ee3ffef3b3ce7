"""The one registry idiom: lazy entries, plug-ins through entry points, duplicates refused.

Plug-ins are real entry points: each test writes a ``.dist-info`` folder with an
``entry_points.txt`` onto ``sys.path``, which is how an installed package declares them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from components.core.errors import UserError
from components.core.plugins import BACKENDS, DOMAINS, ENGINES
from components.core.registry import Registry
from components.domains import registry


def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: str, entries: dict[str, str], module: str = "") -> None:
    """An installed distribution 'posttrain-plugin' declaring ``entries`` in ``group``."""
    info = tmp_path / "posttrain_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: posttrain-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
    if module:
        (tmp_path / "posttrain_plugin.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "posttrain_plugin", raising=False)


def test_builtins_are_listed_without_importing_them() -> None:
    fresh = Registry("engine", "rollout.engine", {"hf": "components.rollout.hf_engine:HFEngine"}, group="posttrain.none")
    sys.modules.pop("components.rollout.hf_engine", None)
    assert fresh.names() == ["hf"]
    assert "components.rollout.hf_engine" not in sys.modules
    assert fresh.load("hf").__name__ == "HFEngine"
    assert "components.rollout.hf_engine" in sys.modules
    assert DOMAINS.names() == ["arithmetic", "code", "extraction", "math", "structured", "terminal", "terminal-interactive"]
    assert ENGINES.names() == ["hf", "openai", "vllm"] and BACKENDS.names() == ["bwrap", "subprocess"]


def test_unknown_name_lists_the_registered_ones() -> None:
    with pytest.raises(UserError) as info:
        ENGINES.load("vlm")
    assert info.value.line() == "rollout.engine='vlm': unknown rollout engine; fix: use one of ['hf', 'openai', 'vllm']"


def test_a_plugin_domain_registers_through_its_entry_point(tmp_path, monkeypatch) -> None:
    plugin(tmp_path, monkeypatch, "posttrain.domains", {"echo": "posttrain_plugin:Echo"}, module=(
        "from components.domains.arithmetic import Arithmetic\n"
        "class Echo(Arithmetic):\n    pass\n"))
    reg = Registry("domain", "domains", {"arithmetic": "components.domains.arithmetic:Arithmetic"}, "posttrain.domains")
    assert reg.names() == ["arithmetic", "echo"]
    assert reg.load("echo").__module__ == "posttrain_plugin"
    monkeypatch.setattr(DOMAINS, "_table", None)  # the project's registry re-reads the entry points
    assert registry.get("echo").name == "echo"  # the class's name comes from its entry point


def test_a_plugin_may_not_shadow_a_builtin(tmp_path, monkeypatch) -> None:
    plugin(tmp_path, monkeypatch, "posttrain.engines", {"hf": "posttrain_plugin:FasterHF"})
    reg = Registry("rollout engine", "rollout.engine", {"hf": "components.rollout.hf_engine:HFEngine"}, "posttrain.engines")
    with pytest.raises(UserError) as info:
        reg.names()
    assert info.value.line() == (
        "entry point posttrain.engines='hf': rollout engine name already registered by built-in "
        "(components.rollout.hf_engine:HFEngine); fix: rename the entry point 'posttrain_plugin:FasterHF' in its "
        "package's metadata")
