"""What the unrolled-loop forms share (``loop``: the TorchScript exporter's, ``loop_dynamo``: the dynamo
exporter's): the experts a branch reads, the verified block, the mask row a branch picks, and the MOE
the block becomes (:class:`UnrolledLoopFusion`'s ``emit``).

Shapes in names: T tokens, H hidden size, I expert intermediate size, E experts, K experts per token.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from .._ir.nodes import standard
from .._ir.weights import Weight, lazy_initializer, weight_value
from ..ops.moe import GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU
from ._match import MoeFusion, axes, emit_moe, producer, require
from ._router import Route


@dataclasses.dataclass(frozen=True)
class LinearExpert:
    """An expert of its own constant Linear weights: swish(x @ gate) * (x @ up) @ down; gate and up may be
    column ranges of one gate_up matrix (``gate_cols``, ``up_cols``). Each weight is stored [in, out] (a
    MatMul's, as the names say) unless ``in_out`` says [out, in] (an nn.Linear weight of a Gemm with
    transB=1, the dynamo exporter's)."""

    gate_HI: Weight
    up_HI: Weight
    down_IH: Weight
    alpha: float
    gate_cols: tuple[int | None, int | None] = (None, None)  # [start, end), None: to the edge
    up_cols: tuple[int | None, int | None] = (None, None)
    in_out: tuple[bool, bool, bool] = (True, True, True)  # gate, up, down

    def matrix(self, role: str) -> np.ndarray:
        """The [in, out] matrix of ``role``: "gate", "up" or "down" (loads it)."""
        w, columns = {"gate": (self.gate_HI, self.gate_cols), "up": (self.up_HI, self.up_cols),
                      "down": (self.down_IH, (None, None))}[role]
        array = w.array() if self.in_out[("gate", "up", "down").index(role)] else w.array().T
        return array[:, slice(*columns)]


@dataclasses.dataclass(frozen=True)
class GatheredExpert:
    """GPT-OSS's expert: the stacked weights and biases gathered at the branch's expert index, with the clamped
    SwiGLU of the interleaved gate_up columns."""

    gate_up_EHN: Weight
    gate_up_bias_EN: Weight
    down_EIH: Weight
    down_bias_EH: Weight
    gate_parity: int
    limit: float
    alpha: float


@dataclasses.dataclass(frozen=True)
class LoopBlock:
    """A verified chain of branches: the MOE inputs and the experts, each expert's own weights (None: no
    branch) or the stacked weights every branch gathers from."""

    name: str  # the chain's result, for the report
    tokens_TH: ir.Value
    route: Route
    experts: list[LinearExpert | None] | GatheredExpert
    hidden: int
    intermediate: int
    note: str | None = None  # what the report should say about the export


def mask_row(row: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``(expert_mask, row index)`` of ``row = expert_mask[index]`` (Gather, Squeeze of a 1-element index)."""
    node = row.producer()
    if standard(node, "Squeeze"):
        require(axes(node, 3) == [0], "the mask row Squeeze axes are not [0]")
        row = node.inputs[0]
    gather = producer(row, "Gather", "the mask row")
    require(gather.attributes.get_int("axis", 0) == 0, "the mask row Gather axis is not 0")
    return gather.inputs[0], gather.inputs[1]


def _stacked(op, name: str, experts: list[LinearExpert | None], role: str, dtype: ir.DataType,
             shape: tuple[int, int, int]) -> ir.Value:
    """A lazy [E, rows, cols] initializer of the transposed ``role`` matrices; zeros for absent experts."""

    def expert_slice(e: int) -> np.ndarray:
        expert = experts[e]
        return np.zeros(shape[1:], dtype=dtype.numpy()) if expert is None else expert.matrix(role).T

    sources = [w.source for x in experts if x for w in (x.gate_HI, x.up_HI, x.down_IH)]
    return lazy_initializer(op, name, expert_slice, dtype, shape, sources=list(dict.fromkeys(sources)))


class UnrolledLoopFusion(MoeFusion):
    """A fusion whose ``read`` returns a :class:`LoopBlock`; ``emit`` replaces the chain's result by
    ``MOE(tokens_TH, routing_TK, topk_indices_TK, gate_EIH, -, up_EIH, -, down_EHI)`` (SwiGLU experts) or
    ``MOE(tokens_TH, routing_TK, topk_indices_TK, gate_up_EHN, gate_up_bias_EN, down_EIH, down_bias_EH)``
    (GPT-OSS's gathered experts)."""

    def emit(self, op, block: LoopBlock) -> ir.Value:
        if block.note and block.note not in self.notes:
            self.notes.append(block.note)
        if isinstance(block.experts, GatheredExpert):
            expert = block.experts
            return emit_moe(op, block.tokens_TH, block.route.weights, block.route.indices,
                            expert_type=GEMM2_BIAS_SWIGLU_CLAMP,
                            weight_0=weight_value(op, expert.gate_up_EHN, "loop_gate_up_EHN"),
                            bias_0=weight_value(op, expert.gate_up_bias_EN, "loop_gate_up_bias_EN"),
                            weight_1=weight_value(op, expert.down_EIH, "loop_down_EIH"),
                            bias_1=weight_value(op, expert.down_bias_EH, "loop_down_bias_EH"),
                            expert_alpha=expert.alpha, expert_beta=expert.limit, gate_parity=expert.gate_parity)
        missing = [e for e, expert in enumerate(block.experts) if expert is None]
        note = (f"block '{block.name}': experts {missing} have no branch in the export (the trace routed no token "
                "to them); fused with zero weights, so they contribute nothing")
        if missing and note not in self.notes:
            self.notes.append(note)
        experts, dtype = block.route.experts, block.tokens_TH.dtype
        shape_EIH, shape_EHI = (experts, block.intermediate, block.hidden), (experts, block.hidden, block.intermediate)
        return emit_moe(op, block.tokens_TH, block.route.weights, block.route.indices, expert_type=GEMM3_SWIGLU,
                        weight_0=_stacked(op, "loop_gate_EIH", block.experts, "gate", dtype, shape_EIH),
                        weight_1=_stacked(op, "loop_up_EIH", block.experts, "up", dtype, shape_EIH),
                        weight_2=_stacked(op, "loop_down_EHI", block.experts, "down", dtype, shape_EHI),
                        expert_alpha=block.experts[next(e for e, x in enumerate(block.experts) if x)].alpha)
