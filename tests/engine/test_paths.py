"""The per-request path choice (``kvxfer.engine.paths.choose.choose_path``) and pipeline routing, as pure logic."""

import pytest

from kvxfer.engine.paths.choose import (
    HOST_MANY_DESCRIPTORS,
    HOST_SHORT_DESCRIPTOR,
    MANY_DESCRIPTORS,
    SHORT_DESCRIPTOR,
    PathFacts,
    choose_path,
)
from kvxfer.engine.paths.pipes import PipeRouter
from kvxfer.engine.paths.prepared import PREPARED_DESCRIPTORS
from kvxfer.backend.fake import FakeBackend, FakeWorld
from kvxfer.errors import ConfigError, ProtocolError, TransferFailedError
from kvxfer.engine.paths.pipeline import DATA, FREE, READY, PipeMessage
from kvxfer.protocol import PipeNote, decode_pipe_note, encode_notification, encode_pipe_note


def facts(ipc=None, staged=None, direct=None, vram=True, descriptors=4096, num_bytes=4096 * 32768, remote=False):
    return PathFacts(ipc, staged, direct, vram, descriptors, num_bytes, remote)


def test_auto_prefers_ipc_when_mapped():
    assert choose_path("auto", facts()) == "ipc"


@pytest.mark.parametrize("descriptors,num_bytes,want", [
    (MANY_DESCRIPTORS + 1, (MANY_DESCRIPTORS + 1) * (4 << 20), "staged"),   # many, long
    (16, 16 * (SHORT_DESCRIPTOR - 1), "staged"),                            # few, short
    (16, 16 * SHORT_DESCRIPTOR, "direct"),                                  # few, long
    (MANY_DESCRIPTORS, MANY_DESCRIPTORS * SHORT_DESCRIPTOR, "direct"),      # at both limits
])
def test_auto_without_ipc_picks_staged_for_many_or_short_descriptors(descriptors, num_bytes, want):
    assert choose_path("auto", facts(ipc="other host", descriptors=descriptors, num_bytes=num_bytes)) == want


def test_auto_on_a_gpu_takes_staged_only_from_gpu_staging_areas():
    # a host-memory producer (e.g. an offload tier) offers host staging under auto: a GPU
    # consumer reads it directly unless only staging can express the move (not measured faster)
    many = dict(ipc="other host", descriptors=MANY_DESCRIPTORS + 1, num_bytes=(MANY_DESCRIPTORS + 1) * 4096)
    assert choose_path("auto", PathFacts(**{**_as_facts(many), "peer_staging_vram": False})) == "direct"
    assert choose_path("auto", PathFacts(**{**_as_facts(many), "peer_staging_vram": False,
                                            "direct_why": "layouts differ"})) == "staged"


def _as_facts(kw):
    f = facts(**kw)
    return {k: getattr(f, k) for k in f.__dataclass_fields__}


def test_auto_on_host_memory_stays_direct():
    assert choose_path("auto", facts(ipc="host memory", vram=False)) == "direct"


N, SHORT = HOST_MANY_DESCRIPTORS, HOST_SHORT_DESCRIPTOR


@pytest.mark.parametrize("remote,descriptors,num_bytes,staged,want", [
    (True, N, N * SHORT, None, "staged"),            # another network stack, many tiny pieces
    (True, 8192, 8192 * 4096, None, "staged"),       # a TP-8 rank of a 70B model, 8,192 tokens
    (True, N - 1, (N - 1) * 4096, None, "direct"),   # too few: the pipeline's set-up is not paid back
    (True, N, N * SHORT + 1, None, "direct"),        # pieces too large: direct reads them well
    (False, 8192, 8192 * 4096, None, "direct"),      # same network stack: shared memory, no pack
    (True, 8192, 8192 * 4096, "peer serves no staged reads", "direct"),
])
def test_auto_on_host_memory_stages_many_tiny_pieces_across_a_network(remote, descriptors, num_bytes,
                                                                      staged, want):
    got = choose_path("auto", facts(ipc="host memory", vram=False, staged=staged, descriptors=descriptors,
                                    num_bytes=num_bytes, remote=remote))
    assert got == want


@pytest.mark.parametrize("remote", [False, True])
@pytest.mark.parametrize("staged", [None, "peer serves no staged reads"])
@pytest.mark.parametrize("descriptors", [1, 16, PREPARED_DESCRIPTORS])
@pytest.mark.parametrize("block_bytes", [1, 4096, 1 << 20])
def test_a_prepared_read_is_direct_in_auto_as_plan_read_takes_it_without_asking(remote, staged, descriptors,
                                                                                 block_bytes):
    """``plan_read`` routes a prepared read (host cache, at most PREPARED_DESCRIPTORS whole blocks,
    nothing staged, not every rank mapped) as direct in "auto" without gathering the facts:
    ``choose_path`` must give that answer for every such read."""
    assert PREPARED_DESCRIPTORS < HOST_MANY_DESCRIPTORS
    for peer_vram in (False, True):
        got = choose_path("auto", PathFacts("host memory", staged, None, False, descriptors,
                                            descriptors * block_bytes, remote, peer_vram))
        assert got == "direct"


def test_auto_falls_back_to_staged_when_direct_cannot_and_to_direct_when_staging_is_missing():
    assert choose_path("auto", facts(ipc="x", direct="layouts differ", descriptors=1,
                                     num_bytes=1 << 30)) == "staged"
    assert choose_path("auto", facts(ipc="x", staged="no staging area")) == "direct"


def test_auto_with_no_path_names_every_reason():
    with pytest.raises(ConfigError, match="ipc: a; staged: b; direct: c"):
        choose_path("auto", facts(ipc="a", staged="b", direct="c"))


