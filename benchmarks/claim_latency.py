"""Claim round trip on the side channel against a plain TCP socket's round trip, in one run
(two processes, loopback, real ZMQ and NIXL agents).

Four kinds of round trip, interleaved so each sees the same host state, back to back and after
the link sat idle (``--idle-ms``):

- ``socket``: a plain TCP socket (TCP_NODELAY), 64 bytes each way, to an echo thread in the
  producer's process: the floor a request/response can reach between two Python processes;
- ``express``: a claim of 512 blocks on the session's express lane (the default);
- ``zmq multiplexed``: the same claim on the ZMQ side channel (``express_port=None``);
- ``zmq serial``: ZMQ, one request at a time (what a peer without ``PeerInfo.multiplexed`` gets);
- ``codec only``: no I/O at all: the same claim framed by the client's session, decoded as the
  server decodes it, its ``Grant`` framed and decoded as the client checks it, all on the
  caller's thread. Both ends run at least this much Python per claim, so this row is a floor
  for any claim carried by the protocol's Python, whatever the socket: where it alone comes near
  twice the socket's round trip (after idle on a VM whose caches went cold), no transport change
  can take the claim there.

Run:  .venv/bin/python benchmarks/claim_latency.py [--requests 30] [--idle-ms 10] [--json out.json]
"""

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

from nixl_peers import Producer, _producer, cache_for, free_port_block  # noqa: E402

from kvxfer import Agent, AgentConfig, KVSpec  # noqa: E402
from kvxfer.protocol import Claim, Grant, pack_ids  # noqa: E402


def _echo_forever(port: int) -> None:
    server = socket.create_server(("127.0.0.1", port))

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def _producer_with_echo(cmd, out, *args, echo_port: int = 0) -> None:
    _echo_forever(echo_port)
    _producer(cmd, out, *args)


class EchoProducer(Producer):
    def __init__(self, spec, seed, port, holds, echo_port):
        from functools import partial
        super().__init__(spec, seed, port, holds, target=partial(_producer_with_echo, echo_port=echo_port))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--idle-ms", type=float, default=10.0)
    ap.add_argument("--json", default=None, help="also write the medians (us) here")
    args = ap.parse_args()
    spec = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=1024,
                  dtype="bfloat16", model="claim-bench")
    ids = np.random.default_rng(0).permutation(1024)[:512]
    n = args.requests
    kinds = ["socket", "express", "zmq multiplexed", "zmq serial", "codec only"]
    echo_port = free_port_block(1)
    prod = EchoProducer(spec, 1, free_port_block(), {f"r{i}": ids for i in range(2 * n)}, echo_port)
    agents = {
        "express": Agent("claimer-x", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=0)),
        "zmq": Agent("claimer-z", spec, AgentConfig(side_channel_host="127.0.0.1", side_channel_port=0,
                                                    express_port=None)),
    }
    sock = socket.create_connection(("127.0.0.1", echo_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        links = {}
        for name, agent in agents.items():
            agent.register(cache_for(spec, 2))
            links[name], _ = agent._links_for(prod.address)
        assert all(link.client.express for link in links["express"]), "the express lane did not attach"
        assert not any(link.client.express for link in links["zmq"])

        session = links["express"][0].session
        engine_id = agents["express"].engine_id

        def codec_only(rid: str) -> None:
            claim = Claim(rid, [], engine_id, 0.0, pack_ids(ids))
            got = session.codec.decode(session.request(claim))  # what the server reads
            assert got.request_id == rid
            reply = session.codec.encode(Grant(rid, 30.0))      # what it answers
            assert isinstance(session.response(reply, claim), Grant)

        def round_trip(kind: str, rid: str) -> float:
            t0 = time.perf_counter()
            if kind == "codec only":
                codec_only(rid)
                return time.perf_counter() - t0
            if kind == "socket":
                sock.sendall(b"x" * 64)
                got = 0
                while got < 64:
                    got += len(sock.recv(4096))
                return time.perf_counter() - t0
            agent = agents["express" if kind == "express" else "zmq"]
            group = links["express" if kind == "express" else "zmq"]
            serial = kind == "zmq serial"
            for link in group:
                link.client.multiplexed = not serial and link.info.multiplexed
            try:
                agent._claims.answers(rid, agent._claims.send(rid, ids, group))
            finally:
                for link in group:
                    link.client.multiplexed = link.info.multiplexed
            return time.perf_counter() - t0

        hot = {k: [] for k in kinds}
        cold = {k: [] for k in kinds}
        for i in range(n):  # a claim of a held request may be repeated: each kind claims r{i}
            for kind in kinds:
                hot[kind].append(round_trip(kind, f"r{i}"))
        for i in range(n, 2 * n):
            for kind in kinds:
                time.sleep(args.idle_ms / 1e3)
                cold[kind].append(round_trip(kind, f"r{i}"))
        med = lambda xs: float(np.median(xs)) * 1e6  # noqa: E731
        print(f"round trips, median of {n} ({len(ids)}-block claims; socket: 64 bytes each way)")
        print(f"| round trip | back to back (us) | x socket | after {args.idle_ms:g} ms idle (us) | x socket |")
        print("|---|---|---|---|---|")
        result = {}
        for kind in kinds:
            h, c = med(hot[kind]), med(cold[kind])
            result[kind] = {"back_to_back_us": h, "after_idle_us": c}
            print(f"| {kind} | {h:.0f} | {h / med(hot['socket']):.1f} | {c:.0f} | {c / med(cold['socket']):.1f} |")
        if args.json:
            Path(args.json).write_text(json.dumps({"idle_ms": args.idle_ms, "requests": n, **result}, indent=1))
    finally:
        sock.close()
        for agent in agents.values():
            agent.close()
        prod.stop()


if __name__ == "__main__":
    main()
