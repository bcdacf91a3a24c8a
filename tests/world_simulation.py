"""Every rank of a sharded model in one process, without MPI: a thread per rank runs its model in
onnx's ReferenceEvaluator, and each multi-rank node meets the other ranks' same node, hands its inputs
over and takes its outputs from the all-ranks references (``ops/distribute.py``'s dispatch_all_ranks and
combine_all_ranks, MOE's and MoeRowParallelLinear's tensor-parallel references). This checks the
sharding transformation on the ops' meaning; the MPI tests check the kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from moe_onnx.ops.layout import Layout
from moe_onnx.ops import DOMAIN, REFERENCE_OPS
from moe_onnx.ops.distribute import combine_all_ranks, dispatch_all_ranks
from moe_onnx.ops.moe import moe as moe_reference, moe_tensor_parallel
from moe_onnx.ops.row_parallel_linear import row_parallel_linear, row_parallel_linear_tensor_parallel

TIMEOUT_S = 60


class World:
    """The meeting point of ``size`` rank threads: :meth:`exchange` returns every rank's value."""

    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=TIMEOUT_S)
        self._slots: list = [None] * size

    def exchange(self, rank: int, value) -> list:
        self._slots[rank] = value
        self._barrier.wait()
        everyone = list(self._slots)
        self._barrier.wait()
        return everyone

    def abort(self) -> None:
        """Wake the other ranks' waits with BrokenBarrierError (a rank failed)."""
        self._barrier.abort()


def _layout(attrs: dict) -> Layout:
    return Layout(attrs.get("ep_world_size") or 1, attrs.get("ep_rank_id") or 0, attrs.get("tp_world_size") or 1,
                  attrs.get("tp_rank_id") or 0)


def _rank_ops(world: World, rank: int) -> list[type[OpRun]]:
    """The multi-rank ops as rank ``rank`` runs them."""

    def dispatch(self, x, expert_ids, **attrs):
        layout = _layout(attrs)
        everyone = world.exchange(rank, (x, expert_ids))
        return dispatch_all_ranks([x for x, _ in everyone], [ids for _, ids in everyone],
                                  num_experts=attrs["num_experts"], expert_capacity=attrs.get("expert_capacity") or 0,
                                  ep_world_size=layout.ep_size, tp_world_size=layout.tp_size)[rank]

    def combine(self, expand_y, assist_info, scales, x1=None, x2=None, **attrs):
        layout = _layout(attrs)
        everyone = list(zip(*world.exchange(rank, (expand_y, assist_info, scales, x1, x2))))
        return (combine_all_ranks(*everyone, num_experts=attrs["num_experts"], gather_tokens=attrs.get("gather_tokens")
                                  or 0, ep_world_size=layout.ep_size, tp_world_size=layout.tp_size)[rank],)

    def tp_group(layout: Layout, value) -> list:
        everyone = world.exchange(rank, value)
        return [everyone[layout.global_rank_of(layout.ep_rank, q)] for q in range(layout.tp_size)]

    def moe(self, *inputs, **attrs):
        attrs = {k: v for k, v in attrs.items() if v is not None}
        if _layout(attrs).tp_size == 1:  # a rank's own node (a shared expert on its tokens): no exchange
            return moe_reference(*inputs, **attrs)
        group = tp_group(_layout(attrs), list(inputs) + [None] * (8 - len(inputs)))
        attrs.pop("tp_rank_id", None)
        return moe_tensor_parallel(group, **attrs)

    def linear(self, x, offsets, w, b=None, **attrs):
        attrs = {k: v for k, v in attrs.items() if v is not None}
        layout = _layout(attrs)
        if layout.tp_size == 1:
            return row_parallel_linear(x, offsets, w, b, **attrs)
        group = tp_group(layout, (x, w))
        attrs.pop("tp_rank_id", None)
        attrs.pop("tp_world_size", None)
        parallel = attrs.get("input_is_parallel", 0) == 1
        return row_parallel_linear_tensor_parallel([x for x, _ in group] if parallel else x, offsets,
                                                   [w for _, w in group], b, **attrs)

    functions = {"MoeDistributeDispatch": dispatch, "MoeDistributeCombine": combine, "MOE": moe,
                 "MoeRowParallelLinear": linear}
    return [type(name, (OpRun,), {"op_domain": DOMAIN, "_run": run}) for name, run in functions.items()]


def run_world(rank_models: Sequence[onnx.ModelProto], feeds: dict[str, np.ndarray]) -> list[list[np.ndarray]]:
    """Every rank's outputs when each runs its model on ``feeds``; re-raises the first rank's error."""
    world = World(len(rank_models))
    results: list = [None] * world.size
    errors: list = []

    def rank_thread(rank: int) -> None:
        ops = _rank_ops(world, rank)
        ours = {op.__name__ for op in ops}
        evaluator = ReferenceEvaluator(rank_models[rank], new_ops=[
            *ops, *(op for op in REFERENCE_OPS if op.__name__ not in ours)])
        try:
            results[rank] = evaluator.run(None, feeds)
        except Exception as error:  # noqa: BLE001 -- handed to the caller
            errors.append(error)
            world.abort()

    threads = [threading.Thread(target=rank_thread, args=(g,)) for g in range(world.size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
