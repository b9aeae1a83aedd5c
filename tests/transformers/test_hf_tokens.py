"""Issue 35 (transformers half): the prefill's params carry its hold token, and a decode that reads
exactly the held blocks uses it (no claim); a shorter read claims. FakeBackend, real bytes, the
producer's real hold words under /dev/shm."""

from __future__ import annotations

import torch

from kvxfer.agent.service import ProducerService
from kvxfer.testing import wait_for
from kvxfer.transfer_params import RemotePrefill as Parsed, producer_answer

from test_hf_quarantine import pair  # noqa: F401 - the fixture


def _count_claims(monkeypatch) -> dict:
    seen = {"n": 0}
    real = ProducerService._claim

    def claim(self, message, peer):
        seen["n"] += 1
        return real(self, message, peer)

    monkeypatch.setattr(ProducerService, "_claim", claim)
    return seen


def _params(producer, request_id, blocks):
    host, port = producer.address
    token = producer.hold_token(request_id)
    return Parsed.parse(producer_answer(request_id=request_id, block_ids=list(blocks), engine_id=producer.engine_id,
                                        host=host, port=port, tp_size=1, num_tokens=len(blocks) * 4, block_size=4,
                                        hold_token=token.wire() if token else None))


def test_a_load_of_every_held_block_goes_by_the_token(pair, monkeypatch):  # noqa: F811
    producer, ppool, transfers, cpool, _ = pair
    claims = _count_claims(monkeypatch)
    producer.hold("p-1", [3, 4, 5])
    remote = _params(producer, "p-1", (3, 4, 5))
    assert remote.hold_token is not None
    landed = transfers.load(remote, prompt_len=11, timeout=5)   # 10 tokens: 3 blocks of 4, every held one
    assert claims["n"] == 0
    for pt, ct in zip(ppool.tensors, cpool.tensors):   # [K/V, block, token, head, dim] per layer
        assert torch.equal(ct[:, landed.blocks], pt[:, [3, 4, 5]])
    assert wait_for(lambda: not producer.holding("p-1"))


def test_a_shorter_load_claims(pair, monkeypatch):  # noqa: F811
    producer, _, transfers, _, _ = pair
    claims = _count_claims(monkeypatch)
    producer.hold("p-1", [3, 4, 5])
    landed = transfers.load(_params(producer, "p-1", (3, 4, 5)), prompt_len=9, timeout=5)  # 8 tokens: 2 blocks
    assert len(landed.blocks) == 2 and claims["n"] == 1
