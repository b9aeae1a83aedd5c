"""UCX settings kvxfer supplies when the user gave none (layer: backend; imports only the standard library).

UCX reads its configuration from ``UCX_*`` environment variables when a UCP context is created,
which happens inside the first NIXL agent of a process. ``apply_ucx_defaults()`` therefore runs
in ``NixlBackend.__init__`` before the agent is made; it only fills variables that are unset, so
a user's own ``UCX_*`` value always wins, and ``KVXFER_UCX_DEFAULTS=0`` turns the whole step off.

The defaults concern UCX's TCP transport only (the path between hosts without RDMA); RDMA,
shared-memory and CUDA transports ignore them. Measured over two network namespaces joined by
a veth pair on a 2-core host (``UCX_TLS=tcp``, raw NIXL READ of 256 MiB; docs/multihost.md):
UCX's own defaults (8 KiB segments, kernel-sized socket buffers) moved 0.3-0.55 GB/s; with the
values below 1.15-2.5 GB/s, against 1.95 GB/s for a plain Python socket on the same link.

* ``UCX_TCP_TX_SEG_SIZE`` / ``UCX_TCP_RX_SEG_SIZE`` = ``512k``: UCX cuts every message into
  segments of this size and pays a send/receive system call and a header per segment; at the
  default 8 KiB a 256 MiB read is 32,768 segments. The receive side's buffers come from one pool
  per interface, so the memory cost stays a few MiB.
* ``UCX_TCP_SNDBUF`` / ``UCX_TCP_RCVBUF`` = ``8m``: fixed socket buffers large enough to keep a
  bandwidth-delay product of ~8 MB in flight (e.g. 25 Gb/s at 2.5 ms round trip) instead of
  waiting for the kernel's autotuning to grow them on every new connection.

One more, only on a host with no RDMA device (``/sys/class/infiniband`` empty or absent):

* ``UCX_MODULES`` = ``^ib``: UCX then does not load its InfiniBand module, which has nothing to
  drive there. Where the system has ``libibverbs`` installed (Debian's ``libibverbs1``, pulled in
  by RDMA-capable packages such as Mooncake's), that module is loaded anyway, and with the NIXL
  1.5.1 wheels every process that made a NIXL agent was seen to crash with SIGSEGV as it exits
  (in ``libnl-route``'s destructor); without the module it exits cleanly.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

__all__ = ["NO_RDMA_DEFAULTS", "OPT_OUT", "UCX_TCP_DEFAULTS", "apply_ucx_defaults", "rdma_devices", "ucx_defaults"]

#: Set to ``0`` (or ``false``/``off``/``no``) to make kvxfer leave UCX's configuration alone.
OPT_OUT = "KVXFER_UCX_DEFAULTS"

#: Variable -> value kvxfer sets when the variable is unset (see the module docstring for why).
UCX_TCP_DEFAULTS: Mapping[str, str] = {
    "UCX_TCP_TX_SEG_SIZE": "512k",
    "UCX_TCP_RX_SEG_SIZE": "512k",
    "UCX_TCP_SNDBUF": "8m",
    "UCX_TCP_RCVBUF": "8m",
}


#: Variable -> value kvxfer also sets, when unset, on a host with no RDMA device.
NO_RDMA_DEFAULTS: Mapping[str, str] = {"UCX_MODULES": "^ib"}


def rdma_devices(sysfs: str = "/sys/class/infiniband") -> bool:
    """Whether this host has an RDMA device (an entry under ``sysfs``)."""
    try:
        return bool(os.listdir(sysfs))
    except OSError:
        return False


def ucx_defaults(environ: Mapping[str, str], rdma: bool = True) -> dict[str, str]:
    """The variables kvxfer would add to ``environ``: each default whose variable is unset there
    (``rdma=False``: also ``NO_RDMA_DEFAULTS``).

    Pure. Returns ``{}`` when ``environ[OPT_OUT]`` is ``0``/``false``/``off``/``no``. A variable
    set to any value (even an empty string) counts as the user's choice and is never replaced.
    """
    if environ.get(OPT_OUT, "").strip().lower() in ("0", "false", "off", "no"):
        return {}
    wanted = dict(UCX_TCP_DEFAULTS) if rdma else {**UCX_TCP_DEFAULTS, **NO_RDMA_DEFAULTS}
    return {name: value for name, value in wanted.items() if name not in environ}


def apply_ucx_defaults(environ: MutableMapping[str, str] | None = None, rdma: bool | None = None) -> dict[str, str]:
    """Write ``ucx_defaults(environ)`` into ``environ`` (``os.environ`` by default); returns what it set.
    ``rdma``: whether the host has an RDMA device (None: look, ``rdma_devices()``).

    Call before the process's first NIXL agent exists: UCX reads the environment once, when its
    context is created, and later changes have no effect on that context. Idempotent.
    """
    target = os.environ if environ is None else environ
    added = ucx_defaults(target, rdma_devices() if rdma is None else rdma)
    target.update(added)
    return added
