"""Portable function bodies: every moe_onnx op as an ONNX function of standard ops only.

``add_function_bodies(model)`` gives each moe_onnx node of a model a model-local function (domain
``moe_onnx``, name the op's) that computes the op's meaning (``moe_onnx/ops/<op>.py``), so the model
also runs where our kernels are not registered: plain onnxruntime and ``onnx.reference.ReferenceEvaluator``.
Where the C++ library is registered, onnxruntime still runs our kernels (a kernel wins over a function).

What changes the computation (the attributes, which optional inputs are given, how many outputs the
node has, the element type for MoeRowParallelLinear's int8 path) is fixed when a body is built: one
function per distinct configuration, told apart by the function ``overload`` (IR 10), which the node
names in its own ``overload`` field; the node keeps its op type, so the model still is a moe_onnx model.
onnxruntime 1.31 resolves overloads; onnx 1.23's ReferenceEvaluator keys functions by domain and name
only, so it runs a portable model only while every op has one configuration (``configurations``
says how many; the fixtures have one per op). onnx 1.23's Python ``OpSchema`` takes no function body
(no setter, no constructor argument), so the bodies live here, keyed by op name in :data:`BUILDERS`,
rather than on the registered schemas.

The bodies compute densely (every expert on every token, then the chosen ones gathered), in float32
for float16/bfloat16 inputs, as the references do: slower, the same numbers within float rounding.
They check nothing: a node outside its op's contract gives an unspecified result here, where the
kernels and the reference raise (run ``moe-onnx check``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from .ops import DOMAIN, OPS
from .ops._expert_math import ACTIVATIONS, clamped_swiglu, swish
from .ops.moe import GEMM2_ACT, GEMM2_BIAS_SWIGLU_CLAMP

__all__ = ["BUILDERS", "MIN_OPSET", "NO_BODY", "add_function_bodies", "configurations", "function_for", "portable_model",
           "require_opset", "summary"]

MIN_OPSET = 18  # ReduceMax/ReduceProd with axes inputs, Pad with constant_value input
_INT64_MAX = np.iinfo(np.int64).max
_FLOAT = TensorProto.FLOAT


@dataclasses.dataclass(frozen=True)
class Config:
    """What a body depends on: the attributes (defaults applied), the inputs given, the outputs."""

    op: str
    attrs: tuple[tuple[str, object], ...]
    given: tuple[bool, ...]  # by input position, up to the node's last input
    n_outputs: int
    int8: bool  # input 0 is int8 (MoeRowParallelLinear accumulates in int32)

    def attr(self, name: str):
        return dict(self.attrs)[name]

    def has(self, input_name: str) -> bool:
        i = [p.name for p in OPS[self.op].inputs].index(input_name)
        return i < len(self.given) and self.given[i]

    @property
    def overload(self) -> str:
        """A short, stable name of this configuration."""
        return hashlib.sha1(repr(self).encode()).hexdigest()[:12]


class Body:
    """A function body under construction: ``body.MatMul(a, b)`` appends a standard-ONNX node and
    returns its output name (a list for ``_outputs=n``); keyword arguments are node attributes."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []

    def __getattr__(self, op_type: str) -> Callable[..., str | list[str]]:
        if op_type.startswith("_"):
            raise AttributeError(op_type)

        def add(*inputs: str, _outputs: int = 1, **attrs) -> str | list[str]:
            outputs = [f"v{len(self.nodes)}_{i}" for i in range(_outputs)]
            self.nodes.append(helper.make_node(op_type, list(inputs), outputs, name=outputs[0], **attrs))
            return outputs[0] if _outputs == 1 else outputs

        return add

    def const(self, value, dtype=np.int64) -> str:
        return self.Constant(value=onnx.numpy_helper.from_array(np.asarray(value, dtype=dtype)))

    def ints(self, *values: int) -> str:
        """A 1-D int64 constant."""
        return self.const(list(values))

    def scalar(self, value: float, dtype=np.float32) -> str:
        return self.const(value, dtype)

    def int64(self, value: int) -> str:
        """A scalar int64 constant."""
        return self.const(value, np.int64)

    def arange(self, start: int, stop: int) -> str:
        return self.Range(self.int64(start), self.int64(stop), self.int64(1))

    def float32(self, name: str) -> str:
        return self.Cast(name, to=_FLOAT)

    def rows(self, x: str) -> str:
        """``x`` [..., H] as [rows, H] (no -1 in the shape: right also when a size is 0)."""
        shape = self.Concat(self.ReduceProd(self.Shape(x, end=-1), keepdims=1), self.Shape(x, start=-1), axis=0)
        return self.Reshape(x, shape, allowzero=1)

    def reshape(self, x: str, *parts: str) -> str:
        return self.Reshape(x, self.Concat(*parts, axis=0), allowzero=1)

    def positions(self, length: str) -> str:
        """0, 1, ..., length - 1 (``length`` a 1-D int64 of one element)."""
        return self.Range(self.int64(0), self.Squeeze(length), self.int64(1))

    def take_rows(self, data: str, idx: str) -> str:
        """``data`` [R, E, ...] at ``idx`` [R, k] (int64) per row: [R, k, ...], ``data[r, idx[r, j]]``.
        A Gather over the flattened first two axes: onnx.reference's GatherElements fails past 64
        entries along the axis and its GatherND with batch_dims on empty inputs."""
        rows, width = self.Shape(data, end=1), self.Shape(data, start=1, end=2)
        flat = self.reshape(data, self.Mul(rows, width), self.Shape(data, start=2))
        row_start = self.Unsqueeze(self.Mul(self.positions(rows), self.Squeeze(width)), self.ints(1))
        return self.Gather(flat, self.Add(idx, row_start), axis=0)

    def abs_max(self, values: str, axis: int) -> str:
        """max |values| along ``axis`` (kept, as size 1), 0 over an empty axis (numpy's ``initial=0``).
        ``axis`` >= 0: onnxruntime 1.31 reduces nothing along a negative axis of an empty tensor."""
        return self.Max(self.ReduceMax(self.Abs(values), self.ints(axis), keepdims=1), self.scalar(0.0))

    def zeros(self, shape: str, like: str) -> str:
        return self.CastLike(self.ConstantOfShape(shape), like)

    def order_key(self, values: str) -> str:
        """float32 ``values`` as float64 keys whose descending order is the references' best-first order:
        NaN above +inf above every finite value (float32 fits float64 exactly), -inf last; TopK breaks
        ties by the lower index."""
        key = self.Cast(values, to=TensorProto.DOUBLE)
        key = self.Where(self.IsInf(values, detect_negative=0), self.scalar(1e300, np.float64), key)
        key = self.Where(self.IsInf(values, detect_positive=0), self.scalar(-1e300, np.float64), key)
        return self.Where(self.IsNaN(values), self.scalar(1e301, np.float64), key)

    def to_int8(self, values: str) -> str:
        """Round half to even, saturate to int8, NaN to 0 (``init_routing.to_int8``)."""
        rounded = self.Round(values)
        clipped = self.Clip(rounded, self.scalar(-128.0), self.scalar(127.0))
        return self.Cast(self.Where(self.IsNaN(rounded), self.scalar(0.0), clipped), to=TensorProto.INT8)


