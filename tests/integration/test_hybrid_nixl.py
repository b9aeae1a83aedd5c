"""Hybrid caches (several KV-cache groups: full attention, a sliding window sharing its tensors, Mamba2 state)
read between real processes over real NIXL (UCX): one hold, one claim and one post per producer rank for every
group, only the window's blocks of the sliding group moved, byte-exact against the layout oracle; TP 1 -> 1 and
TP 2 -> 1; mismatched groups fail typed on the handle, naming the group and both values."""

import numpy as np
import pytest

from kvxfer import Agent, AgentConfig, BlockIdError, ConfigError, IncompatiblePeerError, KVSpec, LayoutError, ReadRequest
from kvxfer.layout import build_hybrid_plan, hybrid_peer_ranks
from kvxfer.layout.oracle import Arena, execute_hybrid, place_hybrid
from kvxfer.testing import ProducerProcess, free_port_block

from hybrid_peers import ATTN, hybrid_cache, hybrid_producer, hybrid_spec
from test_agent_nixl import poll

FULL, SWA, SLOTS = [3, 7, 1, 9, 12], [20, 21, 22, 23, 24], [5]   # the producer's ids of request "r"
DST = ([2, 4, 6, 8, 10], [25, 26, 27, 28, 29], [1])              # the consumer's
TOKENS = 19  # 5 blocks of 4; the window of 10 tokens keeps tokens [8, 20): the last 3 blocks


def start(tp_size: int, port: int, window: int = 10, holds=None):
    holds = holds or {"r": [FULL, SWA, SLOTS]}
    procs = [ProducerProcess(hybrid_producer, tp_size, rank, 10 + rank, port, holds, window, wait=False)
             for rank in range(tp_size)]
    return [p.ready() for p in procs]


def expected(cspec, cbuf: np.ndarray, ptp: int) -> np.ndarray:
    """The consumer's buffer after the read, as the layout oracle moves it (every producer rank it reads)."""
    want = Arena.wrap(cbuf.copy())
    lview, _ = place_hybrid(cspec, arena_base=want.base, share=True)
    for rank in hybrid_peer_ranks(cspec, ptp):
        _, parena, pview = hybrid_cache(hybrid_spec(ptp, rank), 10 + rank)
        plan = build_hybrid_plan(lview, pview)
        execute_hybrid(plan, plan.for_request(list(DST), [FULL, SWA, SLOTS], num_tokens=TOKENS), want, parena)
    return want.buf


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        p.stop()


def consumer(spec, seed: int = 99):
    agent = Agent("hconsumer", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=free_port_block(1)))
    tensors, arena, _ = hybrid_cache(spec, seed)
    agent.register(tensors)
    return agent, tensors, arena


@pytest.mark.compat(producer="kvxfer SDK (`Agent`)", consumer="kvxfer SDK (`Agent`)", tp="1 -> 1, 2 -> 1",
                    layout="hybrid: full + sliding window (shared tensors) + Mamba2 state, NHD split, block 4 -> same",
                    path="direct (one post per producer rank, window only)", device="CPU")
@pytest.mark.parametrize("ptp", [1, 2])
def test_hybrid_read_moves_every_group_in_one_claim_byte_exact(procs, ptp):
    procs += start(ptp, free_port_block())
    cspec = hybrid_spec(1, 0)
    cons, tensors, arena = consumer(cspec)
    before = arena.buf.copy()
    with cons:
        stats = cons.read(procs[0].address, list(DST), [FULL, SWA, SLOTS], "r", num_tokens=TOKENS).wait(60)
        assert stats.peers == ptp
        # full group: every block; the sliding group: the window's 3 blocks, not the 2 before it; the state slot
        want = expected(cspec, before, ptp)
        np.testing.assert_array_equal(arena.buf, want)
        assert not np.array_equal(arena.buf, before)
        if ptp == 1:  # independently of the oracle: the same layout at TP 1 moves blocks as they are
            ptensors, _, _ = hybrid_cache(hybrid_spec(1, 0), 10)
            for layer in range(ATTN["num_layers"]):
                np.testing.assert_array_equal(tensors[0][layer][:, DST[0]], ptensors[0][layer][:, FULL])
                np.testing.assert_array_equal(tensors[1][layer][:, DST[1][2:]], ptensors[1][layer][:, SWA[2:]])
                unchanged = hybrid_cache(cspec, 99)[0][1][layer][:, DST[1][:2]]
                np.testing.assert_array_equal(tensors[1][layer][:, DST[1][:2]], unchanged)
            for t in range(2):
                np.testing.assert_array_equal(tensors[2][0][t].reshape(8, -1)[DST[2]],
                                              ptensors[2][0][t].reshape(8, -1)[SLOTS])
    for p in procs:  # one done notice per producer rank ends its one hold
        assert poll(lambda: p.ask("finished")[0], ["r"]) == ["r"]


@pytest.mark.compat(producer="kvxfer SDK (`Agent`)", consumer="kvxfer SDK (`Agent`)", tp="1 -> 2",
                    layout="hybrid: full + sliding window (shared tensors) + Mamba2 state, NHD split, block 4 -> same",
                    path="direct (head and state-unit slices)", device="CPU")
