"""target="ort": each MOE node becomes onnxruntime's contrib op ``com.microsoft::MoE`` and each QMOE
node its ``com.microsoft::QMoE``, so the model runs on onnxruntime's CPU, CUDA and WebGPU providers
without our library.

The contrib ops route by themselves: they take the router's logits (``router_probs``), their softmax
over the experts, the top k and, with ``normalize_routing_weights=1``, renormalize the k weights. So
a block converts when its router is exactly that (a MoeGatingTopK with softmax, one group, no bias,
no scaling, renormalize without eps, or the same chain unfused, read by ``gating.read_router``). The
experts map as

- GEMM2_BIAS_SWIGLU_CLAMP -> swiglu, alpha = expert_alpha, beta = 1, swiglu_limit = expert_beta,
  fc1 [E, 2I, H] with the gate rows even (the order the contrib ops take; gate_parity 1 is swapped);
- GEMM3_SWIGLU -> swiglu, alpha = expert_alpha, beta = 0, no limit, fc1 = gate and up rows interleaved;
- GEMM2_ACT -> relu, silu, identity as they are; gelu_tanh -> gelu (the contrib ops' gelu is the tanh
  approximation: their CPU kernel, measured); relu2 and erf gelu stay ours.

QMOE's weights, scales and zero points are QMoE's layout already ([E, N, K], raw: weights_prepacked=0);
only the fused rows are rearranged as above (per-column zero points unpacked and packed again).

Every attribute is written (provider defaults have differed, onnxruntime #28738; QMoE's per-projection
bit overrides, absent from older releases, inherit expert_weight_bits and are left off) and SwiGLU is
always interleaved (``swiglu_fusion=1``, the only form the CPU kernel takes). What onnxruntime
1.31.1's CPU kernels do, measured:

- MoE, ``normalize_routing_weights=0``: the softmax over all experts, gathered (no renormalization);
  in float16 it returns zeros or wrong sums, so float16 blocks without renormalization stay ours;
- QMoE renormalizes whatever ``normalize_routing_weights`` says; with ``router_weights`` it gathers
  them as they are (0) or renormalized (1): blocks without renormalization pass the softmax there;
- QMoE with per-column scales keeps float activations at accuracy_level 4, and block-wise 8-bit
  weights take int8 activations at accuracy_level 0 and 3: these stay ours (QMOE means the other);
- QMoE at accuracy_level 3 computes level 0's float activations: QMOE's 3 is written as it is (bf16
  compute allows exact numbers);
- silu ignores ``activation_alpha``.

MoE has no ``accuracy_level``: an MOE at 3 (``optimize --compute bf16``) becomes a MoE that computes in
float32, which the level allows (:func:`accuracy_notes` says so in the report).

A block the contrib ops cannot express keeps its node, and the report says why (a near-miss of ``RULE``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from .._ir.builder import TapeBuilder, const, int64s, replace
from .._ir.nodes import attribute_value
from .._ir.passes import RewritePass, RewriteResult, rewritten
from .._ir.weights import Weight, lazy_initializer, weight
from ..ops import DOMAIN
from ..ops.moe import B0, B1, GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU, MOE, W0, W1, W2
from ..ops.qmoe import INT8_ACTIVATIONS, QMOE, QUANT_INT, SCALES, ZERO_POINTS, pack_codes, unpack_codes
from ..ops.signatures import MOE_GATING_TOPK
from ._match import MatchFailure, constant, require
from ._ort_contrib import (
    ACTIVATION_TYPES, CONTRIB_OPS, ORT_DOMAIN, ORT_OPSET_VERSION, QUANT_TYPES, SWIGLU_INTERLEAVED, Activation,
    ordered_inputs,
)
from .gating import Router, read_router, uncast

RULE = "MoeToOrtMoE"
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


_FOLDED = ("a shared expert is folded into the MOE (SharedExpertFold: every token also selects it); the contrib "
           "op has routed experts only: `--target ort` on the model as exported keeps the shared expert beside it")


def _folded_shared_expert(indices: ir.Value) -> bool:
    """Whether ``indices`` are shared_expert.py's fold: the router's indices, then constant ids for every row."""
    concat = indices.producer()
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 2:
        return False
    extra = concat.inputs[1].producer()
    return extra is not None and extra.op_type == "Expand" and constant(extra.inputs[0]) is not None


def read_routing(moe: ir.Node) -> OrtRouting:
    """The routing of ``moe`` as the contrib op computes it, or MatchFailure naming what it cannot."""
    weights, indices = moe.inputs[1], moe.inputs[2]
    gating = uncast(weights).producer()
    if gating is not None and gating.domain == DOMAIN and gating.op_type == MOE_GATING_TOPK.name:
        router = _gating_router(gating, indices)
    else:
        require(not _folded_shared_expert(indices), _FOLDED)
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
    require(scale == 1.0,
            f"the routing weights are scaled by {str(np.float32(scale))}; the contrib op does not scale them")
    eps = a.get("eps", 0.0)
    require(not a["renormalize"] or eps == 0.0, f"the routing weights are renormalized with eps = "
            f"{str(np.float32(eps))} in the denominator; the contrib op divides by their sum alone")
    return OrtRouting(router.logits, int(a["k"]), bool(a["renormalize"]))


# ----------------------------------------------------------------------------- the experts

@dataclasses.dataclass(frozen=True)
class OrtLinear:
    """One projection of the contrib op: fc weights [E, N, K] (packed for QMoE), bias, scales, zero points."""

    weight: ir.Value
    bias: ir.Value | None = None
    scales: ir.Value | None = None
    zero_points: ir.Value | None = None


@dataclasses.dataclass(frozen=True)
class OrtExperts:
    """The contrib op's expert inputs (lazy initializers) and activation attributes."""

    fc1: OrtLinear
    fc2: OrtLinear
    activation: Activation


