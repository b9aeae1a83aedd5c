"""K and V planned apart, for caches whose K and V differ in form (layer: layout, pure; numpy only, no nixl/zmq/torch).

Where a side keeps K dim-major (``KVSpec.k_dim_chunk``), the pieces of one unit of K are not
the pieces of one unit of V, so one template cannot serve every region. ``SplitKVPlan`` holds
one ``TransferPlan`` per region kind (V, then K: each covers one region of every layer) and
joins their requests into one ``RequestPlan``: rows of V, then rows of K, and for host-staged
plans one staging buffer with V's image first (its unit is a whole head vector, a multiple of
K's sub-vector, so K's part starts on a unit boundary of both).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvxfer.errors import LayoutError
from kvxfer.layout.request import RequestPlan, join_requests
from kvxfer.types import TransferPath

__all__ = ["SplitKVPlan"]


class SplitKVPlan:
    """A plan made of one ``TransferPlan`` per region kind; behaves as one ``TransferPlan``.

    ``parts`` are the V plan then the K plan, of one ``mode``. Attributes as ``TransferPlan``'s:
    ``mode``, ``local``, ``remote``, ``heads``, ``over_read`` (either part), ``reversible``,
    ``pieces_per_block`` (both parts together), ``group`` (1: a group never spans K and V here).
    """

    def __init__(self, parts: Sequence) -> None:
        modes = {p.mode for p in parts}
        if len(modes) != 1:
            raise LayoutError(f"the K and V plans must share one mode; got {sorted(m.value for m in modes)}")
        self.parts = tuple(parts)
        first = self.parts[0]
        self.mode, self.local, self.remote, self.heads = first.mode, first.local, first.remote, first.heads
        self.over_read = any(p.over_read for p in self.parts)
        self.reversible = not self.over_read
        self.pieces_per_block = sum(p.pieces_per_block for p in self.parts)
        self.group = 1

    def __repr__(self) -> str:
        return f"SplitKVPlan({', '.join(repr(p) for p in self.parts)})"

    def for_request(self, local_blocks: Sequence[int] | np.ndarray,
                    remote_blocks: Sequence[int] | np.ndarray, *, num_tokens: int | None = None) -> RequestPlan:
        """As ``TransferPlan.for_request``: V's rows then K's; staged offsets run on across both.

        Raises:
            BlockIdError: as ``TransferPlan.for_request``.
        """
        reqs = [p.for_request(local_blocks, remote_blocks, num_tokens=num_tokens) for p in self.parts]
        return join_requests(reqs, self.mode is TransferPath.HOST_STAGED)
