"""Sans-IO handshake and request state machines (layer: protocol, pure; never imports zmq, sockets or threads).

Bytes in, bytes or messages out; the caller moves the bytes (``kvxfer.transport.zmq`` in
production, an in-memory link in tests). All transitions sit in the two tables below.

Client::   idle --start()--> hello_sent --Welcome--> ready
                                        --Reject/garbage--> failed
           ready --Reject('state') in response()--> idle   (the server forgot us: restarted)
           any  --start()--> hello_sent                     (re-handshake)

Server::   awaiting_hello --valid Hello--> ready --valid Hello--> ready (re-handshake)
           Every invalid frame is answered with a Reject and leaves the state as it was.
"""

from __future__ import annotations

import logging
from typing import Callable

from kvxfer.errors import (
    AuthenticationError,
    ConfigError,
    IncompatiblePeerError,
    KvxferError,
    LayoutError,
    PeerLostError,
    ProtocolError,
)
from kvxfer.protocol.codec import HEADER, Codec
from kvxfer.protocol.messages import (
    PROTOCOL_VERSION,
    REPLIES,
    Abort,
    Announce,
    Claim,
    ClaimBatch,
    Done,
    Grants,
    Heartbeat,
    Hello,
    Message,
    PackRequest,
    PeerInfo,
    Reject,
    Welcome,
    WritesDone,
    check_peer_info,
    spec_from_wire,
    compat_hash,
)
from kvxfer.types import SessionState

__all__ = ["ClientSession", "ServerSession", "reject_error"]

log = logging.getLogger(__name__)

#: Client: which call is legal in which state (anything else raises ProtocolError).
_CLIENT_CALLS: dict[str, frozenset[SessionState]] = {
    "start": frozenset({SessionState.IDLE, SessionState.HELLO_SENT, SessionState.READY, SessionState.FAILED}),
    "receive_welcome": frozenset({SessionState.HELLO_SENT}),
    "request": frozenset({SessionState.READY}),
    "response": frozenset({SessionState.READY}),
}

#: Server: (state, message type) -> handler name. Anything else is Reject('state').
_SERVER_TABLE: dict[tuple[SessionState, type], str] = {
    (SessionState.AWAITING_HELLO, Hello): "_on_hello",
    (SessionState.READY, Hello): "_on_hello",
    **{(SessionState.READY, kind): "_on_request" for kind in REPLIES},
}

#: Requests that name the sending engine: it must be the handshaken one.
_NAMES_ITS_ENGINE = (Claim, Heartbeat, Abort, Done, Announce, WritesDone)

_REPLY_TYPES = tuple({t for replies in REPLIES.values() for t in replies})


def reject_error(reject: Reject, context: str) -> ProtocolError:
    """The typed error a peer's ``Reject`` stands for (not raised here)."""
    text = f"{context}: peer rejected it ({reject.code}): {reject.detail}"
    if reject.code in ("version", "model"):
        return IncompatiblePeerError(text)
    if reject.code == "auth":
        return AuthenticationError(text)
    return ProtocolError(text)


def _check_local(codec: Codec, local: PeerInfo) -> None:
    try:
        got = compat_hash(spec_from_wire(local.spec))
    except (ProtocolError, LayoutError) as exc:
        raise ConfigError(f"local PeerInfo has an invalid spec: {exc}") from None
    if got != codec.compat:
        raise ConfigError(f"local spec compat hash: expected {codec.compat[:16]}... (codec); got {got[:16]}...")


def _check_batch_answer(batch: ClaimBatch, answer: Grants) -> None:
    """A ``Grants`` answers its ``ClaimBatch`` claim by claim, in order: one reply per claim, each
    naming that claim's request (a grant of another request proves nothing about this one)."""
    if len(answer.replies) != len(batch.claims):
        raise ProtocolError(f"a ClaimBatch of {len(batch.claims)} claims was answered with "
                            f"{len(answer.replies)} replies")
    for index, (claim, reply) in enumerate(zip(batch.claims, answer.replies)):
        if reply.request_id != claim.request_id:
            raise ProtocolError(f"reply {index} of a ClaimBatch: request_id: expected {claim.request_id!r}; "
                                f"got {reply.request_id!r}")


