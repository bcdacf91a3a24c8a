"""onnxruntime's com.microsoft::MoE and QMoE nodes into moe_onnx ops: the first pass of ``optimize``.

onnxruntime-genai's model builder writes a MoE layer as one contrib node that takes the router
logits (``router_probs``) and does the routing itself. Each node becomes:

- the routing in standard ops, which the router pass (gating.py) then makes one MoeGatingTopK:
  ``TopK(Softmax(router_probs), k)``, its values divided by their sum when
  ``normalize_routing_weights``; with QMoE's ``router_weights``, the TopK chooses and the weights are
  ``router_weights`` gathered at the chosen experts (normalized likewise); ``use_sparse_mixer`` (k = 2):
  PhiMoE's sparsemixer (:func:`_sparse_mixer`), which stays in standard ops;
- MOE (float weights) or QMOE (quantized; the same [E, N, K] layout as QMoE's), by the experts:

  ========================================  =======================================================
  contrib experts                           ours
  ========================================  =======================================================
  swiglu (or silu with fc3: gated), no      GEMM3_SWIGLU (gate, up, down), expert_alpha = alpha
  limit, beta 0, no biases
  swiglu, beta 1 (any limit) or no limit    GEMM2_BIAS_SWIGLU_CLAMP, gate_parity 0 (gate and up rows
  (any beta, biases)                        interleaved), expert_beta = limit (inf: none); beta != 1
                                            goes into the up bias (up + beta = (up + beta - 1) + 1)
  relu, gelu, silu, identity without fc3    GEMM2_ACT: relu, gelu_tanh (the CPU kernel's gelu),
                                            silu, identity (activation_alpha/beta unused, as there)
  ========================================  =======================================================

  swiglu_fusion 1 takes fc1's rows as gate (even) and up (odd), 2 as gate (first half) and up
  (second half), 0 as gate (fc1) and up (fc3).

- QMoE's quant_type int (bits 4/8, per column or block_size 16..256, zero points) stays as stored;
  2-bit weights are widened to 4 bits, and with per-projection widths the narrower ones to the widest
  (the same codes, two or one per byte; their zero points given or their own width's default, 2 for
  2 bits, 8 for 4 bits: exact), and where one of an interleaved gate/up pair has zero points the other
  gets its default. fp4 becomes mxfp4 (the float8e8m0 scales as their
  uint8 bits; a per-expert global scale that is a power of two moves into the exponents).
  Block-wise experts at accuracy_level 4, and block-wise 8 bits at any level (here: every projection
  8 bits), which onnxruntime computes with int8 activations, become accuracy_level 4; per-column
  experts, and 2-bit ones, keep float activations at every level, as there.

Exact ties among the routing scores: TopK (and MoeGatingTopK) choose the lower expert index, onnxruntime's
CPU kernel the higher (a partial sort of (score, index) pairs); other providers have their own order.

What our ops cannot express exactly stays as it is and the report names the node with the reason:
a finite swiglu_limit with activation_beta other than 1, gated relu/gelu/identity (fc3 with those),
widths other than 2, 4 and 8 bits (or that do not fit the stored bytes), block sizes outside 16..256,
nvfp4 / fp8 / wfp4afp8, prepacked weights, a global fp4 scale that is not a power of two, inputs that
are not initializers. Weights that change layout are
written one expert at a time, when the model is saved.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from .._ir.builder import TapeBuilder, const, int64s, replace, typed
from .._ir.passes import RewritePass, RewriteResult, rewritten
from .._ir.weights import fresh_name, initializer_expert, streamed_initializer
from ..ops import DOMAIN, IN_OUR_DOMAIN, OPSET_VERSION
from ..ops.moe import GEMM2_ACT, GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU
from ..ops.qmoe import INT8_ACTIVATIONS, QUANT_INT, QUANT_MXFP4, pack_codes, unpack_codes
from ._match import MatchFailure, constant, require
from ._ort_contrib import (
    ORT_DOMAIN, OUR_OPS, OUR_QUANT_TYPES, POINTWISE_ACTIVATIONS, SWIGLU_HALVES, SWIGLU_INTERLEAVED, SWIGLU_SEPARATE,
    Activation, named_inputs,
)

RULE = "OrtMoeImport"
JITTER_EPS = 0.01  # onnxruntime's sparse mixer (PhiMoE's router_jitter_noise)

_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


# ----------------------------------------------------------------------------- reading the node

@dataclasses.dataclass(frozen=True)
class _Part:
    """Rows of one [E, N, ...] input: ``rows`` of its N (None: all). ``unpack``: the input holds codes of
    that many bits packed along its last axis, read as one code per byte (``count`` of them); zero points
    are always read so, weights when widened (2 bits to 4 or 8, 4 to 8). ``shift``: float8e8m0 scales, read as
    their uint8 exponents plus a shift per expert (a global scale 2^shift[e]; 255, NaN, stays)."""

    value: ir.Value
    rows: np.ndarray | None = None
    unpack: int = 0
    count: int = 0
    shift: np.ndarray | None = None

    @property
    def source_n(self) -> int:
        """The N of the input (of a per-column zero-point input [E, N packed]: the count of its codes)."""
        return self.count if self.unpack and len(self.value.shape) == 2 else self.value.shape[1]

    @property
    def n(self) -> int:
        """The N of the rows taken."""
        return self.source_n if self.rows is None else len(self.rows)

    @property
    def dtype(self) -> ir.DataType:
        return ir.DataType.UINT8 if self.shift is not None else self.value.dtype

    def expert(self, e: int) -> np.ndarray:
        a = initializer_expert(self.value, e)
        if self.unpack:
            a = unpack_codes(a, self.unpack, self.count)
        if self.shift is not None:
            exponents = np.asarray(a).view(np.uint8)
            moved = exponents.astype(np.int32) + int(self.shift[e % self.shift.size])
            a = np.where(exponents == 255, 255, moved).astype(np.uint8)
        return a if self.rows is None else a[self.rows]


@dataclasses.dataclass
class _Projection:
    """One linear of the experts as the contrib node stores it: the weight rows and what goes with them."""

    weight: _Part
    bias: np.ndarray | None = None
    scales: _Part | None = None
    zero_points: _Part | None = None
    width: int = 0  # quantized: the bits the contrib node stores it with


@dataclasses.dataclass
class _Node:
    """A contrib MoE/QMoE node, read: inputs by name, attributes with their defaults."""

    node: ir.Node
    inputs: dict[str, ir.Value]
    quantized: bool

    def attr(self, name: str, default):
        attribute = self.node.attributes.get(name)
        return default if attribute is None else attribute.value

    def has(self, name: str) -> bool:
        return name in self.inputs


def _read_node(node: ir.Node) -> _Node:
    return _Node(node, named_inputs(node), OUR_OPS[node.op_type] == "QMOE")


def _initializer(n: _Node, name: str) -> ir.Value:
    value = n.inputs[name]
    require(value.const_value is not None and value.shape is not None and value.shape.is_static(),
            f"input '{name}' is not an initializer (the import reads the weights)")
    return value


def _small_constant(n: _Node, name: str) -> np.ndarray | None:
    """A bias, global scale or fp4 scales, loaded (None when absent)."""
    if not n.has(name):
        return None
    array = constant(n.inputs[name])
    require(array is not None, f"input '{name}' is not a constant")
    return array


# ----------------------------------------------------------------------------- the expert mapping

@dataclasses.dataclass(frozen=True)
class _Bias:
    """A bias input of MOE: the contrib biases it is made of ([E, N] each, None: zeros), interleaved when
    two (gate, up), with ``up_shift`` added to the second."""

    parts: tuple[np.ndarray | None, ...]
    shape: tuple[int, int]  # [E, N] of each part
    up_shift: float = 0.0


@dataclasses.dataclass
class _Plan:
    """What one contrib node becomes: MOE's (or QMOE's) expert type, attributes, its linears in weight order
    (a (gate, up) pair is interleaved into one weight) and bias_0 / bias_1."""

    expert_type: str
    attributes: dict
    linears: list[tuple[_Projection, _Projection | None]]
    biases: tuple[_Bias | None, _Bias | None]
    k: int
    quant: _Quant | None


def _split(n: _Node, fc: str, rows: Sequence[np.ndarray | None], quant: _Quant | None) -> list[_Projection]:
    """The projections of ``fc`` (fc1, fc2, fc3) each made of some of its rows; quantized ones read at
    QMOE's width (a 4-bit fc of an 8-bit QMOE, or a 2-bit one, widened: the same codes, its zero points given
    or its own width's default, 8 for 4 bits, 2 for 2 bits)."""
    weight = _initializer(n, f"{fc}_experts_weights")
    bias = _small_constant(n, f"{fc}_experts_bias")
    scales = None
    width = quant.widths.get(fc, 0) if quant is not None else 0
    widen = width if quant is not None and width < quant.bits else 0
    if n.quantized:
        require(n.has(f"{fc}_scales"), f"input '{fc}_scales' is missing")
        scales = _initializer(n, f"{fc}_scales")
    parts = []
    for r in rows:
        zp = None
        if n.has(f"{fc}_zero_points"):
            zp = _Part(_initializer(n, f"{fc}_zero_points"), r, width, _zero_point_count(scales))
        projection = _Projection(_Part(weight, r, widen, weight.shape[2] * 8 // widen if widen else 0),
                                 None if bias is None else (bias if r is None else bias[:, r]),
                                 None if scales is None else _Part(scales, r), zp, width)
        if widen and zp is None:
            _default_zero_points(projection)
        parts.append(projection)
    return parts


def _zero_point_count(scales: ir.Value) -> int:
    """The zero-point codes along the last axis: N per column ([E, N] scales), else the blocks."""
    return scales.shape[1] if len(scales.shape) == 2 else scales.shape[2]


def _default_zero_points(p: _Projection) -> None:
    """Give ``p`` its default zero points 2^(width-1), one code per byte, shaped as its scales (an
    unregistered value: only the QMOE input made of it is written)."""
    shape = tuple(p.scales.value.shape)
    codes = np.full(shape, 1 << (p.width - 1), np.uint8)
    value = ir.Value(shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.UINT8), const_value=ir.tensor(codes))
    p.zero_points = _Part(value, p.scales.rows, 0, _zero_point_count(p.scales.value))


