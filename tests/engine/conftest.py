"""Fixtures for engine and agent tests."""

import pytest

from agent_helpers import Harness


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()
