"""Shared fixtures of the integration tests."""

import pytest


@pytest.fixture
def producers():
    """Producer processes a test starts; every one is stopped afterwards, pass or fail."""
    started = []
    yield started
    for p in started:
        p.stop()
