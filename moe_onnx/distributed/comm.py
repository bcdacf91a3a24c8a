"""The collectives of the Python backend's per-rank kernels, over mpi4py (docs/distributed.md).

The shape of custom_ops/src/comm/comm.h: :func:`groups` gives a layout's world, TP and EP groups, each a
:class:`Group` with ``size``, ``rank`` and the collectives the kernels use, on numpy arrays whose
counts are rows (the first axis). Every collective is a non-blocking MPI call polled with ``Test``
and a short sleep for at most ``MOE_ONNX_COMM_TIMEOUT_S`` seconds (default 300); a failure or a
timeout is a MoeOpError naming the op, the collective, what it carried and the group's world ranks,
in the C++ layer's words; after a timeout the process ends the whole job when it exits (MPI_Abort, not
MPI_Finalize, which would wait for the lost collective). mpi4py (and with it MPI) is imported only by a
layout of more than one rank; a one-rank layout's groups copy.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from ..ops._common import MoeOpError
from ..ops.layout import Layout, layout_words, ranks_word, tp_world_size_problem, world_size_problem

TIMEOUT_VARIABLE = "MOE_ONNX_COMM_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
_POLL_SLEEP_S = 1e-4  # between two Test calls of a pending collective


class CommError(MoeOpError):
    """A collective failed or did not complete in time, or MPI does not fit the node's layout."""

    pending = None  # the request of a collective that timed out


def timeout_s(op: str) -> float:
    """MOE_ONNX_COMM_TIMEOUT_S: seconds > 0 (default 300); CommError naming ``op`` otherwise."""
    text = os.environ.get(TIMEOUT_VARIABLE, "")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise CommError(f"{op}: environment variable {TIMEOUT_VARIABLE} is {text!r}; expected a number of seconds "
                        f"> 0 (default {DEFAULT_TIMEOUT_S:g})")
    return value


def _displacements(counts: np.ndarray) -> np.ndarray:
    return (np.cumsum(counts) - counts).astype(np.int64)


def _rows(count: int, like: np.ndarray) -> np.ndarray:
    return np.empty((int(count), *like.shape[1:]), dtype=like.dtype)


class Group:
    """The ranks of one group in group-rank order. Each collective is a collective of the whole group;
    ``op`` (the node, as errors name it) and ``what`` (the data) go into its error messages."""

    size: int
    rank: int

    def all_reduce_sum(self, data: np.ndarray, op: str, what: str) -> np.ndarray:
        """The element-wise sum of every rank's ``data`` (float32 or int32)."""
        raise NotImplementedError

    def all_gather(self, data: np.ndarray, op: str, what: str) -> np.ndarray:
        """[size, *data.shape]: every rank's ``data`` (the same shape on every rank), in rank order."""
        raise NotImplementedError

    def all_to_all_v(self, send: np.ndarray, send_counts: Sequence[int], recv_counts: Sequence[int], op: str,
                     what: str) -> np.ndarray:
        """``send_counts[r]`` rows of ``send`` (consecutive) go to rank r; ``recv_counts[r]`` rows come from
        rank r, concatenated in rank order."""
        raise NotImplementedError

    def all_gather_v(self, send: np.ndarray, recv_counts: Sequence[int], op: str, what: str) -> np.ndarray:
        """Every rank's ``send`` concatenated in rank order; ``recv_counts[r]`` rows from rank r."""
        raise NotImplementedError

    def reduce_scatter_v_sum(self, send: np.ndarray, counts: Sequence[int], op: str, what: str) -> np.ndarray:
        """``send`` is float32 rows in rank blocks of ``counts``; this rank gets the sum over the group of its
        block."""
        raise NotImplementedError


class SoloGroup(Group):
    """A group of one rank: every collective is a copy (no MPI)."""

    size, rank = 1, 0

    def all_reduce_sum(self, data, op, what):
        return data.copy()

    def all_gather(self, data, op, what):
        return data[None].copy()

    def all_to_all_v(self, send, send_counts, recv_counts, op, what):
        if int(send_counts[0]) != int(recv_counts[0]):
            raise CommError(f"{op}: the all-to-all-v of {what} sends {int(send_counts[0])} rows to its own rank but "
                            f"receives {int(recv_counts[0])}")
        return send.copy()

    def all_gather_v(self, send, recv_counts, op, what):
        if send.shape[0] != int(recv_counts[0]):
            raise CommError(f"{op}: the all-gather-v of {what} sends {send.shape[0]} rows but receives "
                            f"{int(recv_counts[0])}")
        return send.copy()

    def reduce_scatter_v_sum(self, send, counts, op, what):
        return send.copy()


