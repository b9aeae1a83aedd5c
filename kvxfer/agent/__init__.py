"""The composition root: ``Agent`` wires config, backend, registry, engine and side channel."""

from kvxfer.agent.core import Agent
from kvxfer.agent.reports import AgentStats, Finished

__all__ = ["Agent", "AgentStats", "Finished"]
