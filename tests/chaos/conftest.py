"""The chaos modules' shared setting: UCX over TCP (see test_chaos.py's module doc)."""

import os

import pytest


@pytest.fixture(scope="module", autouse=True)
def ucx_over_tcp():
    """Every agent of this module (spawned producers inherit it) moves bytes over UCX's TCP.

    ``KVXFER_CHAOS_TLS=default`` leaves UCX's own choice (shared memory between two processes of
    one host) for a run of the module with the defaults; the cases that need a transfer caught
    in flight may then find it already over (their "caught in flight" checks say so)."""
    old = os.environ.get("UCX_TLS")
    tls = os.environ.get("KVXFER_CHAOS_TLS", "tcp")
    if tls != "default":
        os.environ["UCX_TLS"] = tls
    yield
    if old is None:
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ["UCX_TLS"] = old
