"""Where a handshake waits for the transport: ``Agent.connect`` does, a first read does not.

A read to a new peer handshakes inside the read: the transport is opened (``Backend.connect``)
without a probe, so the read's own operations finish its set-up while the claim travels.
``Agent.connect`` (a peer set up ahead of time) opens it with the probe and waits for it.
Over FakeBackend; the bytes of such first reads across two hosts are checked in
tests/multihost/test_first_contact.py.
"""

import numpy as np

from kvxfer.backend.fake import FakeBackend
from kvxfer.types import Region

from agent_helpers import spec


def _recording(monkeypatch) -> list:
    calls: list = []
    original = FakeBackend.connect

    def connect(self, peer, probe=None, timeout=10.0):
        calls.append(probe)
        return original(self, peer, probe, timeout)

    monkeypatch.setattr(FakeBackend, "connect", connect)
    return calls


def test_first_read_opens_the_transport_without_waiting_for_a_probe(harness, monkeypatch):
    calls = _recording(monkeypatch)
    s = spec()
    prod, pcache = harness.agent(s, seed=1)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    prod.hold("r1", [5, 1])
    cons.read(prod.address, [0, 3], [5, 1], "r1").wait(5)
    assert calls == [None]  # one handshake, no probe
    np.testing.assert_array_equal(ccache[0][0][[0, 3]], pcache[0][0][[5, 1]])


def test_connect_waits_for_the_probe_and_a_read_after_it_handshakes_no_more(harness, monkeypatch):
    calls = _recording(monkeypatch)
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    cons, _ = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    assert len(calls) == 1 and isinstance(calls[0], Region) and calls[0].length > 0
    prod.hold("r1", [5])
    cons.read(prod.address, [0], [5], "r1").wait(5)
    assert len(calls) == 1