# ----------------------------------------------------------------------------- MOE

Linear = Callable[[str, str], str]
"""``linear(weight_input, a)``: ``a`` ([1, T, K] for every expert, or [E, T, K]; float32) times every
expert's weight of that input, ``a @ W[e]^T`` for W [E, N, K]: [E, T, N], without bias."""


def _plus_expert_bias(b: Body, c: Config, y: str, bias: str) -> str:
    """``y`` [E, T, N] plus ``bias`` [E, N] when the node gives it."""
    return b.Add(y, b.Unsqueeze(b.float32(bias), b.ints(1))) if c.has(bias) else y


def expert_outputs(b: Body, c: Config, x: str, linear: Linear) -> str:
    """Every expert on every row of ``x`` [1, T, H] (float32): [E, T, H] (moe.mix_experts's expert types)."""
    expert_type, alpha = c.attr("expert_type"), float(c.attr("expert_alpha"))
    if expert_type == GEMM2_BIAS_SWIGLU_CLAMP:
        gate_up = _plus_expert_bias(b, c, linear("weight_0", x), "bias_0")  # [E, T, 2I]
        parity = int(c.attr("gate_parity"))

        def half(start: int) -> str:
            return b.Slice(gate_up, b.ints(start), b.ints(_INT64_MAX), b.ints(2), b.ints(2))

        act = clamped_swiglu(b, half(parity), half(1 - parity), alpha, float(c.attr("expert_beta")), b.scalar)
        return _plus_expert_bias(b, c, linear("weight_1", act), "bias_1")
    if expert_type == GEMM2_ACT:
        up = _plus_expert_bias(b, c, linear("weight_0", x), "bias_0")
        act = ACTIVATIONS[c.attr("activation")](b, up, b.scalar)
        return _plus_expert_bias(b, c, linear("weight_1", act), "bias_1")
    gate, up = linear("weight_0", x), linear("weight_1", x)
    return linear("weight_2", b.Mul(swish(b, gate, alpha, b.scalar), up))


