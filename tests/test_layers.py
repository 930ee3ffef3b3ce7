"""The import rules that keep stages independent, checked on the source (no imports run).

- ``components/core`` imports nothing else of the project (but the root package's
  version and stage ids): it is the contract every other package builds on.
- A stage package (``components/<stage>/``) imports ``core``, the library packages
  (``domains``, ``evalsuite``) and the published library modules of two stage packages
  (the sandbox executors, the rollout engines), never another stage package's stage
  module or internals. When two stages need the same thing it moves into a library.
- Nothing under ``components`` imports ``components.cli`` or the orchestrators
  (``dags``, ``pipelines``), except the CLI, which sits on top.
- The module-level import graph of ``components`` has no cycle.

Each rule is also run on a small broken tree built by the test itself, so the checker
is shown to catch what it claims to.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from components import STAGES

REPO = Path(__file__).resolve().parents[1]
LIBRARIES = ("components.core", "components.domains", "components.evalsuite")
PUBLISHED = ("components.sandbox.executor", "components.rollout.engines")
"""Modules of stage packages that other packages may use as libraries."""
TOP = ("components.cli",)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path) -> dict[str, list[tuple[str, bool]]]:
    """{module: [(imported module, at module level)]} for every .py under root/components."""
    graph: dict[str, list[tuple[str, bool]]] = {}
    paths = sorted((root / "components").rglob("*.py"))
    modules = {_module_name(root, p) for p in paths}
    for path in paths:
        name = _module_name(root, path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        top_level = {id(n) for n in tree.body}
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [(a.name, id(node) in top_level) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                # "from components.x import y" imports the module components.x.y if there is
                # one, else the name y of the module components.x
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    found.append((sub if sub in modules else base, id(node) in top_level))
        graph[name] = found
    return graph


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(root: Path, stages: tuple[str, ...] = STAGES) -> list[str]:
    graph = imports_of(root)
    modules = set(graph)
    out = []
    for mod, imported in graph.items():
        for target, _ in imported:
            if target not in modules and not target.startswith(("dags", "pipelines")):
                continue  # a library, or the name of a class rather than a module
            if _within(mod, "components.core") and not (_within(target, "components.core") or target == "components"):
                out.append(f"{mod} -> {target}: core imports only core")
            if mod not in TOP and (_within(target, "components.cli") or target.startswith(("dags", "pipelines"))):
                out.append(f"{mod} -> {target}: only the CLI imports the CLI or an orchestrator")
            own = next((s for s in stages if _within(mod, f"components.{s}")), None)
            other = next((s for s in stages if _within(target, f"components.{s}")), None)
            if other is None or other == own:
                continue
            if own is not None and not any(_within(target, p) for p in PUBLISHED):
                out.append(f"{mod} -> {target}: stage package {own} imports stage package {other}")
            if target.endswith(".stage"):
                out.append(f"{mod} -> {target}: a stage module is imported only by the runner, by name")
    return sorted(set(out))


def cycles(root: Path) -> list[list[str]]:
    """Cycles in the module-level import graph (lazy imports inside functions excluded)."""
    graph = imports_of(root)
    edges = {m: sorted({t for t, top in ts if top and t in graph and t != m}) for m, ts in graph.items()}
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in edges[node]:
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    # importing a package's own __init__ from its submodule is how Python resolves names, not a cycle
    return [c for c in found if not all(_within(x, c[0]) or _within(c[0], x) for x in c)]


def test_the_project_follows_the_import_rules() -> None:
    assert violations(REPO) == []


def test_no_import_cycles() -> None:
    assert cycles(REPO) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    """A tree that breaks every rule once."""
    return _write(tmp_path, {
        "components/__init__.py": "",
        "components/cli.py": "import dags.local\n",
        "components/core/__init__.py": "",
        "components/core/runner.py": "from components.domains import registry\n",
        "components/domains/__init__.py": "",
        "components/domains/registry.py": "from components.core import runner\n",
        "components/alpha/__init__.py": "",
        "components/alpha/stage.py": "from components.beta.stage import helper\nfrom components.beta import util\n",
        "components/beta/__init__.py": "",
        "components/beta/stage.py": "from components.cli import main\n",
        "components/beta/util.py": "from components.alpha.stage import x\n",
        "components/sandbox/__init__.py": "",
        "components/sandbox/executor.py": "",
    })


def test_the_checker_catches_each_broken_rule(broken: Path) -> None:
    assert violations(broken, ("alpha", "beta", "sandbox")) == [
        "components.alpha.stage -> components.beta.stage: a stage module is imported only by the runner, by name",
        "components.alpha.stage -> components.beta.stage: stage package alpha imports stage package beta",
        "components.alpha.stage -> components.beta.util: stage package alpha imports stage package beta",
        "components.beta.stage -> components.cli: only the CLI imports the CLI or an orchestrator",
        "components.beta.util -> components.alpha.stage: a stage module is imported only by the runner, by name",
        "components.beta.util -> components.alpha.stage: stage package beta imports stage package alpha",
        "components.core.runner -> components.domains.registry: core imports only core",
    ]


def test_the_checker_finds_a_cycle(broken: Path) -> None:
    assert cycles(broken) == [["components.alpha.stage", "components.beta.util", "components.alpha.stage"],
                              ["components.core.runner", "components.domains.registry", "components.core.runner"]]


def test_a_published_library_module_is_allowed(tmp_path: Path) -> None:
    tree = _write(tmp_path, {
        "components/__init__.py": "",
        "components/alpha/__init__.py": "",
        "components/alpha/stage.py": "from components.sandbox.executor import get_executor\n",
        "components/sandbox/__init__.py": "",
        "components/sandbox/executor.py": "",
        "components/sandbox/bwrap.py": "",
        "components/gamma/__init__.py": "",
        "components/gamma/stage.py": "from components.sandbox import bwrap\n",
    })
    assert violations(tree, ("alpha", "gamma", "sandbox")) == [
        "components.gamma.stage -> components.sandbox.bwrap: stage package gamma imports stage package sandbox"]