def _with_zero_points(pair: Sequence[_Projection], quant: _Quant | None) -> None:
    """Gate and up interleave into one QMOE weight: where one has zero points, the other gets its default."""
    if quant is not None and quant.quant_type == QUANT_INT and any(p.zero_points is not None for p in pair):
        for p in pair:
            if p.zero_points is None:
                _default_zero_points(p)


def _bias_of(*projections: _Projection, up_shift: float = 0.0) -> _Bias | None:
    if all(p.bias is None for p in projections) and up_shift == 0:
        return None
    weight = projections[0].weight
    return _Bias(tuple(p.bias for p in projections), (weight.value.shape[0], weight.n), up_shift)


def _plan(n: _Node) -> _Plan:
    """The plan for node ``n``, or MatchFailure with the reason it cannot be expressed exactly."""
    quant = _quant(n) if n.quantized else None
    contrib = Activation.of(n.node)
    activation, fusion = contrib.activation_type, contrib.swiglu_fusion
    has_fc3 = n.has("fc3_experts_weights")
    require(activation in (*POINTWISE_ACTIVATIONS, "swiglu"),
            f"activation_type is {activation!r}; expected relu, gelu, silu, swiglu or identity")
    experts = _initializer(n, "fc1_experts_weights").shape[0]
    k = n.attr("k", 1)
    require(1 <= k <= experts, f"k is {k}; expected 1..{experts} (the experts)")
    (down,) = _split(n, "fc2", [None], quant)
    if activation != "swiglu" and not has_fc3:
        (up,) = _split(n, "fc1", [None], quant)
        return _Plan(GEMM2_ACT, {"activation": POINTWISE_ACTIVATIONS[activation]}, [(up, None), (down, None)],
                     (_bias_of(up), _bias_of(down)), k, quant)
    require(activation in ("swiglu", "silu"),
            f"activation_type {activation!r} with fc3 (gated {activation}): MOE's gated experts are SwiGLU only")
    if activation == "silu":  # fc3 given: silu(fc1) * fc3
        alpha, beta, limit = 1.0, 0.0, math.inf
    else:
        alpha = float(contrib.activation_alpha)
        beta = float(contrib.activation_beta)
        limit = float(contrib.swiglu_limit)
        require(fusion in (SWIGLU_SEPARATE, SWIGLU_INTERLEAVED, SWIGLU_HALVES),
                f"swiglu_fusion is {fusion}; expected 0, 1 or 2")
    if activation == "silu" or fusion == SWIGLU_SEPARATE:
        require(has_fc3, "swiglu_fusion is 0 (gate in fc1, up in fc3) but fc3_experts_weights is missing")
        (gate,), (up,) = _split(n, "fc1", [None], quant), _split(n, "fc3", [None], quant)
    else:
        require(not has_fc3, f"swiglu_fusion is {fusion} (gate and up fused in fc1) but fc3_experts_weights is given")
        rows = _initializer(n, "fc1_experts_weights").shape[1]
        require(rows % 2 == 0, f"fc1_experts_weights has {rows} rows; fused SwiGLU needs an even count")
        half = rows // 2
        pick = (np.arange(0, rows, 2), np.arange(1, rows, 2)) if fusion == SWIGLU_INTERLEAVED else \
            (np.arange(half), np.arange(half, rows))  # SWIGLU_HALVES
        gate, up = _split(n, "fc1", pick, quant)
    if limit == math.inf and beta == 0 and gate.bias is None and up.bias is None and down.bias is None:
        return _Plan(GEMM3_SWIGLU, {"expert_alpha": alpha}, [(gate, None), (up, None), (down, None)], (None, None),
                     k, quant)
    require(limit > 0, f"swiglu_limit is {limit}; MOE's clamp bound must be > 0")
    require(beta == 1 or limit == math.inf,
            f"swiglu_limit {limit} with activation_beta {beta}: MOE's clamped SwiGLU adds 1 to the clamped up "
            "projection (GEMM2_BIAS_SWIGLU_CLAMP) and GEMM3_SWIGLU has no clamp; only beta 1, or no limit, fits")
    _with_zero_points((gate, up), quant)
    attributes = {"expert_alpha": alpha, "expert_beta": limit, "gate_parity": 0}
    return _Plan(GEMM2_BIAS_SWIGLU_CLAMP, attributes, [(gate, up), (down, None)],
                 (_bias_of(gate, up, up_shift=beta - 1.0), _bias_of(down)), k, quant)


