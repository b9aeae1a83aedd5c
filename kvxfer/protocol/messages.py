"""Side-channel wire messages (layer: protocol, pure; imports msgspec, numpy and kvxfer's fixed modules only, never zmq, sockets or threads).

Every message is a frozen, tagged ``msgspec.Struct`` in the one union ``Message``. The tag
is the class name. Evolution rule: a later protocol revision may only *append* fields with
defaults to a Struct (older peers ignore unknown fields) or add new Structs; anything else
bumps ``PROTOCOL_VERSION``. Field constraints (``Meta``) are enforced by the typed decoder,
so a structurally bad body is rejected before any session code sees it.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from typing import Annotated, Union

import msgspec
import numpy as np
from msgspec import Meta

from kvxfer.errors import IncompatiblePeerError, LayoutError, ProtocolError
from kvxfer.layout.spec import DTYPE_SIZES, CacheGeometry, KVSpec
from kvxfer.types import MemKind

__all__ = [
    "PROTOCOL_VERSION",
    "REJECT_CODES",
    "REPLIES",
    "Abort",
    "Ack",
    "Announce",
    "Claim",
    "Grant",
    "Heartbeat",
    "HeartbeatAck",
    "Hello",
    "IpcWire",
    "MAX_BACKEND_METADATA",
    "MAX_LAYERS",
    "MAX_PAYLOAD",
    "Message",
    "PackReady",
    "PackRequest",
    "PeerInfo",
    "Refuse",
    "Reject",
    "SpecWire",
    "StagingWire",
    "Welcome",
    "WritesDone",
    "check_peer_info",
    "claim_blocks",
    "compat_hash",
    "engine_named",
    "make_peer_info",
    "new_engine_id",
    "pack_ids",
    "spec_from_wire",
    "spec_to_wire",
]

#: The one protocol version. Both sides must speak exactly this version.
PROTOCOL_VERSION = 1

#: Codes a ``Reject`` may carry. A peer may send a code not listed (a newer peer); treat it as "unknown".
REJECT_CODES = frozenset({"version", "model", "auth", "malformed", "state", "busy", "unknown"})

# Bounded scalar types: ids and free text are short; ints fit uint64 / int64 as on the wire.
Id = Annotated[str, Meta(min_length=1, max_length=1024)]
Text = Annotated[str, Meta(max_length=4096)]
U64 = Annotated[int, Meta(ge=0)]  # msgpack ints stop at 2**64 - 1 by construction
NonNeg = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Positive = Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e9)]


class SpecWire(msgspec.Struct, frozen=True):
    """Every ``KVSpec`` field, in wire types (enums as their string values)."""

    num_layers: Positive
    num_kv_heads: Positive
    head_dim: Positive
    block_size: Positive
    num_blocks: Positive
    dtype: Annotated[str, Meta(max_length=64)]
    layout: Annotated[str, Meta(max_length=16)]
    storage: Annotated[str, Meta(max_length=16)]
    mla: bool
    tp_rank: NonNeg
    tp_size: Positive
    model: Annotated[str, Meta(max_length=1024)] = ""
    # Appended: K kept dim-major in chunks of this many elements (``KVSpec.k_dim_chunk``; vLLM's
    # CPU cache). Older peers send none (token-major K) and ignore it: they only ever exchanged
    # such a cache whole-block with one of the same format, where K's order moves untouched.
    k_dim_chunk: Annotated[int, Meta(ge=0, le=1 << 20)] = 0
    # Appended: K and V of a token side by side in one vector (``KVSpec.kv_fused``; vLLM's GPU
    # caches). A fused spec's compat hash differs from every older one, so older peers refuse
    # its Hello before reading it.
    kv_fused: bool = False


#: Bounds of ``PeerInfo`` (a Hello is accepted before anything else is known about its sender, so
#: every field is bounded well below the frame limit). ``MAX_LAYERS``: rows of ``bases`` and of the
#: IPC tables (each row is one layer's K and V, at most 2 entries). ``MAX_BACKEND_METADATA``: NIXL
#: UCX metadata measured 496 B with 2 registered regions, 11.7 KB with 256 and 45 KB with 1024
#: (about 44 B a region, host memory; GPU regions carry larger keys): 512 KiB leaves a wide margin.
MAX_LAYERS = 4096
MAX_PACKED_IDS = 4 << 20  # bytes of ``Claim.packed_ids``: a million block ids
MAX_BACKEND_METADATA = 512 << 10
MAX_IPC_HANDLES = 4096
MAX_REGIONS = MAX_LAYERS
_Row = Annotated[list[U64], Meta(max_length=2)]


class IpcWire(msgspec.Struct, frozen=True):
    """A producer's CUDA IPC export (``kvxfer.gpu.ipc.IpcExport``): one 64-byte handle per
    allocation, and per region ``[layer][kv]`` the allocation index and offset inside it."""

    device: NonNeg
    handles: Annotated[list[Annotated[bytes, Meta(min_length=64, max_length=64)]],
                       Meta(min_length=1, max_length=MAX_IPC_HANDLES)]
    alloc_index: Annotated[list[Annotated[list[NonNeg], Meta(max_length=2)]], Meta(max_length=MAX_REGIONS)]
    offsets: Annotated[list[_Row], Meta(max_length=MAX_REGIONS)]


class StagingWire(msgspec.Struct, frozen=True):
    """A producer's registered staging area for the staged pipeline: ``slots`` x ``slot_bytes`` at ``addr``."""

    addr: U64
    slot_bytes: Positive
    slots: Annotated[int, Meta(ge=1, le=4096)]
    device: NonNeg
    mem_kind: Annotated[str, Meta(max_length=8)]


