"""Domains by name: a thin view of ``components.core.plugins.DOMAINS``.

Built-ins are listed in that table; third-party domains plug in through the
``posttrain.domains`` entry-point group (``name = "package.module:DomainClass"``).
"""

from __future__ import annotations

from components.core.plugins import DOMAINS
from components.domains.base import Domain


def names() -> list[str]:
    return DOMAINS.names()


def get(name: str) -> Domain:
    """A fresh instance of the domain registered as ``name`` (UserError listing the names if unknown)."""
    cls = DOMAINS.load(name, "domain")
    if getattr(cls, "name", None) != name:  # a plug-in class may leave its name to its entry point
        cls.name = name
    return cls()
