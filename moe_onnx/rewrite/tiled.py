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

The routing is read by ``_router.dense_route``, the activations by ``_activation``'s readers.

Abbreviations in names: T tokens, H hidden size, I expert intermediate size, N = 2I (gate and up),
E experts, K experts per token, B batch, S tokens per batch row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from .._ir.builder import int64s
from .._ir.weights import Weight, weight, weight_value
from ..ops.moe import GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU
from ._activation import clamped_swiglu, read_clamped_swiglu, read_swiglu, swiglu
from ._match import Dim, MoeFusion, constant_ints, emit_moe, require, shape_dims
from ._router import Route, dense_route


# ----------------------------------------------------------------------------- shape tensors

def _show(dims: list[Dim] | None) -> str:
    if dims is None:
        return "(not a constant)"
    return "[" + ", ".join("?" if d is None else str(d) if isinstance(d, int) else f"{d[0].name}.shape[{d[1]}]"
                           for d in dims) + "]"


def _shape_value(op, dims: list[Dim]) -> ir.Value:
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


# ----------------------------------------------------------------------------- shared checks

def _check_tiling(tokens_TH: ir.Value, expand_shape, repeats, tokens_shape, experts: int, hidden: int) -> None:
    """Expand? -> Tile -> Reshape is tokens_TH once per expert ([E, T, H])."""
    shape = tokens_TH.shape
    require(shape is not None and len(shape) == 2 and shape[1] == hidden,
            f"the tiled tokens have shape {shape}; expected [T, {hidden}]")
    if expand_shape is not None:
        ones = shape_dims(expand_shape)
        require(ones is not None and len(ones) <= 2 and all(d == 1 for d in ones),
                f"Expand before Tile to {_show(ones)}; expected ones (no broadcast)")
    require(shape_dims(repeats) == [experts, 1],
            f"Tile repeats {_show(shape_dims(repeats))}; expected [{experts}, 1] for the {experts} experts of the "
            "weights")
    require(shape_dims(tokens_shape) == [experts, -1, hidden],
            f"tiled tokens reshaped to {_show(shape_dims(tokens_shape))}; expected [{experts}, -1, {hidden}]")


def _check_tail(out_shape, scores_shape, scores_axes, sum_axes, dense_ET: ir.Value, block_out: ir.Value,
                experts: int, hidden: int, matched: Sequence[ir.Node]) -> None:
    """The weighted sum is sum_e out[e] * dense[:, e] (split alike when reshaped)."""
    perm = dense_ET.producer().attributes.get_ints("perm")
    require(perm is None or list(perm) == [1, 0],
            f"the dense routing weights are transposed with perm {perm and list(perm)}; expected [1, 0]")
    keepdims = block_out.producer().attributes.get_int("keepdims", 1)
    require(constant_ints(sum_axes) == [0] and keepdims == 0,
            f"ReduceSum over axes {constant_ints(sum_axes)} keepdims={keepdims}; expected axis 0, keepdims=0")
    require((out_shape is None) == (scores_shape is None),
            "only one of the expert outputs and the routing weights is reshaped")
    last = 2 if out_shape is None else 3
    require(constant_ints(scores_axes) in ([last], [-1]),
            f"routing weights unsqueezed at {constant_ints(scores_axes)}; expected the last axis {last}")
    if out_shape is None:
        return
    split, scores_split = shape_dims(out_shape), shape_dims(scores_shape)
    require(split is not None and len(split) == 4 and split[0] == experts and split[3] == hidden
            and all(d is not None and d != 0 for d in split[1:3]) and scores_split == split[:3],
            f"expert outputs reshaped to {_show(split)} and routing weights to {_show(scores_split)}; "
            f"expected [{experts}, B, S, {hidden}] and [{experts}, B, S] alike")
    # the fused output is reshaped to [B, S, H] with these dims, read where they come from
    require(not any(isinstance(d, tuple) and d[0].producer() in matched for d in split[1:3]),
            f"expert outputs reshaped to {_show(split)}, read from a value inside the block")


# ----------------------------------------------------------------------------- the frame

class _Offline(NamedTuple):
    """A MOE weight input: ``per_expert`` applied to each expert's slice of ``weight`` (None: as is),
    giving ``shape``."""

    role: str
    weight: Weight
    per_expert: Callable[[np.ndarray], np.ndarray] | None = None
    shape: tuple[int, ...] | None = None


class _Experts(NamedTuple):
    """The expert body of a match: E, H, the MOE weight inputs by name, and the MOE attributes."""

    count: int
    hidden: int
    weights: dict[str, _Offline]
    attributes: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class _Block:
    """A checked tiled block: the tokens, the router's top-k, the experts, and the [B, S, H] dims of
    the output (None when it is [T, H])."""

    tokens_TH: ir.Value
    route: Route
    experts: _Experts
    out_dims: list[Dim] | None