class _Msg(msgspec.Struct, frozen=True, tag=True):
    """Base of every wire message: frozen and tagged with its class name."""


class PeerInfo(msgspec.Struct, frozen=True):
    """Everything a peer needs about one agent (one TP rank).

    ``engine_id`` is unique per agent start (name + random nonce), so a restarted peer
    at the same host:port announces a different one. ``bases`` mirrors
    ``CacheGeometry.bases`` (``[num_layers][kv_count]`` addresses in the owner's process).
    """

    engine_id: Id
    agent_name: Id
    spec: SpecWire
    bases: Annotated[list[_Row], Meta(max_length=MAX_LAYERS)]
    device: NonNeg
    mem_kind: Annotated[str, Meta(max_length=8)]
    backend_metadata: Annotated[bytes, Meta(max_length=MAX_BACKEND_METADATA)]
    listen_host: Annotated[str, Meta(max_length=255)] = ""
    listen_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    lease_timeout: Seconds = 480.0
    # Appended (protocol evolution): the GPU paths. Older peers send none, and get direct reads.
    host_id: Annotated[str, Meta(max_length=512)] = ""   # boot id + hostname: same host, same value
    ipc: IpcWire | None = None                          # CUDA IPC export of a VRAM cache
    staging: StagingWire | None = None                  # staging area serving PackRequests
    # Appended: this agent's listener takes multiplexed requests (an id before each frame, echoed
    # on the reply), so a client may keep several in flight on one session. Older peers: False.
    multiplexed: bool = False
    # Appended: the port of this agent's express lane (per-request frames over plain TCP, on
    # ``listen_host``; see kvxfer.transport.express). 0: none, requests stay on the side channel.
    express_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    # Appended: host identity + network namespace (kvxfer.engine.paths.kit.network_identity): a
    # peer with another value is reached through a network device. Older peers: "" (unknown).
    net_id: Annotated[str, Meta(max_length=1024)] = ""
    # Appended: this agent reads ``Claim.packed_ids``. Older peers: False (they get lists).
    packed_ids: bool = False
    # Appended: this agent answers ``ClaimBatch`` (many requests' claims in one message). Older
    # peers: False (they get one ``Claim`` per request).
    batch_claims: bool = False
    # Appended: this agent reads ``Done.more`` (a step's done notices in one message). Older
    # peers: False (they get one ``Done`` per request).
    batch_done: bool = False
    # Appended: this agent's table of hold words (kvxfer.engine.holdwords; docs/reliability.md,
    # "hold tokens"): its path under /dev/shm for consumers on this host, its slots, and its
    # address as registered with the backend (0: not registered) for consumers elsewhere. Older
    # peers: "" / 0 (every read of them claims).
    hold_words: Annotated[str, Meta(max_length=512)] = ""
    hold_slots: Annotated[int, Meta(ge=0, le=1 << 24)] = 0
    hold_words_addr: Annotated[int, Meta(ge=0)] = 0
    # Appended: a hybrid cache's groups (kvxfer.protocol.hybridwire); ``spec`` is then its flat-id
    # carrier (kvxfer.layout.carrier). Older peers: b"" (one group; they refuse a hybrid peer's
    # carrier spec by its compat hash).
    hybrid: Annotated[bytes, Meta(max_length=4 << 20)] = b""


