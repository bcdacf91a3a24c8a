"""MoeDistributeDispatch: expert parallelism's first half, every slot to the rank that owns its expert.

Meaning (docs/ops/MoeDistributeDispatch.md, docs/distributed.md): rank (EP rank p, TP rank q) returns the
rows of every slot of the world whose expert p owns, sorted by (local expert, global token), dropless or
padded to a capacity with drops, and the assist_info its combine needs. The reference here runs one
process (W = 1: a sort by expert); ``ops/distribute.py`` simulates every rank, ``distributed/kernels.py``
runs one rank over MPI, all three on the planning of ``_exchange.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import TensorProto

from . import signatures
from ._body import CANNOT_COMMUNICATE
from ._common import (
    ArrayView,
    DimBinder,
    NodeView,
    OpDef,
    TensorInfo,
    dim_product,
    is_known,
    refuse_without_group,
)
from ._exchange import (
    HEADER,
    arrange_arrivals,
    check_expert_ids,
    plan_dispatch,
    read_layout,
    send_rows,
    slot_counts,
)
from .layout import Layout

# input positions
X, EXPERT_IDS = range(2)
# output positions
EXPAND_X, EXPERT_OFFSET, ASSIST_INFO = range(3)

_INT64_MAX = 2**63 - 1


def _validate(v: NodeView) -> list[TensorInfo | None]:
    layout, num_experts = read_layout(v)
    local = num_experts // layout.ep_size
    capacity = int(v.attr("expert_capacity"))
    if capacity < 0:
        v.fail("attribute 'expert_capacity'", f"is {capacity}; expected 0 (dropless) or a capacity >= 1")
    if local * capacity > _INT64_MAX:
        v.fail("attribute 'expert_capacity'", f"is {capacity}; expected E_local * expert_capacity (the rows of "
               f"expand_x) <= {_INT64_MAX} (E_local {local})")
    elem = v.expect_elem(X)
    v.expect_elem(EXPERT_IDS)
    dims = DimBinder(v)
    dims.shape(X, ("Bs", "H"), v.expect_rank(X, rank=2))
    dims.shape(EXPERT_IDS, ("Bs", "K"), v.expect_rank(EXPERT_IDS, rank=2))
    k = dims.get("K")
    if is_known(k) and k > num_experts:
        v.fail(v.input_name(EXPERT_IDS), f"dim 1 is {k}; expected K <= num_experts = {num_experts} (the K experts "
               "of a row are distinct)")
    slots = dim_product((dims.get("Bs"), k))
    one_rank_dropless = layout.world_size == 1 and capacity == 0
    if capacity:
        rows = local * capacity
    else:
        rows = slots if one_rank_dropless else None
    arrivals = slots if one_rank_dropless else None
    fixed = len(HEADER) + layout.world_size + layout.tp_size + 2 * layout.ep_size
    assist = fixed + slots + arrivals if is_known(slots, arrivals) else None
    return [TensorInfo(elem, (rows, dims.get("H"))), TensorInfo(TensorProto.INT64, (local + 1,)),
            TensorInfo(TensorProto.INT64, (assist,))]


def validated(inputs: Sequence[np.ndarray | None], attrs: dict, node_name: str = "",
              named_outputs: Sequence[bool] | None = None) -> tuple[ArrayView, Layout, int, int]:
    """One rank's node checked on its arrays, expert ids included: its view, layout, num_experts, capacity."""
    view = ArrayView(MOE_DISTRIBUTE_DISPATCH, inputs, attrs, node_name=node_name, named_outputs=named_outputs)
    MOE_DISTRIBUTE_DISPATCH.validate(view)
    layout, num_experts = read_layout(view)
    check_expert_ids(inputs[EXPERT_IDS], num_experts, view.where())
    return view, layout, num_experts, int(view.attr("expert_capacity"))


def moe_distribute_dispatch(x, expert_ids, *, num_experts=None, expert_capacity=None, ep_world_size=None,
                            ep_rank_id=None, tp_world_size=None, tp_rank_id=None, _node_name="",
                            _named_outputs=None):
    """numpy reference of MoeDistributeDispatch on one process (a world of one rank); returns
    ``(expand_x, expert_offset, assist_info)``.

    Raises MoeOpError for any input or attribute outside the contract, and for a node of a larger world
    (ops/distribute.py's ``dispatch_all_ranks`` simulates every rank).
    """
    attrs = dict(num_experts=num_experts, expert_capacity=expert_capacity, ep_world_size=ep_world_size,
                 ep_rank_id=ep_rank_id, tp_world_size=tp_world_size, tp_rank_id=tp_rank_id)
    view, layout, experts, capacity = validated([x, expert_ids], attrs, _node_name, _named_outputs)
    refuse_without_group(view, layout)
    plan = plan_dispatch(expert_ids, slot_counts(expert_ids, experts)[None], layout, experts, capacity)
    return arrange_arrivals(send_rows(x, plan), plan)  # one rank: it sends to itself


MOE_DISTRIBUTE_DISPATCH = OpDef.of(
    signatures.MOE_DISTRIBUTE_DISPATCH, validate=_validate, reference=moe_distribute_dispatch,
    no_body=f"it sends tokens to the ranks that own their experts (MPI); {CANNOT_COMMUNICATE}")
