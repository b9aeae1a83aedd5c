"""kvxfer's vLLM adapter: ``KvxferConnector``, a vLLM KV connector (KVConnectorBase_V1) built on kvxfer's Agent.

Start vLLM with ``--kv-transfer-config '{"kv_connector":"KvxferConnector","kv_role":"kv_both"}'``;
the ``vllm.general_plugins`` entry point (``kvxfer_vllm.plugin:register``) makes the bare name
known. ``"kv_connector_module_path": "kvxfer_vllm"`` works as well. Importing this package does
not import vLLM; the connector class loads on first access.
"""

__all__ = ["KvxferConnector"]


def __getattr__(name: str):
    if name == "KvxferConnector":
        from kvxfer_vllm.connector import KvxferConnector

        return KvxferConnector
    raise AttributeError(f"module 'kvxfer_vllm' has no attribute {name!r}")