class Hello(_Msg, frozen=True):
    """Client -> server, the first message on a connection."""

    info: PeerInfo


class Welcome(_Msg, frozen=True):
    """Server -> client, the answer to a valid ``Hello``."""

    info: PeerInfo


class Reject(_Msg, frozen=True):
    """Server -> client: the last frame was refused; the server's state did not change."""

    code: Annotated[str, Meta(max_length=32)]
    detail: Text


class Claim(_Msg, frozen=True):
    """Consumer -> producer before reading: 'I am about to read these blocks of this request'.

    ``window``: seconds, from the producer's receipt of this claim, during which the consumer
    may still be moving bytes; the producer keeps the blocks (whatever ``release``, abort or
    lease expiry say meanwhile) until the consumer reports done or the window has passed.
    0 (an older consumer): the producer's own lease timeout.
    """

    request_id: Id
    block_ids: list[NonNeg]
    engine_id: Id
    window: Seconds = 0.0
    # Appended: the ids packed as little-endian uint32 (``block_ids`` then empty), sent only to a
    # peer whose ``PeerInfo.packed_ids`` is set: neither side turns ids into Python ints.
    packed_ids: Annotated[bytes, Meta(max_length=MAX_PACKED_IDS)] = b""


PACKED_ID = np.dtype("<u4")  # one id of ``Claim.packed_ids``


def pack_ids(ids: np.ndarray) -> bytes | None:
    """``ids`` (a 1-D integer array) as ``Claim.packed_ids``; None when one does not fit 32 bits."""
    if ids.size and int(ids.max()) >= 1 << 32:
        return None
    return ids.astype(PACKED_ID, copy=False).tobytes()


def pack_id_lists(lists: list[np.ndarray]) -> list[bytes | None]:
    """``pack_ids`` of each array, in one pass over all of them (an engine step's claims)."""
    if len(lists) < 2:
        return [pack_ids(ids) for ids in lists]
    flat = np.concatenate(lists)
    if flat.size and int(flat.max()) >= 1 << 32:
        return [pack_ids(ids) for ids in lists]
    packed = flat.astype(PACKED_ID, copy=False).tobytes()
    ends = np.cumsum([ids.size for ids in lists]) * PACKED_ID.itemsize
    return [packed[start:end] for start, end in zip([0, *ends[:-1].tolist()], ends.tolist())]


def claim_blocks(msg: Claim) -> bytes | list[int]:
    """The block ids ``msg`` names: its packed bytes (``PACKED_ID`` each) or its list.

    Raises:
        ProtocolError: both forms are set, or the packed bytes are not whole ids.
    """
    if not msg.packed_ids:
        return msg.block_ids
    if msg.block_ids:
        raise ProtocolError(f"Claim names {len(msg.block_ids)} listed and "
                            f"{len(msg.packed_ids) // PACKED_ID.itemsize} packed block ids: expected one form")
    if len(msg.packed_ids) % PACKED_ID.itemsize:
        raise ProtocolError(f"Claim.packed_ids is {len(msg.packed_ids)} bytes: expected a multiple of "
                            f"{PACKED_ID.itemsize}")
    return msg.packed_ids


MAX_BATCH = 4096  # claims in one ClaimBatch


