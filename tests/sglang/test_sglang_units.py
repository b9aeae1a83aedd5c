"""The SGLang adapter's pure parts, in the main venv (no SGLang): the pool description, the announce
payload, the metadata rows, the settings and the backend enum the plugin installs."""

import enum
from types import SimpleNamespace

import numpy as np
import pytest

from kvxfer import ConfigError, LayoutError
from kvxfer_sglang.layout import AnnouncePayload, AuxRows, decode_payload, describe_cache, encode_payload
from kvxfer_sglang.plugin import BACKEND, extended_backends
from kvxfer_sglang.settings import PORT_OFFSET, Settings


def _pool(layers=4, pages=9, page=16, row=256, mla=False, **kw):
    bufs = [np.zeros(pages * page * row, np.uint8) for _ in range(layers * (1 if mla else 2))]
    args = dict(kv_data_ptrs=[b.ctypes.data for b in bufs], kv_data_lens=[b.nbytes for b in bufs],
                kv_item_lens=[page * row] * len(bufs), page_size=page, kv_head_num=2, total_kv_head_num=2,
                is_mla=mla, tp_rank=0, tp_size=1, kv_dtype="auto", model="m")
    args.update(kw)
    return bufs, args


def test_an_mha_pool_is_an_nhd_split_spec_of_pages_with_k_then_v_buffers():
    bufs, args = _pool()
    cache = describe_cache(**args)
    s = cache.spec
    assert (s.num_layers, s.block_size, s.num_blocks, s.head_dim, s.dtype) == (4, 16, 9, 256, "uint8")
    assert s.layout.value == "NHD" and s.storage.value == "split" and not s.mla
    assert cache.layers[1] == (bufs[1].ctypes.data, bufs[5].ctypes.data)  # layer 1: K1, V1
    assert s.model == "sglang:m:auto"


def test_kv_head_num_set_on_one_role_only_still_gives_both_roles_one_spec():
    _, with_heads = _pool()
    _, without = _pool(kv_head_num=None, total_kv_head_num=None)
    assert describe_cache(**with_heads).spec == describe_cache(**without).spec


def test_an_mla_pool_is_one_replicated_latent_buffer_per_layer():
    _, args = _pool(mla=True, tp_rank=1, tp_size=2)
    s = describe_cache(**args).spec
    assert s.mla and s.num_kv_heads == 1 and s.tp_size == 1 and s.num_layers == 4


@pytest.mark.parametrize("change, message", [
    (dict(num_draft_entries=2), "2 draft (speculative) buffers"),
    (dict(kv_item_lens=[4096] * 7 + [2048]), "unequal shape: item lens [2048, 4096]"),
    (dict(kv_data_lens=[1000] * 8, kv_item_lens=[300] * 8), "1000 bytes is not a whole number of 300-byte pages"),
    (dict(kv_data_ptrs=[1, 2, 3]), "got 3, 8 and 8"),
])
def test_pools_kvxfer_cannot_describe_are_layout_errors_naming_the_values(change, message):
    _, args = _pool()
    args.update(change)
    with pytest.raises(LayoutError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        describe_cache(**args)


def test_the_announce_payload_round_trips_and_malformed_ones_are_layout_errors():
    p = AnnouncePayload(2, True, [64, 128])
    assert decode_payload(encode_payload(p)) == p
    with pytest.raises(LayoutError, match="malformed kvxfer SGLang announce payload"):
        decode_payload(b"\xc1garbage")
    with pytest.raises(LayoutError, match="required_dst_info_num: expected >= 1; got 0"):
        decode_payload(encode_payload(AnnouncePayload(0)))


def test_a_metadata_row_moves_between_two_ranks_buffers_and_mismatches_name_both_sizes():
    src = [np.arange(4 * 16, dtype=np.int32).reshape(4, 16), np.arange(4 * 8, dtype=np.float32).reshape(4, 8)]
    dst = [np.zeros_like(b) for b in src]
    rows = lambda bufs: AuxRows([b.ctypes.data for b in bufs], [b.nbytes for b in bufs], [b[0].nbytes for b in bufs])
    packed = rows(src).read(2)
    rows(dst).write(1, packed)
    for s, d in zip(src, dst):
        np.testing.assert_array_equal(d[1], s[2])
        assert not d[0].any() and not d[2].any()
    narrow = [np.zeros((4, 16), np.int32)]
    with pytest.raises(LayoutError, match=r"prefill rows of \[64, 32\] bytes, decode rows of \[64\] bytes"):
        rows(narrow).write(0, packed)
    with pytest.raises(LayoutError, match="metadata row 4: past the buffer"):
        rows(dst).write(4, packed)
    with pytest.raises(LayoutError, match="malformed metadata row"):
        rows(dst).write(0, b"\xc1")


def test_settings_take_the_port_from_the_environment_or_the_server_port():
    args = SimpleNamespace(port=30100, served_model_name="tiny", device="cpu", pp_size=1)
    assert Settings.from_env(args, env={}).base_port == 30100 + PORT_OFFSET
    s = Settings.from_env(args, env={"KVXFER_SIDE_CHANNEL_PORT": "7000", "KVXFER_SGLANG_DROP_KV": "1",
                                     "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "12"})
    assert (s.base_port, s.drop_kv, s.transfer_timeout, s.device_memory, s.model) == (7000, True, 12.0, False, "tiny")
    with pytest.raises(ConfigError, match="KVXFER_SIDE_CHANNEL_PORT must be a port number; got 'x'"):
        Settings.from_env(args, env={"KVXFER_SIDE_CHANNEL_PORT": "x"})


def test_the_plugin_adds_kvxfer_to_the_backend_enum_and_keeps_every_other_member():
    class TransferBackend(enum.Enum):
        MOONCAKE = "mooncake"
        NIXL = "nixl"

    extended = extended_backends(TransferBackend)
    assert extended("kvxfer").name == "KVXFER" and extended(BACKEND).value == "kvxfer"
    assert [m.name for m in extended] == ["MOONCAKE", "NIXL", "KVXFER"] and extended.__name__ == "TransferBackend"
    assert extended_backends(extended) is extended   # a second plugin load changes nothing
