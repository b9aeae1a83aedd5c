"""kvxfer's UCX TCP defaults as a pure policy: what is filled, what is left to the user."""

import subprocess
import sys

from kvxfer.backend.ucx_env import (NO_RDMA_DEFAULTS, OPT_OUT, UCX_TCP_DEFAULTS, apply_ucx_defaults, rdma_devices,
                                    ucx_defaults)


def test_every_default_is_filled_into_an_empty_environment():
    assert ucx_defaults({}) == dict(UCX_TCP_DEFAULTS)
    assert set(UCX_TCP_DEFAULTS) == {"UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE", "UCX_TCP_SNDBUF",
                                     "UCX_TCP_RCVBUF"}


def test_a_variable_the_user_set_is_never_replaced_even_when_empty():
    env = {"UCX_TCP_RCVBUF": "4m", "UCX_TCP_TX_SEG_SIZE": ""}
    added = apply_ucx_defaults(env, rdma=True)
    assert env["UCX_TCP_RCVBUF"] == "4m" and env["UCX_TCP_TX_SEG_SIZE"] == ""
    assert added == {"UCX_TCP_RX_SEG_SIZE": "512k", "UCX_TCP_SNDBUF": "8m"}
    assert apply_ucx_defaults(env, rdma=True) == {}  # idempotent


def test_opting_out_leaves_ucx_alone():
    for value in ("0", "false", "OFF", "no"):
        env = {OPT_OUT: value}
        assert apply_ucx_defaults(env) == {} and env == {OPT_OUT: value}
    assert ucx_defaults({OPT_OUT: "1"}) == dict(UCX_TCP_DEFAULTS)


def test_without_an_rdma_device_ucx_skips_its_infiniband_module_unless_the_user_chose(tmp_path):
    assert ucx_defaults({}, rdma=False) == {**UCX_TCP_DEFAULTS, "UCX_MODULES": "^ib"} == \
        {**UCX_TCP_DEFAULTS, **NO_RDMA_DEFAULTS}
    assert "UCX_MODULES" not in ucx_defaults({}, rdma=True)
    assert "UCX_MODULES" not in ucx_defaults({"UCX_MODULES": ""}, rdma=False)
    assert not rdma_devices(str(tmp_path / "absent")) and not rdma_devices(str(tmp_path))
    (tmp_path / "mlx5_0").mkdir()
    assert rdma_devices(str(tmp_path))


def test_a_process_with_a_nixl_agent_exits_cleanly():
    """With the system's libibverbs present and no RDMA device, UCX's InfiniBand module made every
    process with a NIXL agent die with SIGSEGV at exit; kvxfer's defaults keep it from loading."""
    code = ("from kvxfer.backend.nixl import NixlBackend\n"
            "b = NixlBackend('exit-check', ['UCX'])\n"
            "b.close()\nprint('made')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "made" in done.stdout, (done.returncode, done.stderr[-2000:])
