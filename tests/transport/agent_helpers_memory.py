"""A polling helper for the transport tests (kept apart from tests/engine's helpers)."""

from kvxfer.testing import wait_for

__all__ = ["wait_for"]