class MpiGroup(Group):
    """A group of several ranks over an mpi4py communicator."""

    def __init__(self, mpi, comm, name: str, world_ranks: Sequence[int]):
        self._mpi, self._comm, self.name = mpi, comm, name
        self.world_ranks = [int(r) for r in world_ranks]
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self._stuck = None  # a collective that timed out, kept with its buffers: MPI may still write them

    def where(self, op: str, action: str) -> str:
        return _where(op, action, self.name, self.world_ranks)

    def _run(self, op: str, collective: str, what: str, start, *buffers) -> None:
        """Start a non-blocking collective (``start()`` returns its request) and wait for it (:func:`wait`)."""
        where = self.where(op, f"the {collective} of {what}")
        if self._stuck is not None:
            raise CommError(f"{where} failed: an earlier collective of this group did not complete; the group "
                            "cannot be used again")
        try:
            wait(self._mpi, where, op, start)
        except CommError as error:
            if error.pending is not None:
                self._stuck = (error.pending, buffers)
            raise

    def all_reduce_sum(self, data, op, what):
        send = np.ascontiguousarray(data)
        recv = np.empty_like(send)
        self._run(op, "all-reduce", what, lambda: self._comm.Iallreduce(send, recv, op=self._mpi.SUM), send, recv)
        return recv

    def all_gather(self, data, op, what):
        send = np.ascontiguousarray(data)
        recv = np.empty((self.size, *send.shape), dtype=send.dtype)
        self._run(op, "all-gather", what, lambda: self._comm.Iallgather(send, recv), send, recv)
        return recv

    def all_to_all_v(self, send, send_counts, recv_counts, op, what):
        send = np.ascontiguousarray(send)
        recv = _rows(sum(int(c) for c in recv_counts), send)
        row = send.itemsize * math.prod(send.shape[1:])
        s_counts, r_counts = (np.asarray(c, dtype=np.int64) * row for c in (send_counts, recv_counts))
        byte = self._mpi.BYTE
        self._run(op, "all-to-all-v", what, lambda: self._comm.Ialltoallv(
            [_bytes(send), (s_counts, _displacements(s_counts)), byte],
            [_bytes(recv), (r_counts, _displacements(r_counts)), byte]), send, recv)
        return recv

    def all_gather_v(self, send, recv_counts, op, what):
        send = np.ascontiguousarray(send)
        recv = _rows(sum(int(c) for c in recv_counts), send)
        row = send.itemsize * math.prod(send.shape[1:])
        r_counts = np.asarray(recv_counts, dtype=np.int64) * row
        byte = self._mpi.BYTE
        self._run(op, "all-gather-v", what, lambda: self._comm.Iallgatherv(
            [_bytes(send), byte], [_bytes(recv), (r_counts, _displacements(r_counts)), byte]), send, recv)
        return recv

    def reduce_scatter_v_sum(self, send, counts, op, what):
        send = np.ascontiguousarray(send, dtype=np.float32)
        recv = _rows(int(counts[self.rank]), send)
        row = math.prod(send.shape[1:])
        elements = [int(c) * row for c in counts]
        self._run(op, "reduce-scatter-v", what, lambda: self._comm.Ireduce_scatter(
            send, recv, elements, op=self._mpi.SUM), send, recv)
        return recv


def _where(op: str, action: str, group: str, world_ranks: Sequence[int]) -> str:
    """How errors name a collective: "<op>: <action> over the TP group (world ranks [0, 1])"."""
    return f"{op}: {action} over the {group} group (world ranks [{', '.join(map(str, world_ranks))}])"


