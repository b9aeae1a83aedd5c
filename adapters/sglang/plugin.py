"""SGLang plugin entry point: ``--disaggregation-transfer-backend kvxfer`` without patching SGLang
(layer: adapter).

SGLang loads every ``sglang.srt.plugins`` entry point in each of its processes before it parses
arguments or starts a scheduler. ``register`` adds ``kvxfer`` to the backend choices, replaces the
``TransferBackend`` enum with one that also has ``KVXFER`` (SGLang's hook registry rebinds every
module that imported it), and wraps ``get_kv_class`` so that backend resolves to this adapter's
classes; every other backend resolves as before.
"""

from __future__ import annotations

import enum
import logging

log = logging.getLogger("kvxfer.sglang")

__all__ = ["BACKEND", "extended_backends", "register"]

#: The value of ``--disaggregation-transfer-backend`` that selects kvxfer.
BACKEND = "kvxfer"


def extended_backends(original: type[enum.Enum]) -> type[enum.Enum]:
    """``original`` (SGLang's ``TransferBackend``) with a ``KVXFER`` member added; the others keep
    their names and values. Returns ``original`` itself when it has the member already."""
    members = {m.name: m.value for m in original}
    if BACKEND in members.values():
        return original
    members["KVXFER"] = BACKEND
    extended = enum.Enum(original.__name__, members, module=original.__module__)
    extended.__qualname__ = original.__qualname__
    return extended


def _kv_class(original_fn, transfer_backend, class_type, *args, **kwargs):
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original_fn(transfer_backend, class_type, *args, **kwargs)
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType

    from kvxfer_sglang.conn import (
        KvxferKVBootstrapServer, KvxferKVManager, KvxferKVReceiver, KvxferKVSender,
    )
    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: KvxferKVManager,
        KVClassType.SENDER: KvxferKVSender,
        KVClassType.RECEIVER: KvxferKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: KvxferKVBootstrapServer,
    }[class_type]


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (runs in every SGLang process; idempotent)."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    backends = extended_backends(utils.TransferBackend)
    if backends is not utils.TransferBackend:
        HookRegistry.register("sglang.srt.disaggregation.utils.TransferBackend", backends, HookType.REPLACE)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _kv_class, HookType.AROUND)
    log.debug("kvxfer registered as SGLang disaggregation transfer backend %r", BACKEND)