# ----------------------------------------------------------------------------- quantization

@dataclasses.dataclass(frozen=True)
class _Quant:
    bits: int  # QMOE's: the widest projection's, at least 4 (narrower ones are widened, exactly)
    widths: dict[str, int]  # per fc, as the contrib node stores it
    block_size: int
    quant_type: str
    accuracy_level: int
    exponent_shift: dict[str, np.ndarray]  # fp4: per fc, the power of two of its global scale per expert


def _quant(n: _Node) -> _Quant:
    """QMoE's quantization attributes as QMOE's, or MatchFailure."""
    contrib_quant_type = n.attr("quant_type", "int")
    require(contrib_quant_type in OUR_QUANT_TYPES,
            f"quant_type is {contrib_quant_type!r}; QMOE takes int and fp4 (as mxfp4)")
    quant_type = OUR_QUANT_TYPES[contrib_quant_type]
    require(n.attr("weights_prepacked", -1) != 1, "weights_prepacked is 1: the weights are in a provider's "
            "prepacked layout, not QMoE's [E, N, K] one")
    default_bits = n.attr("expert_weight_bits", 4)
    widths = {}
    for fc in ("fc1", "fc2", "fc3"):
        if fc == "fc3" and not n.has("fc3_experts_weights"):
            continue
        attribute = f"{fc}_expert_weight_bits" if n.node.attributes.get(f"{fc}_expert_weight_bits") else \
            "expert_weight_bits"
        widths[fc] = n.attr(attribute, default_bits)
        require(widths[fc] in (2, 4, 8), f"{attribute} is {widths[fc]}; QMoE stores 2, 4 or 8 bits per weight of "
                f"input '{fc}_experts_weights' (QMOE 4 or 8: 2-bit codes are widened)")
    bits = max(4, *widths.values())
    for name in ("fc1_act_scale", "fc2_act_scale", "fc1_act_block_scale", "fc2_act_block_scale"):
        require(not n.has(name), f"input '{name}' is given (FP8 activations); QMOE has none")
    level = n.attr("accuracy_level", 0)
    block_size = n.attr("block_size", 0)
    if quant_type == QUANT_MXFP4:
        require(set(widths.values()) == {4}, f"quant_type fp4 with widths {widths}; expected 4 bits")
        for fc in ("fc1", "fc2", "fc3"):
            require(not n.has(f"{fc}_zero_points"), f"quant_type fp4 with input '{fc}_zero_points'; MXFP4 has none")
            scales = n.inputs.get(f"{fc}_scales")
            require(scales is None or scales.dtype == ir.DataType.FLOAT8E8M0,
                    f"quant_type fp4: input '{fc}_scales' has type {scales.dtype if scales else None}; "
                    "expected float8e8m0")
        return _Quant(4, widths, 32, QUANT_MXFP4, 0, _global_exponents(n))
    require(block_size == 0 or (block_size & (block_size - 1) == 0 and 16 <= block_size <= 256),
            f"block_size is {block_size}; QMOE takes a power of two in [16, 256] (or none: per column)")
    _check_code_bytes(n, widths)
    # onnxruntime: int8 activations for block-wise experts only: 4 bits at accuracy_level 4, 8 bits always,
    # 2 bits never (measured: its 2-bit experts keep float activations at accuracy_level 4)
    int8_activations = block_size > 0 and 2 not in widths.values() and \
        (level == INT8_ACTIVATIONS or set(widths.values()) == {8})
    return _Quant(bits, widths, block_size, QUANT_INT, INT8_ACTIVATIONS if int8_activations else 0, {})


