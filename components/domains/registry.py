"""Domains by name. Built-ins register on import; third-party domains plug in through the
``posttrain.domains`` entry-point group (``name = "package.module:DomainClass"``)."""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import entry_points

from components.domains.base import Domain

_REGISTRY: dict[str, type[Domain]] = {}
_BUILTINS = (
    "components.domains.arithmetic",
    "components.domains.code",
    "components.domains.math",
    "components.domains.terminal",
    "components.domains.extraction",
    "components.domains.structured",
)
_loaded = False


def register(name: str):
    def wrap(cls: type[Domain]) -> type[Domain]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTINS:
        import_module(module)
    for ep in entry_points(group="posttrain.domains"):
        if ep.name not in _REGISTRY:
            _REGISTRY[ep.name] = ep.load()
            _REGISTRY[ep.name].name = ep.name


def names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def get(name: str) -> Domain:
    from components.core.errors import UserError

    _load()
    if name not in _REGISTRY:
        raise UserError("domain", name, "unknown domain", f"use one of {names()}")
    return _REGISTRY[name]()