def mix_experts(b: Body, c: Config, linear: Linear) -> dict[str, str]:
    """MOE's and QMOE's y: each token's k chosen expert outputs, weighted and summed."""
    x = b.rows(b.float32("hidden_states"))
    tokens_k = b.Concat(b.Shape(x, end=1), b.Shape("router_topk_output_indices", start=-1), axis=0)
    idx = b.Reshape(b.Cast("router_topk_output_indices", to=TensorProto.INT64), tokens_k, allowzero=1)
    routing = b.Reshape(b.float32("routing_weights"), tokens_k, allowzero=1)
    per_token = b.Transpose(expert_outputs(b, c, b.Unsqueeze(x, b.ints(0)), linear), perm=[1, 0, 2])  # [T, E, H]
    chosen = b.take_rows(per_token, idx)  # [T, k, H]
    mixed = b.ReduceSum(b.Mul(chosen, b.Unsqueeze(routing, b.ints(-1))), b.ints(1), keepdims=0)
    y = b.Reshape(mixed, b.Shape("hidden_states"), allowzero=1)
    return {"y": b.CastLike(y, "hidden_states")}


def _moe(b: Body, c: Config) -> dict[str, str]:
    stored_k_n = c.attr("expert_type") == GEMM2_BIAS_SWIGLU_CLAMP  # GEMM2 stores [E, K, N], the others [E, N, K]

    def linear(weight: str, a: str) -> str:
        w = b.float32(weight)
        return b.MatMul(a, w if stored_k_n else b.Transpose(w, perm=[0, 2, 1]))

    return mix_experts(b, c, linear)


# ----------------------------------------------------------------------------- MoeGatingTopK

def _gating_topk(b: Body, c: Config) -> dict[str, str]:
    rows = b.rows(b.float32("logits"))
    scores = b.Softmax(rows, axis=-1) if c.attr("score_func") == "softmax" else b.Sigmoid(rows)
    select = b.Add(scores, b.float32("bias")) if c.has("bias") else scores
    key = b.order_key(select)
    n_group = int(c.attr("n_group"))
    if n_group > 1:
        key = b.Where(_kept_groups(b, c, select, n_group), key, b.scalar(-1e301, np.float64))
    k = int(c.attr("k"))
    _, idx = b.TopK(key, b.ints(k), axis=1, _outputs=2)
    weights = b.take_rows(scores, idx)
    if c.attr("renormalize"):
        total = b.Add(b.ReduceSum(weights, b.ints(1), keepdims=1), b.scalar(float(c.attr("eps"))))
        weights = b.Div(weights, total)
    weights = b.Mul(weights, b.scalar(float(c.attr("routed_scaling_factor"))))
    out_shape = b.Concat(b.Shape("logits", end=-1), b.ints(k), axis=0)
    return {"weights": b.CastLike(b.Reshape(weights, out_shape, allowzero=1), "logits"),
            "indices": b.Reshape(idx, out_shape, allowzero=1),
            "scores": b.CastLike(b.Reshape(scores, b.Shape("logits"), allowzero=1), "logits")}


def _kept_groups(b: Body, c: Config, select: str, n_group: int) -> str:
    """[rows, E] bool: the experts of each row's ``topk_group`` best groups (gating_topk._kept_groups)."""
    rows = b.Shape(select, end=1)
    group_size = b.Div(b.Shape(select, start=1), b.ints(n_group))
    groups = b.Mul(rows, b.ints(n_group))
    grouped = b.reshape(select, groups, group_size)  # [rows * G, E/G]
    best = 2 if c.attr("group_select") == "sum_top2" else 1
    _, top = b.TopK(b.order_key(grouped), b.ints(best), axis=1, _outputs=2)
    group_score = b.ReduceSum(b.take_rows(grouped, top), b.ints(1), keepdims=0)  # NaN if any NaN
    group_score = b.reshape(group_score, rows, b.ints(n_group))
    topk_group = int(c.attr("topk_group")) or n_group
    _, kept = b.TopK(b.order_key(group_score), b.ints(topk_group), axis=1, _outputs=2)
    mask = b.ScatterElements(b.ConstantOfShape(b.Concat(rows, b.ints(n_group), axis=0)), kept,
                             b.Expand(b.scalar(1.0), b.Shape(kept)), axis=1)
    per_expert = b.Expand(b.Unsqueeze(mask, b.ints(2)), b.Concat(rows, b.ints(n_group), group_size, axis=0))
    return b.Greater(b.reshape(per_expert, rows, b.Shape(select, start=1)), b.scalar(0.0))


