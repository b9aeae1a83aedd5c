"""Builders for protocol tests: specs, PeerInfo and codecs (imported by the tests, not a fixture file)."""

from __future__ import annotations

from kvxfer.layout.spec import CacheGeometry, KVSpec
from kvxfer.protocol import Codec, PeerInfo, compat_hash, make_peer_info

KEY = b"0123456789abcdef0123456789abcdef"


def spec(**kw) -> KVSpec:
    base = dict(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16, num_blocks=32,
                model="tiny-llama")
    base.update(kw)
    return KVSpec(**base)


def info(engine_id: str = "eng-a", s: KVSpec | None = None, base: int = 1 << 40,
         metadata: bytes = b"nixl-md") -> PeerInfo:
    s = s or spec()
    return make_peer_info(engine_id, f"agent-{engine_id}", s, CacheGeometry.contiguous(s, base),
                          metadata, listen_host="127.0.0.1", listen_port=5600)


def codec(s: KVSpec | None = None, key: bytes | None = None, max_bytes: int = 4 << 20) -> Codec:
    return Codec(compat_hash(s or spec()), key=key, max_bytes=max_bytes)


