"""kvxfer's UCX TCP defaults as a pure policy: what is filled, what is left to the user."""

from kvxfer.backend.ucx_env import OPT_OUT, UCX_TCP_DEFAULTS, apply_ucx_defaults, ucx_defaults


def test_every_default_is_filled_into_an_empty_environment():
    assert ucx_defaults({}) == dict(UCX_TCP_DEFAULTS)
    assert set(UCX_TCP_DEFAULTS) == {"UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE", "UCX_TCP_SNDBUF",
                                     "UCX_TCP_RCVBUF"}


def test_a_variable_the_user_set_is_never_replaced_even_when_empty():
    env = {"UCX_TCP_RCVBUF": "4m", "UCX_TCP_TX_SEG_SIZE": ""}
    added = apply_ucx_defaults(env)
    assert env["UCX_TCP_RCVBUF"] == "4m" and env["UCX_TCP_TX_SEG_SIZE"] == ""
    assert added == {"UCX_TCP_RX_SEG_SIZE": "512k", "UCX_TCP_SNDBUF": "8m"}
    assert apply_ucx_defaults(env) == {}  # idempotent


def test_opting_out_leaves_ucx_alone():
    for value in ("0", "false", "OFF", "no"):
        env = {OPT_OUT: value}
        assert apply_ucx_defaults(env) == {} and env == {OPT_OUT: value}
    assert ucx_defaults({OPT_OUT: "1"}) == dict(UCX_TCP_DEFAULTS)