# ----------------------------------------------------------------------------- MoeInitRouting

def _init_routing(b: Body, c: Config) -> dict[str, str]:
    expert_num = int(c.attr("expert_num"))
    start, end = c.attr("active_expert_range") or (0, expert_num)
    active_experts = end - start
    ids = b.Cast("expert_idx", to=TensorProto.INT64)
    k = b.Shape(ids, start=1)
    flat = b.Reshape(ids, b.ints(-1))
    slots = b.Shape(flat)
    active = b.And(b.GreaterOrEqual(flat, b.int64(start)), b.Less(flat, b.int64(end)))
    # stable sort by expert, inactive slots (key `end`) last: TopK keeps the lower index first on ties
    sorted_key, order = b.TopK(b.Where(active, flat, b.int64(end)), slots, axis=0, largest=0, _outputs=2)
    n_valid = b.ReduceSum(b.Cast(active, to=TensorProto.INT64), keepdims=1)
    position = b.positions(slots)
    relative = b.Sub(sorted_key, b.int64(start))  # active_experts for the inactive slots
    experts = b.arange(start, end)
    routed_to = b.Equal(b.Unsqueeze(sorted_key, b.ints(0)), b.Unsqueeze(experts, b.ints(1)))  # [A, slots]

    def count(where: str | None) -> str:
        hits = routed_to if where is None else b.And(routed_to, b.Unsqueeze(where, b.ints(0)))
        return b.ReduceSum(b.Cast(hits, to=TensorProto.INT64), b.ints(1), keepdims=0)

    hidden = b.Shape("x", start=1)
    if c.attr("drop_pad_mode"):  # rank inside the expert's run, kept below the capacity
        capacity = int(c.attr("expert_capacity"))
        counts = count(None)  # before the drop
        first = b.CumSum(counts, b.int64(0), exclusive=1)
        rank = b.Sub(position, b.Gather(first, b.Min(relative, b.int64(active_experts - 1))))
        kept = b.And(b.Less(position, n_valid), b.Less(rank, b.int64(capacity)))
        dest = b.Add(b.Mul(relative, b.int64(capacity)), rank)
        out_rows = b.ints(expert_num * capacity)
        rows_shape = b.ints(expert_num, capacity)
    else:  # the first rows of the sorted order, up to expanded_x's row count
        active_num = int(c.attr("active_num"))
        out_rows = slots if active_num <= 0 else b.Min(slots, b.ints(active_num))
        kept = b.Less(position, b.Min(n_valid, out_rows))
        dest = position
        counts = count(kept)
        rows_shape = out_rows

    if c.attr("row_idx_type") == 1:  # scatter form (dropless only): row -> slot
        row_idx = b.Where(kept, order, b.int64(-1))
    else:  # gather form: slot -> row
        row_idx = b.ScatterElements(b.CastLike(b.ConstantOfShape(slots), order), order,
                                    b.Where(kept, dest, b.int64(-1)), axis=0)

    tokens = b.Compress(b.Div(order, k), kept)
    targets = b.Unsqueeze(b.Compress(dest, kept), b.ints(1))
    values, row_scale = _expand_rows(b, c, b.Gather("x", tokens, axis=0), tokens, b.Compress(relative, kept))
    expanded_x = b.ScatterND(b.zeros(b.Concat(out_rows, hidden, axis=0), values), targets, values)
    expanded_scale = b.ConstantOfShape(out_rows)
    if row_scale is not None:
        expanded_scale = b.ScatterND(expanded_scale, targets, row_scale)
    return {"expanded_x": b.reshape(expanded_x, rows_shape, hidden),
            "expanded_row_idx": b.Cast(row_idx, to=TensorProto.INT32),
            "expert_tokens_count_or_cumsum": _token_counts(b, c, counts, experts),
            "expanded_scale": b.Reshape(expanded_scale, rows_shape, allowzero=1)}