class ClientSession:
    """Client side of one connection to one remote agent.

    Attributes:
        state: a ``SessionState``: ``IDLE``, ``HELLO_SENT``, ``READY`` or ``FAILED``.
        peer: the server's ``PeerInfo`` from the latest Welcome (kept across a restart).
        peer_spec, peer_geometry: the validated ``KVSpec`` / ``CacheGeometry`` of ``peer``.
        restarted: the latest Welcome came from another ``engine_id`` than the one before:
            the peer restarted; every plan or handle built for the old one is stale.
    """

    def __init__(self, codec: Codec, local: PeerInfo):
        _check_local(codec, local)
        self.codec = codec
        self.local = local
        self.state = SessionState.IDLE
        self.peer: PeerInfo | None = None
        self.peer_spec = None
        self.peer_geometry = None
        self.restarted = False

    def _require(self, call: str) -> None:
        if self.state not in _CLIENT_CALLS[call]:
            allowed = sorted(state.value for state in _CLIENT_CALLS[call])
            raise ProtocolError(f"{call}(): expected state in {allowed}; got {self.state.value!r}")

    def start(self) -> bytes:
        """Begin (or restart) the handshake; returns the Hello frame to send."""
        self._require("start")
        frame = self.codec.encode(Hello(self.local))
        self.state = SessionState.HELLO_SENT
        return frame

    def receive_welcome(self, frame: bytes) -> PeerInfo:
        """Take the server's answer to Hello; on success the session is ``ready``.

        Raises:
            ProtocolError: wrong state (state unchanged), malformed frame or not a Welcome.
            IncompatiblePeerError: the server rejected us or serves an incompatible cache.
            AuthenticationError: the frame or the server's verdict failed authentication.
            Any error but the wrong-state one leaves the session ``failed``.
        """
        self._require("receive_welcome")
        try:
            msg = self.codec.decode(frame)
            if isinstance(msg, Reject):
                raise reject_error(msg, "Hello")
            if not isinstance(msg, Welcome):
                raise ProtocolError(f"handshake reply: expected Welcome; got {type(msg).__name__}")
            spec, geometry = check_peer_info(msg.info, self.codec.compat)
        except KvxferError:
            self.state = SessionState.FAILED
            raise
        self.restarted = self.peer is not None and self.peer.engine_id != msg.info.engine_id
        self.peer, self.peer_spec, self.peer_geometry = msg.info, spec, geometry
        self.state = SessionState.READY
        return msg.info

    def request(self, msg: Message) -> bytes:
        """Frame a request (Claim, Heartbeat, Abort or PackRequest); only when ready.

        Raises:
            ProtocolError: not ready, or ``msg`` is not a request type.
        """
        self._require("request")
        if type(msg) not in REPLIES:
            names = sorted(t.__name__ for t in REPLIES)
            raise ProtocolError(f"request(): expected one of {names}; got {type(msg).__name__}")
        return self.codec.encode(msg)

    def response(self, frame: bytes, request: Message | None = None) -> Message:
        """Decode the reply to a request; with ``request``, also check it answers that request.

        Raises:
            PeerLostError: the server no longer knows this session (restarted or evicted us);
                the state drops to ``idle``: call ``start()`` and check ``restarted``.
            ProtocolError (or a subclass): not ready, garbage, a Reject, or a reply of the wrong
                type or request id; the state is unchanged.
        """
        self._require("response")
        msg = self.codec.decode(frame)
        if isinstance(msg, Reject):
            if msg.code == "state":
                self.state = SessionState.IDLE
                peer = self.peer.engine_id if self.peer else "?"
                raise PeerLostError(
                    f"peer {peer} no longer knows this session ({msg.detail}); it restarted or "
                    "dropped us: handshake again"
                )
            raise reject_error(msg, "request")
        allowed = REPLIES.get(type(request), _REPLY_TYPES) if request is not None else _REPLY_TYPES
        if not isinstance(msg, allowed):
            names = sorted(t.__name__ for t in allowed)
            raise ProtocolError(f"reply: expected one of {names}; got {type(msg).__name__}")
        want_id = getattr(request, "request_id", None)
        got_id = getattr(msg, "request_id", want_id)
        if want_id is not None and got_id != want_id:
            raise ProtocolError(f"reply request_id: expected {want_id!r}; got {got_id!r}")
        if isinstance(request, ClaimBatch) and isinstance(msg, Grants):
            _check_batch_answer(request, msg)
        return msg