def _constant_weight(node: ir.Node, index: int | None) -> Weight | None:
    """The constant at input ``index`` of ``node`` (None when absent), or MatchFailure when computed."""
    value = node.inputs[index] if index is not None and index < len(node.inputs) else None
    if value is None:
        return None
    w = weight(value)
    require(w is not None, f"input {index} of the {node.op_type} is computed at run time; the export needs "
            "constant weights")
    return w


def _lazy(op, name: str, sources: list[Weight], per_expert: Callable[..., np.ndarray],
          shape: tuple[int, ...]) -> ir.Value:
    """A lazy initializer whose expert e is ``per_expert(*(w.expert(e) for w in sources))``."""
    return lazy_initializer(op, name, lambda e: np.ascontiguousarray(per_expert(*(w.expert(e) for w in sources))),
                            sources[0].dtype, shape, sources=[w.source for w in sources])


def _even_gate_rows(rows: np.ndarray, gate_parity: int) -> np.ndarray:
    """``rows`` [2I, ...] interleaved gate/up with the gate at ``gate_parity``, as gate-even."""
    if gate_parity == 0:
        return rows
    pairs = rows.reshape(rows.shape[0] // 2, 2, *rows.shape[1:])
    return pairs[:, ::-1].reshape(rows.shape)


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Rows gate[0], up[0], gate[1], up[1], ... of two [I, ...] arrays."""
    return np.stack([gate, up], axis=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def _fc_tensor(op, name: str, weights: list[Weight | None], arrange: Callable[..., np.ndarray] | None, *,
               transposed: bool = False, packed_bits: int = 0, codes: int = 0) -> ir.Value | None:
    """One contrib input made of the experts of ``weights`` (each [E, rows, ...], or [E, ..., rows] when
    ``transposed``), combined row-wise by ``arrange`` (None: the one weight as it is). ``packed_bits``:
    the tensors are per-column zero points, ``codes`` of that many bits each packed along the rows."""
    present = [w for w in weights if w is not None]
    if not present:
        return None
    require(len(present) == len(weights), f"{name}: given for some of the projections it joins, not all")
    if arrange is None and not transposed and not present[0].steps:
        return present[0].source
    arrange = arrange or (lambda a: a)

    def expert_slice(*experts: np.ndarray) -> np.ndarray:
        if transposed:
            experts = tuple(a.T for a in experts)
        if packed_bits:
            return pack_codes(arrange(*(unpack_codes(a, packed_bits, codes) for a in experts)), packed_bits)
        return arrange(*experts)

    if packed_bits:
        shape = (present[0].shape[0], math.ceil(codes * len(present) * packed_bits / 8))
    else:
        rest = [w.shape[:0:-1] if transposed else w.shape[1:] for w in present]
        shape = (present[0].shape[0], sum(r[0] for r in rest), *rest[0][1:])
    return _lazy(op, name, present, expert_slice, shape)


_BIAS = {W0: B0, W1: B1, W2: None}


def _linear(op, node: ir.Node, name: str, positions: list[int], arrange=None, transposed: bool = False) -> OrtLinear:
    """The contrib op's projection ``name`` from the weights at ``positions`` (with their bias, scales and
    zero points), rows combined by ``arrange``."""
    def tensor(suffix: str, indices: list[int | None], **packing) -> ir.Value | None:
        return _fc_tensor(op, f"ort_{name}_{suffix}", [_constant_weight(node, i) for i in indices], arrange,
                          **packing)

    linear = OrtLinear(tensor("weights", positions, transposed=transposed),
                       tensor("bias", [_BIAS[p] for p in positions]))
    if node.op_type != QMOE.name:
        return linear
    bits, block_size = attribute_value(node, "bits", 0), attribute_value(node, "block_size", 0)
    rows = node.inputs[positions[0]].shape[1]
    zero_points = tensor("zero_points", [ZERO_POINTS[p] for p in positions],
                         **({} if block_size else {"packed_bits": bits, "codes": rows}))
    return dataclasses.replace(linear, scales=tensor("scales", [SCALES[p] for p in positions]),
                               zero_points=zero_points)


def _experts(op, node: ir.Node) -> OrtExperts:
    """The contrib op's experts for a MOE or QMOE ``node`` (MatchFailure for an activation it lacks)."""
    expert_type = attribute_value(node, "expert_type", "")
    alpha = float(attribute_value(node, "expert_alpha", 1.0))
    if expert_type == GEMM2_BIAS_SWIGLU_CLAMP:
        parity = int(attribute_value(node, "gate_parity", 0))
        transposed = node.op_type != QMOE.name  # MOE keeps GPT-OSS's [E, H, 2I] and [E, I, H]
        fc1 = _linear(op, node, "fc1", [W0], lambda rows: _even_gate_rows(rows, parity), transposed)
        limit = float(attribute_value(node, "expert_beta", 0.0))
        return OrtExperts(fc1, _linear(op, node, "fc2", [W1], transposed=transposed),
                          Activation("swiglu", alpha, 1.0, SWIGLU_INTERLEAVED, limit))
    if expert_type == GEMM3_SWIGLU:
        return OrtExperts(_linear(op, node, "fc1", [W0, W1], _interleave), _linear(op, node, "fc2", [W2]),
                          Activation("swiglu", alpha, 0.0, SWIGLU_INTERLEAVED, math.inf))
    activation = attribute_value(node, "activation", "")
    require(activation in ACTIVATION_TYPES, f"the experts' activation is {activation}; the contrib op has "
            f"{', '.join(sorted(ACTIVATION_TYPES))} (its gelu is the tanh approximation)")
    return OrtExperts(_linear(op, node, "fc1", [W0]), _linear(op, node, "fc2", [W1]),
                      Activation(ACTIVATION_TYPES[activation]))