def _expand_rows(b: Body, c: Config, rows: str, tokens: str, relative: str) -> tuple[str, str | None]:
    """The gathered rows as the quant mode makes them, and their scales (None: none)
    (init_routing._expand_rows)."""
    quant_mode = int(c.attr("quant_mode"))
    if quant_mode == -1:
        return rows, b.Gather("scale", tokens, axis=0) if c.has("scale") else None
    values = b.float32(rows)
    if quant_mode == 0:
        shifted = b.Mul(values, "scale")
        return b.to_int8(b.Add(shifted, "offset") if c.has("offset") else shifted), None
    if c.has("scale"):  # one smooth row per active expert, or one for all: index min(relative, rows - 1)
        last = b.Sub(b.Shape("scale", end=1), b.ints(1))
        values = b.Mul(values, b.Gather("scale", b.Min(relative, last), axis=0))
    largest = b.Squeeze(b.abs_max(values, 1), b.ints(1))
    has_nan = b.Greater(b.ReduceMax(b.Cast(b.IsNaN(values), to=_FLOAT), b.ints(1), keepdims=0), b.scalar(0.0))
    row_scale = b.Div(b.Where(has_nan, b.scalar(float("nan")), largest), b.scalar(127.0))
    return b.to_int8(b.Div(values, b.Unsqueeze(row_scale, b.ints(1)))), row_scale


def _token_counts(b: Body, c: Config, counts: str, experts: str) -> str:
    """The count output from the per-expert ``counts`` of the active ``experts`` (init_routing._token_counts)."""
    count_type = int(c.attr("expert_tokens_num_type"))
    if count_type == 0:
        return b.CumSum(counts, b.int64(0))
    if count_type == 1:
        return counts
    used = b.Greater(counts, b.int64(0))
    used_experts = b.Compress(experts, used)
    padding = b.Concat(b.ints(0), b.Sub(b.Shape(experts), b.Shape(used_experts)), axis=0)
    keys = b.Pad(used_experts, padding, b.int64(-1))
    values = b.Pad(b.Compress(counts, used), padding, b.int64(0))
    return b.Concat(b.Unsqueeze(keys, b.ints(1)), b.Unsqueeze(values, b.ints(1)), axis=1)


# ----------------------------------------------------------------------------- MoeFinalizeRouting

def _finalize_routing(b: Body, c: Config) -> dict[str, str]:
    rows = b.rows(b.float32("expanded_x"))
    hidden = b.Shape(rows, start=1)
    row_idx = b.Cast("expanded_row_idx", to=TensorProto.INT64)
    slots = b.Shape(row_idx)
    listed = b.GreaterOrEqual(row_idx, b.int64(0))
    listed_at, listed_value = b.Compress(b.positions(slots), listed), b.Compress(row_idx, listed)
    slot, row = (listed_value, listed_at) if c.attr("row_idx_type") == 1 else (listed_at, listed_value)
    routed = b.Gather(rows, row, axis=0)
    if c.has("bias"):
        expert = b.Gather(b.Reshape(b.Cast("expert_idx", to=TensorProto.INT64), b.ints(-1)), slot)
        routed = b.Add(routed, b.Gather(b.float32("bias"), expert, axis=0))
    if c.has("scales"):
        routed = b.Mul(routed, b.Unsqueeze(b.Gather(b.Reshape(b.float32("scales"), b.ints(-1)), slot), b.ints(1)))
    per_slot = b.ScatterND(b.ConstantOfShape(b.Concat(slots, hidden, axis=0)), b.Unsqueeze(slot, b.ints(1)), routed)
    token_source = next(name for name in ("x1", "x2", "scales", "expert_idx") if c.has(name))
    tokens = b.Shape(token_source, end=1)
    k = b.Div(slots, b.Max(tokens, b.ints(1)))
    out = b.ReduceSum(b.reshape(per_slot, tokens, k, hidden), b.ints(1), keepdims=0)
    for residual in ("x1", "x2"):
        if c.has(residual):
            out = b.Add(out, b.float32(residual))
    return {"out": b.CastLike(out, "expanded_x")}


# ----------------------------------------------------------------------------- MoeRowParallelLinear

