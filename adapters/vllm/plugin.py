"""vLLM general-plugin hook: registers ``KvxferConnector`` by name with vLLM's connector factory."""

from __future__ import annotations

CONNECTOR_NAME = "KvxferConnector"


def register() -> None:
    """Make ``"kv_connector": "KvxferConnector"`` resolvable (idempotent; vLLM calls it in every process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvxfer_vllm.connector", CONNECTOR_NAME)
    except ValueError:
        pass  # already registered in this process (plugins may load more than once)