class ClaimBatch(_Msg, frozen=True):
    """Consumer -> producer: the claims of many requests (one engine step) in one message.

    Each claim is judged on its own, exactly as if it came alone; the reply ``Grants`` answers
    them in the same order. Every claim must name the session's engine."""

    claims: Annotated[list[Claim], Meta(min_length=1, max_length=MAX_BATCH)]


class Grant(_Msg, frozen=True):
    """Producer -> consumer: the blocks are held for ``lease_remaining`` more seconds."""

    request_id: Id
    lease_remaining: Seconds
    # (protocol 1 as first released also had staging_offset/staging_bytes here; never set or read,
    # so they were dropped: a peer that still sends them is decoded with them ignored)


class Refuse(_Msg, frozen=True):
    """Producer -> consumer: the claim or pack cannot be served (e.g. 'lease expired')."""

    request_id: Id
    reason: Text


class Grants(_Msg, frozen=True):
    """Producer -> consumer: the answer to a ``ClaimBatch``, one ``Grant`` or ``Refuse`` per claim, in order."""

    replies: Annotated[list[Union[Grant, Refuse]], Meta(max_length=MAX_BATCH)]


class Heartbeat(_Msg, frozen=True):
    """Consumer -> producer: these requests are still wanted; extend their leases."""

    request_ids: list[Id]
    engine_id: Id


class HeartbeatAck(_Msg, frozen=True):
    """Producer -> consumer: which of the heartbeat's requests are still held."""

    alive: list[Id]
    gone: list[Id]


class Abort(_Msg, frozen=True):
    """Consumer -> producer: release the request's blocks; the consumer will not read them."""

    request_id: Id
    engine_id: Id


class Ack(_Msg, frozen=True):
    """Producer -> consumer: the message was applied.

    ``released`` (appended): to an ``Abort``, whether a hold was released (False: the request
    was not held). Older producers leave it at True.
    """

    released: bool = True


class PackRequest(_Msg, frozen=True):
    """Consumer -> producer (staged path): pack these blocks' heads [start, stop) into staging.

    ``head_start``/``head_stop`` are global KV-head indices (the heads both ranks share);
    ``consumer_ids`` are the consumer's block ids (the staging image is in its layout);
    pipeline messages of this transfer carry ``tag``; pieces are cut at ``piece_bytes``;
    the producer stops serving ``timeout`` seconds after accepting, or when the claim window it
    granted this consumer ends if that comes first (0: at the window's end).
    Sent after a granted ``Claim`` for the same request.
    """

    request_id: Id
    block_ids: list[NonNeg]
    head_start: NonNeg
    head_stop: NonNeg
    consumer_ids: list[NonNeg] = []
    tag: U64 = 0
    piece_bytes: NonNeg = 0
    timeout: Seconds = 0.0


class PackReady(_Msg, frozen=True):
    """Producer -> consumer (staged path): the packed bytes are at ``offset`` in staging.

    For the pipelined pack (``PackRequest.tag`` set) it means "accepted": ``nbytes`` is the
    whole request's staged size and pieces are announced as pipeline messages.
    """

    request_id: Id
    offset: NonNeg
    nbytes: NonNeg


class Done(_Msg, frozen=True):
    """Consumer -> producer: this consumer finished reading the request (the paths that move
    bytes without a NIXL transfer to carry the completion notification: CUDA IPC, staged; and
    replicas the consumer depends on but did not read). Not sent to a peer that announces no
    ``PeerInfo.host_id`` (an older release, which does not know it): it gets the NIXL notification."""

    request_id: Id
    engine_id: Id
    # Appended: more requests this consumer finished, told in the same message (a step's reads,
    # to a producer that announces ``PeerInfo.batch_done``). Older peers never get it.
    more: Annotated[list[Id], Meta(max_length=MAX_BATCH)] = []
    # Appended: for ``request_id`` and each of ``more``, in order, the epoch of the hold token the
    # read went by (0: it claimed); a producer ends only the hold that epoch names, never a later
    # one of the same request. Empty: no epoch (older consumers); older producers ignore it.
    epochs: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_BATCH + 1)] = []


#: Largest ``Announce.payload`` / ``WritesDone.aux`` (bytes): a few rows of engine metadata, not KV.
MAX_PAYLOAD = 1 << 20


