"""Two processes, one KV request read with a hold token: no claim, no producer CPU on the read.

Run:  python examples/hold_token_read.py
The prefill side holds the blocks and sends the hold's token with the block ids (here over a
queue; engines send it in kv_transfer_params as ``remote_hold_token``). The decode side reads
with it: the bytes move at once, and the read succeeds only if the producer's hold word still
equals the token once they have moved (docs/reliability.md, "hold tokens"). A second read with
the same token after the producer released the request fails with LeaseExpiredError.

req-1's token is chosen before the hold, as an engine whose answer leaves before its hold is made
does (vLLM's scheduler): ``TokenBook.issue`` gives it and ``Agent.hold(..., token=)`` holds under it.
"""

import multiprocessing as mp
import os

import numpy as np

from kvxfer import Agent, AgentConfig, HoldToken, KVSpec, LeaseExpiredError, ReadRequest, TokenBook

SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16, num_blocks=64,
              dtype="bfloat16", layout="NHD", model="example-model")
PORT = int(os.environ.get("KVXFER_EXAMPLE_PORT", "5730"))


def make_cache(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for shape in SPEC.tensor_shapes()]


def prefill(params, done) -> None:
    cache = make_cache(seed=1)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT)
    with Agent("prefill", SPEC, config) as agent:
        agent.register(cache)
        agent.listen()
        book = TokenBook(config.hold_words)               # the scheduler's mirror of the table
        token = book.issue("req-1", [10, 11, 3])          # chosen by the scheduler, before the hold
        agent.hold("req-1", [10, 11, 3], token=token)     # the worker holds under it
        params.put(("req-1", [10, 11, 3], token.wire()))  # what kv_transfer_params carry (after the hold)
        agent.hold("req-2", [10, 11, 3])                  # or the table chooses, and hold_token() tells
        params.put(("req-2", [10, 11, 3], agent.hold_token("req-2").wire()))
        while "req-1" not in agent.finished().freed:
            done.wait(0.01)
        agent.release("req-2")            # the engine takes req-2's blocks back: its token is dead now
        params.put("released")
        done.wait(30)


def decode(params, done) -> None:
    cache = make_cache(seed=2)
    config = AgentConfig(side_channel_host="127.0.0.1", side_channel_port=PORT + 1)
    with Agent("decode", SPEC, config) as agent:
        agent.register(cache)
        agent.connect("127.0.0.1", PORT)  # a known producer: a token read starts on this thread
        (rid1, ids1, wire1), (rid2, ids2, wire2) = params.get(timeout=60), params.get(timeout=60)
        read = ReadRequest(("127.0.0.1", PORT), [0, 1, 2], ids1, rid1, 30, token=HoldToken.from_wire(wire1))
        stats = agent.read_many([read])[0].wait()
        expected = make_cache(seed=1)
        for layer in range(SPEC.num_layers):
            assert np.array_equal(cache[layer][:, [0, 1, 2]], expected[layer][:, [10, 11, 3]])
        assert stats.by_token
        print(f"decode: {rid1}: {stats.num_bytes} bytes by its token, every byte matches")
        assert params.get(timeout=60) == "released"
        late = ReadRequest(("127.0.0.1", PORT), [4, 5, 6], ids2, rid2, 30, token=HoldToken.from_wire(wire2))
        try:
            agent.read_many([late])[0].wait()
        except LeaseExpiredError as exc:
            print(f"decode: {rid2} after its release: LeaseExpiredError ({exc})")
        else:
            raise SystemExit("a read with a dead token succeeded")
    done.set()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    params, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=prefill, args=(params, done))
    p.start()
    decode(params, done)
    p.join(30)
    raise SystemExit(p.exitcode)