def _check_code_bytes(n: _Node, widths: dict[str, int]) -> None:
    """Each weight's rows hold its K inputs at its width (hidden_size for fc1 and fc3, inter_size for fc2), or
    MatchFailure: a width that does not fit the stored bytes would read other codes."""
    hidden = n.inputs["fc2_experts_weights"].shape[1]
    rows = n.inputs["fc1_experts_weights"].shape[1]
    fused = n.attr("activation_type", "relu") == "swiglu" and n.attr("swiglu_fusion", 0) in (1, 2)
    inter = rows // 2 if fused and isinstance(rows, int) else rows
    for fc, width in widths.items():
        inputs, stored = (inter if fc == "fc2" else hidden), n.inputs[f"{fc}_experts_weights"].shape[2]
        require(not all(isinstance(d, int) for d in (inputs, stored)) or stored * 8 == inputs * width,
                f"input '{fc}_experts_weights' has {stored} bytes per row; {inputs} codes of {width} bits "
                f"take {inputs * width / 8:g}")


def _global_exponents(n: _Node) -> dict[str, np.ndarray]:
    """fp4: the power of two p[e] of each fc's global scale 2^p[e] (fc3 shares fc1's), or MatchFailure
    (also when moving the scales' exponents by it leaves E8M0's [0, 254])."""
    shifts = {}
    for fc, source in (("fc1", "fc1"), ("fc2", "fc2"), ("fc3", "fc1")):
        scale = _small_constant(n, f"{source}_global_scale")
        shift = np.zeros(1, np.int32)
        if scale is not None:
            mantissa, exponent = np.frexp(scale.astype(np.float32).reshape(-1))
            require(bool(np.all(mantissa == 0.5)), f"input '{source}_global_scale' holds a value that is not a "
                    "power of two: MXFP4's scales cannot absorb it")
            shift = (exponent - 1).astype(np.int32)
        exponents = _small_constant(n, f"{fc}_scales")
        if exponents is not None and shift.any():
            exponents = exponents.view(np.uint8).reshape(exponents.shape[0], -1).astype(np.int32)
            finite = exponents != 255
            moved = exponents + shift.reshape(-1, 1)
            require(not np.any(finite & ((moved < 0) | (moved > 254))),
                    f"input '{source}_global_scale' moves an exponent of '{fc}_scales' out of E8M0's range")
        shifts[fc] = shift
    return shifts


