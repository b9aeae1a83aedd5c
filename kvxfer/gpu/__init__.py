"""The GPU data path: pair-copy tables, the fused pack/unpack kernel, the staged pipeline and CUDA IPC (layer: gpu; torch and cupy are imported lazily, never nixl or zmq).

Modules: ``pairs`` (pure numpy tables: which bytes go where), ``ops`` (``PairKernel``, the one
CUDA kernel that executes them), ``staged`` (pack -> move -> unpack in pieces over a
``Backend``), ``ipc`` (same-host single pass through CUDA IPC handles).
"""
