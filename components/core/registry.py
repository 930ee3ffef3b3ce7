"""One registry idiom for everything picked by name: domains, rollout engines, sandbox backends.

A ``Registry`` maps names to lazy ``"package.module:Attribute"`` references: nothing is
imported until a name is looked up, so listing or validating names (a recipe check,
``--help``) costs no heavy import. Third-party packages add entries through an entry
point group (``[project.entry-points."posttrain.domains"] mine = "pkg.mod:MyDomain"``).
A name given twice (a plug-in that shadows a built-in, or two plug-ins) is refused
with an error naming both sources, never silently resolved by load order. An unknown
name is a ``UserError`` that lists what is registered.

An entry is loaded as its entry point would be (``EntryPoint.load``: ``module:attr.attr``,
or a module alone). An entry that cannot be loaded (its package missing or broken, an
attribute it lacks) or is not what the registry holds (``base``: a non-abstract subclass of
that class; else anything callable) is a ``UserError`` naming the field and the name, never
a traceback. ``check`` loads a plug-in's entry too (never a built-in's), so a recipe naming
a broken plug-in is refused when it is loaded, before any stage.

``distribution(name)`` names the distribution (and its version) that provides a plug-in:
the runner puts it in the cache key of the stages that can use it
(``runner.stage_code_version``), so upgrading a plug-in package re-runs them.

The registries themselves are declared in :mod:`components.core.plugins`. Not covered:
unregistering, or versioned entries.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from components.core.errors import UserError, exc_line, value_text


class Registry:
    """Names -> lazily imported objects (classes or factories)."""

    def __init__(self, kind: str, field: str, builtins: Mapping[str, str], group: str, base: str = "") -> None:
        self.kind = kind  # e.g. "domain", for messages
        self.field = field  # the recipe field that names an entry, e.g. "rollout.engine"
        self.group = group  # entry-point group for plug-ins
        self.base = base  # "module:Class" every entry must be a non-abstract subclass of ("": anything callable)
        self._builtins = dict(builtins)
        self._table: dict[str, str] | None = None
        self._dists: dict[str, tuple[str, str]] = {}  # plug-in name -> (name, version) of the distribution declaring it
        self._loaded: dict[str, Any] = {}

    def _entries(self) -> dict[str, str]:
        if self._table is None:
            table = dict(self._builtins)
            source = {name: "built-in" for name in table}
            dists: dict[str, tuple[str, str]] = {}
            for ep in entry_points(group=self.group):
                package = _package(ep)
                if ep.name in table:
                    raise UserError(f"entry point {self.group}", ep.name,
                                    f"{self.kind} name already registered by {source[ep.name]} ({table[ep.name]})",
                                    f"rename the entry point {ep.name!r} ({ep.value}) in the metadata of {package}")
                table[ep.name] = ep.value
                source[ep.name] = package
                if ep.dist is not None:
                    dists[ep.name] = (ep.dist.name, ep.dist.version)
            self._table, self._dists = table, dists
        return self._table

    def names(self) -> list[str]:
        return sorted(self._entries())

    def distribution(self, name: str) -> tuple[str, str] | None:
        """(name, version) of the installed distribution whose entry point registers
        ``name``, as read when the entry points were (the code a load runs); None for a
        built-in (posttrain's own code) or an unknown name."""
        if name in self._builtins or name not in self._entries():
            return None
        return self._dists.get(name)

    def _known(self, name: str, field: str | None) -> None:
        if name not in self._entries():
            raise UserError(field or self.field, name, f"unknown {self.kind}", f"use one of {self.names()}")

    def check(self, name: str, field: str | None = None) -> None:
        """A UserError unless ``name`` is registered and, for a plug-in, loads (a built-in
        is not imported)."""
        self._known(name, field)
        if name not in self._builtins:
            self.load(name, field)

    def load(self, name: str, field: str | None = None) -> Any:
        """The object registered as ``name``, imported on first use; a UserError naming
        ``field`` when a plug-in cannot be loaded or is not a usable entry."""
        self._known(name, field)
        if name not in self._loaded and name in self._builtins:  # our own code: its failure is a bug, a traceback
            self._loaded[name] = EntryPoint(name, self._builtins[name], self.group).load()
        if name not in self._loaded:
            value = self._entries()[name]
            fix = "install or fix the package providing it" + (f" ({self._dists[name][0]!r})" if name in self._dists else "")
            try:
                loaded = EntryPoint(name, value, self.group).load()
            except Exception as exc:  # noqa: BLE001 - whatever a plug-in's import raises is its package's to fix
                problem = f"cannot be loaded: {value_text(exc_line(exc))}"
            else:
                problem = self._unusable(loaded)
            if problem is not None:
                raise UserError(field or self.field, name, f"{self.kind} plug-in {value!r} {problem}", fix) from None
            self._loaded[name] = loaded
        return self._loaded[name]

    def _unusable(self, obj: Any) -> str | None:
        """Why ``obj`` cannot serve as an entry of this registry, or None."""
        if not self.base:
            return None if callable(obj) else f"is {_what(obj)}, not a class or factory"
        base = EntryPoint("base", self.base, self.group).load()
        if not (isinstance(obj, type) and issubclass(obj, base)):
            return f"is {_what(obj)}, not a subclass of {base.__module__}.{base.__qualname__}"
        if inspect.isabstract(obj):
            return f"is an abstract class (it does not implement {', '.join(sorted(obj.__abstractmethods__))})"
        return None


def _what(obj: Any) -> str:
    """``obj`` in a few words: ``a module``, ``the class X``, ``a function``, ``an int``."""
    if inspect.ismodule(obj):
        return "a module"
    if isinstance(obj, type):
        return f"the class {obj.__qualname__}"
    name = type(obj).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def _package(ep: EntryPoint) -> str:
    """The distribution that declares ``ep``, as a message names it."""
    return f"the package {ep.dist.name!r}" if ep.dist is not None else f"the package providing {ep.value!r}"
