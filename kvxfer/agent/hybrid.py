"""What ``Agent`` does differently for a hybrid cache (layer: agent; imports layout, config, types, errors).

A hybrid agent's ``spec`` is the cache's flat-id carrier (``kvxfer.layout.carrier``): holds,
claims, hold tokens, quarantines and done notices run on flat ids exactly as for one group, so
one claim (or hold token) and one post per producer rank cover every group of a request. Here:
the constructor's spec and config, and each call's per-group id lists turned into flat ids.
Reads always move by descriptors (the ``direct`` path): the IPC kernel and the staged
pipelines know one group only.
"""

from __future__ import annotations

from dataclasses import replace

from kvxfer.config import AgentConfig
from kvxfer.errors import ConfigError
from kvxfer.layout.carrier import carrier_for, flat_ids, hybrid_of
from kvxfer.layout.groups import HybridSpec
from kvxfer.types import ReadRequest

__all__ = ["hybrid_config", "hybrid_hold_ids", "hybrid_reads", "hybrid_spec", "refuse_hybrid"]


def hybrid_spec(spec):
    """The spec an agent keeps: a ``HybridSpec`` becomes its carrier; anything else is returned."""
    return carrier_for(spec) if isinstance(spec, HybridSpec) else spec


def hybrid_config(spec, config: AgentConfig) -> AgentConfig:
    """``config`` for an agent of ``spec``: a hybrid cache's reads take the direct path ("auto"
    becomes "direct"; "ipc" or "staged" is a ConfigError naming it)."""
    if hybrid_of(spec) is None:
        return config
    path = str(getattr(config.transfer_path, "value", config.transfer_path))
    if path == "direct":
        return config
    if path != "auto":
        raise ConfigError(f"a hybrid cache moves by descriptors: transfer_path must be 'auto' or 'direct'; "
                          f"got {path!r}")
    return replace(config, transfer_path="direct")


def hybrid_hold_ids(spec, block_ids):
    """A hold's ids: one list per group for a hybrid cache (flat ids returned), else as given."""
    h = hybrid_of(spec)
    return block_ids if h is None else flat_ids(h, block_ids, "held")


def hybrid_reads(spec, requests):
    """``read_many``'s requests with a hybrid cache's per-group lists as flat ids (each
    sliding group's lists cut to the window of ``num_tokens``, which then moves whole blocks);
    anything else unchanged. Raises BlockIdError / ConfigError before anything is booked."""
    h = hybrid_of(spec)
    if h is None:
        return requests
    out = []
    for rr in requests:
        if not isinstance(rr, ReadRequest):
            raise ConfigError(f"read_many takes ReadRequest items; got {type(rr).__name__}")
        out.append(replace(rr, local_blocks=flat_ids(h, rr.local_blocks, "local", rr.num_tokens),
                           remote_blocks=flat_ids(h, rr.remote_blocks, "remote", rr.num_tokens), num_tokens=None))
    return out


def refuse_hybrid(spec, what: str) -> None:
    """ConfigError when ``spec`` is a hybrid cache: ``what`` (writes, pushes) moves one group only."""
    if hybrid_of(spec) is not None:
        raise ConfigError(f"{what} of a hybrid cache (several KV-cache groups) is not supported: read it instead "
                          f"(Agent.read with one block list per group)")
