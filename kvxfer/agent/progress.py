"""The agent's background thread: polls transfers, delivers notifications, expires leases (layer: agent).

One per ``Agent`` (``kvxfer-<name>``). It completes handles whose bytes landed, drains failed
requests, routes a staged pipeline's notifications and reports a consumer's write as arrived.
It sleeps between passes unless bytes are moving: UCX moves shared-memory data inside the polls.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvxfer.errors import ClosedError, KvxferError
from kvxfer.protocol import decode_notification

if TYPE_CHECKING:
    from kvxfer.agent.parts import AgentParts

__all__ = ["DONE_DEFER", "HOLDING_CADENCE", "IDLE_CADENCE", "drive_once", "on_notification", "run_progress"]

log = logging.getLogger("kvxfer.agent")

IDLE_CADENCE = 0.005     # seconds between the driver's whole passes with nothing to poll
HOLDING_CADENCE = 0.001  # the same while this agent holds requests (their leases expire)
#: The longest the driver defers its done-notice flush while a call submits reads: the flush
#: wakes the producers' done lanes, which would share the interpreter with that call's launch.
DONE_DEFER = 0.02


def on_notification(agent: "AgentParts", peer: str, data: bytes) -> None:
    """One backend notification: a staged pipeline's message, or a request-done notice."""
    if agent.paths is not None and agent.paths.deliver(peer, data):
        return  # a staged pipeline's message, routed to its transfer
    try:
        request_id, engine_id = decode_notification(data, agent.config.auth_key)
    except KvxferError as exc:
        log.warning("dropping a bad notification from %s: %s", peer, exc)
        return
    if agent.leases.done(request_id, engine_id) or agent.leases.held(request_id):
        return
    agent.reports.write_arrived(request_id, engine_id)


def drive_once(agent: "AgentParts", driver: bool = False) -> tuple[bool, int, float]:
    """One pass over everything that moves: transfers (and the claims they wait for), staged
    pipelines, notifications, lease expiry. Runs in ``Agent.poll`` (an engine's own thread) and
    on the progress thread (``driver``); both may run it at once: each request is polled by one
    thread at a time.

    The driver stays off the interpreter of the threads that submit and poll their own reads: it
    leaves a request to the thread that submitted it while that call works on it and for
    ``CALLER_GRACE`` after, and makes a whole pass only when it has a request to poll, a staged
    pipeline runs, or its cadence has come (``IDLE_CADENCE``, ``HOLDING_CADENCE`` while this
    agent holds requests) since its last whole pass; otherwise it only looks. While a call
    submits reads it does not flush done notices (for ``DONE_DEFER`` at most). Returns (busy:
    poll again without sleeping, moving: ``TransferEngine.moving`` over what it polls, rest: the
    longest it may sleep before it looks again)."""
    engine = agent.engine
    cadence = HOLDING_CADENCE if len(agent.leases) else IDLE_CADENCE
    busy, moving, fresh = False, 0, 0.0
    if engine is not None:
        moving, fresh = engine.driver_view(leave_fresh=driver)
    if driver and not moving and not (engine is not None and agent.paths.pipelines_active()):
        now = time.monotonic()
        due = agent.driven_at + cadence - now
        if due > 0 and (fresh or engine is None or not engine.in_flight()):
            return False, 0, _sooner(fresh, due)  # nothing for the driver yet: look again then
    if driver:
        agent.driven_at = time.monotonic()
    if engine is not None:
        # Spin only while bytes move: a request still claiming on its lane needs no polls, and
        # a spinning loop would take the interpreter from that lane.
        busy = moving == 2
        if moving or engine.in_flight():
            engine.progress(leave_fresh=driver)
        if agent.paths.pipelines_active():
            busy = True  # pipelines wait on notifications: deliver them at once
            agent.paths.packer.reap()
    if agent.done is not None:
        # the done notices of the reads completed since the last flush; the driver keeps them
        # while a call submits reads (at most DONE_DEFER): the lanes they wake would slow it
        at = time.monotonic()
        if not (driver and agent.submitting and at - agent.flushed_at < DONE_DEFER):
            agent.flushed_at = at
            agent.done.flush()
    for peer, data in agent.backend.notifications():
        on_notification(agent, peer, data)
    now = agent.clock.now()
    if now - agent.expired_at > 0.01:
        agent.expired_at = now
        agent.leases.expire()
    ttl = agent.config.peer_idle_ttl
    if ttl is not None and agent.peers is not None and now - agent.idle_swept_at >= min(ttl / 4, 30.0):
        agent.idle_swept_at = now
        forget_idle_peers(agent, ttl)
    if moving == 1:  # kernels, pipelines or claims' answers in flight: look again soon, not in a spin
        return busy, moving, 0.0002
    return busy, moving, _sooner(fresh, cadence)


def _sooner(fresh: float, bound: float) -> float:
    """The driver's rest: ``bound``, or less where a caller's grace (``fresh`` seconds, 0.0 for
    none) ends first."""
    return min(fresh, bound) if fresh else bound


def forget_idle_peers(agent: "AgentParts", ttl: float) -> None:
    """Forget the producers' links unused for ``ttl`` seconds (``AgentConfig.peer_idle_ttl``),
    except those a read of this agent may still use: one with parts on that peer (in flight or
    quarantined), or one in flight to that host and not yet posted."""
    in_use = agent.engine.peers_in_use() if agent.engine is not None else set()
    hosts = agent.read_remotes.hosts()
    for link in agent.peers.forget_idle(ttl, lambda link: link.agent_name in in_use or link.host in hosts):
        log.info("kvxfer: forgot %s at %s:%d, unused for %.0f s (peer_idle_ttl); a later read handshakes afresh",
                 link.engine_id, link.host, link.port, ttl)


def run_progress(agent: "AgentParts") -> None:
    """The loop, until the agent closes."""
    wake = agent.wake
    while not agent.closed:
        # Cleared before the pass, not after the wait: a wake-up that comes during the pass
        # makes the wait below return at once instead of being lost.
        wake.clear()
        busy, rest = False, IDLE_CADENCE
        try:
            busy, _, rest = drive_once(agent, driver=True)
        except ClosedError:
            return
        except Exception:  # the loop must survive anything a peer can cause
            log.exception("kvxfer progress loop")
        if not busy:
            wake.wait(rest)
        elif agent.config.progress_interval:
            wake.wait(agent.config.progress_interval)
        else:  # UCX moves shared-memory data inside our polls: spin while transfers are in flight
            time.sleep(0)
