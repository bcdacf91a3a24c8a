"""target="ort": each MOE node becomes onnxruntime's contrib op ``com.microsoft::MoE``, so the model
runs on onnxruntime's CPU, CUDA and WebGPU providers without our library.

The contrib op routes by itself: it takes the router's logits (``router_probs``), takes their softmax
over the experts, picks the top k and, with ``normalize_routing_weights=1``, renormalizes the k
weights. So a block converts when its router is exactly that (a MoeGatingTopK with softmax, one
group, no bias, no scaling, renormalize without eps, or the same chain unfused, read by
``gating.read_router``); the experts map as

- GEMM2_BIAS_SWIGLU_CLAMP -> swiglu, alpha = expert_alpha, beta = 1, swiglu_limit = expert_beta,
  fc1 = weight_0 as [E, 2I, H] with the gate rows even (the order the contrib op takes);
- GEMM3_SWIGLU -> swiglu, alpha = expert_alpha, beta = 0, no limit, fc1 = gate and up rows interleaved;
- GEMM2_ACT -> relu, silu, identity as they are; gelu_tanh -> gelu (the contrib op's gelu is the tanh
  approximation: its CPU kernel, measured).

Every attribute is written (provider defaults have differed, onnxruntime #28738) and SwiGLU is always
interleaved (``swiglu_fusion=1``, the only form the CPU kernel takes). What onnxruntime 1.31.1's CPU
kernel does, measured: ``normalize_routing_weights=0`` weights by the softmax over all experts (the
probabilities themselves), ``1`` renormalizes them over the k chosen; ``silu`` ignores
``activation_alpha``. A block the contrib op cannot express keeps its MOE node, and the report says
why (a near-miss of ``RULE``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from ..ops import DOMAIN
from ..ops.moe import GEMM2_ACT, GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU
from ..ops.signatures import MOE_GATING_TOPK
from ._match import MatchFailure, attribute_value, constant, int64s, replace_node, require
from ._onnxscript import TapeBuilder
from ._weights import Weight, lazy_initializer, weight
from .gating import Router, read_router, uncast

ORT_DOMAIN = "com.microsoft"
ORT_OPSET_VERSION = 1
RULE = "MoeToOrtMoE"
# GEMM2_ACT's activations by the contrib op's name for them (gelu: the tanh approximation, measured)
_ORT_ACTIVATIONS = {"relu": "relu", "silu": "silu", "identity": "identity", "gelu_tanh": "gelu"}
_ORT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
_BIASED = ("the router adds a bias to choose the experts (DeepSeek-V3's e_score_correction_bias); the contrib "
           "op chooses by the softmax scores")


# ----------------------------------------------------------------------------- the router

@dataclasses.dataclass(frozen=True)
class OrtRouting:
    """What the contrib op's own routing needs: the logits [*, E], k and whether to renormalize."""

    logits: ir.Value
    k: int
    renormalize: bool


def _gating_router(gating: ir.Node, indices: ir.Value) -> Router:
    """The Router a MoeGatingTopK node computes (its attributes with their defaults)."""
    require(indices.producer() is gating and indices.index() == 1,
            "the MOE's indices are not the indices of the MoeGatingTopK that gives its weights")
    bias_input = gating.inputs[1] if len(gating.inputs) > 1 else None
    bias = None if bias_input is None else constant(bias_input)
    require(bias_input is None or bias is not None, _BIASED)
    attributes = {a.name: attribute_value(gating, a.name, a.default) for a in MOE_GATING_TOPK.attributes}
    return Router(gating.inputs[0], bias, attributes)


def read_routing(moe: ir.Node) -> OrtRouting:
    """The routing of ``moe`` as the contrib op computes it, or MatchFailure naming what it cannot."""
    weights, indices = moe.inputs[1], moe.inputs[2]
    gating = uncast(weights).producer()
    if gating is not None and gating.domain == DOMAIN and gating.op_type == MOE_GATING_TOPK.name:
        router = _gating_router(gating, indices)
    else:
        try:
            router = read_router(weights, indices)
        except MatchFailure as failure:
            raise MatchFailure(f"the router is not one the contrib op computes ({failure})") from None
    a = router.attributes
    require(a.get("score_func", "softmax") == "softmax",
            f"the router scores are {a['score_func']}; the contrib op takes a softmax over the experts")
    require(a.get("n_group", 1) == 1, f"the router picks the experts from {a.get('n_group')} groups "
            "(group-limited top-k); the contrib op takes a plain top-k")
    require(router.bias is None, _BIASED)
    scale = a.get("routed_scaling_factor", 1.0)
    require(scale == 1.0, f"the routing weights are scaled by {scale}; the contrib op does not scale them")
    eps = a.get("eps", 0.0)
    require(not a["renormalize"] or eps == 0.0, f"the routing weights are renormalized with eps = {eps} in the "
            "denominator; the contrib op divides by their sum alone")
    return OrtRouting(router.logits, int(a["k"]), bool(a["renormalize"]))


