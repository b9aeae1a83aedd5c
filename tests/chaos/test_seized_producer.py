"""A read with a hold token needs no producer interpreter (issues 34, 35).

The producer's main thread seizes the GIL in C code (``chaos_peers`` "seize": no Python thread of
that process runs, kvxfer's own threads included) while the consumer reads blocks it holds, over
UCX's TCP transport, which needs the target to progress. NIXL's progress thread (on by default;
on a small host it waits for UCX's events instead of spinning) serves the move without the
interpreter, and the token's hold word is looked at in shared memory, so the read completes,
exact, before the seizure ends. A claimed read (no token) could not: its grant needs the
producer's Python. With the producer's NIXL progress thread off the token read waits for the
seizure too (checked by hand: ``nixl_progress_thread=False`` below fails this test).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvxfer import HoldToken, KVSpec, ReadRequest

from chaos_peers import Peer, blocks_of, consumer, fill, wait_until

SPEC = dict(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=64, dtype="bfloat16",
            model="seized")
SEIZE_S = 2
TRIALS = 3


@pytest.fixture(scope="module")
def pair():
    prod = Peer(KVSpec(**SPEC), seed=5)
    agent, cache = consumer(KVSpec(**SPEC))
    yield prod, agent, cache
    agent.close()
    prod.stop()


def _held(prod: Peer, rid: str, src: list[int]) -> tuple[list[np.ndarray], HoldToken]:
    """The producer holds ``src`` under ``rid`` (reused once freed): its bytes once held, and the
    token. (Taken before the hold, the bytes of a block an earlier trial's request still held
    could change: that request's release may reach the producer's engine after the snapshot.)"""
    token = HoldToken.from_wire(prod.ask(("hold_token", rid, src, None, True)))
    return prod.ask(("blocks", src)), token


def _read(agent, prod: Peer, rid: str, src: list[int], dst: list[int], token: HoldToken):
    return agent.read_many([ReadRequest(prod.address, dst, src, rid, 10.0, token=token)])[0]


def test_a_token_read_completes_exact_while_the_producers_interpreter_is_seized(pair, tmp_path):
    prod, agent, cache = pair
    _read(agent, prod, "warm", [1, 2], [3, 4], _held(prod, "warm", [1, 2])[1]).wait()  # first contact
    rng = np.random.default_rng(0)
    for trial in range(TRIALS):
        src, dst = (rng.permutation(SPEC["num_blocks"])[:8].tolist() for _ in range(2))
        want, token = _held(prod, f"t{trial}", src)
        fill(cache, dst)
        marker = tmp_path / f"seized-{trial}"
        prod.cmd.put(("seize", SEIZE_S, str(marker)))
        wait_until(lambda: os.path.exists(marker), timeout=10)
        began = time.time()
        _read(agent, prod, f"t{trial}", src, dst, token).wait()
        ended = time.time()
        start, end = prod.out.get(timeout=30)
        for got, w in zip(blocks_of(cache, dst), want):
            np.testing.assert_array_equal(got, w)
        assert start <= began and ended < end, (
            f"trial {trial}: the read ran {began - start:.3f}..{ended - start:.3f} s into a seizure of "
            f"{end - start:.3f} s; it must complete inside it")
