"""The Agent with a producer of the previous release (no GPU-path fields, no ``Done``), over FakeBackend.

An older kvxfer producer speaks the same protocol version but announces a ``PeerInfo`` without
the appended ``host_id``/``ipc``/``staging`` fields and does not know the ``Done``,
``PackRequest`` and ``PackReady`` messages (its decoder's ``Message`` union lacks them, so such
a frame is answered with ``Reject('malformed')``). ``make_old`` turns a current producer agent
into that model before any consumer connects; the codec-level model is checked in
tests/protocol/test_protocol_old_peer.py.
"""

import types
from typing import Union, get_args

import msgspec
import numpy as np
import pytest

from kvxfer.engine.paths.kit import PathKit
from kvxfer.errors import ConfigError
from kvxfer.protocol import Done, Message, PackReady, PackRequest
from kvxfer.protocol.messages import IpcWire

from agent_helpers import free_port, spec, wait_for

#: The messages the previous release did not have.
NEWER = (Done, PackRequest, PackReady)
OLD_MESSAGE = Union[tuple(t for t in get_args(Message) if t not in NEWER)]  # noqa: UP007
GPU_DEFAULTS = dict(host_id="", ipc=None, staging=None)


def make_old(agent) -> None:
    """Make a listening producer agent announce no GPU-path fields and refuse the newer messages."""
    current = agent._peer_info
    agent._peer_info = lambda: msgspec.structs.replace(current(), **GPU_DEFAULTS)
    agent._codec._decoder = msgspec.msgpack.Decoder(OLD_MESSAGE)


def snapshot(cache):
    return [c.copy() for c in cache]


def assert_same(cache, before):
    for got, want in zip(cache, before):
        np.testing.assert_array_equal(got, want)


STAGED = dict(transfer_path="staged", pipeline_slot_bytes=16 << 10, pipeline_slots=4)


def test_old_producer_announces_defaults_and_auto_read_is_direct_and_exact(harness):
    """auto reads from a producer without the GPU-path fields: direct, byte-exact, hold released."""
    s = spec()
    prod, pcache = harness.agent(s, seed=1, **STAGED)  # would announce a staging area if it could
    make_old(prod)
    cons, ccache = harness.agent(s, seed=2, listen=False)
    link = cons.connect(*prod.address)
    assert (link.info.host_id, link.info.ipc, link.info.staging) == ("", None, None)
    prod.hold("r", [5, 1, 7])
    stats = cons.read(prod.address, [0, 3, 9], [5, 1, 7], "r").wait(5)
    assert stats.mode == "direct"
    for layer in range(s.num_layers):
        for kv in range(2):
            np.testing.assert_array_equal(ccache[layer][kv][[0, 3, 9]], pcache[layer][kv][[5, 1, 7]])
    assert wait_for(lambda: not prod.holding("r"))
    assert "r" in prod.finished().sent


def test_forced_staged_from_old_producer_is_a_config_error_and_changes_nothing(harness):
    """transfer_path='staged' against a producer that announced no staging area: ConfigError naming
    why, raised before the claim (the producer still holds, the consumer's cache is untouched);
    the same producer with its fields intact serves the staged read."""
    s = spec()
    new, _ = harness.agent(s, seed=1, **STAGED)
    old, _ = harness.agent(s, seed=1, **STAGED)
    make_old(old)
    cons, ccache = harness.agent(s, seed=2, listen=False, **STAGED)
    for prod in (new, old):
        prod.hold("r", [5, 1, 7])
    before = snapshot(ccache)
    with pytest.raises(ConfigError, match=r"transfer_path='staged' cannot move this request: peer "
                                          r".* serves no staged reads \(no staging area announced\)"):
        cons.read(old.address, [0, 3, 9], [5, 1, 7], "r").wait()
    assert old.holding("r")
    assert_same(ccache, before)
    assert cons.read(new.address, [0, 3, 9], [5, 1, 7], "r").wait(5).mode == "staged"


