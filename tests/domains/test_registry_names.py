"""registry.get: a domain class registered under a name other than its own."""

from __future__ import annotations

import random

import pytest

from components.core.plugins import DOMAINS
from components.domains import registry
from components.domains.arithmetic import Arithmetic


@pytest.fixture
def second_name(monkeypatch):
    """``arith2`` registered as ``Arithmetic``, as a second entry point naming the same class would."""
    table = dict(DOMAINS._entries())
    table["arith2"] = "components.domains.arithmetic:Arithmetic"
    monkeypatch.setattr(DOMAINS, "_table", table)
    monkeypatch.setattr(DOMAINS, "_loaded", dict(DOMAINS._loaded))
    return "arith2"


def test_one_class_under_two_names_keeps_each_name(second_name):
    """Before, get() set ``cls.name`` on the shared class: after get("arith2"), the
    arithmetic domain's tasks were labelled arith2 too."""
    plugged = registry.get(second_name)
    builtin = registry.get("arithmetic")
    assert (plugged.name, builtin.name, Arithmetic.name) == ("arith2", "arithmetic", "arithmetic")
    assert plugged.make_task(random.Random(0), "train").domain == "arith2"
    assert builtin.make_task(random.Random(0), "train").domain == "arithmetic"
    assert isinstance(plugged, Arithmetic)
    assert type(registry.get(second_name)) is type(plugged)  # one subclass per name, made once
    assert type(builtin) is Arithmetic
