"""Size of a real NIXL agent's metadata (the ``PeerInfo.backend_metadata`` a Hello carries) against
the number of registered regions, in host memory and (with ``--vram``, torch on a GPU) in device
memory. The side channel bounds the field at ``kvxfer.protocol.MAX_BACKEND_METADATA``; this shows
the margin.

Run:  .venv/bin/python benchmarks/metadata_size.py [--vram] [--regions 2 64 256 1024]
"""

import argparse

import numpy as np

from kvxfer.backend.nixl import NixlBackend
from kvxfer.protocol import MAX_BACKEND_METADATA
from kvxfer.types import MemKind, Region


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vram", action="store_true", help="register GPU buffers (torch, cuda:0)")
    ap.add_argument("--regions", type=int, nargs="+", default=[2, 64, 256, 1024])
    args = ap.parse_args()
    for count in args.regions:
        backend = NixlBackend(f"md-{count}", ("UCX",), progress_thread=False)
        if args.vram:
            import torch

            bufs = [torch.zeros(1 << 16, dtype=torch.uint8, device="cuda:0") for _ in range(count)]
            regions = [Region(b.data_ptr(), b.numel(), 0, MemKind.VRAM) for b in bufs]
        else:
            bufs = [np.zeros(1 << 16, np.uint8) for _ in range(count)]
            regions = [Region(b.ctypes.data, b.nbytes, 0, MemKind.DRAM) for b in bufs]
        backend.register(regions)
        size = len(backend.metadata())
        print(f"{'VRAM' if args.vram else 'DRAM'} regions {count:5d}: metadata {size:8d} B "
              f"({size / count:.0f} B a region; bound {MAX_BACKEND_METADATA} B = {MAX_BACKEND_METADATA / size:.0f}x)",
              flush=True)
        backend.close()


if __name__ == "__main__":
    main()
