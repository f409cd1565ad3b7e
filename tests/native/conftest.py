"""Fixtures shared by the tests of engine._native: a device and a two-worker engine over it."""

from __future__ import annotations

import pytest

from engine import _native


@pytest.fixture
def device():
    return _native.Device(0)


@pytest.fixture
def eng(device):
    e = _native.Engine(device, 2)
    yield e
    e.close(True)