# ----------------------------------------------------------------------------- writing the weights

def _combined(graph: ir.Graph, name: str, parts: Sequence[_Part], *, transpose: bool = False,
              pack: int = 0) -> ir.Value:
    """One [E, N, ...] initializer: the rows of ``parts``, interleaved when two (the first at the even
    rows), codes packed ``pack`` bits along the last axis (0: as read), transposed to [E, ..., N] if
    asked; the input itself when that is all it is."""
    if len(parts) == 2 and parts[0].value is parts[1].value and parts[0].rows is not None \
            and parts[1].rows is not None and parts[0].shift is parts[1].shift:
        rows = np.empty(2 * len(parts[0].rows), np.int64)
        rows[0::2], rows[1::2] = parts[0].rows, parts[1].rows
        whole = np.array_equal(rows, np.arange(parts[0].source_n))
        parts = [dataclasses.replace(parts[0], rows=None if whole else rows)]
    first = parts[0]
    if len(parts) == 1 and first.rows is None and first.shift is None and not transpose \
            and first.unpack == pack and first.value.name in graph.initializers:
        return first.value

    def expert(e: int) -> np.ndarray:
        arrays = [part.expert(e) for part in parts]
        if len(arrays) == 1:
            rows = arrays[0]
        else:
            rows = np.empty((2 * arrays[0].shape[0], *arrays[0].shape[1:]), arrays[0].dtype)
            rows[0::2], rows[1::2] = arrays
        if pack:
            rows = pack_codes(rows, pack)
        return np.ascontiguousarray(rows.T if transpose else rows)

    shape = (first.value.shape[0], *expert(0).shape)
    return streamed_initializer(graph, name, expert, first.dtype, shape,
                                [part.value for part in parts if part.value.name in graph.initializers])


