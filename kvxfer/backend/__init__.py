"""Transports behind one protocol (layer: backend; NIXL is imported only by kvxfer.backend.nixl, lazily).

``NixlBackend`` is imported on first use, so ``import kvxfer.backend`` never loads NIXL.
"""

from __future__ import annotations

from typing import Any

from kvxfer.backend.base import Backend, XferId, descs

__all__ = ["Backend", "FakeBackend", "NixlBackend", "XferId", "descs"]


def __getattr__(name: str) -> Any:
    if name == "NixlBackend":
        from kvxfer.backend.nixl import NixlBackend

        return NixlBackend
    if name == "FakeBackend":
        from kvxfer.backend.fake import FakeBackend

        return FakeBackend
    raise AttributeError(f"module 'kvxfer.backend' has no attribute {name!r}")
