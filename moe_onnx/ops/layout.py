"""A node's place among the ranks (:class:`Layout`, read from its attributes ep_world_size, ep_rank_id,
tp_world_size, tp_rank_id) and the one wording of a world of the wrong size, shared by the op
references, the Python comm layer and the runner (docs/distributed.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


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

    def attributes(self) -> dict[str, int]:
        """The node attributes that say this layout (ep_world_size, ep_rank_id, tp_world_size, tp_rank_id)."""
        return dict(ep_world_size=self.ep_size, ep_rank_id=self.ep_rank, tp_world_size=self.tp_size,
                    tp_rank_id=self.tp_rank)

    def of_rank(self, global_rank: int) -> Layout:
        """The layout of ``global_rank`` in the same world."""
        return dataclasses.replace(self, ep_rank=global_rank // self.tp_size, tp_rank=global_rank % self.tp_size)


def several_ranks(attrs: Mapping[str, object]) -> bool:
    """Whether a node with the attributes ``attrs`` is one of several ranks: its ep_world_size times
    tp_world_size (1 when not set) is over 1. Sizes that are not ints count as one rank (the reference
    says what is wrong with them)."""
    sizes = [attrs.get(name, 1) for name in ("ep_world_size", "tp_world_size")]
    return all(isinstance(size, int) for size in sizes) and sizes[0] * sizes[1] > 1


def ranks_word(n: int) -> str:
    return f"{n} MPI rank" if n == 1 else f"{n} MPI ranks"


def layout_words(layout: Layout) -> str:
    return f"ep_world_size {layout.ep_size} x tp_world_size {layout.tp_size}"


def _one_process(op: str, subject: str, ranks: int) -> str:
    return (f"{op}: {subject}: this node is one of {ranks} ranks and runs only with its group (under MPI, "
            "docs/distributed.md), not on one process")


def world_size_problem(op: str, world_size: int, layout: Layout) -> str | None:
    """What is wrong with running a node of ``layout`` in an MPI world of ``world_size`` ranks (None: nothing).
    One wording for the comm layers (Python and C++) and the one-process references (a world of one rank)."""
    if world_size == 1 and layout.world_size > 1:
        return _one_process(op, f"attributes 'ep_world_size' and 'tp_world_size' are {layout.ep_size} and "
                                f"{layout.tp_size}", layout.world_size)
    if world_size != layout.world_size:
        return (f"{op}: runs with {ranks_word(world_size)}; the node needs {layout.world_size} "
                f"({layout_words(layout)}; start it under mpirun -n {layout.world_size})")
    return None


def tp_world_size_problem(op: str, world_size: int, tp_size: int) -> str | None:
    """As :func:`world_size_problem` for a node that names only its TP group (MOE, MoeRowParallelLinear):
    the world must be a multiple of ``tp_size``."""
    if world_size == 1 and tp_size > 1:
        return _one_process(op, f"attribute 'tp_world_size' is {tp_size}", tp_size)
    if world_size % tp_size:
        return (f"{op}: runs with {ranks_word(world_size)}; the node needs a multiple of tp_world_size {tp_size} "
                f"(start it under mpirun -n {tp_size})")
    return None


__all__ = ["Layout", "layout_words", "ranks_word", "several_ranks", "tp_world_size_problem", "world_size_problem"]
