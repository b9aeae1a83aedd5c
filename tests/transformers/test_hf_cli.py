"""``kvxfer-hf`` as users start it: the installed console script, in bfloat16.

Two servers, each started through the ``kvxfer-hf`` script with ``--dtype bfloat16``: a plain
request equals transformers' own bfloat16 ``generate``, and a P/D request from one to the other
moves the KV (the decoder loads all but the last prompt token) and answers like the decoder alone.
"""

from __future__ import annotations

import pytest

from cross_contract import MAX_TOKENS, first_difference
from hf_harness import HF_CORE, HFScriptServer, hf_config, port_run, prompt_of, quiet_env, route_pd, start_all

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def bf16(hf_model, hf_logs):
    side = port_run(8)
    servers = [HFScriptServer(name, hf_model, hf_logs, cpu_bind=HF_CORE, env=quiet_env(side + 4 * i),
                              args=("--dtype", "bfloat16", "--block-size", "16",
                                    "--kv-transfer-config", hf_config("fail")))
               for i, name in enumerate(("bf16-prefill", "bf16-decode"))]
    start_all(servers, timeout=180)
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


def test_the_console_script_serves_bfloat16_like_transformers_generate(bf16, hf_model):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.bfloat16).eval()
    for n in (3, 70):
        prompt = prompt_of(n, seed=200 + n)
        want = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                              do_sample=False)[0, n:].tolist()
        got = bf16[1].client().complete(prompt, MAX_TOKENS).token_ids
        assert got == want, first_difference(got, want)


@pytest.mark.compat(producer="transformers", consumer="transformers", tp="1 -> 1",
                    layout="NHD split bfloat16, block 16 -> same (the `kvxfer-hf` script)", path="direct",
                    device="CPU")
def test_bfloat16_prefill_then_decode_through_the_console_script(bf16):
    prefiller, decoder = (s.client() for s in bf16)
    for n in (9, 33, 200):
        prompt = prompt_of(n, seed=300 + n)
        got = route_pd(prefiller, decoder, prompt, MAX_TOKENS)
        assert got.cached_tokens == n - 1, got.raw
        want = decoder.complete(prompt, MAX_TOKENS).token_ids
        assert got.token_ids == want, first_difference(got.token_ids, want)
