"""kvxfer-hf with hybrid models: prefill on one engine, decode on another, the cache moved over NIXL.

Two transformers engines (``kvxfer_transformers.HFEngine``, what ``kvxfer-hf serve`` runs) in
this process, each with its own kvxfer Agent and side channel:

* a sliding-window model (tiny Gemma 3: window 32 and full attention): the prefill answers one
  block list per group, the sliding group's cut to its window; the decode reads both in one read
  and only the window's blocks of the sliding group move;
* an SSM hybrid (tiny GraniteMoeHybrid: Mamba2 and attention): each request's conv and SSM
  state sits in a slot, which moves in the same read as the attention blocks.

Both models are random but context-dependent (``kvxfer_transformers.testing``). The decode's
tokens must equal the producer's own generation; the script exits non-zero otherwise.

    python examples/hf_hybrid_pd.py
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path

from kvxfer.testing import free_port_block
from kvxfer_transformers.engine import HFEngine
from kvxfer_transformers.params import RemotePrefill
from kvxfer_transformers.settings import ServeSettings
from kvxfer_transformers.testing import make_tiny_gemma3, make_tiny_granite_hybrid


def pair(model: Path, base_port: int) -> tuple[HFEngine, HFEngine]:
    """A prefill and a decode engine for ``model`` (side channels at base_port and base_port + 4)."""
    settings = ServeSettings(enabled=True, transfer_timeout=30)
    engines = []
    for i in range(2):
        os.environ["KVXFER_SIDE_CHANNEL_PORT"] = str(base_port + 4 * i)
        engines.append(HFEngine.start(str(model), settings=settings, block_size=16, num_blocks=64))
    return engines[0], engines[1]


def main() -> int:
    os.environ.setdefault("KVXFER_SIDE_CHANNEL_HOST", "127.0.0.1")
    os.environ.setdefault("KVXFER_NIXL_PROGRESS_THREAD", "0")
    ok = True
    with tempfile.TemporaryDirectory() as work:
        for name, make in (("gemma3 (sliding 32 + full)", make_tiny_gemma3),
                           ("granite-hybrid (mamba2 + full)", make_tiny_granite_hybrid)):
            p, d = pair(make(Path(work) / name.split()[0]), free_port_block(8))
            try:
                rng = random.Random(7)
                prompt = [rng.randrange(1024) for _ in range(100)]
                alone = p.generate(prompt, 8).token_ids
                params = p.prefill(prompt, 8).kv_transfer_params          # what a prefill server answers
                remote = RemotePrefill.parse(params, num_groups=p.num_groups)
                got = d.decode(prompt, 8, remote)
                print(f"{name}: groups {[len(g) for g in params['remote_block_ids']]} ids, "
                      f"loaded {got.loaded_tokens} tokens ({got.notes['transfer_bytes']} bytes): "
                      f"{'equal' if got.token_ids == alone else 'DIFFERENT'}")
                ok &= got.token_ids == alone and got.loaded_tokens == len(prompt) - 1
            finally:
                p.close()
                d.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
