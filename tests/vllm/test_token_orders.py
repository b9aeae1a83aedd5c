"""Hold tokens through the vLLM adapter without servers (issue 35).

The prefill's scheduler answers before its workers hold, so it chooses each hold's token
(``TokenBook``) and the workers hold under it (``Agent.hold(..., token=)``); the decode's loads
pass it. Real Agents over the byte-copying FakeBackend; the real-server cases are in
test_kvxfer_connector.py (``test_loads_read_by_the_hold_token_...``)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
from vllm.v1.request import RequestStatus

from kvxfer import HoldToken, hold_tag
from kvxfer_vllm.metadata import LoadOrder, StepOrders, WorkerAddress
from kvxfer_vllm.scheduler import KvxferScheduler
from kvxfer_vllm.settings import Settings
from test_worker_loads import _collect_until, _Peers, _worker

BLOCK = 4


def _producer(blocks: dict[str, tuple[int, ...]]) -> KvxferScheduler:
    sched = KvxferScheduler(Settings(), engine_id="e", tp_size=1, block_size=BLOCK)
    sched.bind(NS(get_block_ids=lambda rid: (list(blocks[rid]),)))
    sched.set_addresses({0: WorkerAddress("127.0.0.1", 7300, "eng-p", 0)})
    return sched


def _prefill(sched: KvxferScheduler, rid: str, prompt: int) -> tuple[StepOrders, NS]:
    """A do_remote_decode request whose whole prompt is scheduled in one step."""
    request = NS(request_id=rid, kv_transfer_params={"do_remote_decode": True}, num_computed_tokens=0,
                 num_prompt_tokens=prompt, status=RequestStatus.RUNNING)
    sched.after_alloc(request, None, 0)
    orders = sched.build_orders(NS(num_scheduled_tokens={rid: prompt}))
    request.num_computed_tokens, request.status = prompt, RequestStatus.FINISHED_LENGTH_CAPPED
    return orders, request


def test_the_prefill_answers_the_token_its_workers_hold_under():
    blocks = {"r1": (5, 1, 7), "r2": (2, 3)}
    sched = _producer(blocks)
    orders, request = _prefill(sched, "r1", 12)
    token = orders.tokens["r1"]
    assert orders.holds["r1"] == (5, 1, 7) and token[2] == hold_tag("r1", [5, 1, 7]) and token[1] >= 1
    keep, params = sched.finished(request, ([5, 1, 7],))
    assert keep and params["remote_hold_token"] == list(token)
    orders2, request2 = _prefill(sched, "r2", 8)
    assert orders2.tokens["r2"][0] != token[0] and orders2.tokens["r2"][1] > token[1]
    # r2 decoded past its prompt: re-held under a new token in the next step, so its answer has none
    blocks["r2"] = (2, 3, 4)
    keep, params2 = sched.finished(request2, ([2, 3, 4],))
    assert keep and "remote_hold_token" not in params2
    nxt = sched.build_orders(NS(num_scheduled_tokens={}))
    assert nxt.holds["r2"] == (2, 3, 4) and nxt.tokens["r2"][0] == orders2.tokens["r2"][0]
    assert nxt.tokens["r2"][1] > orders2.tokens["r2"][1]
    sched.update(NS(finished_recving=None, finished_sending={"r1", "r2"}))
    assert len(sched._book) == 0  # both slots free again


def test_the_decode_passes_the_token_only_for_a_load_of_every_held_block():
    answer = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[5, 1, 7]],
              "remote_engine_id": "eng-p", "remote_request_id": "r1", "remote_host": "127.0.0.1",
              "remote_port": 7300, "tp_size": 1, "remote_hold_token": [3, 9, hold_tag("r1", [5, 1, 7])]}

    def load(use: bool, external: int) -> LoadOrder:
        sched = KvxferScheduler(Settings(use_hold_tokens=use), engine_id="d", tp_size=1, block_size=BLOCK)
        request = NS(request_id="d1", kv_transfer_params=dict(answer), num_prompt_tokens=12)
        blocks = NS(get_block_ids=lambda: ([0, 3, 9],), get_unhashed_block_ids_all_groups=lambda: [0, 3, 9])
        sched.after_alloc(request, blocks, external)
        (order,) = sched.build_orders(NS(num_scheduled_tokens={})).loads
        return order

    assert load(True, 12).hold_token == (3, 9, answer["remote_hold_token"][2])
    assert load(False, 12).hold_token is None          # use_hold_tokens: false claims, as an older decoder
    assert load(True, 8).hold_token is None             # fewer blocks than held: the token cannot prove them


def test_workers_hold_under_the_token_and_the_decode_reads_by_it():
    peers = _Peers()
    try:
        prod, pcache = peers.agent("p", 7400, seed=1)
        cons, ccache = peers.agent("d", 7401, seed=2)
        sched = _producer({"r1": (5, 1, 7)})
        orders, request = _prefill(sched, "r1", 12)
        producer = _worker(prod)
        producer.apply(orders)
        token = orders.tokens["r1"]
        assert prod.hold_token("r1") == HoldToken(*token)
        params = sched.finished(request, ([5, 1, 7],))[1]
        consumer = _worker(cons)
        cons.connect("127.0.0.1", 7400)  # a read that handshakes first waits on the producer's lane: it claims
        consumer.apply(StepOrders(loads=[
            LoadOrder("d1", "r1", "127.0.0.1", 7400, (0, 3, 9), (5, 1, 7), hold_token=tuple(params["remote_hold_token"])),
        ]))
        out, _ = _collect_until(consumer, lambda o: "d1" in o.recving, 5)
        assert out is not None and not out.failed
        for layer in range(2):
            np.testing.assert_array_equal(ccache[layer][:, [0, 3, 9]], pcache[layer][:, [5, 1, 7]])
        assert consumer.stats().data["num_token_reads"] == [1]
        # a step that drops a hold and holds another in its slot: the drop goes first
        five = HoldToken(11, token[1] + 1, hold_tag("r5", [4]))
        producer.apply(StepOrders(holds={"r5": (4,)}, tokens={"r5": five.wire()}))
        assert prod.hold_token("r5") == five
        nine = HoldToken(11, token[1] + 2, hold_tag("r9", [2]))
        producer.apply(StepOrders(dropped={"r5"}, holds={"r9": (2,)}, tokens={"r9": nine.wire()}))
        assert prod.hold_token("r9") == nine and not prod.holding("r5")
    finally:
        peers.close()
