"""Embedding kvxfer's P/D proxy (layer: example): two stand-in engines and the proxy in one
process on loopback, one request through, checked.

Real deployments run ``kvxfer proxy --prefiller-hosts ... --decoder-hosts ...`` in front of vLLM
(docs/proxy.md). Here the "engines" are tiny Starlette apps that speak just enough of the
OpenAI API and of the kv_transfer_params contract to show the flow: the prefill engine answers
``max_tokens=1`` requests with the parameters a decoder needs to pull the KV blocks, and the
decode engine reports which parameters it was given.
"""

from __future__ import annotations

import asyncio
import socket
import sys

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvxfer.proxy import Endpoint, ProxyConfig, create_app


def engine(role: str) -> Starlette:
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        rid = request.headers["x-request-id"]
        if role == "prefill":
            if body["max_tokens"] != 1 or body["kv_transfer_params"]["do_remote_decode"] is not True:
                return JSONResponse({"error": {"message": "not a prefill request", "code": 400}}, status_code=400)
            params = {"remote_engine_id": "prefill-0", "remote_block_ids": [7, 8, 9], "remote_host": "127.0.0.1",
                      "remote_port": 5600, "remote_request_id": rid}
            return JSONResponse({"id": rid, "choices": [{"text": ""}], "kv_transfer_params": params})
        got = body["kv_transfer_params"]
        return JSONResponse({"id": rid, "choices": [{"text": f"decoded with blocks {got['remote_block_ids']}"}]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)])


def bound_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


async def main() -> int:
    socks = {name: bound_socket() for name in ("prefill", "decode", "proxy")}
    port = {name: s.getsockname()[1] for name, s in socks.items()}
    config = ProxyConfig(prefill=(Endpoint("127.0.0.1", port["prefill"]),),
                         decode=(Endpoint("127.0.0.1", port["decode"]),), port=port["proxy"])
    apps = {"prefill": engine("prefill"), "decode": engine("decode"), "proxy": create_app(config)}
    servers = {n: uvicorn.Server(uvicorn.Config(a, log_level="warning", lifespan="on")) for n, a in apps.items()}
    tasks = [asyncio.create_task(servers[n].serve(sockets=[socks[n]])) for n in servers]
    try:
        while not all(s.started for s in servers.values()):
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port['proxy']}", trust_env=False) as client:
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 32},
                                  headers={"X-Request-Id": "example-1"})
        print(r.status_code, r.json())
        ok = r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded with blocks [7, 8, 9]"
    finally:
        for s in servers.values():
            s.should_exit = True
        await asyncio.gather(*tasks)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
