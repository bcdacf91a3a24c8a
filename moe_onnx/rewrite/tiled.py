"""Fusions of the tiled export form: every token through every expert, zeroed by dense routing weights.

The accelerator-friendly experts forwards (transformers 4.57 GPT-OSS on its non-CPU branch, as
optimum exports it; transformers 5 Qwen3/Mixtral/OLMoE/Qwen2-MoE experts as optimum-intel patches
them for OpenVINO) run all E experts on all T tokens with batched MatMuls, then keep each token's
top-k experts by multiplying with a dense [T, E] matrix that the router scatters from its top-k:

    tokens_TH -> Expand(ones)? -> Tile [E, 1] -> Reshape [E, -1, H] -> experts -> out_ETH
    out_ETH (-> Reshape [E, B, S, H])? * (dense_TE -> Transpose (-> Reshape [E, B, S])? -> Unsqueeze(last))
    -> ReduceSum(axis 0)
    dense_TE = ScatterElements(zeros [T, E], TopK indices_TK, weights_TK, axis=1)

Each rule makes that one MOE node on tokens_TH, fed with the scatter's compact top-k weights and
indices. The router stays; the scatter stays too while something else reads it (GPT-OSS returns it
as router_scores). The two expert bodies:

- GPT-OSS (GEMM2_BIAS_SWIGLU_CLAMP): MatMul + bias, interleaved Slice gate/up, Clip, (up + 1) * gate *
  sigmoid(alpha * gate), MatMul + bias.
- SwiGLU (GEMM3_SWIGLU): MatMul with the gate_up weight and Split in halves (or two MatMuls),
  silu(gate) * up, MatMul; no biases.

Abbreviations in names: T tokens, H hidden size, I expert intermediate size, N = 2I (gate and up),
E experts, K experts per token, B batch, S tokens per batch row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, pattern

from ..ops.moe import GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU
from ._match import MoeFusion, Weight, constant, constant_ints, constant_scalar, emit_moe, int64s, is_zeros, \
    same_scalar, weight, weight_value

# One element of a small int64 shape tensor: a known int, (value, axis) for a dim known only at run
# time, or None when unknown.
_Dim = int | tuple[ir.Value, int] | None
_MAX_RANK = 8  # longest shape tensor that ConstantOfShape may build here


# ----------------------------------------------------------------------------- shape arithmetic

def _dims(value: ir.Value | None) -> list[_Dim] | None:
    """The elements of a 1-D shape tensor, folded through the shape arithmetic exporters emit
    (Shape, Gather, Concat, Unsqueeze/Squeeze/Reshape, Cast, ConstantOfShape); None if not foldable."""
    if value is None:
        return None
    ints = constant_ints(value)
    if ints is not None:
        return ints
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Shape":
        source = node.inputs[0]
        if source.shape is None:
            return None
        rank = len(source.shape)
        start, end = (min(rank, max(0, i + rank if i < 0 else i))
                      for i in (node.attributes.get_int("start", 0), node.attributes.get_int("end", rank)))
        return [dim if isinstance(dim, int) else (source, axis)
                for axis, dim in enumerate(source.shape) if start <= axis < end]
    if node.op_type in ("Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape"):
        return _dims(node.inputs[0])
    if node.op_type == "Concat":
        parts = [_dims(part) for part in node.inputs]
        return None if any(part is None for part in parts) else [dim for part in parts for dim in part]
    if node.op_type == "Gather":
        data, index = _dims(node.inputs[0]), constant_ints(node.inputs[1])
        if data is None or index is None or node.attributes.get_int("axis", 0) != 0:
            return None
        return [data[i] for i in index] if all(-len(data) <= i < len(data) for i in index) else None
    if node.op_type == "ConstantOfShape":
        length, fill = _dims(node.inputs[0]), node.attributes.get_tensor("value")
        if length is None or len(length) != 1 or not isinstance(length[0], int) or length[0] > _MAX_RANK:
            return None
        fill_value = 0 if fill is None else fill.numpy().reshape(-1)[0]
        return [int(fill_value)] * length[0] if float(fill_value).is_integer() else None
    return None


def _show(dims: list[_Dim] | None) -> str:
    if dims is None:
        return "(not a constant)"
    return "[" + ", ".join("?" if d is None else str(d) if isinstance(d, int) else f"{d[0].name}.shape[{d[1]}]"
                           for d in dims) + "]"


def _shape_value(op, dims: list[_Dim]) -> ir.Value:
    """A shape tensor with these elements (run-time dims read again with Shape)."""
    parts = [int64s(op, [d]) if isinstance(d, int) else op.Shape(d[0], start=d[1], end=d[1] + 1) for d in dims]
    return op.Concat(*parts, axis=0)


# ----------------------------------------------------------------------------- shared pattern parts

def _tiled_tokens(op, tokens_TH, expand_shape, repeats, tokens_shape):
    """tokens_TH -> Expand? -> Tile -> Reshape: the tokens once per expert, [E, T, H]."""
    tokens = pattern.OrValue([op.Expand(tokens_TH, expand_shape), tokens_TH])
    return op.Reshape(op.Tile(tokens, repeats), tokens_shape)


def _weighted_sum(op, out_ETH, dense_TE, out_shape, scores_shape, scores_axes, sum_axes):
    """sum over e of out_ETH[e] * dense_TE[:, e], both optionally split [E, B, S, ...]."""
    out = pattern.OrValue([op.Reshape(out_ETH, out_shape), out_ETH])
    dense_ET = op.Transpose(dense_TE, _outputs=["dense_ET"])
    scores = op.Unsqueeze(pattern.OrValue([op.Reshape(dense_ET, scores_shape), dense_ET]), scores_axes)
    return op.ReduceSum(op.Mul(out, scores), sum_axes, _outputs=["block_out"])


def _swiglu(op, gate_ETI, up_ETI, alpha):
    """silu(gate) * up, with an optional swish alpha: gate * sigmoid(alpha * gate) * up."""
    sigmoid = op.Sigmoid(pattern.OrValue([op.Mul(gate_ETI, alpha), gate_ETI]))
    return op.Mul(op.Mul(gate_ETI, sigmoid), up_ETI)


# ----------------------------------------------------------------------------- shared checks

def _tiling_problem(tokens_TH: ir.Value, expand_shape, repeats, tokens_shape, experts: int,
                    hidden: int) -> str | None:
    """Why Expand? -> Tile -> Reshape is not tokens_TH once per expert ([E, T, H]), or None."""
    shape = tokens_TH.shape
    if shape is None or len(shape) != 2 or shape[1] != hidden:
        return f"the tiled tokens have shape {shape}; expected [T, {hidden}]"
    if expand_shape is not None:
        ones = _dims(expand_shape)
        if ones is None or len(ones) > 2 or any(d != 1 for d in ones):
            return f"Expand before Tile to {_show(ones)}; expected ones (no broadcast)"
    if _dims(repeats) != [experts, 1]:
        return f"Tile repeats {_show(_dims(repeats))}; expected [{experts}, 1] for the {experts} experts of the weights"
    if _dims(tokens_shape) != [experts, -1, hidden]:
        return f"tiled tokens reshaped to {_show(_dims(tokens_shape))}; expected [{experts}, -1, {hidden}]"
    return None


def _scalar_text(value: ir.Value | None) -> str:
    array = constant(value)
    if array is None:
        return "(not a constant)"
    return f"{array.reshape(-1)[0]}" if array.size == 1 else f"a tensor of shape {list(array.shape)}"


def _routing_problem(dense_TE: ir.Value, experts: int) -> str | None:
    """Why dense_TE is not the router's top-k scattered into zeros [T, E], or None."""
    scatter = dense_TE.producer()
    if scatter is None or scatter.op_type != "ScatterElements":
        return "the dense routing weights are not a ScatterElements output"
    if scatter.attributes.get_int("axis", 0) not in (1, -1):
        return f"ScatterElements axis {scatter.attributes.get_int('axis', 0)}; expected 1 (experts)"
    if scatter.attributes.get_string("reduction", "none") != "none":
        return f"ScatterElements reduction {scatter.attributes.get_string('reduction')}; expected none"
    if not is_zeros(scatter.inputs[0]):
        return "ScatterElements does not write into zeros"
    if dense_TE.shape is None or len(dense_TE.shape) != 2 or dense_TE.shape[1] != experts:
        return f"dense routing weights of shape {dense_TE.shape}; expected [T, {experts}]"
    # TopK's indices are distinct: the scatter keeps each, as MOE sums each
    indices = scatter.inputs[1]
    topk = indices.producer()
    if topk is None or topk.op_type != "TopK" or indices.index() != 1:
        return "the scattered expert indices are not a TopK's indices"
    scores = topk.inputs[0]
    if scores.shape is None or len(scores.shape) != 2 or topk.attributes.get_int("axis", -1) not in (-1, 1):
        return (f"TopK over axis {topk.attributes.get_int('axis', -1)} of shape {scores.shape}; "
                "expected the last axis of [T, E]")
    return None


