"""MemoryRegistry checks tensors against a KVSpec and registers deduplicated memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer.backend.base import descs
from kvxfer.errors import ClosedError, RegistrationError
from kvxfer.layout.spec import CacheGeometry, KVSpec, Layout
from kvxfer.memory import MemoryRegistry, merge_spans
from kvxfer.testing import FakeBackend, FakeWorld
from kvxfer.types import Direction, MemKind, Region, XferState


def spec(**kw) -> KVSpec:
    base = dict(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=5, dtype="float16")
    return KVSpec(**{**base, **kw})


@pytest.fixture
def backend():
    b = FakeBackend("reg", FakeWorld())
    yield b
    b.close()


def test_split_torch_tensors_bases_and_regions(backend):
    s = spec()
    layers = [torch.zeros(shape, dtype=torch.float16) for shape in s.tensor_shapes()]
    reg = MemoryRegistry(backend)
    geo = reg.register(s, layers)
    assert isinstance(geo, CacheGeometry) and geo.kind is MemKind.DRAM
    for i, t in enumerate(layers):
        assert int(geo.bases[i, 0]) == t.data_ptr()
        assert int(geo.bases[i, 1]) == t[1].data_ptr()  # V half starts halfway
    assert sorted(r.addr for r in backend.registered()) == sorted(t.data_ptr() for t in layers)
    assert all(reg.contains(t.data_ptr(), t.numel() * 2) for t in layers)
    assert not reg.contains(layers[0].data_ptr(), layers[0].numel() * 2 + 1)


def test_kv_pairs_numpy(backend):
    s = spec(layout=Layout.HND)
    shape = s.tensor_shapes()[0][1:]
    pairs = [(np.zeros(shape, np.float16), np.ones(shape, np.float16)) for _ in range(s.num_layers)]
    geo = MemoryRegistry(backend).register(s, pairs)
    assert [tuple(map(int, row)) for row in geo.bases] == [(k.ctypes.data, v.ctypes.data) for k, v in pairs]
    assert len(backend.registered()) == 2 * s.num_layers


def test_packed_and_cross_layer(backend):
    s = spec(storage="packed")
    layers = [torch.zeros(shape, dtype=torch.bfloat16) for shape in s.tensor_shapes()]
    geo = MemoryRegistry(backend).register(s, {f"model.layers.{i}": t for i, t in enumerate(layers)})
    assert int(geo.bases[2, 1]) == layers[2].data_ptr() + s.block_bytes

    c = spec(storage="cross_layer")
    (shape,) = c.tensor_shapes()
    cross = np.zeros(shape, np.float16)
    geo = MemoryRegistry(backend).register(c, cross)
    assert np.array_equal(geo.bases, CacheGeometry.contiguous(c, cross.ctypes.data).bases)
    assert int(geo.bases[1, 1]) == cross[0, 1, 1].ctypes.data


def test_geometry_addresses_real_blocks(backend):
    """Bytes written through the registry's bases land in the tensor's [layer][kv][block]."""
    s = spec()
    layers = [torch.zeros(shape, dtype=torch.float16) for shape in s.tensor_shapes()]
    geo = MemoryRegistry(backend).register(s, layers)
    peer = FakeBackend("src", backend._world)
    src = np.full(s.block_bytes, 0x3C, np.uint8)  # 0x3C3C as fp16 = 1.0586
    peer.register([Region(src.ctypes.data, src.nbytes, 0, MemKind.DRAM)])
    peer.add_peer(backend.metadata())
    dst = int(geo.bases[2, 1]) + 3 * s.block_stride
    x = peer.post(Direction.WRITE, descs(np.array([src.ctypes.data]), s.block_bytes, 0), MemKind.DRAM,
                  descs(np.array([dst]), s.block_bytes, 0), MemKind.DRAM, "reg", b"")
    assert peer.state(x) is XferState.DONE
    assert (layers[2][1, 3] != 0).all() and layers[2][1, :3].eq(0).all() and layers[2][0].eq(0).all()
    peer.close()


def test_wrong_dtype_names_both(backend):
    s = spec()
    layers = [torch.zeros(shape, dtype=torch.float32) for shape in s.tensor_shapes()]
    with pytest.raises(RegistrationError, match=r"layer 0: expected float16 \(itemsize 2\).*got float32 \(itemsize 4\)"):
        MemoryRegistry(backend).register(s, layers)
    assert backend.registered() == []


def test_wrong_shape_names_both(backend):
    s = spec()
    layers = [np.zeros(shape, np.float16) for shape in s.tensor_shapes()]
    layers[1] = np.zeros((2, 4, 4, 2, 8), np.float16)  # one block short
    with pytest.raises(RegistrationError, match=r"layer 1: expected .*\(2, 5, 4, 2, 8\).*got .*\(2, 4, 4, 2, 8\)"):
        MemoryRegistry(backend).register(s, layers)
    with pytest.raises(RegistrationError, match="expected 3 tensor entries .*got 2"):
        MemoryRegistry(backend).register(s, layers[:2])


def test_equivalent_view_is_accepted(backend):
    s = spec()
    flat = [np.zeros((2, s.num_blocks, s.block_bytes // 2), np.float16) for _ in range(s.num_layers)]
    geo = MemoryRegistry(backend).register(s, flat)
    assert int(geo.bases[0, 1]) == flat[0][1].ctypes.data


def test_non_contiguous_names_tensor(backend):
    s = spec()
    layers = [torch.zeros(shape, dtype=torch.float16) for shape in s.tensor_shapes()]
    layers[2] = torch.zeros(s.tensor_shapes()[2][::-1], dtype=torch.float16).permute(4, 3, 2, 1, 0)
    with pytest.raises(RegistrationError, match="layer 2: memory must be contiguous"):
        MemoryRegistry(backend).register(s, layers)
    np_layers = [np.zeros(sh, np.float16) for sh in s.tensor_shapes()]
    np_layers[0] = np.zeros((2, 10, 4, 2, 8), np.float16)[:, ::2]
    with pytest.raises(RegistrationError, match="layer 0: memory must be contiguous"):
        MemoryRegistry(backend).register(s, np_layers)


def test_shared_storage_registered_once(backend):
    s = spec()
    (shape,) = set(s.tensor_shapes())
    one = torch.zeros(shape, dtype=torch.float16)
    reg = MemoryRegistry(backend)
    reg.register(s, [one, one, one])  # every layer aliases one tensor
    assert backend.registered() == [Region(one.data_ptr(), one.numel() * 2, 0, MemKind.DRAM)]
    # overlapping spans of one allocation merge into one region
    big = np.zeros(4096, np.uint8)
    reg.register_buffer((big.ctypes.data, 3000, 0, "DRAM"))
    reg.register_buffer((big.ctypes.data + 1000, 1000, 0, "DRAM"))  # inside: not registered again
    assert len(backend.registered()) == 2
    merged = merge_spans([Region(100, 50, 0, MemKind.DRAM), Region(120, 100, 0, MemKind.DRAM),
                          Region(220, 10, 0, MemKind.DRAM), Region(130, 10, 1, MemKind.DRAM)])
    assert merged == [Region(100, 120, 0, MemKind.DRAM), Region(220, 10, 0, MemKind.DRAM),
                      Region(130, 10, 1, MemKind.DRAM)]


def test_overlapping_views_merge(backend):
    s = spec(num_layers=2)
    (shape,) = set(s.tensor_shapes())
    n = int(np.prod(shape))
    storage = torch.zeros(n + n // 2, dtype=torch.float16)  # layer 1 starts halfway through layer 0
    views = [storage[:n].view(shape), storage[n // 2:].view(shape)]
    MemoryRegistry(backend).register(s, views)
    assert backend.registered() == [Region(storage.data_ptr(), storage.numel() * 2, 0, MemKind.DRAM)]


def test_mixed_devices_and_non_tensors(backend):
    s = spec(num_layers=1)
    with pytest.raises(RegistrationError, match="layer 0: expected a tensor .*got str"):
        MemoryRegistry(backend).register(s, ["nope"])


def test_close_deregisters_everything(backend):
    s = spec()
    reg = MemoryRegistry(backend)
    reg.register(s, [np.zeros(sh, np.float16) for sh in s.tensor_shapes()])
    region = reg.register_buffer(np.zeros(1 << 12, np.uint8))
    assert region.length == 4096 and len(backend.registered()) == 4
    reg.close()
    reg.close()
    assert backend.registered() == [] and reg.regions == () and not reg.contains(region.addr, 1)
    with pytest.raises(ClosedError):
        reg.register_buffer(np.zeros(16, np.uint8))


def test_close_after_backend_closed_is_quiet(backend):
    reg = MemoryRegistry(backend)
    reg.register_buffer(np.zeros(64, np.uint8))
    backend.close()
    reg.close()


def test_tensors_in_another_layouts_shape_are_refused(backend):
    # Same dtype, same bytes, but HND tensors under an NHD spec: every transfer would move wrong bytes.
    s = spec()
    nhd = s.tensor_shapes()[0]
    hnd = (nhd[0], nhd[1], nhd[3], nhd[2], nhd[4])
    assert hnd != nhd
    layers = [np.zeros(hnd, np.float16) for _ in range(s.num_layers)]
    registry = MemoryRegistry(backend)
    with pytest.raises(RegistrationError, match=r"layer 0: expected shape .* got shape"):
        registry.register(s, layers)
    assert backend.registered() == []
    packed = [np.zeros((s.num_blocks, 2, *nhd[2:]), np.float16) for _ in range(s.num_layers)]
    with pytest.raises(RegistrationError, match="expected shape"):
        registry.register(s, packed)
