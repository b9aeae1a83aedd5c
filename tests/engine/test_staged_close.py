"""Closing an agent never frees its staging area while a staged pipeline may still write into it.

Before (audit R3): ``Agent.close`` cancelled the producer's serve jobs without waiting for them
(a cancel only asks the pipeline to stop at its next turn) and then deregistered and dropped the
staging area. A serve thread caught packing (a memmove into the slot on host memory; a kernel on
the pipeline's own stream, which close never synchronized, on a GPU) wrote into freed memory.
Now close refuses new slots, waits for the pipelines writing into the area to end (each
synchronizes its stream before it gives its slots back), and frees the area only then; one that
has not ended within ``CLOSE_WAIT`` leaves the area allocated and registered (a leak, logged).

The pack is caught inside its launch by wrapping the producer's pair-copy kernel; the wrapper
records whether the area was still alive when the pack went on to write.
"""

import threading

import pytest

from kvxfer.engine.paths import kit as kit_module

from agent_helpers import Harness, spec, wait_for

STAGED = dict(transfer_path="staged", pipeline_slot_bytes=16 << 10, pipeline_slots=4)


@pytest.fixture
def producer_mid_pack():
    """A producer whose first pack is held inside its launch until ``go`` is set; yields
    ``(prod, kit, go, seen)``: ``seen["area_alive"]`` is what the pack found when it went on."""
    h = Harness()
    s = spec()
    prod, _ = h.agent(s, seed=1, **STAGED)
    cons, _ = h.agent(s, seed=2, listen=False, **STAGED)
    cons.connect(*prod.address)
    prod.hold("A", [1, 2])
    kit = prod._paths.kit
    area, kernel = kit.area, kit.kernel
    real = kernel.launch
    entered, go, seen = threading.Event(), threading.Event(), {}

    def launch_held(copy, stream=None):
        entered.set()
        go.wait(30)
        seen["area_alive"] = area._owner is not None and not area._closed
        if seen["area_alive"]:
            return real(copy, stream)
        return None  # the area is freed: the real memmove would write freed memory (the bug)

    kernel.launch = launch_held
    cons.read(prod.address, [3, 4], [1, 2], "A", timeout=30)
    assert entered.wait(10), "no pack started"
    try:
        yield prod, kit, go, seen
    finally:
        go.set()
        h.close()


def test_close_waits_for_a_running_pack_before_it_frees_the_staging_area(producer_mid_pack):
    prod, kit, go, seen = producer_mid_pack
    area = kit.area
    closer = threading.Thread(target=prod.close)
    closer.start()
    # Close has begun (it now waits for the pack), or, before the fix, already freed the area.
    assert wait_for(lambda: area._closed or getattr(kit, "closing", False), 10)
    go.set()                                              # the pack goes on and writes its slot
    closer.join(30)
    assert not closer.is_alive()
    assert wait_for(lambda: "area_alive" in seen, 10)
    assert seen["area_alive"], "the pack wrote into a staging area close had freed"
    assert area._closed and area not in kit_module._KEPT  # freed once the pack ended, not leaked


def test_close_keeps_the_staging_area_when_a_pack_does_not_end(producer_mid_pack):
    prod, kit, go, seen = producer_mid_pack
    area = kit.area
    prod.close()                                          # gives up on the pack after CLOSE_WAIT
    assert not area._closed and area._owner is not None, "the area was freed under a running pack"
    assert area in kit_module._KEPT
    go.set()
    assert wait_for(lambda: "area_alive" in seen, 10)
    assert seen["area_alive"]