def ort_attributes(node: ir.Node, experts: OrtExperts, routing: OrtRouting) -> dict:
    """Every attribute of com.microsoft::MoE (QMoE: and its quantization's), written out."""
    attributes = {"k": routing.k, "normalize_routing_weights": int(routing.renormalize), "use_sparse_mixer": 0,
                  **experts.activation.attributes()}
    if node.op_type == QMOE.name:
        attributes.update(expert_weight_bits=attribute_value(node, "bits", 0),
                          block_size=attribute_value(node, "block_size", 0), quant_type=QUANT_TYPES[QUANT_INT],
                          accuracy_level=attribute_value(node, "accuracy_level", 0), weights_prepacked=0)
    return attributes


# ----------------------------------------------------------------------------- the node

def _check_types(node: ir.Node) -> None:
    """The types the contrib ops take (one float type T); QMOE: the quantizations they compute as QMOE."""
    dtype = node.inputs[0].dtype
    require(dtype in _ORT_TYPES, f"hidden_states are {dtype}; onnxruntime's CPU MoE takes float32 and float16")
    quantized = node.op_type == QMOE.name
    for i in (B0, B1) if quantized else (W0, B0, W1, B1, W2):
        if i < len(node.inputs) and node.inputs[i] is not None:
            require(node.inputs[i].dtype == dtype, f"input {i} of the {node.op_type} is {node.inputs[i].dtype}, "
                    f"not {dtype} like hidden_states; the contrib op takes one type")
    if quantized:  # QMoE's scales are its T2: float32 beside float16 tokens runs on the CPU kernel (measured)
        for i in SCALES.values():
            if i < len(node.inputs) and node.inputs[i] is not None:
                require(node.inputs[i].dtype in (dtype, ir.DataType.FLOAT), f"input {i} of the QMOE is "
                        f"{node.inputs[i].dtype}; the export writes scales of hidden_states' type or float32")
        _check_quantization(node)