def _bias_value(graph: ir.Graph, name: str, bias: _Bias | None, dtype: ir.DataType) -> ir.Value | None:
    if bias is None:
        return None
    parts = [np.zeros(bias.shape, np.float32) if a is None else a.astype(np.float32) for a in bias.parts]
    if len(parts) == 2:
        parts[1] = parts[1] + np.float32(bias.up_shift)
        merged = np.empty((bias.shape[0], 2 * bias.shape[1]), np.float32)
        merged[:, 0::2], merged[:, 1::2] = parts
    else:
        merged = parts[0]
    value = ir.Value(name=fresh_name(graph, name), shape=ir.Shape(merged.shape), type=ir.TensorType(dtype),
                     const_value=ir.tensor(merged.astype(dtype.numpy())))
    graph.register_initializer(value)
    return value


# ----------------------------------------------------------------------------- routing

def _float32(op: TapeBuilder, value: ir.Value, shape: Sequence) -> ir.Value:
    """``value`` as float32: itself, or a Cast of it typed with ``shape``."""
    return value if value.dtype == ir.DataType.FLOAT else \
        typed(op.Cast(value, to=ir.DataType.FLOAT), ir.DataType.FLOAT, shape)


def _check_routing(n: _Node, k: int) -> None:
    if n.attr("use_sparse_mixer", 0):
        require(k == 2, f"use_sparse_mixer with k = {k}; the sparse mixer picks 2 experts")
        require(not n.has("router_weights"), "use_sparse_mixer with router_weights: the sparse mixer weighs its "
                "picks by the router_probs it masks")