def _tail_problem(out_shape, scores_shape, scores_axes, sum_axes, dense_ET: ir.Value, block_out: ir.Value,
                  experts: int, hidden: int, matched: Sequence[ir.Node]) -> str | None:
    """Why the weighted sum is not sum_e out[e] * dense[:, e] (split alike when reshaped), or None."""
    perm = dense_ET.producer().attributes.get_ints("perm")
    if perm is not None and list(perm) != [1, 0]:
        return f"the dense routing weights are transposed with perm {list(perm)}; expected [1, 0]"
    keepdims = block_out.producer().attributes.get_int("keepdims", 1)
    if constant_ints(sum_axes) != [0] or keepdims != 0:
        return f"ReduceSum over axes {constant_ints(sum_axes)} keepdims={keepdims}; expected axis 0, keepdims=0"
    if (out_shape is None) != (scores_shape is None):
        return "only one of the expert outputs and the routing weights is reshaped"
    last = 2 if out_shape is None else 3
    if constant_ints(scores_axes) not in ([last], [-1]):
        return f"routing weights unsqueezed at {constant_ints(scores_axes)}; expected the last axis {last}"
    if out_shape is not None:
        split, scores_split = _dims(out_shape), _dims(scores_shape)
        if (split is None or len(split) != 4 or split[0] != experts or split[3] != hidden
                or any(d is None or d == 0 for d in split[1:3]) or scores_split != split[:3]):
            return (f"expert outputs reshaped to {_show(split)} and routing weights to {_show(scores_split)}; "
                    f"expected [{experts}, B, S, {hidden}] and [{experts}, B, S] alike")
        # the fused output is reshaped to [B, S, H] with these dims, read where they come from
        if any(isinstance(d, tuple) and d[0].producer() in matched for d in split[1:3]):
            return f"expert outputs reshaped to {_show(split)}, read from a value inside the block"
    return None