def test_forced_ipc_from_old_producer_is_a_config_error_and_changes_nothing(harness):
    """transfer_path='ipc' against an old producer: ConfigError naming why, before the claim."""
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    make_old(prod)
    cons, ccache = harness.agent(s, seed=2, listen=False, transfer_path="ipc")
    prod.hold("r", [4])
    before = snapshot(ccache)
    with pytest.raises(ConfigError, match="transfer_path='ipc' cannot move this request: "):
        cons.read(prod.address, [0], [4], "r").wait()
    assert prod.holding("r")
    assert_same(ccache, before)


def _vram_kit(harness):
    """A PathKit that believes its cache is VRAM with a working kernel (so only the peer decides)."""
    agent, _ = harness.agent(spec(), seed=3, listen=False)
    kit = PathKit(agent._backend, agent.config, agent.cache)
    kit.vram, kit.no_kernel = True, ""
    return kit


def _link(info, s):
    return types.SimpleNamespace(info=info, paths={}, spec=s, engine_id=info.engine_id)


def test_ipc_why_names_the_missing_fields_of_an_old_peer(harness):
    """For a same-host VRAM peer, CUDA IPC is refused because of exactly the fields an old peer
    leaves out: no host_id reads as 'another host'; a host_id without an export as 'no handles'."""
    s = spec()
    prod, _ = harness.agent(s, seed=1)
    kit = _vram_kit(harness)
    vram = msgspec.structs.replace(prod._peer_info(), mem_kind="VRAM")
    old = msgspec.structs.replace(vram, **GPU_DEFAULTS)
    assert kit.ipc_why(_link(old, s)) == f"peer {old.engine_id} is on another host"
    same_host = msgspec.structs.replace(old, host_id=kit.host_id)
    assert kit.ipc_why(_link(same_host, s)) == f"peer {old.engine_id} exported no CUDA IPC handles"
    # control: with an export the checks go past both fields (to the table shape, before any CUDA call)
    export = IpcWire(0, [bytes(64)], [[0, 0]], [[0, 0]])
    why = kit.ipc_why(_link(msgspec.structs.replace(same_host, ipc=export), s))
    assert why == f"peer {old.engine_id}'s IPC export does not cover its {(s.num_layers, 2)} regions"


def test_notify_only_replica_of_an_old_producer_is_released_after_a_direct_read(harness):
    """Producer TP 2 with one replicated KV head, consumer TP 1: rank 0 is read, rank 1 only
    notified. An old rank 1 does not know ``Done``; it must still learn the consumer is done
    (through the NIXL notification the previous release used), not hold until its lease expires."""
    base = dict(num_kv_heads=1)
    port = free_port()
    p0, _ = harness.agent(spec(tp_size=2, tp_rank=0, **base), seed=10, port=port)
    p1, _ = harness.agent(spec(tp_size=2, tp_rank=1, **base), seed=11, port=port)
    make_old(p0)
    make_old(p1)
    cons, _ = harness.agent(spec(**base), seed=12, listen=False)
    for p in (p0, p1):
        p.hold("r", [2, 3])
    assert cons.read(p0.address, [7, 8], [2, 3], "r").wait(5).mode == "direct"
    assert wait_for(lambda: not p0.holding("r"))
    assert wait_for(lambda: not p1.holding("r")), "the old notify-only replica still holds the request"
    assert "r" in p1.finished().sent


def test_notify_only_replica_of_a_current_producer_still_gets_done(harness):
    """Control: a current notify-only replica is still told by a ``Done`` message, not by the
    older peers' NIXL notification (both would release it: the check is which one arrived)."""
    base = dict(num_kv_heads=1)
    port = free_port()
    p0, _ = harness.agent(spec(tp_size=2, tp_rank=0, **base), seed=10, port=port)
    p1, _ = harness.agent(spec(tp_size=2, tp_rank=1, **base), seed=11, port=port)
    cons, _ = harness.agent(spec(**base), seed=12, listen=False)
    for p in (p0, p1):
        p.hold("r", [2, 3])
    seen = []
    handle = p1._service.handle
    p1._service.handle = lambda message, peer: (seen.append(type(message).__name__), handle(message, peer))[1]
    cons.read(p0.address, [7, 8], [2, 3], "r").wait(5)
    assert wait_for(lambda: not p1.holding("r"))
    assert "Done" in seen