def _row_parallel_linear(b: Body, c: Config) -> dict[str, str]:
    accumulate = TensorProto.INT32 if c.int8 else _FLOAT
    x = b.rows(b.Cast("X", to=accumulate))
    every_expert = b.MatMul(x, b.Transpose(b.Cast("W", to=accumulate), perm=[0, 2, 1]))  # [E, rows, N]
    offsets = "expert_offset"
    position = b.positions(b.Shape(x, end=1))
    ends = b.Slice(offsets, b.ints(1), b.ints(_INT64_MAX))
    # row r belongs to the expert whose range holds it: the number of range ends <= r
    expert = b.ReduceSum(b.Cast(b.LessOrEqual(b.Unsqueeze(ends, b.ints(0)), b.Unsqueeze(position, b.ints(1))),
                                to=TensorProto.INT64), b.ints(1), keepdims=0)
    expert = b.Min(expert, b.Sub(b.Shape(ends), b.ints(1)))
    covered = b.And(b.GreaterOrEqual(position, b.Slice(offsets, b.ints(0), b.ints(1))),
                    b.Less(position, b.Slice(offsets, b.ints(-1), b.ints(_INT64_MAX))))
    y = b.Squeeze(b.take_rows(b.Transpose(every_expert, perm=[1, 0, 2]), b.Unsqueeze(expert, b.ints(1))), b.ints(1))
    if c.has("B"):
        y = b.Add(y, b.Gather(b.Cast("B", to=accumulate), expert, axis=0))
    y = b.Where(b.Unsqueeze(covered, b.ints(1)), y, b.CastLike(b.scalar(0.0), y))
    y = b.reshape(y, b.Shape("X", end=-1), b.Shape("W", start=1, end=2))
    return {"Y": y if c.int8 else b.CastLike(y, "X")}


# ----------------------------------------------------------------------------- QMOE

# E2M1 codes and E8M0 exponents (qmoe.dequantize's mxfp4) as lookup tables
_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
_E8M0 = np.append(np.ldexp(1.0, np.arange(255) - 127), np.nan).astype(np.float32)  # 255: NaN


def _unpack(b: Body, packed: str, bits: int, count: str | None = None) -> str:
    """The codes (int32) along the last dim of uint8 ``packed``: one per byte, or two (the even index in the
    low nibble); the first ``count`` of them when given (qmoe.unpack_codes)."""
    codes = b.Cast(packed, to=TensorProto.INT32)
    if bits == 4:
        low, high = b.Mod(codes, b.scalar(16, np.int32)), b.Div(codes, b.scalar(16, np.int32))
        pairs = b.Concat(b.Unsqueeze(low, b.ints(-1)), b.Unsqueeze(high, b.ints(-1)), axis=-1)
        codes = b.reshape(pairs, b.Shape(packed, end=-1), b.Mul(b.Shape(packed, start=-1), b.ints(2)))
    return codes if count is None else b.Slice(codes, b.ints(0), count, b.ints(-1))


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """One quantized weight input by blocks: codes [E, N, blocks, block] (int32), scale [E, N, blocks]
    (float32; mxfp4: the factor 2^(s - 127)), zero point [E, N, blocks, 1] or a scalar (int32, to subtract
    from the codes; None for mxfp4)."""

    codes: str
    scale: str
    zero_point: str | None


def _blocks(b: Body, c: Config, weight: str) -> _Blocks:
    bits, block_size = int(c.attr("bits")), int(c.attr("block_size"))
    suffix = weight[-1]
    scales, zero_points = f"scales_{suffix}", f"zero_points_{suffix}"
    codes = _unpack(b, weight, bits)
    if block_size:
        blocks, block = b.Div(b.Shape(codes, start=2), b.ints(block_size)), b.ints(block_size)
    else:
        blocks, block = b.ints(1), b.Shape(codes, start=2)
    codes = b.reshape(codes, b.Shape(codes, end=2), blocks, block)
    if c.attr("quant_type") == "mxfp4":
        factor = b.Gather(b.const(_E8M0, np.float32), b.Cast(scales, to=TensorProto.INT64), axis=0)
        return _Blocks(codes, factor, None)
    scale = b.float32(scales)
    if not block_size:
        scale = b.Unsqueeze(scale, b.ints(2))
    if not c.has(zero_points):
        zero_point = b.scalar(1 << (bits - 1), np.int32)
    elif block_size:
        zero_point = b.Unsqueeze(_unpack(b, zero_points, bits, blocks), b.ints(-1))
    else:
        zero_point = b.Unsqueeze(_unpack(b, zero_points, bits, b.Shape(weight, start=1, end=2)), b.ints(2, 3))
    return _Blocks(codes, scale, zero_point)


def _dequantized(b: Body, c: Config, weight: str) -> str:
    """float32 W [E, N, K] of a quantized weight input (qmoe.dequantize)."""
    q = _blocks(b, c, weight)
    if q.zero_point is None:
        values = b.Gather(b.const(_E2M1, np.float32), b.Cast(q.codes, to=TensorProto.INT64), axis=0)
    else:
        values = b.Cast(b.Sub(q.codes, q.zero_point), to=_FLOAT)
    w = b.Mul(values, b.Unsqueeze(q.scale, b.ints(-1)))
    return b.reshape(w, b.Shape(weight, end=2), b.Mul(b.Shape(q.codes, start=2, end=3), b.Shape(q.codes, start=3)))


