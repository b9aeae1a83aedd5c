"""Claims' answers on the express lane (an audit's findings, each failing before its fix):

* A step's claims share one ``ClaimBatch`` answer. When one read of the step ended, its give-back
  took the shared answer on the producer's lane, waiting on a frozen producer while holding the
  answer's lock; the step's other reads then looked ready to their poller (the caller's ``done()``
  or kvxfer's progress thread), which queued behind that lock until the claim's deadline, and
  every other peer's reads with it.
* A give-back ran on the lane of the claimed rank's own address, not of the producer instance
  whose reads queue under its rank 0's: with a consumer rank that reads from producer rank 1, a
  retried read's claim could overtake the give-back, whose abort then closed the retry's window.
* A reply that came after its request's deadline was taken as an answer in time when another
  request's waiter had read it off the socket (both clients: the express lane and ZMQ).
"""

import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvxfer.agent.claims import Claims
from kvxfer.agent.peers import PendingAnswer
from kvxfer.errors import TransferTimeoutError
from kvxfer.protocol import Grant
from kvxfer.transport.express import ATTACHED, ExpressLane, FrameReader, frame


def _server(listener, answer_after: dict[bytes, float]):
    """An express server that attaches, then answers each request after its delay (never, if absent)."""
    conn, _ = listener.accept()
    reader = FrameReader(1 << 20)
    while True:
        data = conn.recv(65536)
        if not data:
            return
        for rid, payload in reader.feed(data):
            if rid == 0:
                conn.sendall(frame(0, ATTACHED))
            elif payload in answer_after:
                threading.Timer(answer_after[payload], conn.sendall, (frame(rid, b"GRANT:" + payload),)).start()


@pytest.fixture
def lane_to():
    made = []

    def make(answer_after: dict[bytes, float]) -> ExpressLane:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        threading.Thread(target=_server, args=(listener, answer_after), daemon=True).start()
        lane = ExpressLane("127.0.0.1", listener.getsockname()[1], b"\x01" * 16, 1 << 20, 2.0)
        made.append((lane, listener))
        return lane

    yield make
    for lane, listener in made:
        lane.close()
        listener.close()


class _LaneLink:
    host, port, engine_id = "127.0.0.1", 1, "producer"
    spec = SimpleNamespace(tp_rank=0)

    def __init__(self, lane: ExpressLane) -> None:
        self.lane = lane
        self.info = SimpleNamespace(packed_ids=True, batch_claims=True)
        self.session = SimpleNamespace(response=lambda reply, message: reply)

    def try_send(self, message, timeout):
        pending = self.lane.try_send(b"claim", timeout)
        return None if pending is None else PendingAnswer(self, message, pending)


def test_a_give_back_waiting_on_a_frozen_producer_does_not_hold_the_steps_poller(lane_to):
    link = _LaneLink(lane_to({}))  # attaches, then never answers: a frozen producer

    def on_a_lane(key, fn):
        threading.Thread(target=fn, name="lane", daemon=True).start()

    claims = Claims(peers=None, engine_id="consumer", timeout=5.0, defer=on_a_lane)
    ids = np.arange(4)
    sent = claims.try_send_many([("A", ids, 0.0), ("B", ids, 0.0)], link, 3.0)
    assert sent is not None
    claims.undo("A", sent[0])       # read A ended: its give-back takes the batch's answer on the lane
    shared = sent[1][0][1]._shared  # the batch's one answer
    until = time.monotonic() + 5
    while not shared._lock.locked() and time.monotonic() < until:
        time.sleep(0.01)
    assert shared._lock.locked()    # the lane is inside, waiting on the producer
    started = time.monotonic()
    ready = claims.ready(sent[1], 0.0)
    assert time.monotonic() - started < 0.5
    assert ready is False           # B's answer is not in: its poller moves on (before: True, then blocked)


class _RankLink:
    def __init__(self, port: int, rank: int) -> None:
        self.host, self.port, self.engine_id = "10.0.0.1", port, f"rank{rank}"
        self.spec = SimpleNamespace(tp_rank=rank)
        self.info = SimpleNamespace(packed_ids=True, batch_claims=True)

    def try_send(self, message, timeout):
        return self

    def send(self, message, timeout):
        return self

    def answer(self):
        return Grant("x", 1.0)

    def ready(self, wait=0.0):
        return True


def test_give_backs_run_on_the_producer_instances_lane_whichever_rank_granted():
    remote = ("10.0.0.1", 5000)    # the instance as the reads name it: rank 0's address
    rank1 = _RankLink(5001, 1)     # the one rank this consumer rank reads from
    deferred = []
    claims = Claims(peers=None, engine_id="consumer", timeout=1.0, defer=lambda key, fn: deferred.append(key))
    sent = claims.try_send_many([("X", np.arange(2), 1.0)], rank1, 1.0)       # from the caller's thread
    claims.answers("X", sent[0])
    claims.give_back("X")
    sent = claims.send_many([("Y", np.arange(2), 1.0)], [rank1], timeout=1.0)  # from the lane
    claims.answers("Y", sent[0])
    claims.give_back("Y")
    sent = claims.send_many([("Z", np.arange(2), 1.0)], [rank1], timeout=1.0, lane=remote)
    claims.answers("Z", sent[0])
    claims.give_back("Z")
    assert deferred == [remote, remote, remote]


def test_an_express_reply_after_its_deadline_is_not_an_answer(lane_to):
    lane = lane_to({b"claim": 0.5, b"other": 0.8})
    claim = lane.send(b"claim", 0.3)       # 0.3 s to answer; the producer answers after 0.5 s
    other = lane.send(b"other", 5.0)
    waiter = threading.Thread(target=other.reply, daemon=True)
    waiter.start()                         # its waiter reads the socket meanwhile
    time.sleep(0.65)
    assert claim.ready()
    with pytest.raises(TransferTimeoutError):
        claim.reply()
    waiter.join(5)


def test_a_zmq_reply_after_its_deadline_is_not_an_answer():
    import zmq

    from kvxfer.transport.zmq_client import SideChannelClient

    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():  # answers each request after its delay, from this one thread (a socket is not thread-safe)
        poller = zmq.Poller()
        poller.register(server, zmq.POLLIN)
        due: list = []
        while not stop.is_set():
            if poller.poll(10):
                ident, body = server.recv_multipart()
                delay = 0.5 if body.endswith(b"claim") else 0.8
                due.append((time.monotonic() + delay, [ident, body[:-5] + b"GRANT"]))
            now = time.monotonic()
            for item in [d for d in due if d[0] <= now]:
                due.remove(item)
                server.send_multipart(item[1])
        server.close(linger=0)

    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    client = SideChannelClient("127.0.0.1", port)
    client.multiplexed = True  # as after a handshake with a current peer: replies carry their ids
    try:
        claim = client.send(b"claim", 0.3)
        other = client.send(b"other", 5.0)
        waiter = threading.Thread(target=other.reply, daemon=True)
        waiter.start()
        time.sleep(0.65)
        with pytest.raises(TransferTimeoutError):
            claim.reply()
        waiter.join(5)
    finally:
        stop.set()
        serving.join(5)
        client.close()