class _TiledFusion(MoeFusion):
    """The shared frame: tiled tokens in, expert body (``_experts``), dense routing, weighted sum out."""

    def _experts(self, **bindings) -> _Experts:
        """The expert body's sizes, weights and attributes (MatchFailure when it does not fit MOE)."""
        raise NotImplementedError

    def read(self, context, tokens_TH, expand_shape, repeats, tokens_shape, dense_TE, dense_ET, out_shape,
             scores_shape, scores_axes, sum_axes, block_out, **bindings) -> _Block:
        experts = self._experts(**bindings)
        _check_tiling(tokens_TH, expand_shape, repeats, tokens_shape, experts.count, experts.hidden)
        route = dense_route(dense_TE)
        require(route.experts == experts.count,
                f"dense routing weights of shape {dense_TE.shape}; expected [T, {experts.count}]")
        _check_tail(out_shape, scores_shape, scores_axes, sum_axes, dense_ET, block_out, experts.count,
                    experts.hidden, context.nodes)
        return _Block(tokens_TH, route, experts, None if out_shape is None else shape_dims(out_shape)[1:])

    def emit(self, op, block: _Block) -> ir.Value:
        weights = {name: weight_value(op, w.weight, f"{w.weight.source.name}.{w.role}", w.per_expert, w.shape)
                   for name, w in block.experts.weights.items()}
        out_TH = emit_moe(op, block.tokens_TH, block.route.weights, block.route.indices, **weights,
                          **block.experts.attributes)
        if block.out_dims is None:
            return out_TH
        return op.Reshape(out_TH, _shape_value(op, block.out_dims))


# ----------------------------------------------------------------------------- GPT-OSS

def _gate_up_weight(value: ir.Value) -> Weight:
    """The constant [E, H, 2I] gate_up weight behind ``value``."""
    w = weight(value)
    require(w is not None and len(w.shape) == 3 and w.shape[2] % 2 == 0,
            f"gate_up weight {w.shape if w else '(not a constant)'} is not a constant [E, H, 2I]")
    return w


class TiledGptOssFusion(_TiledFusion):
    """GPT-OSS tiled experts (transformers 4.57 accelerator branch) -> MOE GEMM2_BIAS_SWIGLU_CLAMP::

        gate_up_ETN = Add(MatMul(tokens_ETH, gate_up_EHN), gate_up_bias [E, 1, N])
        gate = Clip(Slice(gate_up_ETN, parity::2), max=limit)
        up   = Clip(Slice(gate_up_ETN, 1-parity::2), -limit, limit)
        act  = (up + 1) * gate * Sigmoid(gate * alpha)      (either association; alpha may be absent)
        out_ETH = Add(MatMul(act, down_EIH), down_bias [E, 1, H])
    """

    def pattern(self, op, tokens_TH, expand_shape, repeats, tokens_shape, gate_up_EHN, gate_up_bias, down_EIH,
                down_bias, dense_TE, out_shape, scores_shape, scores_axes, sum_axes):
        tokens_ETH = _tiled_tokens(op, tokens_TH, expand_shape, repeats, tokens_shape)
        gate_up_ETN = op.Add(op.MatMul(tokens_ETH, gate_up_EHN), gate_up_bias)
        out_ETH = op.Add(op.MatMul(clamped_swiglu(op, gate_up_ETN), down_EIH), down_bias)
        return _weighted_sum(op, out_ETH, dense_TE, out_shape, scores_shape, scores_axes, sum_axes)

    def _experts(self, gate_up_EHN, gate_up_bias, down_EIH, down_bias, act, **_) -> _Experts:
        gate_up = _gate_up_weight(gate_up_EHN)
        experts, hidden, n = gate_up.shape
        inter = n // 2
        down = weight(down_EIH)
        require(down is not None and down.shape == (experts, inter, hidden),
                f"down weight {down.shape if down else '(not a constant)'} does not fit gate_up weight "
                f"{gate_up.shape}: expected [E, I, H] = [{experts}, {inter}, {hidden}]")
        biases = {}
        for name, value, size in (("gate_up", gate_up_bias, n), ("down", down_bias, hidden)):
            bias = weight(value)
            require(bias is not None and bias.shape == (experts, 1, size),
                    f"{name} bias {bias.shape if bias else '(not a constant)'} is not [{experts}, 1, {size}]")
            biases[name] = _Offline(f"{name}_bias", bias, lambda a, s=size: a.reshape(s), (experts, size))
        activation = read_clamped_swiglu(act, n)
        return _Experts(experts, hidden,
                        dict(weight_0=_Offline("gate_up", gate_up), bias_0=biases["gate_up"],
                             weight_1=_Offline("down", down), bias_1=biases["down"]),
                        dict(expert_type=GEMM2_BIAS_SWIGLU_CLAMP, expert_alpha=activation.alpha,
                             expert_beta=activation.limit, gate_parity=activation.gate_parity))


# ----------------------------------------------------------------------------- SwiGLU