def _routing(op: TapeBuilder, n: _Node, k: int, experts: int) -> tuple[ir.Value, ir.Value]:
    """(weights float32 [T, k], indices int64 [T, k]) of the node's own routing. The values get their
    [T, E] or [T, k] shape and type: the router pass reads them (shape inference ran before)."""
    router = n.inputs["router_probs"]
    rows = router.shape[0] if router.shape is not None and len(router.shape) == 2 else None
    scores, chosen = (rows, experts), (rows, k)
    logits = _float32(op, router, scores)
    if n.attr("use_sparse_mixer", 0):
        return _sparse_mixer(op, logits)
    probs = typed(op.Softmax(logits, axis=-1), ir.DataType.FLOAT, scores)
    values, indices = op.TopK(probs, int64s(op, [k]), axis=-1, largest=1, sorted=1, _outputs=2)
    typed(values, ir.DataType.FLOAT, chosen)
    typed(indices, ir.DataType.INT64, chosen)
    if n.has("router_weights"):
        values = typed(op.GatherElements(_float32(op, n.inputs["router_weights"], scores), indices, axis=1),
                       ir.DataType.FLOAT, chosen)
    if n.attr("normalize_routing_weights", 0):
        total = typed(op.ReduceSum(values, int64s(op, [-1]), keepdims=1), ir.DataType.FLOAT, (rows, 1))
        values = typed(op.Div(values, total), ir.DataType.FLOAT, chosen)
    return values, indices


def _sparse_mixer(op: TapeBuilder, logits: ir.Value) -> tuple[ir.Value, ir.Value]:
    """PhiMoE's sparsemixer: pick j is the maximum of the logits left (the earlier picks set to -inf);
    its weight the softmax, at the pick, of the logits left with those farther than 2 * jitter_eps
    (relative: (top - s) / max(|s|, top)) from it set to -inf."""
    minus_inf = const(op, -np.inf, ir.DataType.FLOAT)
    threshold = const(op, 2 * JITTER_EPS, ir.DataType.FLOAT)
    magnitude = op.Abs(logits)
    left, weights, picks = logits, [], []
    for j in range(2):
        if j:
            left = op.ScatterElements(left, picks[-1], op.Expand(minus_inf, op.Shape(picks[-1])), axis=1)
        pick = op.ArgMax(left, axis=-1, keepdims=1)
        top = op.GatherElements(left, pick, axis=1)
        far = op.Greater(op.Div(op.Sub(top, logits), op.Max(magnitude, top)), threshold)
        gates = op.Softmax(op.Where(far, minus_inf, left), axis=-1)
        weights.append(op.GatherElements(gates, pick, axis=1))
        picks.append(pick)
    return op.Concat(*weights, axis=-1), op.Concat(*picks, axis=-1)


# ----------------------------------------------------------------------------- the node

def _write(n: _Node, plan: _Plan) -> None:
    """Replace the contrib node by the routing and one MOE/QMOE node as ``plan`` says."""
    node, graph = n.node, n.node.graph
    hidden = n.inputs["input"]
    dtype = hidden.dtype
    name = node.name or n.node.op_type
    op = TapeBuilder()
    weights, indices = _routing(op, n, plan.k, plan.linears[0][0].weight.value.shape[0])
    if dtype != ir.DataType.FLOAT:
        weights = typed(op.Cast(weights, to=dtype), dtype, weights.shape)
    quant = plan.quant
    transpose = quant is None and plan.expert_type == GEMM2_BIAS_SWIGLU_CLAMP  # MOE's GEMM2 takes [E, K, N]
    weight_values, scales, zero_points = [], [], []
    for i, (first, second) in enumerate(plan.linears):
        pair = [first] if second is None else [first, second]
        widened = quant is not None and any(p.weight.unpack for p in pair)
        weight_values.append(_combined(graph, f"{name}_weight_{i}", [p.weight for p in pair], transpose=transpose,
                                       pack=quant.bits if widened else 0))
        if quant is None:
            continue
        scale_parts = [p.scales for p in pair]
        if quant.quant_type == QUANT_MXFP4:
            scale_parts = [dataclasses.replace(part, shift=quant.exponent_shift[_fc_of(n, p.weight.value)])
                           for part, p in zip(scale_parts, pair)]
        scales.append(_combined(graph, f"{name}_scales_{i}", scale_parts))
        zero_points.append(None if first.zero_points is None else
                           _combined(graph, f"{name}_zero_points_{i}", [p.zero_points for p in pair],
                                     pack=quant.bits))
    bias_0, bias_1 = (_bias_value(graph, f"{name}_bias_{i}", bias, dtype) for i, bias in enumerate(plan.biases))
    w0, w1, *w2 = weight_values
    inputs = [hidden, weights, indices, w0, bias_0, w1, bias_1, w2[0] if w2 else None]
    attributes = {"expert_type": plan.expert_type, **plan.attributes}
    op_type = "MOE"
    if quant is not None:
        op_type = "QMOE"
        pad = [None] * (3 - len(scales))
        inputs += scales + pad + zero_points + pad
        attributes |= {"bits": quant.bits, "block_size": quant.block_size, "quant_type": quant.quant_type,
                       "accuracy_level": quant.accuracy_level}
    while inputs[-1] is None:
        inputs.pop()
    y = op.op(op_type, *inputs, **IN_OUR_DOMAIN, _name=f"{name}/{op_type}", **attributes)
    replace(node, y, op)