def _int8_linear(b: Body, c: Config, weight: str, a: str) -> str:
    """accuracy_level 4 (qmoe.int8_linear): ``a`` [1 or E, T, K] in int8 per row and block, exact int32
    dots with q - zero point, then the blocks' (sa * scale) * dot summed: [E, T, N]."""
    q = _blocks(b, c, weight)
    a4 = b.reshape(a, b.Shape(a, end=-1), b.Shape(q.codes, start=2, end=3), b.Shape(q.codes, start=3))
    sa = b.Div(b.abs_max(a4, 3), b.scalar(127.0))  # [., T, blocks, 1]
    steps = b.Clip(b.Round(b.Div(a4, sa)), b.scalar(-127.0), b.scalar(127.0))
    qa = b.Cast(b.Where(b.Greater(sa, b.scalar(0.0)), steps, b.scalar(0.0)), to=TensorProto.INT32)
    qw = b.Sub(q.codes, q.zero_point)  # [E, N, blocks, block]
    qw_t = b.Transpose(qw, perm=[0, 2, 3, 1])  # [E, blocks, block, N]
    qa_t = b.Transpose(qa, perm=[0, 2, 1, 3])  # [1 or E, blocks, T, block]
    # expanded to E first: onnxruntime's int32 MatMul gives a wrong shape broadcasting over an empty K
    qa_t = b.Expand(qa_t, b.Concat(b.Shape(qw_t, end=1), b.Shape(qa_t, start=1), axis=0))
    dots = b.MatMul(qa_t, qw_t)  # [E, blocks, T, N]
    factor = b.Mul(b.Transpose(sa, perm=[0, 2, 1, 3]), b.Unsqueeze(b.Transpose(q.scale, perm=[0, 2, 1]), b.ints(2)))
    return b.ReduceSum(b.Mul(factor, b.Cast(dots, to=_FLOAT)), b.ints(1), keepdims=0)


def _qmoe(b: Body, c: Config) -> dict[str, str]:
    if int(c.attr("accuracy_level")) == 4:
        return mix_experts(b, c, lambda weight, a: _int8_linear(b, c, weight, a))
    return mix_experts(b, c, lambda weight, a: b.MatMul(a, b.Transpose(_dequantized(b, c, weight), perm=[0, 2, 1])))


# ----------------------------------------------------------------------------- the functions

BUILDERS: dict[str, Callable[[Body, Config], dict[str, str]]] = {
    "MOE": _moe,
    "MoeInitRouting": _init_routing,
    "MoeRowParallelLinear": _row_parallel_linear,
    "MoeFinalizeRouting": _finalize_routing,
    "MoeGatingTopK": _gating_topk,
    "QMOE": _qmoe,
}
"""Each op's body builder: (body, configuration) -> the value of each formal output."""

_CANNOT_COMMUNICATE = "standard ONNX ops cannot exchange data between processes (docs/distributed.md)"
NO_BODY: dict[str, str] = {
    "MoeDistributeDispatch": f"it sends tokens to the ranks that own their experts (MPI); {_CANNOT_COMMUNICATE}",
    "MoeDistributeCombine": f"it sends expert outputs back to their tokens' ranks (MPI); {_CANNOT_COMMUNICATE}",
}
"""The ops without a body, each with the reason ``--portable`` gives when it refuses a model that has one."""


# Attributes that only state sizes or a layout the inputs already have (checked, never computed with):
# nodes that differ only there share a function.
_CHECK_ONLY_ATTRIBUTES = {"MoeRowParallelLinear": {"num_experts", "in_features", "out_features", "bias_term",
                                                   "input_is_parallel"}}


def config_of(node: onnx.NodeProto, int8_input: bool = False) -> Config:
    """The configuration of a moe_onnx node (``int8_input``: its input 0 is int8)."""
    op = OPS[node.op_type]
    given = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    attrs = []
    for spec in op.attributes:
        if spec.name in _CHECK_ONLY_ATTRIBUTES.get(op.name, ()):
            continue
        value = given.get(spec.name, spec.default)
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        elif spec.kind == "float":
            value = float(np.float32(value))  # as the node stores it
        elif spec.kind == "ints" and value is not None:
            value = tuple(int(v) for v in value)
        attrs.append((spec.name, value))
    return Config(node.op_type, tuple(attrs), tuple(bool(name) for name in node.input), len(node.output), int8_input)


