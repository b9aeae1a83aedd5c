"""The server's session table and log limiter, pure (no sockets): bounds, eviction order, pinning."""

from __future__ import annotations

import logging

from kvxfer.protocol import ServerSession
from kvxfer.transport.sessions import LogLimiter, SessionTable

from test_transport_zmq import SPEC, peer_info
from kvxfer.protocol import Codec, compat_hash


def session(engine_id: str = "c") -> ServerSession:
    s = ServerSession(Codec(compat_hash(SPEC)), peer_info("prod"), on_request=lambda m: None)
    s.peer = peer_info(engine_id)
    return s


def test_per_address_bound_evicts_hello_only_sessions_before_active_ones():
    table = SessionTable(max_sessions=100, per_address=3)
    table.add(b"active", "10.0.0.1", session("active"))
    table.touch(b"active", request=True)
    table.add(b"h1", "10.0.0.1", session())
    table.add(b"h2", "10.0.0.1", session())
    assert table.add(b"h3", "10.0.0.1", session())          # evicts h1, not the older active one
    assert table.get(b"active") is not None and table.get(b"h1") is None
    assert table.add(b"other", "10.0.0.2", session())       # another address has its own bound
    assert len(table) == 4 and table.evicted == 1


def test_pinned_sessions_are_never_evicted_and_a_full_table_refuses():
    pinned = {"busy"}
    table = SessionTable(max_sessions=2, per_address=10, pinned=lambda s: s.peer.engine_id in pinned)
    table.add(b"a", "x", session("busy"))
    table.add(b"b", "y", session("busy"))
    assert not table.add(b"c", "z", session())
    assert table.refused == 1 and table.get(b"c") is None and len(table) == 2
    pinned.clear()
    assert table.add(b"c", "z", session())
    assert table.get(b"a") is None  # the least recently active unpinned one went


def test_a_closed_connection_forgets_its_sessions():
    table = SessionTable()
    table.add(b"a", "x", session(), fd=7)
    table.add(b"b", "x", session(), fd=8)
    assert table.disconnect(7) == 1
    assert table.get(b"a") is None and table.get(b"b") is not None and table.disconnected == 1
    assert table.disconnect(7) == 0


def test_log_limiter_writes_one_line_per_reason_per_interval_with_a_count(caplog):
    now = [0.0]
    limiter = LogLimiter(logging.getLogger("kvxfer.test.limiter"), interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvxfer.test.limiter"):
        for _ in range(500):
            limiter.event("malformed", "x" * 5000)
        limiter.event("auth", "bad tag")
        now[0] = 11.0
        limiter.event("malformed", "again")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert all(len(line) < 300 for line in lines)
    assert "499 more" in lines[2]
    assert limiter.counts == {"malformed": 501, "auth": 1}