def _fc_of(n: _Node, weight: ir.Value) -> str:
    return next(fc for fc in ("fc1", "fc2", "fc3") if n.inputs.get(f"{fc}_experts_weights") is weight)


def _check_shapes(n: _Node) -> None:
    """The inputs the contrib op requires, as the import reads them: MatchFailure naming the first that is
    missing or has another rank or expert count (onnxruntime would reject the node too)."""
    for name in ("input", "router_probs", "fc1_experts_weights", "fc2_experts_weights"):
        require(n.has(name), f"input '{name}' is missing; the contrib op requires it")
    weights = [name for name in ("fc1_experts_weights", "fc2_experts_weights", "fc3_experts_weights") if n.has(name)]
    for name in weights:
        require(n.inputs[name].shape is not None and len(n.inputs[name].shape) == 3,
                f"input '{name}' has shape {n.inputs[name].shape}; expected [E, N, K] (rank 3)")
    experts = {n.inputs[name].shape[0] for name in weights}
    require(len(experts) == 1, f"the experts' weights disagree on E: {sorted(map(str, experts))}")
    block_size = n.attr("block_size", 0) if n.quantized and n.attr("quant_type", "int") == "int" else 0
    if block_size > 0:  # K of fc1 (and fc3) is hidden_size, of fc2 inter_size (fc2 is [E, hidden, inter/pack])
        rows = n.inputs["fc1_experts_weights"].shape[1]
        fused = n.attr("activation_type", "relu") == "swiglu" and n.attr("swiglu_fusion", 0) in (1, 2)
        hidden = n.inputs["fc2_experts_weights"].shape[1]
        inter = rows // 2 if fused and isinstance(rows, int) else rows
        for name, size in (("hidden_size", hidden), ("inter_size", inter)):
            require(not isinstance(size, int) or size % block_size == 0,
                    f"block_size is {block_size}; it does not divide {name} = {size}")


class ImportOrtNodes(RewritePass):
    """Replace every com.microsoft::MoE/QMoE node that our ops express exactly; a near-miss (rule, node, reason)
    for each node left as it is."""

    stage = "onnxruntime MoE/QMoE nodes"

    def call(self, model: ir.Model) -> RewriteResult:
        count, misses = 0, []
        nodes = [node for node in ir.traversal.RecursiveGraphIterator(model.graph)
                 if node.domain == ORT_DOMAIN and node.op_type in OUR_OPS]
        for node in nodes:
            n = _read_node(node)
            try:
                _check_shapes(n)
                require(n.inputs["input"].dtype in _FLOATS,
                        f"input 'input' has type {n.inputs['input'].dtype}; expected a float type")
                plan = _plan(n)
                _check_routing(n, plan.k)
            except MatchFailure as failure:
                misses.append({"rule": RULE, "node": node.name or "", "reason": f"{node.op_type}: {failure}"})
                continue
            _write(n, plan)
            count += 1
        if count:
            model.opset_imports[DOMAIN] = OPSET_VERSION
        return rewritten(model, {RULE: count}, near_misses=misses)
