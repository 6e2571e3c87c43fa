"""Fixtures of the multi-process tests."""
from __future__ import annotations

import pytest

import netns


@pytest.fixture
def hosts():
    """Hosts of the test's own (a network namespace each, on one bridge), removed after it; skipped where
    namespaces cannot be made (not root, no iproute2)."""
    why = netns.unavailable()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    h = netns.Hosts()
    try:
        yield h
    finally:
        h.remove()
