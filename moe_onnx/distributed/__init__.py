"""Running one model over several processes (docs/distributed.md).

:class:`Layout` is where one node sits among the ranks, read from its attributes. The MPI groups
and collectives are in :mod:`moe_onnx.distributed.comm`, the Python backend's per-rank kernels in
:mod:`moe_onnx.distributed.kernels`; importing this package loads neither MPI nor mpi4py.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Layout:
    """A node's place among the ranks: its ep_world_size, ep_rank_id, tp_world_size, tp_rank_id."""

    ep_size: int = 1
    ep_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.ep_size * self.tp_size

    @property
    def global_rank(self) -> int:
        return self.ep_rank * self.tp_size + self.tp_rank

    def global_rank_of(self, ep_rank: int, tp_rank: int) -> int:
        """The global rank of (ep_rank, tp_rank) in this layout."""
        return ep_rank * self.tp_size + tp_rank

    def of_rank(self, global_rank: int) -> Layout:
        """The layout of ``global_rank`` in the same world."""
        return dataclasses.replace(self, ep_rank=global_rank // self.tp_size, tp_rank=global_rank % self.tp_size)


__all__ = ["Layout"]
