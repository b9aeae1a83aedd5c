"""The composition root: ``Agent`` wires config, backend, registry, engine and side channel."""

from kvxfer.agent.announce import Announcement
from kvxfer.agent.core import Agent
from kvxfer.agent.reports import AgentStats, Finished
from kvxfer.agent.streams import WriteStream

__all__ = ["Agent", "AgentStats", "Announcement", "Finished", "WriteStream"]