class ServerSession:
    """Server side for ONE client identity (one connection).

    Args:
        codec: shared with the other sessions of this listener.
        local: this agent's ``PeerInfo``, sent in Welcome.
        on_request: called with each valid request of a handshaken client (Claim,
            Heartbeat, Abort, PackRequest) and returns the reply message. A
            ``KvxferError`` it raises becomes a Reject; any other exception is logged
            and becomes Reject('unknown').

    Attributes:
        state: a ``SessionState``: ``AWAITING_HELLO`` or ``READY``.
        peer: the client's ``PeerInfo`` once handshaken; ``peer_spec``/``peer_geometry`` validated.
        restarted: the latest Hello replaced a peer with another ``engine_id``.
        rejected: how many frames were answered with a Reject (for metrics and tests).
        last_reject: ``(code, detail)`` of the latest Reject (for the transport's rate-limited log).
    """

    def __init__(self, codec: Codec, local: PeerInfo, on_request: Callable[[Message], Message]):
        _check_local(codec, local)
        self.codec = codec
        self.local = local
        self.on_request = on_request
        self.state = SessionState.AWAITING_HELLO
        self.peer: PeerInfo | None = None
        self.peer_spec = None
        self.peer_geometry = None
        self.restarted = False
        self.rejected = 0
        self.last_reject: tuple[str, str] = ("", "")

    def receive(self, frame: bytes) -> bytes:
        """Handle one frame from the client; returns the reply frame. Never raises for peer input."""
        try:
            msg = self.codec.decode(frame)
        except AuthenticationError as exc:
            return self._reject("auth", exc)
        except IncompatiblePeerError as exc:
            return self._reject(self._incompatible_code(frame), exc)
        except ProtocolError as exc:
            return self._reject("malformed", exc)
        handler = _SERVER_TABLE.get((self.state, type(msg)))
        if handler is None:
            return self._reject(
                "state", f"in state {self.state.value!r} a client may not send {type(msg).__name__}"
                + (" (expected Hello first)" if self.state is SessionState.AWAITING_HELLO else "")
            )
        return getattr(self, handler)(msg)

    @staticmethod
    def _incompatible_code(frame: bytes) -> str:
        version = int.from_bytes(bytes(frame[4:6]), "big") if len(frame) >= HEADER.size else None
        return "version" if version != PROTOCOL_VERSION else "model"

    def _reject(self, code: str, why: object) -> bytes:
        # Not logged here: the transport counts rejections and rate-limits their log lines, so
        # hostile input cannot flood the log (see kvxfer.transport.sessions.LogLimiter).
        self.rejected += 1
        detail = str(why)[:1000]
        self.last_reject = (code, detail)
        return self.codec.encode(Reject(code=code, detail=detail))

    def refuse_busy(self, why: str) -> bytes:
        """A ``Reject('busy')`` frame: the transport keeps no session for this client now (its
        table is full of sessions it may not evict). Resets the session to ``awaiting_hello``."""
        self.forget_peer()
        return self._reject("busy", why)

    def forget_peer(self) -> None:
        """Back to ``awaiting_hello``, dropping the peer's ``PeerInfo`` (up to 512 KiB of backend
        metadata): the transport calls this when it stops keeping the session."""
        self.state, self.peer, self.peer_spec, self.peer_geometry = SessionState.AWAITING_HELLO, None, None, None

    def _on_hello(self, msg: Hello) -> bytes:
        try:
            spec, geometry = check_peer_info(msg.info, self.codec.compat)
        except IncompatiblePeerError as exc:
            return self._reject("model", exc)
        except ProtocolError as exc:
            return self._reject("malformed", exc)
        previous = self.peer
        self.restarted = previous is not None and previous.engine_id != msg.info.engine_id
        if self.restarted:
            log.info("side channel: client %s replaced by %s (restart)",
                     previous.engine_id, msg.info.engine_id)
        self.peer, self.peer_spec, self.peer_geometry = msg.info, spec, geometry
        self.state = SessionState.READY
        return self.codec.encode(Welcome(self.local))

    def _on_request(self, msg: Message) -> bytes:
        if isinstance(msg, _NAMES_ITS_ENGINE) and msg.engine_id != self.peer.engine_id:
            return self._reject(
                "state", f"engine_id: expected {self.peer.engine_id!r} (handshaken); got {msg.engine_id!r}"
            )
        if isinstance(msg, ClaimBatch):
            other = next((c.engine_id for c in msg.claims if c.engine_id != self.peer.engine_id), None)
            if other is not None:
                return self._reject(
                    "state", f"engine_id: expected {self.peer.engine_id!r} (handshaken); got {other!r}")
        if isinstance(msg, PackRequest) and msg.head_stop <= msg.head_start:
            return self._reject(
                "malformed", f"PackRequest heads: expected head_start < head_stop; got "
                f"[{msg.head_start}, {msg.head_stop})"
            )
        try:
            reply = self.on_request(msg)
        except (ProtocolError, LayoutError) as exc:
            return self._reject("malformed", exc)
        except KvxferError as exc:
            return self._reject("unknown", exc)
        except Exception as exc:  # a bug in the handler must not kill the listener
            log.exception("side channel: request handler failed on %s", type(msg).__name__)
            return self._reject("unknown", f"internal error: {type(exc).__name__}")
        allowed = REPLIES[type(msg)]
        if not isinstance(reply, allowed):
            log.error("side channel: handler answered %s with %r", type(msg).__name__, reply)
            return self._reject("unknown", f"internal error: handler returned {type(reply).__name__}")
        try:
            return self.codec.encode(reply)
        except ProtocolError as exc:
            return self._reject("unknown", exc)
