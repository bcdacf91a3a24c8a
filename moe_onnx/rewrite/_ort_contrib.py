"""onnxruntime's contrib ops com.microsoft::MoE and QMoE in our terms: the one mapping both directions
use (``ort_import`` reads a contrib node into MOE/QMOE, ``ort_export`` writes one from them).

Each table is written once, from our side to the contrib op's; the import's inverse is derived here
from it. What each direction accepts or refuses (which expert types, routers and quantizations the
other side computes exactly) stays with that direction.
"""

from __future__ import annotations

import dataclasses
import math

import onnx_ir as ir

from .._ir.inference import ORT_DOMAIN
from ..ops.qmoe import QUANT_INT, QUANT_MXFP4
from ..ops.signatures import MOE, QMOE

ORT_OPSET_VERSION = 1

#: our op -> the contrib op
CONTRIB_OPS = {MOE.name: "MoE", QMOE.name: "QMoE"}
OUR_OPS = {contrib: ours for ours, contrib in CONTRIB_OPS.items()}

#: each contrib op's inputs, by name, in its order
INPUTS = {
    "MoE": ("input", "router_probs", "fc1_experts_weights", "fc1_experts_bias", "fc2_experts_weights",
            "fc2_experts_bias", "fc3_experts_weights", "fc3_experts_bias"),
    "QMoE": ("input", "router_probs", "fc1_experts_weights", "fc1_scales", "fc1_experts_bias",
             "fc2_experts_weights", "fc2_scales", "fc2_experts_bias", "fc3_experts_weights", "fc3_scales",
             "fc3_experts_bias", "fc1_zero_points", "fc2_zero_points", "fc3_zero_points", "router_weights",
             "fc1_global_scale", "fc2_global_scale", "fc1_act_scale", "fc2_act_scale", "fc1_act_block_scale",
             "fc2_act_block_scale"),
}

#: GEMM2_ACT's pointwise activations -> the contrib op's activation_type (its gelu is the tanh
#: approximation: its CPU kernel, measured); relu2 and erf gelu have none
ACTIVATION_TYPES = {"relu": "relu", "silu": "silu", "identity": "identity", "gelu_tanh": "gelu"}
POINTWISE_ACTIVATIONS = {contrib: ours for ours, contrib in ACTIVATION_TYPES.items()}

#: swiglu_fusion: where a SwiGLU's gate and up rows are (fc1 [E, 2I, H] when fused)
SWIGLU_SEPARATE = 0  # gate in fc1, up in fc3
SWIGLU_INTERLEAVED = 1  # gate rows even, up rows odd (the only form onnxruntime's CPU kernel takes)
SWIGLU_HALVES = 2  # gate the first half of the rows, up the second

#: our quant_type -> QMoE's
QUANT_TYPES = {QUANT_INT: "int", QUANT_MXFP4: "fp4"}
OUR_QUANT_TYPES = {contrib: ours for ours, contrib in QUANT_TYPES.items()}


@dataclasses.dataclass(frozen=True)
class Activation:
    """The contrib op's expert activation attributes, each with the value a node that leaves it off has."""

    activation_type: str = "relu"
    activation_alpha: float = 1.0
    activation_beta: float = 0.0
    swiglu_fusion: int = SWIGLU_SEPARATE
    swiglu_limit: float = math.inf

    @classmethod
    def of(cls, node: ir.Node) -> Activation:
        """The activation attributes of contrib ``node``."""
        return cls(**{field.name: node.attributes[field.name].value for field in dataclasses.fields(cls)
                      if field.name in node.attributes})

    def attributes(self) -> dict:
        """Every attribute, to write on a contrib node."""
        return dataclasses.asdict(self)


def named_inputs(node: ir.Node) -> dict[str, ir.Value]:
    """The inputs contrib ``node`` is given, by name."""
    return {name: value for name, value in zip(INPUTS[node.op_type], node.inputs) if value is not None}


def ordered_inputs(op_type: str, named: dict[str, ir.Value | None]) -> list[ir.Value | None]:
    """The inputs of a contrib ``op_type`` node, in its order, from ``named`` (a name left out: absent)."""
    unknown = sorted(set(named) - set(INPUTS[op_type]))
    if unknown:
        raise ValueError(f"com.microsoft::{op_type} has no inputs {unknown}; its inputs are {INPUTS[op_type]}")
    inputs = [named.get(name) for name in INPUTS[op_type]]
    while inputs[-1] is None:
        inputs.pop()
    return inputs
