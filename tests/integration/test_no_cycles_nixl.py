"""A completed read leaves nothing for the cycle collector, on either side (issue 34, rule 4).

Every request of a step was once freed only by the interpreter's cycle collector (the step's
launch group, a claim's driver and a success callback each referred back to the request), so an
engine embedding kvxfer paid collector passes that grew with its steps: 1.4 ms a generation-1
pass on the CPU host, against 0.1 ms once a completed request lets go of them. Over real NIXL and
ZMQ between two processes, with the collector off while the reads run: claimed and token reads,
alone and as a step, byte-exact, a step aborted by its consumer and a read the producer refuses,
then (``finished()`` drained, as an engine does) the garbage the collector finds holds no kvxfer
object.
"""

import gc
import time

import numpy as np
import pytest

from kvxfer import AbortedError, Agent, AgentConfig, HoldToken, KVSpec, LeaseExpiredError, ReadRequest
from kvxfer.testing import ProducerProcess, collector_off, cycle_garbage

from nixl_peers import cache_for, free_port_block, spec_kwargs

SPEC = dict(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, num_blocks=64,
            dtype="bfloat16", model="cycles")
# request id -> the producer's blocks: a warm-up read, then claimed and token reads, alone and as steps
HOLDS = {"warm": [0, 1], "c1": [2, 3], **{f"c{i}": [2 * i, 2 * i + 1] for i in range(2, 6)},
         "t1": [12, 13], **{f"t{i}": [2 * i + 10, 2 * i + 11] for i in range(2, 6)},
         **{f"a{i}": [2 * i + 20, 2 * i + 21] for i in range(2, 6)}}


def _producer(cmd, out, spec_kw: dict, port: int) -> None:
    from kvxfer.testing import serve_commands

    spec = KVSpec(**spec_kw)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=port)
    with Agent("producer", spec, config) as agent:
        agent.register(cache_for(spec, 1))
        agent.listen()
        serve_commands(agent, HOLDS, cmd, out, timeout=120, extra={
            "tokens": lambda a: {rid: a.hold_token(rid).wire() for rid in HOLDS if rid.startswith("t")},
            "collector_off": lambda a: collector_off(),
            "garbage": lambda a: cycle_garbage(),
        })


def test_completed_reads_leave_no_kvxfer_object_to_the_cycle_collector(producers):
    spec = KVSpec(**SPEC)
    port = free_port_block()
    prod = ProducerProcess(_producer, spec_kwargs(spec), port)
    producers.append(prod)
    tokens = {rid: HoldToken.from_wire(w) for rid, w in prod.ask("tokens").items()}
    src = cache_for(spec, 1)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=free_port_block(1))
    with Agent("consumer", spec, config) as agent:
        cache = cache_for(spec, 2)
        agent.register(cache)
        dst = iter(range(spec.num_blocks))

        def request(rid: str, token: bool = False) -> ReadRequest:
            return ReadRequest(prod.address, [next(dst), next(dst)], HOLDS[rid], rid, timeout=20,
                               token=tokens[rid] if token else None)

        agent.read_many([request("warm")])[0].wait(30)  # the handshake, NIXL's first post: not measured
        assert prod.ask("collector_off") is True
        collector_off()
        try:
            steps = [[request("c1")], [request(f"c{i}") for i in range(2, 6)],
                     [request("t1", token=True)], [request(f"t{i}", token=True) for i in range(2, 6)]]
            for step in steps:
                for handle in agent.read_many(step):
                    handle.wait(30)
                for rr in step:
                    for layer in range(spec.num_layers):
                        np.testing.assert_array_equal(cache[layer][:, rr.local_blocks], src[layer][:, rr.remote_blocks])
            aborted = [request(f"a{i}") for i in range(2, 6)]
            handles = agent.read_many(aborted)
            for rr in aborted:  # the engine gives up on them: each fails typed (or had landed whole)
                agent.abort(rr.request_id, remote=prod.address)
            landed = set()
            for rr, handle in zip(aborted, handles):
                try:
                    handle.wait(30)
                except AbortedError:
                    continue
                landed.add(rr.request_id)
                for layer in range(spec.num_layers):
                    np.testing.assert_array_equal(cache[layer][:, rr.local_blocks], src[layer][:, rr.remote_blocks])
            refused = request("c1")  # released by now (its read is done): the producer refuses the claim
            refused = ReadRequest(refused.remote, refused.local_blocks, [60, 61], "never-held", timeout=20)
            with pytest.raises(LeaseExpiredError):
                agent.read_many([refused])[0].wait(30)
            del step, handle, handles
            assert set(agent.finished().failed) == {rr.request_id for rr in aborted} - landed | {"never-held"}
            time.sleep(0.3)  # kvxfer's threads let go of what their last pass held (else it is not garbage yet)
            consumer_garbage = cycle_garbage()
        finally:
            gc.enable()
        assert consumer_garbage == {}, f"the consumer's completed reads left cycles: {consumer_garbage}"
    assert prod.ask("garbage") == {}, "the producer's served reads left cycles"
