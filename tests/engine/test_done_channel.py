"""``Done`` notices travel on the link's own session, multiplexed: never a second session, and a
notice never waits for (nor holds up) a request in flight on the same link.

A notice queued behind the link's pending claim would delay back-to-back reads; before requests
carried ids, a second session per producer rank (a second ZMQ connection and Hello) avoided that.
"""

import threading
import types

import msgspec
import pytest

from kvxfer import ReadRequest
from kvxfer.agent.notices import DoneSender
from kvxfer.errors import ProtocolError
from kvxfer.protocol import MAX_BATCH, Claim, Codec, Done, Grant, Heartbeat, HeartbeatAck, compat_hash

from agent_helpers import spec, wait_for


def _seen(agent, messages=None):
    """Record the type name of every side-channel message ``agent`` handles (and, into
    ``messages``, the messages themselves)."""
    seen = []
    handle = agent._service.handle

    def record(message, peer):
        seen.append(type(message).__name__)
        if messages is not None:
            messages.append(message)
        return handle(message, peer)
    agent._service.handle = record
    return seen


def _told(messages) -> list[str]:
    """The request ids the ``Done`` messages among ``messages`` named, in order."""
    return [rid for m in messages if isinstance(m, Done) for rid in (m.request_id, *m.more)]


def test_done_is_delivered_while_a_request_on_the_link_awaits_its_answer(harness):
    s = spec()
    prod, _ = harness.agent(s)
    cons, _ = harness.agent(s, listen=False)
    link = cons.connect(*prod.address)
    prod.hold("r", [1, 2])
    prod.hold("q", [3])
    seen = _seen(prod)
    claim = Claim("q", [3], cons.engine_id)
    pending = link.send(claim, 2.0)  # a claim in flight, its answer not taken yet
    cons._done.send(link, "r")
    assert wait_for(lambda: "Done" in seen), "the notice waited for the link's pending request"
    assert wait_for(lambda: not prod.holding("r"))
    assert isinstance(pending.answer(), Grant)
    assert isinstance(link.ask(Heartbeat(["q"], cons.engine_id), 2.0), HeartbeatAck)


def test_notices_open_no_second_session(harness):
    s = spec()
    prod, _ = harness.agent(s)
    cons, _ = harness.agent(s, listen=False)
    link = cons.connect(*prod.address)
    messages: list = []
    _seen(prod, messages)
    for i in range(3):
        cons._done.send(link, f"r{i}")
    assert wait_for(lambda: _told(messages) == ["r0", "r1", "r2"])
    assert [p.engine_id for p in prod._server.peers()] == [cons.engine_id]
    assert prod._server.counters()["sessions"] == 1


def test_a_steps_notices_to_one_rank_go_in_one_message_and_end_every_hold(harness):
    """Notices queued while the rank's lane is busy (a step's reads ending together) travel as one
    ``Done`` naming them all; the producer ends each of those holds, and only those."""
    s = spec()
    prod, _ = harness.agent(s)
    cons, _ = harness.agent(s, listen=False)
    link = cons.connect(*prod.address)
    assert link.info.batch_done
    rids = [f"s{i}" for i in range(8)]
    for i, rid in enumerate(rids):
        prod.hold(rid, [i])
    prod.hold("other", [10])
    messages: list = []
    _seen(prod, messages)
    gate, entered = threading.Event(), threading.Event()
    ask = cons._done._ask

    def slow_ask(lk, m):  # the lane is busy with the first notice: the others queue up meanwhile
        entered.set()
        gate.wait(5)
        return ask(lk, m)
    cons._done._ask = slow_ask
    cons._done.send(link, rids[0])
    cons._done.flush()
    assert entered.wait(5)
    for rid in rids[1:]:
        cons._done.send(link, rid)
    cons._done.flush()  # (the agent's thread may have flushed some already: all are queued behind the first)
    gate.set()
    assert wait_for(lambda: _told(messages) == rids)
    assert sum(isinstance(m, Done) for m in messages) == 2  # the first alone, then the 7 queued behind it
    assert wait_for(lambda: not any(prod.holding(rid) for rid in rids))
    assert prod.holding("other")


