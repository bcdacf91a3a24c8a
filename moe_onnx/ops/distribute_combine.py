"""MoeDistributeCombine: expert parallelism's second half, the expert outputs back to their tokens.

Meaning (docs/ops/MoeDistributeCombine.md, docs/distributed.md): dispatch's path backwards (TP
reduce-scatter of the partials, all-to-all back in the EP group), then
``out[t] = x1[t] + x2[t] + sum_j scales[t, j] * y(t, j)`` over the kept slots, optionally all-gathered
over the world. The reference here runs one process (W = 1); ``ops/distribute.py`` simulates every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import signatures
from ._body import CANNOT_COMMUNICATE
from ._common import (
    ArrayView,
    DimBinder,
    NodeView,
    OpDef,
    TensorInfo,
    check_choice,
    refuse_without_group,
)
from ._exchange import CombinePlan, read_assist_info, read_layout, weighted_sum

# input positions
EXPAND_Y, ASSIST_INFO, SCALES, X1, X2 = range(5)


def _validate(v: NodeView) -> list[TensorInfo | None]:
    layout, _ = read_layout(v)
    gather = check_choice(v, "gather_tokens", (0, 1)) == 1
    elem = v.expect_elem(EXPAND_Y)
    for i in (SCALES, X1, X2):
        if v.has(i):
            v.expect_elem(i)
            v.expect_same_elem(i, EXPAND_Y)
    v.expect_elem(ASSIST_INFO)
    dims = DimBinder(v)
    dims.shape(EXPAND_Y, ("rows", "H"), v.expect_rank(EXPAND_Y, rank=2))
    v.expect_rank(ASSIST_INFO, rank=1)
    dims.shape(SCALES, ("Bs", "K"), v.expect_rank(SCALES, rank=2))
    for i in (X1, X2):
        if v.has(i):
            dims.shape(i, ("Bs", "H"), v.expect_rank(i, rank=2))
    tokens = dims.get("Bs") if not gather or layout.world_size == 1 else None
    return [TensorInfo(elem, (tokens, dims.get("H")))]


def validated(inputs: Sequence[np.ndarray | None], attrs: dict, node_name: str = "",
              named_outputs: Sequence[bool] | None = None) -> tuple[ArrayView, CombinePlan]:
    """One rank's node checked on its arrays, assist_info included: its view and the plan assist_info holds."""
    view = ArrayView(MOE_DISTRIBUTE_COMBINE, inputs, attrs, node_name=node_name, named_outputs=named_outputs)
    MOE_DISTRIBUTE_COMBINE.validate(view)
    layout, num_experts = read_layout(view)
    expand_y, assist_info, scales = inputs[EXPAND_Y], inputs[ASSIST_INFO], inputs[SCALES]
    plan = read_assist_info(assist_info, layout, num_experts, scales.shape[0], scales.shape[1], expand_y.shape[0],
                            view.where())
    return view, plan


def moe_distribute_combine(expand_y, assist_info, scales, x1=None, x2=None, *, num_experts=None,
                           gather_tokens=None, ep_world_size=None, ep_rank_id=None, tp_world_size=None,
                           tp_rank_id=None, _node_name="", _named_outputs=None):
    """numpy reference of MoeDistributeCombine on one process (a world of one rank); returns ``(out,)``,
    [Bs, H] in the type of ``expand_y``.

    Raises MoeOpError for any input or attribute outside the contract, and for a node of a larger world
    (ops/distribute.py's ``combine_all_ranks`` simulates every rank).
    """
    attrs = dict(num_experts=num_experts, gather_tokens=gather_tokens, ep_world_size=ep_world_size,
                 ep_rank_id=ep_rank_id, tp_world_size=tp_world_size, tp_rank_id=tp_rank_id)
    view, plan = validated([expand_y, assist_info, scales, x1, x2], attrs, _node_name, _named_outputs)
    refuse_without_group(view, plan.layout)
    returned = expand_y[plan.arrival_to_row].astype(np.float32)  # one rank: the arrivals are its send buffer
    return (weighted_sum(returned, plan, scales, x1, x2),)


MOE_DISTRIBUTE_COMBINE = OpDef.of(
    signatures.MOE_DISTRIBUTE_COMBINE, validate=_validate, reference=moe_distribute_combine,
    no_body=f"it sends expert outputs back to their tokens' ranks (MPI); {CANNOT_COMMUNICATE}")