# ----------------------------------------------------------------------------- the frame

class _Offline(NamedTuple):
    """A MOE weight input: ``transform(weight)`` of shape ``shape``, computed offline (None: as is)."""

    role: str
    weight: Weight
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    shape: tuple[int, ...] | None = None


class _Experts(NamedTuple):
    """The expert body of a match: E, H, the MOE weight inputs by name, and the MOE attributes."""

    count: int
    hidden: int
    weights: dict[str, _Offline]
    attributes: dict[str, Any]


class _TiledFusion(MoeFusion):
    """The shared frame: tiled tokens in, expert body (``_experts``), dense routing, weighted sum out."""

    def _experts(self, **bindings) -> _Experts | str:
        """The expert body's sizes, weights and attributes, or why it does not fit MOE."""
        raise NotImplementedError

    def check(self, context, tokens_TH, expand_shape, repeats, tokens_shape, dense_TE, dense_ET, out_shape,
              scores_shape, scores_axes, sum_axes, block_out, **bindings) -> MatchResult:
        experts = self._experts(**bindings)
        if isinstance(experts, str):
            return self.fail(experts)
        problem = (_tiling_problem(tokens_TH, expand_shape, repeats, tokens_shape, experts.count, experts.hidden)
                   or _routing_problem(dense_TE, experts.count)
                   or _tail_problem(out_shape, scores_shape, scores_axes, sum_axes, dense_ET, block_out,
                                    experts.count, experts.hidden, context.nodes))
        return self.fail(problem) if problem else MatchResult()

    def rewrite(self, op, tokens_TH, dense_TE, out_shape, **bindings):
        experts = self._experts(**bindings)  # again: cheap, no weight is loaded
        scatter = dense_TE.producer()
        weights = {name: weight_value(op, w.weight, f"{w.weight.source.name}.{w.role}", w.transform, w.shape)
                   for name, w in experts.weights.items()}
        out_TH = emit_moe(op, tokens_TH, scatter.inputs[2], scatter.inputs[1], **weights, **experts.attributes)
        if out_shape is None:
            return out_TH
        return op.Reshape(out_TH, _shape_value(op, _dims(out_shape)[1:]))