def test_a_notice_wakes_no_thread_and_goes_with_the_next_flush_in_one_message():
    """A read's completion only queues its notice (no lane is woken while the engine's thread
    completes reads); ``flush`` (the agent's next whole pass, or ``Agent.poll``) hands everything
    queued to the producer ranks' lanes, one ``Done`` per rank naming them all."""
    told: list = []
    sender = DoneSender("consumer-engine", lambda link, message: told.append((link, message)))
    links = [types.SimpleNamespace(host="h", port=p, info=types.SimpleNamespace(batch_done=True, host_id="x"),
                                   engine_id=f"p{p}") for p in (1, 2)]
    for i in range(6):
        sender.send(links[i % 2], f"r{i}")
    threading.Event().wait(0.05)
    assert told == [] and sender.pending() == 6 and sender._lanes.busy() == 0  # nothing sent, no thread
    sender.flush()
    assert wait_for(lambda: len(told) == 2) and sender.pending() == 0
    by_port = {link.port: [m.request_id, *m.more] for link, m in told}
    assert by_port == {1: ["r0", "r2", "r4"], 2: ["r1", "r3", "r5"]}
    sender.send(links[0], "late")
    sender.close()  # close sends what is still queued
    assert [m.request_id for _, m in told[2:]] == ["late"]


def test_an_agents_read_notices_reach_the_producer_without_a_flush_from_the_caller(harness):
    """The agent's own thread flushes on its cadence: a notice queued and never flushed by the
    caller still ends the producer's hold."""
    s = spec()
    prod, _ = harness.agent(s)
    cons, _ = harness.agent(s, listen=False)
    link = cons.connect(*prod.address)
    prod.hold("n", [4])
    cons._done.send(link, "n")
    assert wait_for(lambda: not prod.holding("n"))


def test_a_producer_without_batch_done_gets_one_notice_per_request(harness):
    s = spec()
    prod, _ = harness.agent(s)
    cons, _ = harness.agent(s, listen=False)
    link = cons.connect(*prod.address)
    object.__setattr__(link, "info", msgspec.structs.replace(link.info, batch_done=False))  # as an older peer
    for i in range(3):
        prod.hold(f"r{i}", [i])
    messages: list = []
    _seen(prod, messages)
    cons._done._run(None, [(link, f"r{i}", 0) for i in range(3)])
    assert [m.more for m in messages if isinstance(m, Done)] == [[], [], []]
    assert _told(messages) == ["r0", "r1", "r2"]
    assert wait_for(lambda: not any(prod.holding(f"r{i}") for i in range(3)))


def test_done_more_round_trips_and_is_bounded():
    codec = Codec(compat_hash(spec()))
    message = Done("a", "eng", ["b", "c"])
    assert codec.decode(codec.encode(message)) == message
    assert codec.decode(codec.encode(Done("a", "eng"))).more == []
    assert codec.decode(codec.encode(Done("a", "eng"))).epochs == []          # an older consumer's
    with_epochs = Done("a", "eng", ["b"], [(1 << 64) - 1, 0])                  # a token read, a claimed one
    assert codec.decode(codec.encode(with_epochs)) == with_epochs
    with pytest.raises(ProtocolError):
        codec.decode(codec.encode(Done("a", "eng", [], [-1])))
    with pytest.raises(ProtocolError):
        codec.decode(codec.encode(Done("a", "eng", ["x"] * (MAX_BATCH + 1))))


def test_a_claimed_steps_joined_post_sends_its_notices_on_the_done_lane(harness):
    """A step of claimed direct reads to one rank is one joined backend post; each read's done
    notice goes on the done lane once the read is known good, never as a NIXL notification sent
    by the thread that completes the read (network I/O there could hold a completed read's
    handle back for as long as the call takes)."""
    s = spec()
    prod, prod_cache = harness.agent(s, seed=1)
    cons, cons_cache = harness.agent(s, seed=2, listen=False)
    cons.connect(*prod.address)
    for i in range(3):
        prod.hold(f"j{i}", [2 * i, 2 * i + 1])
    inline: list = []
    cons._backend.notify = lambda peer, message: inline.append(peer)
    handles = cons.read_many([ReadRequest(prod.address, [6 + 2 * i, 7 + 2 * i], [2 * i, 2 * i + 1], f"j{i}",
                                          timeout=5) for i in range(3)])
    assert {h.wait(5).mode for h in handles} == {"direct"}
    for i in range(3):
        for got, want in zip(cons_cache, prod_cache):
            assert (got[:, [6 + 2 * i, 7 + 2 * i]] == want[:, [2 * i, 2 * i + 1]]).all()
    assert inline == []
    assert wait_for(lambda: not any(prod.holding(f"j{i}") for i in range(3)))