def _check_quantization(node: ir.Node) -> None:
    """The QMOE configurations whose numbers onnxruntime's CPU QMoE gives (measured, 1.31.1)."""
    quant_type = attribute_value(node, "quant_type", QUANT_INT)
    require(quant_type == QUANT_INT, f"quant_type is {quant_type}; the export writes QMoE's integer "
            "quantization only (its fp4 takes float8e8m0 scales and global scales, not checked here)")
    bits, block_size = attribute_value(node, "bits", 0), attribute_value(node, "block_size", 0)
    int8_activations = attribute_value(node, "accuracy_level", 0) == INT8_ACTIVATIONS
    require(block_size or not int8_activations, "accuracy_level 4 with per-column scales: onnxruntime's CPU QMoE "
            "keeps float activations there, so its numbers would be accuracy_level 0's")
    require(not (bits == 8 and block_size) or int8_activations, f"bits 8 with block_size {block_size} at "
            f"accuracy_level {attribute_value(node, 'accuracy_level', 0)}: onnxruntime's CPU QMoE has no "
            "float-activation kernel for block-wise 8-bit weights and quantizes the activations to int8 at every "
            "accuracy_level")


def _rows(op, value: ir.Value, width: int) -> ir.Value:
    """``value`` as [rows, width] (itself when it is 2-D already)."""
    if value.shape is not None and len(value.shape) == 2:
        return value
    return op.Reshape(value, int64s(op, [-1, width]))