# ----------------------------------------------------------------------------- GPT-OSS

def _interleaved_start(node: ir.Node, n: int) -> int | str:
    """The start, 0 or 1, of a Slice that takes every other column [start::2] of the last axis of
    [E, T, n]; else why it does not."""
    starts, ends, axes, steps = (constant_ints(v) for v in (list(node.inputs) + [None] * 5)[1:5])
    if starts not in ([0], [1]) or steps != [2] or axes not in ([2], [-1]) or ends is None or ends[0] < n:
        return f"starts={starts} ends={ends} axes={axes} steps={steps}; expected [0] or [1], [>= {n}], [-1], [2]"
    return starts[0]


def _clip_bounds(node: ir.Node) -> list[float | None]:
    """[min, max] of a Clip: None when absent, nan when not a scalar constant."""
    bounds = []
    for value in (list(node.inputs) + [None, None])[1:3]:
        scalar = None if value is None else constant_scalar(value)
        bounds.append(None if value is None else math.nan if scalar is None else scalar)
    return bounds


def _clamp_limit(gate_clip: ir.Node, up_clip: ir.Node) -> float | str:
    """The clamp bound: the gate's Clip has only max = limit, the up's Clip is [-limit, limit]."""
    (gate_min, limit), (up_min, up_max) = _clip_bounds(gate_clip), _clip_bounds(up_clip)
    if gate_min not in (None, -math.inf) or limit is None or not limit > 0:
        return f"gate Clip bounds ({gate_min}, {limit}); expected (none, limit > 0)"
    if up_min is None or up_max is None or not (same_scalar(up_max, limit) and same_scalar(up_min, -limit)):
        return f"up Clip bounds ({up_min}, {up_max}); expected (-{limit}, {limit}) like the gate's limit"
    return limit


