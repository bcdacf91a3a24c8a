"""MOE: the fused experts block (router outside, top-k weights and indices in).

Meaning (docs/ops/MOE.md): ``y[t] = sum_j routing_weights[t, j] * expert_{idx[t, j]}(x[t])``,
computing only the selected experts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from onnx import TensorProto

from . import _expert_math, signatures
from ._body import INT64_MAX, Config, float32, ints, scalar, take_rows, to_rows
from ._common import (
    FLOAT_ACCURACY_LEVELS,
    ArrayView,
    DimBinder,
    MoeOpError,
    NodeView,
    OpDef,
    TensorInfo,
    as_rows,
    check_choice,
    check_float_attr,
    check_group_attrs,
    compute_dtype,
    dim_product,
    drop_group_attrs,
    refuse_without_group,
)
from .layout import Layout

# The expert types, as the signature declares them.
EXPERT_TYPES = signatures.MOE.attr_spec("expert_type").choices
GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU, GEMM2_ACT = EXPERT_TYPES

# input positions
HIDDEN, ROUTING, INDICES, W0, B0, W1, B1, W2 = range(8)

# The linears of each expert type, in the order they run: (weight input, bias input or None, N, K), N the
# symbol of the output width and K of the input width. MOE stores GEMM2's weights as GPT-OSS does,
# [E, K, N] (x @ W); the other types in nn.Linear's [E, N, K] (x @ W^T). QMOE stores every weight as [E, N, K].
LINEARS = {
    GEMM2_BIAS_SWIGLU_CLAMP: ((W0, B0, "2I", "H"), (W1, B1, "H", "I")),
    GEMM3_SWIGLU: ((W0, None, "I", "H"), (W1, None, "I", "H"), (W2, None, "H", "I")),
    GEMM2_ACT: ((W0, B0, "I", "H"), (W1, B1, "H", "I")),
}
# The expert inputs some expert type does not use (each must be absent where its type does not use it).
_OPTIONAL_EXPERT_INPUTS = (B0, W1, B1, W2)


def sigmoid(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-z))


def _relu(z: np.ndarray) -> np.ndarray:
    return np.where(z > 0, z, np.where(np.isnan(z), z, 0.0))


def _gelu(z: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf, otypes=[z.dtype])
    return 0.5 * z * (1.0 + erf(z / math.sqrt(2.0))) if z.size else z


def _gelu_tanh(z: np.ndarray) -> np.ndarray:
    return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))


# GEMM2_ACT's activations, by the name of the `activation` attribute (its declared choices, in their order;
# NaN propagates through each).
ACTIVATIONS = {
    "relu": _relu,
    "relu2": lambda z: _relu(z) ** 2,
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": lambda z: z * sigmoid(z),
    "identity": lambda z: z,
}
# The attributes of the SwiGLU types; GEMM2_ACT requires their defaults.
_SWIGLU_ONLY = ("expert_alpha", "expert_beta", "gate_parity")


def _validate(v: NodeView) -> list[TensorInfo | None]:
    expert_type = validate_expert_attrs(v)
    check_group_attrs(v, "tp_world_size", "tp_rank_id")
    check_choice(v, "accuracy_level", FLOAT_ACCURACY_LEVELS)
    dims = DimBinder(v)
    elem, hidden = validate_tokens(v, dims, float_inputs=(ROUTING, W0, B0, W1, B1, W2))
    check_expert_inputs(v, expert_type)
    for weight, bias, n, k in LINEARS[expert_type]:
        if v.has(weight):
            symbols = ("E", k, n) if expert_type == GEMM2_BIAS_SWIGLU_CLAMP else ("E", n, k)
            dims.shape(weight, symbols, v.expect_rank(weight, rank=3))
        if bias is not None and v.has(bias):
            dims.shape(bias, ("E", n), v.expect_rank(bias, rank=2))
    return [TensorInfo(elem, hidden)]


def validate_expert_attrs(v: NodeView) -> str:
    """The attributes MOE and QMOE share (expert type, SwiGLU, activation); returns the expert type."""
    expert_type = check_choice(v, "expert_type")
    check_float_attr(v, "expert_alpha")
    if expert_type == GEMM2_BIAS_SWIGLU_CLAMP:
        check_float_attr(v, "expert_beta", positive=True, allow_inf=True)
    check_choice(v, "gate_parity", (0, 1))
    _check_activation(v, expert_type)
    return expert_type


def validate_tokens(v: NodeView, dims: DimBinder, float_inputs: tuple[int, ...]) -> tuple[int, tuple | None]:
    """Types of the tokens, the routing and ``float_inputs`` (those given must have hidden_states' type),
    and the token dims H, T and k; returns hidden_states' element type and shape."""
    elem = v.expect_elem(HIDDEN)
    for i in float_inputs:
        if v.has(i):
            v.expect_elem(i)
            v.expect_same_elem(i, HIDDEN)
    v.expect_elem(INDICES)

    hidden = v.expect_rank(HIDDEN, min_rank=2)
    if hidden is not None:
        dims.bind("H", hidden[-1], "input 'hidden_states' dim -1")
        dims.bind("T", dim_product(hidden[:-1]), "input 'hidden_states' leading dims (product)")
    for i in (ROUTING, INDICES):
        shape = v.expect_rank(i, min_rank=1)
        if shape is not None:
            name = v.op.inputs[i].name
            dims.bind("k", shape[-1], f"input '{name}' dim -1")
            dims.bind("T", dim_product(shape[:-1]), f"input '{name}' leading dims (product)")
    return elem, hidden


def check_expert_inputs(v: NodeView, expert_type: str, required_with: dict[int, int] | None = None,
                        optional_with: dict[int, int] | None = None) -> None:
    """The weights and biases of ``expert_type`` (LINEARS) are given where required, the others absent.
    ``required_with`` and ``optional_with`` map each weight input to an input of the op's own that goes with
    it (QMOE's scales, zero points): required or allowed with a weight the type uses, absent otherwise."""
    required_with, optional_with = required_with or {}, optional_with or {}
    linears = LINEARS[expert_type]
    used = {i for weight, bias, _, _ in linears for i in (weight, bias) if i is not None}
    for weight, _, _, _ in linears:
        v.require(weight)
        if weight in required_with:
            v.require(required_with[weight])
        used |= {companions[weight] for companions in (required_with, optional_with) if weight in companions}
    for i in (*_OPTIONAL_EXPERT_INPUTS, *required_with.values(), *optional_with.values()):
        if v.has(i) and i not in used:
            v.fail(v.input_name(i), f"is given, but {expert_type} does not use it; leave it empty")


def _check_activation(v: NodeView, expert_type: str) -> None:
    """GEMM2_ACT names its activation and leaves the SwiGLU attributes at their defaults; the SwiGLU
    types name none."""
    activation = v.attr("activation")
    if expert_type != GEMM2_ACT:
        if activation:
            v.fail("attribute 'activation'", f"is {activation!r}; {expert_type} does not use it (its activation is "
                   "SwiGLU): leave it empty")
        return
    if not activation:
        v.fail("attribute 'activation'", f"is required for {GEMM2_ACT}")
    check_choice(v, "activation")
    for name in _SWIGLU_ONLY:
        value, spec = v.attr(name), v.op.attr_spec(name)
        if spec.kind == "float":
            value = float(np.float32(value))  # as a node stores it, and as the kernels see it
        default = spec.default
        if value != default:
            v.fail(f"attribute '{name}'", f"is {value!r}; {GEMM2_ACT} does not use it: leave the default {default!r}")


def _check_indices(view: NodeView, idx: np.ndarray, num_experts: int) -> None:
    """Every expert index is in [0, num_experts) (MoeOpError naming the first one outside)."""
    bad = (idx < 0) | (idx >= num_experts)
    if bad.any():
        pos = tuple(int(p) for p in np.argwhere(bad)[0])
        raise MoeOpError(f"{view.where()}: router_topk_output_indices{list(pos)} = {int(idx[pos])} is outside "
                         f"[0, {num_experts}) (num_experts from weight_0)")


def moe(hidden_states, routing_weights, router_topk_output_indices, weight_0, bias_0=None, weight_1=None,
        bias_1=None, weight_2=None, *, expert_type=None, expert_alpha=None, expert_beta=None, gate_parity=None,
        activation=None, tp_world_size=None, tp_rank_id=None, accuracy_level=None, _node_name="",
        _named_outputs=None):
    """numpy reference of MOE on one process; returns ``(y,)`` with the shape and dtype of ``hidden_states``.

    Computes the exact result at every ``accuracy_level`` (3 allows bfloat16 GEMM operands; exact is within
    that). Raises MoeOpError for any input or attribute outside the contract, and for a node of a
    tensor-parallel group of more than one rank (:func:`moe_tensor_parallel` simulates every rank).
    """
    attrs = dict(expert_type=expert_type, expert_alpha=expert_alpha, expert_beta=expert_beta,
                 gate_parity=gate_parity, activation=activation, tp_world_size=tp_world_size, tp_rank_id=tp_rank_id,
                 accuracy_level=accuracy_level)
    arrays = [hidden_states, routing_weights, router_topk_output_indices, weight_0, bias_0, weight_1, bias_1, weight_2]
    view = validated(arrays, attrs, _node_name, _named_outputs)
    refuse_without_group(view, Layout(tp_size=int(view.attr("tp_world_size"))), tp_only=True)
    return (round_like(partial_y(view, arrays), hidden_states),)


def validated(arrays: Sequence[np.ndarray | None], attrs: dict, node_name: str = "",
              named_outputs: Sequence[bool] | None = None) -> ArrayView:
    """One rank's MOE node checked on its arrays (its 8 inputs, None where absent); its view."""
    view = ArrayView(MOE, arrays, attrs, node_name=node_name, named_outputs=named_outputs)
    MOE.validate(view)
    return view


def partial_y(view: NodeView, arrays: Sequence[np.ndarray | None]) -> np.ndarray:
    """This rank's y [T, H] in float32 (the compute type) over the I-slice its weights hold, before rounding:
    y itself with tp_world_size 1. bias_1 counts once over the group: only tp_rank_id 0 adds it."""
    hidden_states, routing_weights, indices, weight_0, bias_0, weight_1, bias_1, _ = arrays
    weights = {W0: weight_0, W1: weight_1, W2: arrays[W2]}
    acc = compute_dtype(hidden_states.dtype)
    if view.attr("expert_type") == GEMM2_BIAS_SWIGLU_CLAMP:  # stored [E, K, N]
        def linear(i, e, a):
            return a @ weights[i][e].astype(acc)
    else:
        def linear(i, e, a):
            return a @ weights[i][e].astype(acc).T
    down_bias = bias_1 if int(view.attr("tp_rank_id")) == 0 else None
    return expert_sum(view, hidden_states, routing_weights, indices, weight_0.shape[0], linear, bias_0, down_bias)


def round_like(y: np.ndarray, hidden_states: np.ndarray) -> np.ndarray:
    """y [T, H] from the compute type to the type and shape of ``hidden_states``, rounded once."""
    return y.astype(hidden_states.dtype).reshape(hidden_states.shape)


def moe_tensor_parallel(rank_inputs: Sequence[Sequence[np.ndarray | None]], **attrs) -> tuple[np.ndarray]:
    """The tensor-parallel meaning of MOE (docs/distributed.md): ``rank_inputs[q]`` are TP rank q's 8 inputs,
    the same tokens and routing on every rank, the weights its I-slice, bias_1 whole. Each rank's partial y
    (float32, bias_1 on rank 0 only) is summed over the ranks (the all-reduce) and rounded once. Returns
    ``(y,)`` like :func:`moe`; raises MoeOpError when a rank's node is invalid or the ranks' routing differs.
    """
    ranks = len(rank_inputs)
    if not ranks:
        raise MoeOpError(f"{MOE.name}: rank_inputs is empty; expected the 8 inputs of every TP rank")
    drop_group_attrs(MOE.name, attrs, ranks, "rank_inputs")
    first = rank_inputs[0]
    total = None
    for q, arrays in enumerate(rank_inputs):
        for i in (HIDDEN, ROUTING, INDICES):
            if not np.array_equal(arrays[i], first[i]):
                raise MoeOpError(f"{MOE.name}: TP rank {q}'s {MOE.inputs[i].name} differs from TP rank 0's; "
                                 "expected the same tokens and routing on every rank")
        view = validated(arrays, {**attrs, "tp_world_size": ranks, "tp_rank_id": q}, f"tp rank {q}")
        partial = partial_y(view, arrays)
        total = partial if total is None else total + partial
    return (round_like(total, first[HIDDEN]),)


def mix_experts(view: NodeView, hidden_states, routing_weights, indices, num_experts: int,
                linear: Callable[[int, int, np.ndarray], np.ndarray], bias_0: np.ndarray | None,
                bias_1: np.ndarray | None) -> np.ndarray:
    """y of MOE and QMOE after validation: :func:`expert_sum` rounded to the type and shape of hidden_states."""
    return round_like(expert_sum(view, hidden_states, routing_weights, indices, num_experts, linear, bias_0, bias_1),
                      hidden_states)


def expert_sum(view: NodeView, hidden_states, routing_weights, indices, num_experts: int,
               linear: Callable[[int, int, np.ndarray], np.ndarray], bias_0: np.ndarray | None,
               bias_1: np.ndarray | None) -> np.ndarray:
    """Each token's selected experts, weighted and summed: [T, H] in the compute type, not rounded.

    ``linear(i, e, a)`` is ``a @ W^T`` for expert ``e`` of weight input ``i`` (W [N, K]), in the compute
    type; ``bias_0`` and ``bias_1`` go with weight_0 and weight_1 (None: absent). Raises MoeOpError for an index
    outside [0, num_experts)."""
    expert_type, alpha = view.attr("expert_type"), float(view.attr("expert_alpha"))
    beta, parity = float(view.attr("expert_beta")), int(view.attr("gate_parity"))

    dtype = hidden_states.dtype
    acc = compute_dtype(dtype)
    hidden = hidden_states.shape[-1]
    x = as_rows(hidden_states).astype(acc)
    tokens, k = x.shape[0], indices.shape[-1]
    idx = indices.reshape(tokens, k).astype(np.int64)
    weights = routing_weights.reshape(tokens, k).astype(acc)
    _check_indices(view, indices, num_experts)

    biases = {W0: bias_0, W1: bias_1}

    def biased(i, e, a):
        y = linear(i, e, a)
        return y if biases[i] is None else y + biases[i][e].astype(acc)

    out = np.zeros((tokens, hidden), dtype=acc)
    slots = idx.reshape(-1)
    order = np.argsort(slots, kind="stable")
    bounds = np.searchsorted(slots[order], np.arange(num_experts + 1))
    for e in range(num_experts):
        chosen = order[bounds[e]:bounds[e + 1]]
        if chosen.size == 0:
            continue
        rows = chosen // k
        xe = x[rows]
        if expert_type == GEMM2_BIAS_SWIGLU_CLAMP:
            gu = biased(W0, e, xe)
            gate, up = gu[:, parity::2], gu[:, 1 - parity::2]
            gate = np.minimum(gate, beta)
            up = np.clip(up, -beta, beta)
            ye = biased(W1, e, (up + 1.0) * gate * sigmoid(alpha * gate))
        elif expert_type == GEMM2_ACT:
            ye = biased(W1, e, ACTIVATIONS[view.attr("activation")](biased(W0, e, xe)))
        else:
            gate = linear(W0, e, xe)
            ye = linear(W2, e, gate * sigmoid(alpha * gate) * linear(W1, e, xe))
        np.add.at(out, rows, ye * weights.reshape(-1)[chosen][:, None])
    return out


# ----------------------------------------------------------------------------- as standard ONNX ops

def expert_layer(op, x, linear: Callable[[int, int | None, Any], Any], attr: Callable[[str], Any],
                 const: Callable[[float], Any]):
    """Every expert on ``x`` as standard ONNX ops, for any op builder ``op``: the one dispatch on the expert
    type of the function bodies (MOE, QMOE) and the grouped chain (``moe_onnx/rewrite/grouped.py``).

    ``linear(weight, bias, a)`` is ``a`` through the linear of weight input ``weight`` and bias input ``bias``
    (None: none; each as :data:`LINEARS` lists them), as the caller computes it; ``attr(name)`` is the node's
    attribute with its default; ``const(v)`` a scalar of the computation's float type. GEMM2's gate and up
    are interleaved along the last axis."""
    expert_type, alpha = attr("expert_type"), float(attr("expert_alpha"))
    layers = [functools.partial(linear, weight, bias) for weight, bias, _, _ in LINEARS[expert_type]]
    if expert_type == GEMM2_BIAS_SWIGLU_CLAMP:
        gate_up_linear, down_linear = layers
        gate_up, parity = gate_up_linear(x), int(attr("gate_parity"))

        def half(start: int):
            return op.Slice(gate_up, ints(op, start), ints(op, INT64_MAX), ints(op, -1), ints(op, 2))

        beta = float(attr("expert_beta"))
        return down_linear(_expert_math.clamped_swiglu(op, half(parity), half(1 - parity), alpha, beta, const))
    if expert_type == GEMM2_ACT:
        up_linear, down_linear = layers
        return down_linear(_expert_math.ACTIVATIONS[attr("activation")](op, up_linear(x), const))
    gate_linear, up_linear, down_linear = layers
    gate, up = gate_linear(x), up_linear(x)
    return down_linear(op.Mul(_expert_math.swish(op, gate, alpha, const), up))


def experts_body(op, c: Config, inputs: dict[str, Any], product: Callable[[str, Any], Any]) -> dict[str, Any]:
    """MOE's and QMOE's function body (:mod:`moe_onnx.ops._body`): each token's k chosen expert outputs,
    weighted and summed. ``product(weight, a)`` is ``a`` ([1, T, K] for every expert, or [E, T, K]; float32)
    times every expert's weight of the input named ``weight``, ``a @ W[e]^T`` for W [E, N, K]: [E, T, N]."""

    def linear(weight: int, bias: int | None, a):
        y = product(MOE.inputs[weight].name, a)
        if bias is None or not c.has(MOE.inputs[bias].name):
            return y
        return op.Add(y, op.Unsqueeze(float32(op, inputs[MOE.inputs[bias].name]), ints(op, 1)))  # [E, 1, N]

    hidden_states, indices = inputs["hidden_states"], inputs["router_topk_output_indices"]
    tokens = to_rows(op, float32(op, hidden_states))  # [T, H]
    tokens_k = op.Concat(op.Shape(tokens, end=1), op.Shape(indices, start=-1), axis=0)
    idx = op.Reshape(op.Cast(indices, to=TensorProto.INT64), tokens_k, allowzero=1)
    routing = op.Reshape(float32(op, inputs["routing_weights"]), tokens_k, allowzero=1)
    every_expert = expert_layer(op, op.Unsqueeze(tokens, ints(op, 0)), linear, c.attr, lambda v: scalar(op, v))
    chosen = take_rows(op, op.Transpose(every_expert, perm=[1, 0, 2]), idx)  # [T, k, H]
    mixed = op.ReduceSum(op.Mul(chosen, op.Unsqueeze(routing, ints(op, -1))), ints(op, 1), keepdims=0)
    y = op.Reshape(mixed, op.Shape(hidden_states), allowzero=1)
    return {"y": op.CastLike(y, hidden_states)}


def _function_body(op, c: Config, inputs: dict[str, Any]) -> dict[str, Any]:
    """Exact at every accuracy_level (not part of the configuration: ``checked_only``)."""
    stored_k_n = c.attr("expert_type") == GEMM2_BIAS_SWIGLU_CLAMP  # GEMM2 stores [E, K, N], the others [E, N, K]

    def product(weight: str, a):
        w = float32(op, inputs[weight])
        return op.MatMul(a, w if stored_k_n else op.Transpose(w, perm=[0, 2, 1]))

    return experts_body(op, c, inputs, product)


MOE = OpDef.of(signatures.MOE, validate=_validate, reference=moe, body=_function_body,
               checked_only=("accuracy_level",))