def _convert(node: ir.Node) -> tuple[TapeBuilder, ir.Value]:
    """The builder of the nodes replacing a MOE or QMOE ``node`` and their output; MatchFailure when it stays."""
    _check_types(node)
    routing = read_routing(node)
    quantized = node.op_type == QMOE.name
    require(quantized or routing.renormalize or node.inputs[0].dtype != ir.DataType.FLOAT16,
            "float16 with softmax -> top-k weights not renormalized: onnxruntime 1.31.1's CPU MoE computes "
            "zeros or wrong sums for float16 with normalize_routing_weights=0 (measured)")
    op = TapeBuilder()
    experts = _experts(op, node)
    hidden, logits = node.inputs[0], routing.logits
    num_experts = node.inputs[W0].shape[0]
    hidden_size = hidden.shape[-1] if hidden.shape is not None else None
    require(isinstance(hidden_size, int), f"hidden_states have shape {hidden.shape}; expected a static last dim")
    require(logits.shape is not None and logits.shape[-1] == num_experts,
            f"the router logits have shape {logits.shape}; expected [..., {num_experts}] (the {node.op_type}'s "
            "experts)")
    if logits.dtype != hidden.dtype:
        logits = op.Cast(logits, to=hidden.dtype)
    rows, logits = _rows(op, hidden, hidden_size), _rows(op, logits, num_experts)
    fc1, fc2 = experts.fc1, experts.fc2
    attributes = ort_attributes(node, experts, routing)
    inputs = {"input": rows, "router_probs": logits, "fc1_experts_weights": fc1.weight, "fc1_experts_bias": fc1.bias,
              "fc2_experts_weights": fc2.weight, "fc2_experts_bias": fc2.bias}
    if quantized:
        # QMoE renormalizes the softmax of the chosen logits whatever normalize_routing_weights says
        # (measured); its router_weights, gathered as they are, give the weights without renormalization
        inputs |= {"fc1_scales": fc1.scales, "fc2_scales": fc2.scales, "fc1_zero_points": fc1.zero_points,
                   "fc2_zero_points": fc2.zero_points,
                   "router_weights": None if routing.renormalize else op.Softmax(logits, axis=-1)}
    contrib = CONTRIB_OPS[node.op_type]
    y = op.op(contrib, *ordered_inputs(contrib, inputs), _domain=ORT_DOMAIN, _version=ORT_OPSET_VERSION,
              **attributes)
    # onnxruntime 1.31.1's CPU MoE and QMoE may compute in place (MayInplace(0, 0)) but read their input
    # after writing the output (measured: wrong numbers when the input is a value nothing reads after
    # them); a node after them that reads the input keeps its buffer theirs alone. Where(false, rows, y)
    # is y exactly.
    y = op.Where(const(op, False), rows, y)
    if rows is not hidden:  # allowzero: a 0 in the shape (no tokens) is a 0, not "copy that dim"
        y = op.Reshape(y, op.Shape(hidden), allowzero=1)
    return op, y


def accuracy_notes(model: ir.Model) -> list[str]:
    """For a model optimized with compute bf16: what its contrib nodes make of accuracy_level 3."""
    count = sum(1 for node in model.graph if node.domain == ORT_DOMAIN and node.op_type == CONTRIB_OPS[MOE.name])
    if not count:
        return []
    return [f"compute bf16: com.microsoft::MoE has no accuracy_level: {count} MoE node{'s' if count != 1 else ''} "
            "compute in float32 (exact, which bf16 compute allows; QMoE nodes take accuracy_level 3)"]


class ExportToOrt(RewritePass):
    """Replace every MOE (QMOE) node the contrib ops express by com.microsoft::MoE (QMoE); a near-miss (rule,
    node, reason) for each node that stays; with ``compute`` bf16, a note on what the MoE nodes make of it."""

    stage = "writing onnxruntime's com.microsoft::MoE"

    def __init__(self, compute: str = "fp32") -> None:
        self.compute = compute

    def call(self, model: ir.Model) -> RewriteResult:
        count, refused = 0, []
        for node in list(model.graph):
            if node.domain != DOMAIN or node.op_type not in CONTRIB_OPS:
                continue
            try:
                op, y = _convert(node)
                replace(node, y, op)
            except MatchFailure as failure:
                refused.append({"rule": RULE, "node": node.name or "",
                                "reason": f"stays a {DOMAIN} {node.op_type} (needs our library): {failure}"})
                continue
            count += 1
        if count:
            model.opset_imports[ORT_DOMAIN] = ORT_OPSET_VERSION
        notes = accuracy_notes(model) if self.compute == "bf16" else []
        return rewritten(model, {RULE: count}, near_misses=refused, notes=notes)