class TiledGptOssFusion(_TiledFusion):
    """GPT-OSS tiled experts (transformers 4.57 accelerator branch) -> MOE GEMM2_BIAS_SWIGLU_CLAMP::

        gate_up_ETN = Add(MatMul(tokens_ETH, gate_up_EHN), gate_up_bias [E, 1, N])
        gate = Clip(Slice(gate_up_ETN, parity::2), max=limit)
        up   = Clip(Slice(gate_up_ETN, 1-parity::2), -limit, limit)
        act  = (up + 1) * gate * Sigmoid(gate * alpha)      (either association; alpha may be absent)
        out_ETH = Add(MatMul(act, down_EIH), down_bias [E, 1, H])
    """

    def pattern(self, op, tokens_TH, expand_shape, repeats, tokens_shape, gate_up_EHN, gate_up_bias, one, alpha,
                down_EIH, down_bias, dense_TE, out_shape, scores_shape, scores_axes, sum_axes):
        tokens_ETH = _tiled_tokens(op, tokens_TH, expand_shape, repeats, tokens_shape)
        gate_up_ETN = op.Add(op.MatMul(tokens_ETH, gate_up_EHN), gate_up_bias)
        gate_ETI = op.Clip(op.Slice(gate_up_ETN, _allow_other_inputs=True, _outputs=["gate_slice"]),
                           _allow_other_inputs=True, _outputs=["gate_clip"])
        up_ETI = op.Clip(op.Slice(gate_up_ETN, _allow_other_inputs=True, _outputs=["up_slice"]),
                         _allow_other_inputs=True, _outputs=["up_clip"])
        up_plus_one = op.Add(up_ETI, one)
        sigmoid = op.Sigmoid(pattern.OrValue([op.Mul(gate_ETI, alpha), gate_ETI]))
        act_ETI = pattern.OrValue([op.Mul(op.Mul(up_plus_one, gate_ETI), sigmoid),
                                   op.Mul(up_plus_one, op.Mul(gate_ETI, sigmoid))])
        out_ETH = op.Add(op.MatMul(act_ETI, down_EIH), down_bias)
        return _weighted_sum(op, out_ETH, dense_TE, out_shape, scores_shape, scores_axes, sum_axes)

    def _experts(self, gate_up_EHN, gate_up_bias, down_EIH, down_bias, gate_slice, up_slice, gate_clip, up_clip,
                 one, alpha, **_) -> _Experts | str:
        gate_up, down = weight(gate_up_EHN), weight(down_EIH)
        if gate_up is None or len(gate_up.shape) != 3 or gate_up.shape[2] % 2:
            return f"gate_up weight {gate_up.shape if gate_up else '(not a constant)'} is not a constant [E, H, 2I]"
        experts, hidden, n = gate_up.shape
        inter = n // 2
        if down is None or down.shape != (experts, inter, hidden):
            return (f"down weight {down.shape if down else '(not a constant)'} does not fit gate_up weight "
                    f"{gate_up.shape}: expected [E, I, H] = [{experts}, {inter}, {hidden}]")
        biases = {}
        for name, value, size in (("gate_up", gate_up_bias, n), ("down", down_bias, hidden)):
            bias = weight(value)
            if bias is None or bias.shape != (experts, 1, size):
                return f"{name} bias {bias.shape if bias else '(not a constant)'} is not [{experts}, 1, {size}]"
            biases[name] = _Offline(f"{name}_bias", bias, lambda a, s=(experts, size): a.reshape(s), (experts, size))
        starts = []
        for role, value in (("gate", gate_slice), ("up", up_slice)):
            start = _interleaved_start(value.producer(), n)
            if isinstance(start, str):
                return f"{role} Slice {start}"
            starts.append(start)
        if starts[0] == starts[1]:
            return f"gate and up Slices both start at {starts[0]}; expected one even and one odd half"
        limit = _clamp_limit(gate_clip.producer(), up_clip.producer())
        if isinstance(limit, str):
            return limit
        if not same_scalar(constant_scalar(one), 1.0):
            return f"the constant added to up is {_scalar_text(one)}; expected 1"
        swish_alpha = 1.0 if alpha is None else constant_scalar(alpha)
        if swish_alpha is None:
            return f"swish alpha (the Mul before Sigmoid) is {_scalar_text(alpha)}; expected a scalar constant"
        return _Experts(experts, hidden,
                        dict(weight_0=_Offline("gate_up", gate_up), bias_0=biases["gate_up"],
                             weight_1=_Offline("down", down), bias_1=biases["down"]),
                        dict(expert_type=GEMM2_BIAS_SWIGLU_CLAMP, expert_alpha=swish_alpha, expert_beta=limit,
                             gate_parity=starts[0]))


# ----------------------------------------------------------------------------- SwiGLU

def _transpose_last(a: np.ndarray) -> np.ndarray:
    return a.transpose(0, 2, 1)


def _gemm3(gate: tuple[Weight, Callable], up: tuple[Weight, Callable], sizes: tuple[int, int, int], down_EIH,
           alpha) -> _Experts | str:
    """GEMM3_SWIGLU from gate/up weights (each with its transform to [E, I, H]) of sizes (E, H, I)."""
    experts, hidden, inter = sizes
    down = weight(down_EIH)
    if down is None or down.shape != (experts, inter, hidden):
        return (f"down weight {down.shape if down else '(not a constant)'} does not fit gate and up: "
                f"expected [E, I, H] = [{experts}, {inter}, {hidden}]")
    swish_alpha = 1.0 if alpha is None else constant_scalar(alpha)
    if swish_alpha is None:
        return f"swish alpha (the Mul before Sigmoid) is {_scalar_text(alpha)}; expected a scalar constant"
    shape_EIH = (experts, inter, hidden)
    return _Experts(experts, hidden,
                    dict(weight_0=_Offline("gate", *gate, shape_EIH), weight_1=_Offline("up", *up, shape_EIH),
                         weight_2=_Offline("down", down, _transpose_last, (experts, hidden, inter))),
                    dict(expert_type=GEMM3_SWIGLU, expert_alpha=swish_alpha))