def function_for(config: Config, opset: int) -> onnx.FunctionProto:
    """The function (domain moe_onnx, the op's name, ``config.overload``) computing ``config``'s op
    with standard ops of ``opset``."""
    op = OPS[config.op]
    body = Body()
    values = BUILDERS[config.op](body, config)
    outputs = [p.name for p in op.outputs[: config.n_outputs]]
    for name in outputs:
        body.nodes.append(helper.make_node("Identity", [values[name]], [name]))
    inputs = [p.name for p in op.inputs[: len(config.given)]]
    return helper.make_function(DOMAIN, op.name, inputs, outputs, body.nodes, [helper.make_opsetid("", opset)],
                                doc_string=f"{op.name} as standard ONNX ops (moe_onnx.portable), for {config}",
                                overload=config.overload)


def configurations(model: ir.Model) -> dict[str, int]:
    """How many distinct configurations (functions) each moe_onnx op has in ``model``."""
    counts: dict[str, int] = {}
    for domain, name, _ in model.functions:
        if domain == DOMAIN:
            counts[name] = counts.get(name, 0) + 1
    return counts


def summary(model: ir.Model) -> str:
    """One line for the optimize report: the bodies written, and whether ReferenceEvaluator can run them."""
    counts = configurations(model)
    line = "portable: function bodies " + (", ".join(f"{op} x{n}" for op, n in sorted(counts.items())) or "none")
    mixed = sorted(op for op, n in counts.items() if n > 1)
    if mixed:
        line += (f"; {', '.join(mixed)} with several configurations (overloads): onnxruntime runs this model, "
                 "onnx.reference.ReferenceEvaluator (it ignores overload) cannot")
    return line


def add_function_bodies(model: ir.Model) -> ir.Model:
    """Give every moe_onnx node of ``model`` (in place) its portable function: a model-local function
    per distinct configuration, named by the node's ``overload``. Raises ValueError when the model's
    default opset is below :data:`MIN_OPSET`, an int8-capable input's type is unknown, or a node needs other
    processes (:data:`NO_BODY`, a tensor-parallel group of more than one rank) (PortableError)."""
    opset = require_opset(model)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != DOMAIN or node.op_type not in OPS:
            continue
        _refuse_distributed(node)
        config = config_of(ir.serde.serialize_node(node), _int8_input(node))
        key = (DOMAIN, node.op_type, config.overload)
        if key not in model.functions:
            model.functions[key] = ir.serde.deserialize_function(function_for(config, opset))
        node.overload = config.overload
    if model.ir_version < 10:  # function overloads are IR 10
        model.ir_version = 10
    return model


class PortableError(ValueError):
    """A model the function bodies cannot be written into (``moe-onnx optimize --portable``: exit 2)."""


def require_opset(model: ir.Model) -> int:
    """The model's default-domain opset; PortableError when the bodies cannot be written in it."""
    opset = model.opset_imports.get("", 0)
    if opset < MIN_OPSET:
        raise PortableError(f"portable function bodies need the default ONNX opset >= {MIN_OPSET}; the model "
                            f"imports {opset or 'none'}")
    return opset


def _refuse_distributed(node: ir.Node) -> None:
    """PortableError for a node whose meaning needs other processes: no standard op can reach them."""
    reason = NO_BODY.get(node.op_type)
    tp_size = node.attributes.get("tp_world_size")
    if reason is None and tp_size is not None and tp_size.as_int() > 1:
        reason = (f"its attribute 'tp_world_size' is {tp_size.as_int()}: it sums partial results over its "
                  f"tensor-parallel group; {_CANNOT_COMMUNICATE}")
    if reason is not None:
        raise PortableError(f"{node.op_type} node '{node.name}' has no portable function body: {reason}")


def _int8_input(node: ir.Node) -> bool:
    if node.op_type != "MoeRowParallelLinear":
        return False
    value = node.inputs[0]
    if value is None or value.dtype is None:
        raise PortableError(f"{node.op_type} node '{node.name}': the element type of input 'X' is unknown; the "
                            "portable body needs it (float or int8): run shape inference first")
    return value.dtype == ir.DataType.INT8


def portable_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with the portable function bodies (:func:`add_function_bodies`), after
    onnx shape inference (for the element types the bodies depend on)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    return ir.serde.serialize_model(add_function_bodies(ir.serde.deserialize_model(inferred)))
