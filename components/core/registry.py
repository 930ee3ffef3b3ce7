"""One registry idiom for everything picked by name: domains, rollout engines, sandbox backends.

A ``Registry`` maps names to lazy ``"package.module:Attribute"`` references: nothing is
imported until a name is looked up, so listing or validating names (a recipe check,
``--help``) costs no heavy import. Third-party packages add entries through an entry
point group (``[project.entry-points."posttrain.domains"] mine = "pkg.mod:MyDomain"``).
A name given twice (a plug-in that shadows a built-in, or two plug-ins) is refused
with an error naming both sources, never silently resolved by load order. An unknown
name is a ``UserError`` that lists what is registered.

The registries themselves are declared in :mod:`components.core.plugins`. Not covered:
unregistering, or versioned entries.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

from components.core.errors import UserError


class Registry:
    """Names -> lazily imported objects (classes or factories)."""

    def __init__(self, kind: str, field: str, builtins: Mapping[str, str], group: str) -> None:
        self.kind = kind  # e.g. "domain", for messages
        self.field = field  # the recipe field that names an entry, e.g. "rollout.engine"
        self.group = group  # entry-point group for plug-ins
        self._builtins = dict(builtins)
        self._table: dict[str, str] | None = None
        self._loaded: dict[str, Any] = {}

    def _entries(self) -> dict[str, str]:
        if self._table is None:
            table = dict(self._builtins)
            source = {name: "built-in" for name in table}
            for ep in entry_points(group=self.group):
                if ep.name in table:
                    raise UserError(f"entry point {self.group}", ep.name,
                                    f"{self.kind} name already registered by {source[ep.name]} ({table[ep.name]})",
                                    f"rename the entry point {ep.value!r} in its package's metadata")
                table[ep.name] = ep.value
                source[ep.name] = f"the package providing {ep.value!r}"
            self._table = table
        return self._table

    def names(self) -> list[str]:
        return sorted(self._entries())

    def check(self, name: str, field: str | None = None) -> None:
        """A UserError unless ``name`` is registered (imports nothing)."""
        if name not in self._entries():
            raise UserError(field or self.field, name, f"unknown {self.kind}", f"use one of {self.names()}")

    def load(self, name: str, field: str | None = None) -> Any:
        """The object registered as ``name``, imported on first use."""
        self.check(name, field)
        if name not in self._loaded:
            module, _, attr = self._entries()[name].partition(":")
            self._loaded[name] = getattr(import_module(module), attr)
        return self._loaded[name]
