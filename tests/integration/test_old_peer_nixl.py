"""A current consumer reading over real NIXL from producer processes of the previous release.

Each producer runs in its own process as a model of the older kvxfer: before the agent starts,
its ``PeerInfo`` loses the appended GPU-path fields (``host_id``, ``ipc``, ``staging``) and its
codec's body decoder loses the messages it did not know (``Done``, ``PackRequest``,
``PackReady``: such a frame gets ``Reject('malformed')``). The codec-level model is in
tests/protocol/test_protocol_old_peer.py, the same over FakeBackend in tests/engine/test_old_peer.py.
"""

import time

import numpy as np

from kvxfer import Agent, AgentConfig, KVSpec
from kvxfer.layout import notify_ranks, peer_ranks
from kvxfer.testing import expected_read, logical_kv

from nixl_peers import Producer, _producer, cache_for, free_port_block

SPEC = dict(num_layers=4, num_kv_heads=1, head_dim=64, block_size=16, num_blocks=48,
            dtype="bfloat16", model="itest-old")


def consumer(spec: KVSpec, seed: int = 99) -> tuple[Agent, list[np.ndarray]]:
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=free_port_block(1))
    agent = Agent("consumer", spec, config)
    cache = cache_for(spec, seed)
    agent.register(cache)
    return agent, cache


def poll(fn, want, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def _old_producer(*args) -> None:
    """``nixl_peers._producer`` in a process patched to behave like the previous release."""
    from typing import Union, get_args

    import msgspec

    from kvxfer.agent.core import Agent
    from kvxfer.protocol import Done, Message, PackReady, PackRequest
    from kvxfer.protocol.codec import Codec

    old_union = Union[tuple(t for t in get_args(Message) if t not in (Done, PackRequest, PackReady))]  # noqa: UP007
    codec_init, peer_info = Codec.__init__, Agent._peer_info

    def old_codec_init(self, *a, **kw):
        codec_init(self, *a, **kw)
        self._decoder = msgspec.msgpack.Decoder(old_union)

    Codec.__init__ = old_codec_init
    Agent._peer_info = lambda self: msgspec.structs.replace(peer_info(self), host_id="", ipc=None, staging=None)
    _producer(*args)


def test_auto_read_from_old_producers_is_direct_exact_and_releases_the_notify_only_replica(producers):
    """Producer TP 2 holding one replicated KV head, consumer TP 1, transfer_path auto: the
    consumer reads rank 0 only (direct, byte-exact per the oracle) and must tell rank 1, which
    does not know ``Done``, that it is done: both old ranks release the request as sent."""
    port = free_port_block(2)
    p_ids, c_ids = [31, 2, 17, 40], [3, 4, 20, 47]
    specs = [KVSpec(**SPEC, tp_size=2, tp_rank=r) for r in range(2)]
    for rank, spec in enumerate(specs):
        producers.append(Producer(spec, seed=30 + rank, port=port, holds={"r": p_ids},
                                  target=_old_producer, wait=False))
    for p in producers:
        p.ready()
    cspec = KVSpec(**SPEC)
    assert (peer_ranks(cspec, 2), notify_ranks(cspec, 2)) == ([0], [0, 1])
    cons, cache = consumer(cspec)
    before = [t.copy() for t in cache]
    with cons:
        link = cons.connect(*producers[0].address)
        assert (link.info.host_id, link.info.ipc, link.info.staging) == ("", None, None)
        stats = cons.read(producers[0].address, c_ids, p_ids, "r").wait(30)
        assert stats.mode == "direct" and stats.peers == 1
        want = expected_read(cspec, before, c_ids, [(specs[0], cache_for(specs[0], 30))], p_ids)
        np.testing.assert_array_equal(logical_kv(cspec, cache, c_ids), want)
        for p in producers:  # rank 1 (notify-only) included: not held until its lease expires
            assert poll(lambda: p.ask("finished"), (["r"], [], []), timeout=15) == (["r"], [], [])