# ----------------------------------------------------------------------------- the experts

@dataclasses.dataclass(frozen=True)
class OrtExperts:
    """The contrib op's expert inputs (lazy initializers) and activation attributes."""

    num_experts: int
    hidden_size: int
    fc1: ir.Value
    fc1_bias: ir.Value | None
    fc2: ir.Value
    fc2_bias: ir.Value | None
    activation_type: str
    alpha: float
    beta: float
    limit: float
    swiglu_fusion: int


def _constant_weight(value: ir.Value | None, what: str) -> Weight | None:
    if value is None:
        return None
    w = weight(value)
    require(w is not None, f"{what} is computed at run time; the export needs constant weights")
    return w


def _lazy(op, name: str, sources: list[Weight], per_expert: Callable[..., np.ndarray],
          shape: tuple[int, ...]) -> ir.Value:
    """A lazy initializer whose expert e is ``per_expert(*(w.expert(e) for w in sources))``."""
    return lazy_initializer(op, name, lambda e: np.ascontiguousarray(per_expert(*(w.expert(e) for w in sources))),
                            sources[0].dtype, shape, sources=[w.source for w in sources])


def _as_is(op, w: Weight | None, name: str) -> ir.Value | None:
    if w is None:
        return None
    if not w.steps:
        return w.source
    return _lazy(op, name, [w], lambda a: a, w.shape)


