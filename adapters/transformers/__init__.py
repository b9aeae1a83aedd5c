"""kvxfer's Hugging Face transformers adapter: a paged KV pool, P/D prefill and decode, and ``kvxfer-hf serve``.

A transformers causal LM (Llama/Qwen family: rotary, GQA) keeps its KV in a ``DynamicCache``;
this package copies it into a pool of fixed-size blocks registered with a kvxfer ``Agent``
(prefill side), or reads a peer's blocks into that pool and rebuilds a ``DynamicCache`` from
them (decode side). The peer may be another ``kvxfer-hf`` server or vLLM with
``KvxferConnector``: ``kv_transfer_params`` carry vLLM's field names. Hybrid models
(sliding-window layers, SSM / linear-attention state layers) are held as several groups
(``kvxfer_transformers.groups``, ``kvxfer_transformers.state``; docs/engines.md). Uses kvxfer's public API
only (``from kvxfer import ...``), like the vLLM adapter. Importing the package loads neither
torch nor transformers; the modules that need them import them themselves.
"""

__all__ = ["HFEngine", "KVPool", "ServeSettings"]


def __getattr__(name: str):
    if name == "HFEngine":
        from kvxfer_transformers.engine import HFEngine

        return HFEngine
    if name == "KVPool":
        from kvxfer_transformers.pool import KVPool

        return KVPool
    if name == "ServeSettings":
        from kvxfer_transformers.settings import ServeSettings

        return ServeSettings
    raise AttributeError(f"module 'kvxfer_transformers' has no attribute {name!r}")