@pytest.mark.parametrize("path", ["ipc", "staged", "direct"])
def test_forced_path_is_taken_or_refused_with_the_reason(path):
    assert choose_path(path, facts()) == path
    why = {"ipc": "peer is on another host", "staged": "no staging", "direct": "layouts differ"}[path]
    with pytest.raises(ConfigError, match=f"transfer_path='{path}' cannot move this request: {why}"):
        choose_path(path, facts(**{path: why}))


def test_unknown_path_is_a_config_error():
    with pytest.raises(ConfigError, match="got 'fast'"):
        choose_path("fast", facts())


def _router():
    world = FakeWorld()
    a, b = FakeBackend("a", world), FakeBackend("b", world)
    a.add_peer(b.metadata())
    b.add_peer(a.metadata())
    return a, b, PipeRouter(b)


def test_router_takes_pipeline_messages_by_tag_and_leaves_the_rest():
    a, b, router = _router()
    link = router.open("a", 7, slot_offset=4, slot_count=2)
    assert router.deliver("a", PipeMessage(READY, 7, 0, 5).encode())
    assert router.deliver("a", PipeMessage(READY, 8, 0, 5).encode())   # closed tag: taken, dropped
    assert not router.deliver("a", b"a request-done notification")
    assert [PipeMessage.decode(m) for m in link.receive()] == [PipeMessage(READY, 7, 0, 1)]
    link.send(PipeMessage(FREE, 7, 0, 1).encode())                      # sent with the window offset
    assert [decode_pipe_note(m, None) for _, m in a.notifications()] == [PipeNote(FREE, 7, 0, 5)]


def test_pipeline_messages_travel_as_typed_authenticated_notes(caplog):
    """On the wire a pipeline message is a ``PipeNote`` in the notification envelope, with the
    shared key's tag; a note with another key, or out of bounds, is dropped (never routed); a
    bare record from a peer of the release before is taken only by an agent without a key: with
    one it is refused (claimed, never routed), and the refusals are logged a bounded number of times."""
    world = FakeWorld()
    a, b = FakeBackend("a", world), FakeBackend("b", world)
    a.add_peer(b.metadata())
    b.add_peer(a.metadata())
    key = b"k" * 32
    sender, receiver = PipeRouter(a, key=key), PipeRouter(b, key=key)
    out, inbox = sender.open("b", 7), receiver.open("a", 7)
    out.send(PipeMessage(READY, 7, 3, 2).encode())
    [(_, wire)] = b.notifications()
    assert decode_pipe_note(wire, key) == PipeNote(READY, 7, 3, 2)
    assert receiver.deliver("a", wire)
    assert receiver.deliver("a", encode_pipe_note(PipeNote(READY, 7, 4, 2), b"x" * 32))   # wrong key: dropped
    caplog.clear()
    for piece in range(5, 10):
        assert receiver.deliver("a", PipeMessage(DATA, 7, piece, 1).encode())            # unsigned: refused
    assert [PipeMessage.decode(m) for m in inbox.receive()] == [PipeMessage(READY, 7, 3, 2)]
    assert receiver.dropped == {"bad": 1, "unsigned": 5}
    refusals = [r.getMessage() for r in caplog.records if "unsigned" in r.getMessage()]
    assert len(refusals) == 1 and "(unsigned, 1 so far): a bare pipeline record" in refusals[0]
    assert not receiver.deliver("a", encode_notification("r", "e", key))                # request-done: not ours

    keyless = PipeRouter(b)
    old_inbox = keyless.open("a", 8)
    assert keyless.deliver("a", PipeMessage(DATA, 8, 5, 1).encode())                      # an older peer's record
    assert [PipeMessage.decode(m) for m in old_inbox.receive()] == [PipeMessage(DATA, 8, 5, 1)]
    assert not keyless.dropped


def test_router_refuses_a_slot_outside_the_window_and_a_tag_in_use():
    _, _, router = _router()
    link = router.open("a", 7, slot_offset=4, slot_count=2)
    with pytest.raises(ProtocolError, match="tag 7 is already in use"):
        router.open("a", 7)
    router.deliver("a", PipeMessage(FREE, 7, 0, 9).encode())
    with pytest.raises(ProtocolError, match=r"slot 9; expected \[4, 6\)"):
        link.receive()


def test_stopped_link_raises_its_error_and_closing_frees_the_tag():
    _, _, router = _router()
    link = router.open("a", 3)
    link.stop(TransferFailedError("cancelled"))
    with pytest.raises(TransferFailedError, match="cancelled"):
        link.receive()
    router.close(link)
    assert router.active() == 0
    router.open("a", 3)


def test_the_ipc_id_check_still_names_a_remote_id_beyond_the_producers_cache():
    """``plan_read``'s id check on the IPC path relies on ``Agent.read``'s checks and tests only
    the remote bound; an id past the producer's cache is still a typed error naming id and bound."""
    import numpy as np

    from kvxfer import BlockIdError, KVSpec
    from kvxfer.engine.paths.reading import _check_ids
    from kvxfer.layout.request import check_block_ids

    small = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16, dtype="float16")
    big = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64, dtype="float16")
    local = check_block_ids("local", [0, 1, 2], big.num_blocks)
    _check_ids(big, local, small, check_block_ids("remote", [3, 15, 7], 1 << 62))  # in range: passes
    with pytest.raises(BlockIdError, match=r"remote block id 40 is outside \[0, 16\)"):
        _check_ids(big, local, small, check_block_ids("remote", [3, 40, 7], 1 << 62))
    with pytest.raises(BlockIdError, match="same tokens"):
        _check_ids(big, local, small, check_block_ids("remote", [3, 4], 1 << 62))
    assert np.array_equal(local, [0, 1, 2])
