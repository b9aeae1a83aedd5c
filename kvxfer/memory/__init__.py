"""Memory registration (layer: memory; imports backend.base, layout.spec, types, errors, numpy; never torch, cupy or nixl)."""

from kvxfer.memory.registry import MemoryRegistry, merge_spans
from kvxfer.memory.tensors import TensorInfo, describe, host_view

__all__ = ["MemoryRegistry", "TensorInfo", "describe", "host_view", "merge_spans"]
