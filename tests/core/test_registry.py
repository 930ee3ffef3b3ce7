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
        "(components.rollout.hf_engine:HFEngine); fix: rename the entry point 'hf' (posttrain_plugin:FasterHF) in the "
        "metadata of the package 'posttrain-plugin'")


def fresh_domains(monkeypatch: pytest.MonkeyPatch) -> None:
    """The project's domain registry re-reads the entry points, and forgets what it loaded, for one test."""
    monkeypatch.setattr(DOMAINS, "_table", None)
    monkeypatch.setattr(DOMAINS, "_dists", {})
    monkeypatch.setattr(DOMAINS, "_loaded", dict(DOMAINS._loaded))


MODULE = (
    "from components.domains.arithmetic import Arithmetic\n"
    "from components.domains.base import Domain\n"
    "def F():\n    return 1\n"
    "class NotDomain:\n    pass\n"
    "class Abstract(Domain):\n    name = 'abstract'\n"
    "class Outer:\n    class Inner(Arithmetic):\n        pass\n")
BAD_PLUGINS = [  # (entry point value, what its module holds, the problem after "domain plug-in <value> ")
    ("posttrain_nosuch.x:Y", "", "cannot be loaded: ModuleNotFoundError: No module named 'posttrain_nosuch'"),
    ("json:NoSuch", "", "cannot be loaded: AttributeError: module 'json' has no attribute 'NoSuch'"),
    ("posttrain_plugin:X", "raise RuntimeError('boom at import')\n", "cannot be loaded: RuntimeError: boom at import"),
    ("posttrain_plugin:F", MODULE, "is a function, not a subclass of components.domains.base.Domain"),
    ("posttrain_plugin:NotDomain", MODULE, "is the class NotDomain, not a subclass of components.domains.base.Domain"),
    ("posttrain_plugin:Abstract", MODULE,
     "is an abstract class (it does not implement make_task, reference_completion, verify)"),
    ("posttrain_plugin", MODULE, "is a module, not a subclass of components.domains.base.Domain"),
    ("posttrain_plugin:Outer.Inner.name", MODULE, "is a str, not a subclass of components.domains.base.Domain"),
]


@pytest.mark.parametrize(("value", "module", "problem"), BAD_PLUGINS)
def test_a_plugin_domain_that_cannot_serve_is_one_line_naming_the_field(value, module, problem, tmp_path, monkeypatch,
                                                                      capsys) -> None:
    """Each was a traceback (exit 1, retried): mid-stage, or from ``posttrain verify``; the
    recipe check saw only the name, so a recipe naming it ran stages first."""
    from components.cli import main
    from components.core.recipe import parse_recipe

    plugin(tmp_path, monkeypatch, "posttrain.domains", {"broken": value}, module=module)
    fresh_domains(monkeypatch)
    line = (f"broken': domain plug-in {value!r} {problem}; fix: install or fix the package providing it "
            "('posttrain-plugin')")
    (tmp_path / "t.json").write_text('{"prompt": "1+1=", "reference": {"answer": "2"}}')
    (tmp_path / "c.txt").write_text("2")
    code = main(["verify", "--domain", "broken", "--task", str(tmp_path / "t.json"), "--completion", str(tmp_path / "c.txt")])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [f"posttrain: error: --domain='{line}"]
    with pytest.raises(UserError) as info:  # the recipe check loads a plug-in it names (before any stage runs)
        parse_recipe({"pipeline": "t", "domains": ["arithmetic", "broken"]})
    assert info.value.line() == f"<recipe>: domains[1]='{line}"


def test_a_plugin_entry_point_may_name_a_dotted_attribute(tmp_path, monkeypatch) -> None:
    """``module:Outer.Inner`` is entry-point syntax (``EntryPoint.load``): it was looked up
    as one attribute ``'Outer.Inner'``."""
    plugin(tmp_path, monkeypatch, "posttrain.domains", {"inner": "posttrain_plugin:Outer.Inner"}, module=MODULE)
    fresh_domains(monkeypatch)
    domain = registry.get("inner")
    assert domain.name == "inner" and type(domain).__qualname__ == "Outer.Inner"
    assert {t.domain for t in domain.eval_set(2, 0)} == {"inner"}


def test_a_plugin_engine_that_is_a_module_is_refused(tmp_path, monkeypatch) -> None:
    plugin(tmp_path, monkeypatch, "posttrain.engines", {"mine": "posttrain_plugin"}, module="X = 1\n")
    reg = Registry("rollout engine", "rollout.engine", {}, "posttrain.engines")
    with pytest.raises(UserError) as info:
        reg.check("mine")
    assert info.value.line() == ("rollout.engine='mine': rollout engine plug-in 'posttrain_plugin' is a module, not a class "
                                 "or factory; fix: install or fix the package providing it ('posttrain-plugin')")


def test_a_name_two_packages_register_names_both_packages(tmp_path, monkeypatch) -> None:
    for dist, value in (("second-pkg", "second_mod:B"), ("first-pkg", "first_mod:A")):  # prepended: first-pkg first
        info = tmp_path / dist / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[posttrain.domains]\npalindromes = {value}\n")
        monkeypatch.syspath_prepend(str(tmp_path / dist))
    reg = Registry("domain", "domains", {}, "posttrain.domains")
    with pytest.raises(UserError) as info:
        reg.names()
    assert info.value.line() == (
        "entry point posttrain.domains='palindromes': domain name already registered by the package 'first-pkg' "
        "(first_mod:A); fix: rename the entry point 'palindromes' (second_mod:B) in the metadata of the package "
        "'second-pkg'")