def _gemm3(gate: tuple[Weight, Callable], up: tuple[Weight, Callable], sizes: tuple[int, int, int], down_EIH,
           alpha: float) -> _Experts:
    """GEMM3_SWIGLU from gate/up weights (each with its per-expert transform to [I, H]) of sizes (E, H, I)."""
    experts, hidden, inter = sizes
    down = weight(down_EIH)
    require(down is not None and down.shape == (experts, inter, hidden),
            f"down weight {down.shape if down else '(not a constant)'} does not fit gate and up: "
            f"expected [E, I, H] = [{experts}, {inter}, {hidden}]")
    shape_EIH = (experts, inter, hidden)
    return _Experts(experts, hidden,
                    dict(weight_0=_Offline("gate", *gate, shape_EIH), weight_1=_Offline("up", *up, shape_EIH),
                         weight_2=_Offline("down", down, np.transpose, (experts, hidden, inter))),
                    dict(expert_type=GEMM3_SWIGLU, expert_alpha=alpha))


class TiledSwigluFusion(_TiledFusion):
    """Tiled SwiGLU experts with one gate_up weight split in halves -> MOE GEMM3_SWIGLU::

        first_ETI, second_ETI = Split(MatMul(tokens_ETH, gate_up_EHN), 2, axis=-1)
        out_ETH = MatMul(gate * Sigmoid(gate (* alpha)) * up, down_EIH)   (gate: either half, usually the first)
    """

    def pattern(self, op, tokens_TH, expand_shape, repeats, tokens_shape, gate_up_EHN, down_EIH, dense_TE,
                out_shape, scores_shape, scores_axes, sum_axes):
        tokens_ETH = _tiled_tokens(op, tokens_TH, expand_shape, repeats, tokens_shape)
        first_ETI, second_ETI = op.Split(op.MatMul(tokens_ETH, gate_up_EHN), _allow_other_inputs=True,
                                         _outputs=["first_ETI", "second_ETI"])
        out_ETH = op.MatMul(swiglu(op, first_ETI, second_ETI), down_EIH)
        return _weighted_sum(op, out_ETH, dense_TE, out_shape, scores_shape, scores_axes, sum_axes)

    def _experts(self, gate_up_EHN, first_ETI, down_EIH, act, **_) -> _Experts:
        gate_up = _gate_up_weight(gate_up_EHN)
        experts, hidden, n = gate_up.shape
        inter = n // 2
        split = first_ETI.producer()
        given_sizes = len(split.inputs) > 1 and split.inputs[1] is not None
        sizes = constant_ints(split.inputs[1]) if given_sizes else [inter, inter]  # num_outputs=2: halves
        axis = split.attributes.get_int("axis", 0)
        require(axis in (2, -1) and len(split.outputs) == 2 and sizes == [inter, inter],
                f"Split of gate_up: axis={axis}, {len(split.outputs)} outputs, sizes {sizes}; "
                f"expected axis -1 into halves [{inter}, {inter}]")
        activation = read_swiglu(act)
        halves = (slice(0, inter), slice(inter, n))
        gate_cols, up_cols = halves if activation.gate is first_ETI else halves[::-1]
        return _gemm3((gate_up, lambda a: a[:, gate_cols].T), (gate_up, lambda a: a[:, up_cols].T),
                      (experts, hidden, inter), down_EIH, activation.alpha)


class TiledSwigluSeparateFusion(_TiledFusion):
    """Tiled SwiGLU experts with separate gate and up weights -> MOE GEMM3_SWIGLU::

        gate_ETI = MatMul(tokens_ETH, gate_EHI); up_ETI = MatMul(tokens_ETH, up_EHI)
        out_ETH = MatMul(gate * Sigmoid(gate (* alpha)) * up, down_EIH)
    """

    def pattern(self, op, tokens_TH, expand_shape, repeats, tokens_shape, first_EHI, second_EHI, down_EIH,
                dense_TE, out_shape, scores_shape, scores_axes, sum_axes):
        tokens_ETH = _tiled_tokens(op, tokens_TH, expand_shape, repeats, tokens_shape)
        first_ETI, second_ETI = op.MatMul(tokens_ETH, first_EHI), op.MatMul(tokens_ETH, second_EHI)
        out_ETH = op.MatMul(swiglu(op, first_ETI, second_ETI), down_EIH)
        return _weighted_sum(op, out_ETH, dense_TE, out_shape, scores_shape, scores_axes, sum_axes)

    def _experts(self, down_EIH, act, **_) -> _Experts:
        activation = read_swiglu(act)  # which MatMul is the gate follows from the dataflow
        gate, up = (weight(half.producer().inputs[1]) for half in (activation.gate, activation.up))
        require(gate is not None and up is not None and len(gate.shape) == 3 and gate.shape == up.shape,
                f"gate and up weights {gate.shape if gate else '(not a constant)'} and "
                f"{up.shape if up else '(not a constant)'} are not two constant [E, H, I]")
        return _gemm3((gate, np.transpose), (up, np.transpose), gate.shape, down_EIH, activation.alpha)


FUSIONS: list[type[MoeFusion]] = [TiledGptOssFusion, TiledSwigluFusion, TiledSwigluSeparateFusion]