class Announce(_Msg, frozen=True):
    """Consumer -> producer (push model, consumer first): write ``request_id`` into these blocks of
    mine. ``listen_host``/``listen_port`` is where the consumer's side channel listens (the producer
    writes there); ``payload`` is the engine's own bytes for the producer (e.g. a metadata row index)."""

    request_id: Id
    engine_id: Id
    block_ids: list[NonNeg]
    listen_host: Annotated[str, Meta(max_length=255)]
    listen_port: Annotated[int, Meta(ge=1, le=65535)]
    payload: Annotated[bytes, Meta(max_length=MAX_PAYLOAD)] = b""


class WritesDone(_Msg, frozen=True):
    """Producer -> consumer (push model): every write of ``request_id`` by this producer has
    completed; there were ``writes`` of them. ``aux`` is delivered with the KV: the consumer reports
    the request received only once the writes and this message have all arrived."""

    request_id: Id
    engine_id: Id
    writes: NonNeg
    aux: Annotated[bytes, Meta(max_length=MAX_PAYLOAD)] = b""
    error: Text = ""   # not empty: the producer gave the request up (the consumer fails it with this reason)


Message = Union[
    Hello, Welcome, Reject, Claim, Grant, Refuse, Heartbeat, HeartbeatAck,
    Abort, Ack, PackRequest, PackReady, Done, ClaimBatch, Grants, Announce, WritesDone,
]

#: Messages a client may send once ready, and the replies each one may get.
REPLIES: dict[type, tuple[type, ...]] = {
    Claim: (Grant, Refuse),
    ClaimBatch: (Grants, Refuse),
    Heartbeat: (HeartbeatAck,),
    Abort: (Ack, Refuse),
    PackRequest: (PackReady, Refuse),
    Done: (Ack, Refuse),
    Announce: (Ack, Refuse),
    WritesDone: (Ack, Refuse),
}


def compat_hash(spec: KVSpec) -> str:
    """Hex SHA-256 of what two peers must share to exchange KV blocks at all.

    Covers the protocol version, model identity, dtype, head_dim, num_layers,
    num_kv_heads, mla and kv_fused (added only when true, so other specs hash as before).
    Leaves out tp_rank/tp_size, layout, storage, block_size and num_blocks: the layout
    translator bridges those.
    """
    fields = [
        PROTOCOL_VERSION, spec.model, spec.dtype, int(spec.head_dim),
        int(spec.num_layers), int(spec.num_kv_heads), bool(spec.mla),
    ]
    if spec.kv_fused:
        fields.append("kv_fused")
    return hashlib.sha256(b"kvxfer-compat\0" + msgspec.msgpack.encode(fields)).hexdigest()


def spec_to_wire(spec: KVSpec) -> SpecWire:
    """The wire form of ``spec``."""
    return SpecWire(
        num_layers=int(spec.num_layers), num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_dim), block_size=int(spec.block_size),
        num_blocks=int(spec.num_blocks), dtype=spec.dtype, layout=spec.layout.value,
        storage=spec.storage.value, mla=bool(spec.mla), tp_rank=int(spec.tp_rank),
        tp_size=int(spec.tp_size), model=spec.model, k_dim_chunk=int(spec.k_dim_chunk),
        kv_fused=bool(spec.kv_fused),
    )


def spec_from_wire(wire: SpecWire) -> KVSpec:
    """Rebuild and re-validate a peer's ``KVSpec``.

    Raises:
        IncompatiblePeerError: the peer uses a dtype this side does not know.
        ProtocolError: any other inconsistent value (the LayoutError text names it).
    """
    if wire.dtype not in DTYPE_SIZES:
        raise IncompatiblePeerError(
            f"peer dtype: expected one of {sorted(DTYPE_SIZES)}; got {wire.dtype!r}"
        )
    try:
        return KVSpec(**msgspec.structs.asdict(wire))
    except LayoutError as exc:
        raise ProtocolError(f"peer sent an invalid KV spec: {exc}") from None