def test_hybrid_read_tp1_producer_to_tp2_consumer_ranks(procs):
    """Each consumer rank reads its half of the heads and of the Mamba2 state units from the one producer
    rank; the producer frees the request after both ranks' done notices (one each, for all groups)."""
    procs += start(1, free_port_block())
    ranks = [consumer(hybrid_spec(2, r)) for r in range(2)]
    try:
        befores = [arena.buf.copy() for _, _, arena in ranks]
        for i, (agent, _, _) in enumerate(ranks):
            agent.read(procs[0].address, list(DST), [FULL, SWA, SLOTS], "r", num_tokens=TOKENS).wait(60)
            if i == 0:  # one rank's done notice does not end a hold two consumer ranks depend on
                assert procs[0].ask("finished") == ([], [], []) and procs[0].ask("holding") == ["r"]
        for r, ((_, _, arena), before) in enumerate(zip(ranks, befores)):
            np.testing.assert_array_equal(arena.buf, expected(hybrid_spec(2, r), before, 1))
            assert not np.array_equal(arena.buf, before)
    finally:
        for agent, _, _ in ranks:
            agent.close()
    assert poll(lambda: procs[0].ask("finished")[0], ["r"]) == ["r"]


def test_hybrid_read_with_a_hold_token_moves_every_group(procs):
    """The producer holds the window it keeps (vLLM's clipped list) and hands out one token for every
    group; the read carrying it moves all groups and the producer reports the request sent."""
    procs += start(1, free_port_block(), holds={"t": [FULL, SWA[2:], SLOTS]})
    token = procs[0].ask("token")
    assert token is not None
    cons, tensors, _ = consumer(hybrid_spec(1, 0))
    with cons:
        cons.read_many([ReadRequest(procs[0].address, [DST[0], DST[1][2:], DST[2]], [FULL, SWA[2:], SLOTS], "t",
                                    num_tokens=TOKENS, token=token)])[0].wait(60)
        ptensors, _, _ = hybrid_cache(hybrid_spec(1, 0), 10)
        for layer in range(ATTN["num_layers"]):
            np.testing.assert_array_equal(tensors[0][layer][:, DST[0]], ptensors[0][layer][:, FULL])
            np.testing.assert_array_equal(tensors[1][layer][:, DST[1][2:]], ptensors[1][layer][:, SWA[2:]])
        np.testing.assert_array_equal(tensors[2][0][1].reshape(8, -1)[DST[2]], ptensors[2][0][1].reshape(8, -1)[SLOTS])
    assert poll(lambda: procs[0].ask("finished")[0], ["t"]) == ["t"]


def test_a_step_of_two_hybrid_reads_is_byte_exact(procs):
    """Two requests in one ``read_many`` step (their claims and posts joined per producer rank)."""
    second = ([13, 14], [30, 31], [6])
    procs += start(1, free_port_block(), holds={"r": [FULL, SWA, SLOTS], "r2": list(second)})
    cons, tensors, _ = consumer(hybrid_spec(1, 0))
    dst2 = ([15, 16], [17, 18], [2])
    with cons:
        handles = cons.read_many([ReadRequest(procs[0].address, list(DST), [FULL, SWA, SLOTS], "r", num_tokens=TOKENS),
                                  ReadRequest(procs[0].address, list(dst2), list(second), "r2", num_tokens=8)])
        for h in handles:
            h.wait(60)
        src, _, _ = hybrid_cache(hybrid_spec(1, 0), 10)
        for layer in range(ATTN["num_layers"]):
            np.testing.assert_array_equal(tensors[0][layer][:, DST[0] + dst2[0]], src[0][layer][:, FULL + second[0]])
            np.testing.assert_array_equal(tensors[1][layer][:, DST[1][2:] + dst2[1]], src[1][layer][:, SWA[2:] + second[1]])
        for t in range(2):
            np.testing.assert_array_equal(tensors[2][0][t].reshape(8, -1)[[1, 2]], src[2][0][t].reshape(8, -1)[[5, 6]])
    assert poll(lambda: procs[0].ask("finished")[0], ["r", "r2"]) == ["r", "r2"]


def test_hybrid_mismatched_groups_fail_typed_and_move_nothing(procs):
    procs += start(1, free_port_block(), window=12)
    cons, _, arena = consumer(hybrid_spec(1, 0, window=10))
    before = arena.buf.copy()
    with cons:
        with pytest.raises(LayoutError, match=r"group 1 \(sliding 'swa'\): sliding_window differs: local has 10; "
                                              r"remote has 12"):
            cons.read(procs[0].address, list(DST), [FULL, SWA, SLOTS], "r", num_tokens=TOKENS).wait(60)
        with pytest.raises(BlockIdError, match="one list per group: 3 groups; got 2"):
            cons.read(procs[0].address, list(DST[:2]), [FULL, SWA], "r2")
    np.testing.assert_array_equal(arena.buf, before)
    assert procs[0].ask("holding") == ["r"]  # the producer still holds it


def test_hybrid_and_one_group_agents_do_not_meet(procs):
    procs += start(1, free_port_block())
    spec = KVSpec(**ATTN)
    agent = Agent("plain", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=free_port_block(1)))
    with agent:
        agent.register([np.zeros(s, np.float16) for s in spec.tensor_shapes()])
        with pytest.raises(IncompatiblePeerError):
            agent.read(procs[0].address, [1], [3], "r").wait(60)


def test_hybrid_refuses_paths_and_writes_typed():
    with pytest.raises(ConfigError, match="transfer_path must be 'auto' or 'direct'; got 'ipc'"):
        Agent("h", hybrid_spec(), AgentConfig(transfer_path="ipc"))
    agent = Agent("h", hybrid_spec(), AgentConfig(side_channel_host="127.0.0.1"))
    with agent:
        agent.register(hybrid_cache(hybrid_spec(), 1)[0])
        assert agent.config.transfer_path == "direct"
        with pytest.raises(ConfigError, match="a write of a hybrid cache"):
            agent.write(("127.0.0.1", 1), [1], [1], "w")
        with pytest.raises(BlockIdError, match=r"group 2 \(state 'mamba'\): id 8 is outside \[0, 8\)"):
            agent.hold("x", [[1], [2], [8]])
