"""``kvxfer-hf serve MODEL_DIR ...``: parse the command line, build the engine, run uvicorn (layer: adapter entry point).

    kvxfer-hf serve /models/qwen3 --port 8100 \\
        --kv-transfer-config '{"kv_connector":"KvxferConnector","kv_role":"kv_both"}' \\
        [--dtype float32|bfloat16] [--device cpu|cuda:N] [--block-size N]

The side channel's host and port come from ``KVXFER_SIDE_CHANNEL_HOST/PORT`` or
``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT`` (as for vLLM with KvxferConnector).
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvxfer import KvxferError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvxfer-hf", description="Hugging Face transformers P/D server over kvxfer")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a causal LM with an OpenAI-compatible /v1/completions")
    s.add_argument("model_dir", help="a transformers model directory (config.json + weights)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--kv-transfer-config", default=None,
                   help="vLLM-style JSON (kv_role, kv_load_failure_policy, ...); omit to serve locally only")
    s.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    s.add_argument("--device", default="cpu", help="cpu or cuda:N")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    s.add_argument("--kv-layout", default="nhd", choices=("nhd", "vllm-cpu"),
                   help="pool format: nhd (natural; kvxfer converts to and from any peer, vLLM CPU "
                        "included) or vllm-cpu (vLLM's CPU attention cache byte for byte: with vLLM's "
                        "--block-size, whole blocks move without staging)")
    s.add_argument("--num-blocks", type=int, default=1024, help="blocks in the KV pool (default 1024)")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + generation served (default: the config's max_position_embeddings)")
    s.add_argument("--served-model-name", default=None, help="the name clients send in 'model' (default MODEL_DIR)")
    s.add_argument("--kv-model-name", default=None,
                   help="model identity peers must share (default MODEL_DIR as given, the rule vLLM's "
                        "KvxferConnector uses with --model)")
    s.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    s.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    import uvicorn

    from kvxfer_transformers.engine import HFEngine
    from kvxfer_transformers.server import create_app
    from kvxfer_transformers.settings import ServeSettings

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        settings = ServeSettings.parse(args.kv_transfer_config, device=args.device)
        engine = HFEngine.start(args.model_dir, settings=settings, dtype=args.dtype, device=args.device,
                                block_size=args.block_size, num_blocks=args.num_blocks,
                                kv_model=args.kv_model_name, max_model_len=args.max_model_len,
                                kv_layout=args.kv_layout)
    except (KvxferError, ValueError, OSError) as exc:
        print(f"kvxfer-hf: {exc}", file=sys.stderr)
        return 2
    if engine.transfers is not None:
        host, port = engine.transfers.address
        logging.getLogger("kvxfer_transformers").info(
            "kvxfer agent %s on %s:%d: %d layers x %d blocks of %d, %s, %s, role %s, policy %s",
            engine.transfers.engine_id, host, port, engine.pool.spec.num_layers, engine.pool.spec.num_blocks,
            engine.pool.block_size, engine.pool.format, engine.pool.spec.dtype, settings.role, settings.failure_policy)
    try:
        uvicorn.run(create_app(engine, args.served_model_name or args.model_dir), host=args.host,
                    port=args.port, log_level=args.log_level.lower())
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
