"""Sandbox sessions by backend name: how a stage outside the sandbox package opens one.

``SESSIONS.load(sandbox.backend)(config, size)`` is that backend's session pool: a
context manager whose ``open()`` returns a session (``exec(cmd, timeout_s, files)``,
``close()``). Only ``bwrap`` has sessions (``components.sandbox.session.SessionPool``);
a backend without them is a ``UserError`` listing the ones that have. Plug-ins add theirs
through the ``posttrain.sandbox_sessions`` entry points.

Not covered: running jobs (``components.core.plugins.BACKENDS``).
"""

from __future__ import annotations

from components.core.registry import Registry

SESSIONS = Registry("sandbox session backend", "sandbox.backend", {
    "bwrap": "components.sandbox.session:SessionPool",
}, group="posttrain.sandbox_sessions")
"""Session pools (called with the recipe's ``SandboxConfig`` and how many idle sessions to keep)."""