class TiledSwigluFusion(_TiledFusion):
    """Tiled SwiGLU experts with one gate_up weight split in halves -> MOE GEMM3_SWIGLU::

        gate_ETI, up_ETI = Split(MatMul(tokens_ETH, gate_up_EHN), 2, axis=-1)     (gate first)
        out_ETH = MatMul(gate * Sigmoid(gate (* alpha)) * up, down_EIH)
    """

    def pattern(self, op, tokens_TH, expand_shape, repeats, tokens_shape, gate_up_EHN, alpha, down_EIH, dense_TE,
                out_shape, scores_shape, scores_axes, sum_axes):
        tokens_ETH = _tiled_tokens(op, tokens_TH, expand_shape, repeats, tokens_shape)
        gate_ETI, up_ETI = op.Split(op.MatMul(tokens_ETH, gate_up_EHN), _allow_other_inputs=True,
                                    _outputs=["gate_ETI", "up_ETI"])
        out_ETH = op.MatMul(_swiglu(op, gate_ETI, up_ETI, alpha), down_EIH)
        return _weighted_sum(op, out_ETH, dense_TE, out_shape, scores_shape, scores_axes, sum_axes)

    def _experts(self, gate_up_EHN, gate_ETI, down_EIH, alpha, **_) -> _Experts | str:
        gate_up = weight(gate_up_EHN)
        if gate_up is None or len(gate_up.shape) != 3 or gate_up.shape[2] % 2:
            return f"gate_up weight {gate_up.shape if gate_up else '(not a constant)'} is not a constant [E, H, 2I]"
        experts, hidden, n = gate_up.shape
        inter = n // 2
        split = gate_ETI.producer()
        given_sizes = len(split.inputs) > 1 and split.inputs[1] is not None
        sizes = constant_ints(split.inputs[1]) if given_sizes else [inter, inter]  # num_outputs=2: halves
        axis = split.attributes.get_int("axis", 0)
        if axis not in (2, -1) or len(split.outputs) != 2 or sizes != [inter, inter]:
            return (f"Split of gate_up: axis={axis}, {len(split.outputs)} outputs, sizes {sizes}; "
                    f"expected axis -1 into halves [{inter}, {inter}]")
        return _gemm3((gate_up, lambda a: _transpose_last(a[:, :, :inter])),
                      (gate_up, lambda a: _transpose_last(a[:, :, inter:])), (experts, hidden, inter), down_EIH, alpha)


class TiledSwigluSeparateFusion(_TiledFusion):
    """Tiled SwiGLU experts with separate gate and up weights -> MOE GEMM3_SWIGLU::

        gate_ETI = MatMul(tokens_ETH, gate_EHI); up_ETI = MatMul(tokens_ETH, up_EHI)
        out_ETH = MatMul(gate * Sigmoid(gate (* alpha)) * up, down_EIH)
    """

    def pattern(self, op, tokens_TH, expand_shape, repeats, tokens_shape, gate_EHI, up_EHI, alpha, down_EIH,
                dense_TE, out_shape, scores_shape, scores_axes, sum_axes):
        tokens_ETH = _tiled_tokens(op, tokens_TH, expand_shape, repeats, tokens_shape)
        gate_ETI, up_ETI = op.MatMul(tokens_ETH, gate_EHI), op.MatMul(tokens_ETH, up_EHI)
        out_ETH = op.MatMul(_swiglu(op, gate_ETI, up_ETI, alpha), down_EIH)
        return _weighted_sum(op, out_ETH, dense_TE, out_shape, scores_shape, scores_axes, sum_axes)

    def _experts(self, gate_EHI, up_EHI, down_EIH, alpha, **_) -> _Experts | str:
        gate, up = weight(gate_EHI), weight(up_EHI)
        if gate is None or up is None or len(gate.shape) != 3 or gate.shape != up.shape:
            shapes = [w.shape if w else "(not a constant)" for w in (gate, up)]
            return f"gate and up weights {shapes[0]} and {shapes[1]} are not two constant [E, H, I]"
        return _gemm3((gate, _transpose_last), (up, _transpose_last), gate.shape, down_EIH, alpha)


FUSIONS: list[type[MoeFusion]] = [TiledGptOssFusion, TiledSwigluFusion, TiledSwigluSeparateFusion]
