"""Fixtures for sandbox tests: an executor per mode, skipped only when bwrap cannot run here."""

from __future__ import annotations

import pytest

from tests.sandbox.helpers import bwrap_unavailable, sandbox_config


@pytest.fixture(scope="module", params=["strict", "warm"])
def executor(request):
    if bwrap_unavailable():
        pytest.skip(f"bwrap sandbox unavailable: {bwrap_unavailable()}")
    from components.sandbox.executor import get_executor

    ex = get_executor(sandbox_config(mode=request.param))
    yield ex
    ex.close()