def check_peer_info(info: PeerInfo, compat: str | None = None) -> tuple[KVSpec, CacheGeometry]:
    """Validate a peer's ``PeerInfo`` and return its spec and geometry.

    Args:
        info: as decoded from a ``Hello`` or ``Welcome``.
        compat: when given, the spec's ``compat_hash`` must equal it (a peer whose
            envelope hash and body disagree is lying or broken).

    Raises:
        IncompatiblePeerError: the spec is well formed but not compatible with ``compat``.
        ProtocolError: any malformed value (names expected and actual).
    """
    spec = spec_from_wire(info.spec)
    if compat is not None:
        got = compat_hash(spec)
        if got != compat:
            raise IncompatiblePeerError(
                f"peer spec compat hash: expected {compat[:16]}...; got {got[:16]}... "
                f"(model {spec.model!r}, dtype {spec.dtype}, layers {spec.num_layers}, "
                f"kv heads {spec.num_kv_heads}, head_dim {spec.head_dim}, mla {spec.mla}, kv_fused {spec.kv_fused})"
            )
    want = (spec.num_layers, spec.kv_count)
    got_shape = (len(info.bases), *{len(row) for row in info.bases})
    if len(info.bases) != want[0] or any(len(row) != want[1] for row in info.bases):
        raise ProtocolError(f"peer bases shape: expected {want}; got {got_shape}")
    if info.mem_kind not in (MemKind.DRAM.value, MemKind.VRAM.value):
        raise ProtocolError(f"peer mem_kind: expected 'DRAM' or 'VRAM'; got {info.mem_kind!r}")
    if not math.isfinite(info.lease_timeout) or info.lease_timeout <= 0:
        raise ProtocolError(f"peer lease_timeout: expected > 0; got {info.lease_timeout!r}")
    geometry = CacheGeometry(info.bases, device=info.device, kind=MemKind(info.mem_kind))
    if info.hybrid:  # a hybrid cache: its carrier spec and every group's geometry
        from kvxfer.protocol.hybridwire import hybrid_from_wire
        return hybrid_from_wire(info.hybrid, spec, info.device, MemKind(info.mem_kind))
    return spec, geometry


def new_engine_id(name: str) -> str:
    """A fresh engine id: ``name`` plus a random nonce, so every agent start is distinguishable."""
    return f"{name}-{secrets.token_hex(8)}"


def engine_named(name: str, engine_id: str) -> bool:
    """Whether ``engine_id`` is the engine ``name`` designates: that exact engine id, or any start
    of the agent called ``name`` (``name`` + "-" + the 16-hex-digit nonce of ``new_engine_id``)."""
    if engine_id == name:
        return True
    nonce = engine_id[len(name) + 1:]
    return (engine_id.startswith(name) and engine_id[len(name):len(name) + 1] == "-" and len(nonce) == 16
            and all(c in "0123456789abcdef" for c in nonce))


def make_peer_info(
    engine_id: str, agent_name: str, spec: KVSpec, geometry: CacheGeometry,
    backend_metadata: bytes, listen_host: str = "", listen_port: int = 0,
    lease_timeout: float = 480.0, multiplexed: bool = True, express_port: int = 0,
) -> PeerInfo:
    """Build this agent's ``PeerInfo`` from its spec and geometry.

    Raises:
        LayoutError: ``geometry`` does not fit ``spec``.
    """
    geometry.check(spec)
    hybrid = b""
    if getattr(geometry, "view", None) is not None:  # a hybrid cache (kvxfer.layout.carrier)
        from kvxfer.protocol.hybridwire import hybrid_to_wire
        hybrid = hybrid_to_wire(geometry.view)
    return PeerInfo(
        engine_id=engine_id, agent_name=agent_name, spec=spec_to_wire(spec),
        bases=geometry.bases.tolist(), device=int(geometry.device),
        mem_kind=MemKind(geometry.kind).value, backend_metadata=bytes(backend_metadata),
        listen_host=listen_host, listen_port=int(listen_port), lease_timeout=float(lease_timeout),
        multiplexed=bool(multiplexed), express_port=int(express_port), packed_ids=True,
        batch_claims=True, batch_done=True, hybrid=hybrid,
    )