def _bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a contiguous array (bfloat16 and every other dtype travel as MPI_BYTE)."""
    return array.reshape(-1).view(np.uint8)


def wait(mpi, where: str, op: str, start) -> None:
    """Start a collective (``start()`` gives its request) and poll it with ``Test`` and a short sleep.
    CommError starting with ``where`` when MPI fails, or when it is still pending after the timeout (the
    error's ``pending`` is then the request, whose buffers MPI may still write)."""
    timeout = timeout_s(op)
    try:
        request = start()
        deadline = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                error = CommError(f"{where} did not complete within {timeout:g} s ({TIMEOUT_VARIABLE}): a rank of "
                                  "the group failed or never reached it")
                error.pending = request
                _abort_at_exit()
                raise error
            time.sleep(_POLL_SLEEP_S)
    except mpi.Exception as error:
        raise CommError(f"{where} failed: {error}") from None


def _abort_at_exit() -> None:
    """After a timeout, MPI_Finalize would wait for the lost collective (for the rank that never came): at
    Python's exit, mpi4py then ends the job with MPI_Abort(1) instead (the C++ layer skips MPI_Finalize)."""
    from mpi4py.run import set_abort_status

    set_abort_status(1)


@dataclasses.dataclass(frozen=True)
class Groups:
    """The groups of one layout: the whole world, this rank's TP group and its EP group."""

    world: Group
    tp: Group
    ep: Group


_SOLO = Groups(SoloGroup(), SoloGroup(), SoloGroup())
_made: dict[Layout, Groups] = {}
_lock = threading.Lock()


def _mpi(op: str, layout: Layout):
    """mpi4py's MPI module (importing it starts MPI), or CommError saying what is missing."""
    needs = f"{op}: needs {ranks_word(layout.world_size)} ({layout_words(layout)}), but "
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise CommError(needs + f"mpi4py does not import ({error}); install mpi4py and an MPI library "
                        "(docs/distributed.md)") from None
    except RuntimeError as error:  # mpi4py without its MPI library, or MPI_Init failing
        raise CommError(needs + f"MPI does not start ({error})") from None
    return MPI


def _check_layout(layout: Layout, op: str) -> None:
    for size_name, rank_name, size, rank in (("ep_world_size", "ep_rank_id", layout.ep_size, layout.ep_rank),
                                             ("tp_world_size", "tp_rank_id", layout.tp_size, layout.tp_rank)):
        if size < 1:
            raise CommError(f"{op}: attribute '{size_name}' is {size}; expected >= 1")
        if not 0 <= rank < size:
            raise CommError(f"{op}: attribute '{rank_name}' is {rank}; expected 0 <= {rank_name} < {size_name} = "
                            f"{size}")


def _world(mpi) -> tuple[int, int]:
    """The size of MPI_COMM_WORLD and this process's rank in it."""
    return mpi.COMM_WORLD.Get_size(), mpi.COMM_WORLD.Get_rank()


def groups(layout: Layout, op: str) -> Groups:
    """The groups of ``layout``, made once per layout and process (a split of the world is a collective:
    every rank makes its groups in one order). CommError naming ``op`` when the layout is invalid, mpi4py or
    MPI is missing, or the MPI world is not the layout's (size W, rank g). A one-rank layout needs no MPI."""
    _check_layout(layout, op)
    if layout.world_size == 1:
        return _SOLO
    with _lock:
        if layout not in _made:
            _made[layout] = _mpi_groups(layout, op)
        return _made[layout]


def tp_groups(tp_size: int, tp_rank: int, op: str) -> Groups:
    """The groups of a node that knows only its TP group (MOE, MoeRowParallelLinear): the MPI world is
    split into consecutive TP groups of ``tp_size`` ranks, this rank's EP rank being its world rank //
    tp_size. CommError when the world is not a multiple of tp_size or this rank is another TP rank."""
    tp_only = Layout(tp_size=tp_size, tp_rank=tp_rank)
    _check_layout(tp_only, op)
    if tp_size == 1:
        return _SOLO
    size, rank = _world(_mpi(op, tp_only))
    problem = tp_world_size_problem(op, size, tp_size)
    if problem:
        raise CommError(problem)
    if rank % tp_size != tp_rank:
        raise CommError(f"{op}: runs as MPI rank {rank}, TP rank {rank % tp_size} of its group, but the node has "
                        f"tp_rank_id {tp_rank}; expected rank {rank}'s model")
    return groups(Layout(size // tp_size, rank // tp_size, tp_size, tp_rank), op)


def _mpi_groups(layout: Layout, op: str) -> Groups:
    mpi = _mpi(op, layout)
    size, rank = _world(mpi)
    world_size, g = layout.world_size, layout.global_rank
    problem = world_size_problem(op, size, layout)
    if problem:
        raise CommError(problem)
    if rank != g:
        raise CommError(f"{op}: runs as MPI rank {rank}, but the node is global rank {g} (ep_rank_id "
                        f"{layout.ep_rank} * tp_world_size {layout.tp_size} + tp_rank_id {layout.tp_rank}); "
                        f"expected rank {rank}'s model")
    tp_ranks = [g - layout.tp_rank + q for q in range(layout.tp_size)]
    ep_ranks = [layout.global_rank_of(p, layout.tp_rank) for p in range(layout.ep_size)]
    world = MpiGroup(mpi, mpi.COMM_WORLD, "world", range(world_size))

    def split(name: str, color: int, key: int, world_ranks: list[int]) -> Group:
        """A split of the world (after a barrier that waits at most the timeout: MPI's split cannot)."""
        if len(world_ranks) == 1:
            return SoloGroup()
        wait(mpi, _where(op, "the communicator split", name, world_ranks), op, mpi.COMM_WORLD.Ibarrier)
        return MpiGroup(mpi, mpi.COMM_WORLD.Split(color, key), name, world_ranks)

    tp = split("TP", layout.ep_rank, layout.tp_rank, tp_ranks)
    ep = split("EP", layout.tp_rank, layout.ep_rank, ep_ranks)
    return Groups(world, tp, ep)
