"""Fixtures for rollout tests: a tiny random policy shared per module."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import tiny_policy


@pytest.fixture(scope="module")
def policy():
    return tiny_policy()
