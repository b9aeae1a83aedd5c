"""kv_transfer_params: re-exported from ``kvxfer.transfer_params`` (one reader and writer for every engine)."""

from kvxfer.transfer_params import (  # noqa: F401
    REQUIRED, TRANSFER_MODE, BadParams, RemotePrefill, producer_answer, wants_remote_decode, wants_remote_prefill,
)