def _even_gate_rows(rows: np.ndarray, gate_parity: int) -> np.ndarray:
    """``rows`` [2I, ...] interleaved gate/up with the gate at ``gate_parity``, as gate-even."""
    if gate_parity == 0:
        return rows
    pairs = rows.reshape(rows.shape[0] // 2, 2, *rows.shape[1:])
    return pairs[:, ::-1].reshape(rows.shape)


def _swiglu_clamp_experts(op, moe: ir.Node) -> OrtExperts:
    w0, b0, w1, b1 = (_constant_weight(moe.inputs[i], f"input {i} of the MOE") if i < len(moe.inputs) else None
                      for i in (3, 4, 5, 6))
    parity = int(attribute_value(moe, "gate_parity", 0))
    experts, hidden, two_i = w0.shape
    fc1 = _lazy(op, "ort_fc1", [w0], lambda a: _even_gate_rows(a.T, parity), (experts, two_i, hidden))
    fc1_bias = None if b0 is None else _lazy(op, "ort_fc1_bias", [b0], lambda a: _even_gate_rows(a, parity), b0.shape)
    fc2 = _lazy(op, "ort_fc2", [w1], lambda a: a.T, (experts, hidden, two_i // 2))
    return OrtExperts(experts, hidden, fc1, fc1_bias, fc2, _as_is(op, b1, "ort_fc2_bias"), "swiglu",
                      float(attribute_value(moe, "expert_alpha", 1.0)), 1.0, float(attribute_value(moe, "expert_beta", 0.0)), 1)


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Rows gate[0], up[0], gate[1], up[1], ... of two [I, ...] arrays."""
    return np.stack([gate, up], axis=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def _swiglu_experts(op, moe: ir.Node) -> OrtExperts:
    gate, up, down = (_constant_weight(moe.inputs[i], f"input {i} of the MOE") for i in (3, 5, 7))
    experts, inter, hidden = gate.shape
    fc1 = _lazy(op, "ort_fc1", [gate, up], _interleave, (experts, 2 * inter, hidden))
    return OrtExperts(experts, hidden, fc1, None, _as_is(op, down, "ort_fc2"), None, "swiglu",
                      float(attribute_value(moe, "expert_alpha", 1.0)), 0.0, math.inf, 1)


def _activation_experts(op, moe: ir.Node) -> OrtExperts:
    activation = attribute_value(moe, "activation", "")
    require(activation in _ORT_ACTIVATIONS, f"the experts' activation is {activation}; the contrib op has "
            f"{', '.join(sorted(_ORT_ACTIVATIONS))} (its gelu is the tanh approximation)")
    w0, b0, w1, b1 = (_constant_weight(moe.inputs[i], f"input {i} of the MOE") if i < len(moe.inputs) else None
                      for i in (3, 4, 5, 6))
    return OrtExperts(w0.shape[0], w0.shape[2], _as_is(op, w0, "ort_fc1"), _as_is(op, b0, "ort_fc1_bias"), _as_is(op, w1, "ort_fc2"),
                      _as_is(op, b1, "ort_fc2_bias"), _ORT_ACTIVATIONS[activation], 1.0, 0.0, math.inf, 0)


_EXPERTS = {GEMM2_BIAS_SWIGLU_CLAMP: _swiglu_clamp_experts, GEMM3_SWIGLU: _swiglu_experts,
            GEMM2_ACT: _activation_experts}


def ort_attributes(experts: OrtExperts, routing: OrtRouting) -> dict:
    """Every attribute of com.microsoft::MoE, written out."""
    return {"k": routing.k, "normalize_routing_weights": int(routing.renormalize), "use_sparse_mixer": 0,
            "activation_type": experts.activation_type, "activation_alpha": experts.alpha,
            "activation_beta": experts.beta, "swiglu_fusion": experts.swiglu_fusion,
            "swiglu_limit": experts.limit}


# ----------------------------------------------------------------------------- the node

def _check_types(moe: ir.Node) -> None:
    dtype = moe.inputs[0].dtype
    require(dtype in _ORT_TYPES, f"hidden_states are {dtype}; onnxruntime's CPU MoE takes float32 and float16")
    for i in (3, 4, 5, 6, 7):
        if i < len(moe.inputs) and moe.inputs[i] is not None:
            require(moe.inputs[i].dtype == dtype, f"input {i} of the MOE is {moe.inputs[i].dtype}, not "
                    f"{dtype} like hidden_states; the contrib op takes one type")


def _rows(op, value: ir.Value, width: int) -> ir.Value:
    """``value`` as [rows, width] (itself when it is 2-D already)."""
    if value.shape is not None and len(value.shape) == 2:
        return value
    return op.Reshape(value, int64s(op, [-1, width]))


def _convert(moe: ir.Node) -> tuple[list[ir.Node], list[ir.Value], ir.Value]:
    """The nodes replacing ``moe``, new initializers and the output; MatchFailure when it stays."""
    _check_types(moe)
    routing = read_routing(moe)
    expert_type = attribute_value(moe, "expert_type", "")
    op = TapeBuilder()
    experts = _EXPERTS[expert_type](op, moe)
    hidden, logits = moe.inputs[0], routing.logits
    num_experts, hidden_size = experts.num_experts, experts.hidden_size
    require(logits.shape is not None and logits.shape[-1] == num_experts,
            f"the router logits have shape {logits.shape}; expected [..., {num_experts}] (the MOE's experts)")
    if logits.dtype != hidden.dtype:
        logits = op.Cast(logits, to=hidden.dtype)
    inputs = [_rows(op, hidden, hidden_size), _rows(op, logits, num_experts), experts.fc1, experts.fc1_bias,
              experts.fc2, experts.fc2_bias]
    y = op.MoE(*inputs, _domain=ORT_DOMAIN, _version=ORT_OPSET_VERSION, **ort_attributes(experts, routing))
    if inputs[0] is not hidden:
        y = op.Reshape(y, op.Shape(hidden))
    return op.nodes, op.initializers, y


def export_moe_nodes(model: ir.Model) -> tuple[dict[str, int], list[dict[str, str]]]:
    """Replace every MOE node the contrib op expresses by com.microsoft::MoE; returns the count and a
    near-miss (rule, node, reason) for each MOE node that stays."""
    count, refused = 0, []
    for node in list(model.graph):
        if node.domain != DOMAIN or node.op_type != "MOE":
            continue
        try:
            replace_node(node, *_convert(node))
        except MatchFailure as failure:
            refused.append({"rule": RULE, "node": node.name or "",
                            "reason": f"stays a {DOMAIN} MOE (needs our library): {failure}"})
            continue
        count += 1
    if count:
        model.opset_imports[ORT_DOMAIN] = ORT_OPSET_VERSION
    return ({RULE: count} if count else {}), refused
