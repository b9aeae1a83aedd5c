"""Bounded side-channel resources (issue 13, Found 2-4) against a real producer process.

On the old code: a flood of valid keyless Hellos pushed a real consumer's session out of the
server's table (its next abort was lost); each Hello could park ~4 MiB of ``backend_metadata``
for good (100 of them: +411 MiB RSS); every hostile frame wrote ~4 KB of warning.
"""

import threading

import numpy as np
import zmq

from kvxfer import AbortOutcome
from kvxfer.protocol import Codec, compat_hash

from sidechannel_peers import (
    COMMON, HOLD_BLOCKS, KVSpec, Peer, assert_read, consumer, free_port_block, hello_frame, poll, send_hellos,
)

import pytest


@pytest.fixture
def peers():
    started = []
    yield started
    for p in started:
        p.stop()


def test_ten_thousand_keyless_hellos_never_push_out_a_reading_consumer(peers):
    """10,000 valid Hellos from fresh identities (300 kept open at a time, all from the consumer's
    own address) while the consumer reads: every read is byte-exact, its abort is honoured, and the
    producer keeps a bounded number of sessions."""
    holds = {f"r{i}": HOLD_BLOCKS for i in range(12)} | {"victim": HOLD_BLOCKS}
    prod = Peer(1, free_port_block(1), holds)
    peers.append(prod)
    cons, cache = consumer(handshake_timeout=5.0)
    flood = [hello_frame(f"flood-{i}") for i in range(10_000)]
    sent: list[int] = []
    flooder = threading.Thread(target=lambda: sent.append(send_hellos(prod.address, flood)), daemon=True)
    with cons:
        cons.connect(*prod.address)
        flooder.start()
        for i in range(12):
            dst = [(4 * i + k) % 48 for k in range(4)]
            cons.read(prod.address, dst, HOLD_BLOCKS, f"r{i}").wait(60)
            assert_read(cache, dst, 1, HOLD_BLOCKS)
        flooder.join(300)
        assert not flooder.is_alive() and sent == [10_000]
        assert cons.abort("victim", remote=prod.address) is AbortOutcome.RELEASED
        assert "victim" not in prod.ask("holding")
        counters = prod.ask("counters")
        print(f"after the flood: {counters}")
        assert counters["sessions"] <= 256 + 4 and counters["evicted"] > 0


def test_hundred_hellos_of_four_mib_leave_the_producers_memory_flat(peers):
    """Hello fields are bounded (``backend_metadata`` <= 512 KiB), so a 4 MiB Hello is refused
    before anything is kept: 100 of them grow the producer's RSS by less than 50 MiB."""
    prod = Peer(1, free_port_block(1), {})
    peers.append(prod)
    big = hello_frame("big", metadata=b"\x07" * ((4 << 20) - 4096))
    assert len(big) <= 4 << 20
    before = prod.ask("rss")
    assert send_hellos(prod.address, [big] * 100, window=100) == 100
    grown = prod.ask("rss") - before
    print(f"producer RSS growth after 100 Hellos of 4 MiB: {grown / 2**20:.1f} MiB")
    assert grown < 50 << 20, f"producer RSS grew by {grown / 2**20:.1f} MiB"
    assert prod.ask("counters")["rejected"].get("malformed", 0) == 100


def test_four_hundred_closed_sessions_of_half_a_mib_leave_the_producers_memory_flat(peers):
    """Valid Hellos carry up to 512 KiB of ``backend_metadata``, kept while the session lives. A
    closed session's memory is returned at once, without the cyclic collector (the producer never
    calls ``gc.collect``), so 400 sessions of 500 KiB, at most 40 open at a time (20 MiB), grow the
    producer's RSS by less than 50 MiB. (Kept until a collection, through a cycle from the session
    to its request callback: +173 MiB.) With all 400 open at once, glibc may keep a freed 64 MiB
    arena heap of the server thread mapped, so the window keeps the measure about kvxfer's memory."""
    prod = Peer(1, free_port_block(1), {})
    peers.append(prod)
    hellos = (hello_frame(f"big-{i}", metadata=bytes([i % 256]) * (500 << 10)) for i in range(400))
    before = prod.ask("rss")
    assert send_hellos(prod.address, hellos, window=40) == 400
    assert poll(lambda: prod.ask("counters")["sessions"], 0) == 0
    counters = prod.ask("counters")
    grown = prod.ask("rss") - before
    print(f"producer RSS growth after 400 closed sessions of 500 KiB: {grown / 2**20:.1f} MiB; {counters}")
    assert counters["disconnected"] == 400 and not counters["rejected"] and not counters["evicted"]
    assert grown < 50 << 20, f"producer RSS grew by {grown / 2**20:.1f} MiB"


def _hostile_frames(n: int) -> list[list[bytes]]:
    """``n`` hostile messages of many kinds (as multipart lists for a DEALER)."""
    spec = KVSpec(**COMMON)
    codec = Codec(compat_hash(spec))
    good = hello_frame("h")
    other_model = hello_frame("h", spec=KVSpec(**{**COMMON, "model": "other"}))
    keyed = Codec(compat_hash(spec), key=b"k" * 32).encode(codec.decode(good))
    kinds = [
        [b"garbage" * 10],
        [b"XXXX" + good[4:]],                                   # bad magic
        [good[:4] + b"\x00\x63" + good[6:]],                    # another version
        [good[:6] + b"\x00\x80" + good[8:]],                    # unknown flags
        [other_model],                                          # another model
        [good[:-20] + b"\x00" * 20],                            # malformed body
        [keyed],                                                # a key this producer lacks
        [b"a", b"b", b"c"],                                     # wrong shape
        [codec.encode(codec.decode(good).__class__(codec.decode(good).info))[:50]],  # truncated
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


def test_two_thousand_hostile_frames_write_under_100_kb_of_log(peers, tmp_path):
    err = tmp_path / "producer.stderr"
    prod = Peer(1, free_port_block(1), {}, stderr_path=str(err))
    peers.append(prod)
    base = prod.ask("stderr")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{prod.address[0]}:{prod.address[1]}")
    replies = 0
    try:
        for parts in _hostile_frames(2000):
            sock.send_multipart(parts)
            if len(parts) == 1 and sock.poll(10_000):
                sock.recv()
                replies += 1
    finally:
        sock.close(0)
    written = prod.ask("stderr") - base
    print(f"stderr: {written} bytes for 2,000 hostile frames")
    assert written < 100_000, f"{written} bytes of stderr for 2,000 hostile frames"
    counters = prod.ask("counters")
    assert sum(counters["rejected"].values()) >= 2000 - 2000 // 9
    assert counters["sessions"] == 0
