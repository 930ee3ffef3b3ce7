"""Domains by name: a thin view of ``components.core.plugins.DOMAINS``.

Built-ins are listed in that table; third-party domains plug in through the
``posttrain.domains`` entry-point group (``name = "package.module:DomainClass"``).
A class registered under a name other than its own ``name`` (a plug-in class that leaves
its name to its entry point, or one class under two entry points) is served as a subclass
that sets ``name`` to the entry point's, made once per name: the registered class itself is
never changed, so each name's tasks carry that name (``Domain.eval_set`` and
``train_tasks`` refuse a task whose ``domain`` is not it: a ``make_task`` that hard-codes
a name). An entry that cannot be imported, or is not a concrete ``Domain`` subclass, is a
``UserError`` naming the field (``DOMAINS.load``), never a traceback.
"""

from __future__ import annotations

from components.core.plugins import DOMAINS
from components.domains.base import Domain

_NAMED: dict[tuple[type[Domain], str], type[Domain]] = {}


def names() -> list[str]:
    return DOMAINS.names()


def get(name: str, field: str = "domain") -> Domain:
    """A fresh instance of the domain registered as ``name`` (a UserError naming ``field``,
    listing the names if unknown)."""
    cls = DOMAINS.load(name, field)
    if getattr(cls, "name", None) != name:
        key = (cls, name)
        if key not in _NAMED:
            _NAMED[key] = type(cls.__name__, (cls,), {"name": name, "__module__": cls.__module__,
                                                      "__qualname__": cls.__qualname__})
        cls = _NAMED[key]
    return cls()
