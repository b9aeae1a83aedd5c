"""A read whose claim lost one producer rank (a restart) while the others granted it is claimed
again on fresh links; the grants that survived are kept for that retry (their answers taken,
nothing given back). Before, their give-back was queued on the lane and reached the producer
after the retry's own grant from the same engine: it closed the retry's window, and the producer
could free the blocks under the retry's read. On the last attempt the grants still go back."""

import time
import types

import numpy as np

from kvxfer import PeerLostError
from kvxfer.agent.reads import PendingRead
from kvxfer.types import Direction

from agent_helpers import spec


class Claims:
    """Records what the flow does with a claim's answers."""

    def __init__(self, sent):
        self.sent, self.taken, self.undone = sent, [], []

    def send_many(self, items, links, timeout, lane=None):
        return [self.sent for _ in items]

    def answers(self, request_id, sent):
        self.taken.append((request_id, [lk for lk, _ in sent]))

    def undo(self, request_id, sent):
        self.undone.append((request_id, [lk for lk, _ in sent]))


def _read(harness):
    cons, _ = harness.agent(spec(), seed=2, listen=False)
    [req] = cons._parts.engine.reserve_many([("r", time.monotonic() + 30, np.array([1]))], Direction.READ,
                                            granted=False)
    read = PendingRead(req, ("h", 1), np.array([1]), np.array([0]), "r", time.monotonic() + 30, 30, ("e", b""), 0.0)
    return cons, read


def test_the_grants_that_survived_a_lost_rank_are_kept_for_the_retry_and_given_back_after_the_last(harness):
    cons, read = _read(harness)
    kept, lost = types.SimpleNamespace(engine_id="p0"), types.SimpleNamespace(engine_id="p1")
    claims = Claims([(kept, object()), (lost, PeerLostError("rank 1 restarted"))])
    cons._parts.claims = claims
    flow = cons._parts.reads
    assert flow._claim([read], [kept, lost], retry=True) == [read]
    assert claims.taken == [("r", [kept])] and claims.undone == []
    assert flow._claim([read], [kept, lost], retry=False) == [read]
    assert claims.undone == [("r", [kept])]
