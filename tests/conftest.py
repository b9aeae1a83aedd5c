"""Fixtures shared by several test folders."""

import pytest

from kvxfer.bench.hosts import HostsUnavailableError, two_hosts


@pytest.fixture
def hosts():
    """Two "hosts": network namespaces joined by a veth pair (needs root; skipped, saying why, without)."""
    try:
        with two_hosts() as pair:
            yield pair
    except HostsUnavailableError as exc:
        pytest.skip(str(exc))
