"""The registries: every name a recipe can pick, and where its code lives.

Built-ins are listed here as lazy ``"module:Attribute"`` references (nothing is imported
until used); plug-ins add entries through the entry-point group named beside each
registry. A recipe's names are checked against these tables when it is loaded, so a
misspelt engine fails at once, not half-way through an iteration; a plug-in's entry is
loaded then too, so one whose package is missing or broken (or a domain that is not a
concrete ``Domain`` subclass) fails as early, as one line naming the recipe field.

To add a built-in domain: write ``components/domains/<name>.py`` with a ``Domain``
subclass whose ``name`` is the same string, and add one line to ``DOMAINS`` below.
"""

from __future__ import annotations

from components.core.registry import Registry

DOMAINS = Registry("domain", "domains", {
    "arithmetic": "components.domains.arithmetic:Arithmetic",
    "code": "components.domains.code:Code",
    "math": "components.domains.math:Math",
    "terminal": "components.domains.terminal:Terminal",
    "terminal-interactive": "components.domains.terminal:TerminalInteractive",
    "extraction": "components.domains.extraction:Extraction",
    "structured": "components.domains.structured:Structured",
}, group="posttrain.domains", base="components.domains.base:Domain")
"""Task domains (``Domain`` subclasses)."""

ENGINES = Registry("rollout engine", "rollout.engine", {
    "hf": "components.rollout.hf_engine:HFEngine",
    "openai": "components.rollout.openai_engine:OpenAIEngine",
    "vllm": "components.rollout.vllm_engine:VLLMEngine",
}, group="posttrain.engines")
"""Generation engines (``Engine`` subclasses, built with no arguments)."""

BACKENDS = Registry("sandbox backend", "sandbox.backend", {
    "bwrap": "components.sandbox.bwrap:BwrapExecutor",
    "subprocess": "components.sandbox.subprocess_backend:SubprocessExecutor",
}, group="posttrain.sandbox_backends")
"""Sandbox executors (called with the recipe's ``SandboxConfig``)."""
