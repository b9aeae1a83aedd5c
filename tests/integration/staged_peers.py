"""Producer ranks for the staged-path tests (``nixl_peers.Producer`` with staged defaults) and
the logical-KV oracle they check reads against."""

from kvxfer import KVSpec
from kvxfer.testing import expected_read as expect_read  # noqa: F401 - the tests import them from here
from kvxfer.testing import logical_kv as logical  # noqa: F401

from nixl_peers import Producer


class StagedProducer(Producer):
    """A producer rank with ``transfer_path="staged"`` and a small staging area by default."""

    def __init__(self, spec: KVSpec, seed: int, port: int, holds: dict, stall_after: int | None = None,
                 **cfg) -> None:
        cfg.setdefault("transfer_path", "staged")
        cfg.setdefault("pipeline_slot_bytes", 16 << 10)
        cfg.setdefault("pipeline_slots", 4)
        super().__init__(spec, seed, port, holds, stall_after, **cfg)
