"""Test support for engines built on kvxfer (layer: testing; imports backend.fake only, never nixl).

``FakeBackend`` really copies bytes between registered buffers of agents in one process, with
fault injection (``fail_next``, ``hold_transfers``, ``kill``); see ``kvxfer.backend.fake``.
"""

from kvxfer.backend.fake import FakeBackend, FakeWorld

__all__ = ["FakeBackend", "FakeWorld"]
