"""MOE: the fused experts block (router outside, top-k weights and indices in).

Meaning (docs/ops/MOE.md): ``y[t] = sum_j routing_weights[t, j] * expert_{idx[t, j]}(x[t])``,
computing only the selected experts.
"""

from __future__ import annotations

import math

import numpy as np

from . import signatures
from ._common import (
    ArrayView,
    DimBinder,
    MoeOpError,
    NodeView,
    OpDef,
    TensorInfo,
    as_rows,
    check_choice,
    check_float_attr,
    compute_dtype,
    dim_product,
)

GEMM2_BIAS_SWIGLU_CLAMP = "GEMM2_BIAS_SWIGLU_CLAMP"
GEMM3_SWIGLU = "GEMM3_SWIGLU"
GEMM2_ACT = "GEMM2_ACT"
EXPERT_TYPES = (GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU, GEMM2_ACT)

# input positions
HIDDEN, ROUTING, INDICES, W0, B0, W1, B1, W2 = range(8)

# Expected weight shapes per expert type: input -> symbols of its dims.
_WEIGHT_SHAPES = {
    GEMM2_BIAS_SWIGLU_CLAMP: {W0: ("E", "H", "2I"), B0: ("E", "2I"), W1: ("E", "I", "H"), B1: ("E", "H")},
    GEMM3_SWIGLU: {W0: ("E", "I", "H"), W1: ("E", "I", "H"), W2: ("E", "H", "I")},
    GEMM2_ACT: {W0: ("E", "I", "H"), B0: ("E", "I"), W1: ("E", "H", "I"), B1: ("E", "H")},
}
_REQUIRED = {GEMM2_BIAS_SWIGLU_CLAMP: (W0, W1), GEMM3_SWIGLU: (W0, W1, W2), GEMM2_ACT: (W0, W1)}


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


# GEMM2_ACT's activations, by the name of the `activation` attribute (NaN propagates through each).
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
    expert_type = check_choice(v, "expert_type", EXPERT_TYPES)
    check_float_attr(v, "expert_alpha")
    if expert_type == GEMM2_BIAS_SWIGLU_CLAMP:
        check_float_attr(v, "expert_beta", positive=True, allow_inf=True)
    check_choice(v, "gate_parity", (0, 1))
    _check_activation(v, expert_type)

    elem = v.expect_elem(HIDDEN)
    for i in (ROUTING, W0, B0, W1, B1, W2):
        if v.has(i):
            v.expect_elem(i)
            v.expect_same_elem(i, HIDDEN)
    v.expect_elem(INDICES)

    dims = DimBinder(v)
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

    layout = _WEIGHT_SHAPES[expert_type]
    for i in _REQUIRED[expert_type]:
        v.require(i)
    for i in (B0, W1, B1, W2):
        if v.has(i) and i not in layout:
            v.fail(v.input_name(i), f"is given, but {expert_type} does not use it; leave it empty")
    for i, symbols in layout.items():
        if v.has(i):
            dims.shape(i, symbols, v.expect_rank(i, rank=len(symbols)))

    return [TensorInfo(elem, hidden)]


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
    check_choice(v, "activation", tuple(ACTIVATIONS))
    for name in _SWIGLU_ONLY:
        value, spec = v.attr(name), v.op.attr_spec(name)
        if spec.kind == "float":
            value = float(np.float32(value))  # as a node stores it, and as the kernels see it
        default = spec.default
        if value != default:
            v.fail(f"attribute '{name}'", f"is {value!r}; {GEMM2_ACT} does not use it: leave the default {default!r}")


def _check_indices(idx: np.ndarray, num_experts: int, where: str) -> None:
    bad = (idx < 0) | (idx >= num_experts)
    if bad.any():
        pos = tuple(int(p) for p in np.argwhere(bad)[0])
        raise MoeOpError(f"{where}: router_topk_output_indices{list(pos)} = {int(idx[pos])} is outside "
                         f"[0, {num_experts}) (num_experts from weight_0)")


def moe(hidden_states, routing_weights, router_topk_output_indices, weight_0, bias_0=None, weight_1=None,
        bias_1=None, weight_2=None, *, expert_type=None, expert_alpha=None, expert_beta=None, gate_parity=None,
        activation=None, _node_name="", _named_outputs=None):
    """numpy reference of MOE; returns ``(y,)`` with the shape and dtype of ``hidden_states``.

    Raises MoeOpError for any input or attribute outside the contract.
    """
    attrs = dict(expert_type=expert_type, expert_alpha=expert_alpha, expert_beta=expert_beta,
                 gate_parity=gate_parity, activation=activation)
    arrays = [hidden_states, routing_weights, router_topk_output_indices, weight_0, bias_0, weight_1, bias_1, weight_2]
    view = ArrayView(MOE, arrays, attrs, node_name=_node_name, named_outputs=_named_outputs)
    MOE.validate(view)
    expert_type, alpha = view.attr("expert_type"), float(view.attr("expert_alpha"))
    beta, parity = float(view.attr("expert_beta")), int(view.attr("gate_parity"))

    dtype = hidden_states.dtype
    acc = compute_dtype(dtype)
    hidden = hidden_states.shape[-1]
    x = as_rows(hidden_states).astype(acc)
    tokens, k = x.shape[0], router_topk_output_indices.shape[-1]
    idx = router_topk_output_indices.reshape(tokens, k).astype(np.int64)
    weights = routing_weights.reshape(tokens, k).astype(acc)
    _check_indices(router_topk_output_indices, weight_0.shape[0], view.where())

    out = np.zeros((tokens, hidden), dtype=acc)
    slots = idx.reshape(-1)
    order = np.argsort(slots, kind="stable")
    bounds = np.searchsorted(slots[order], np.arange(weight_0.shape[0] + 1))
    for e in range(weight_0.shape[0]):
        chosen = order[bounds[e]:bounds[e + 1]]
        if chosen.size == 0:
            continue
        rows = chosen // k
        xe = x[rows]
        if expert_type == GEMM2_BIAS_SWIGLU_CLAMP:
            gu = xe @ weight_0[e].astype(acc)
            if bias_0 is not None:
                gu = gu + bias_0[e].astype(acc)
            gate, up = gu[:, parity::2], gu[:, 1 - parity::2]
            gate = np.minimum(gate, beta)
            up = np.clip(up, -beta, beta)
            act = (up + 1.0) * gate * sigmoid(alpha * gate)
            ye = act @ weight_1[e].astype(acc)
            if bias_1 is not None:
                ye = ye + bias_1[e].astype(acc)
        elif expert_type == GEMM2_ACT:
            up = xe @ weight_0[e].astype(acc).T
            if bias_0 is not None:
                up = up + bias_0[e].astype(acc)
            ye = ACTIVATIONS[view.attr("activation")](up) @ weight_1[e].astype(acc).T
            if bias_1 is not None:
                ye = ye + bias_1[e].astype(acc)
        else:
            gate = xe @ weight_0[e].astype(acc).T
            up = xe @ weight_1[e].astype(acc).T
            ye = (gate * sigmoid(alpha * gate) * up) @ weight_2[e].astype(acc).T
        np.add.at(out, rows, ye * weights.reshape(-1)[chosen][:, None])
    return (out.astype(dtype).reshape(hidden_states.shape),)


MOE = OpDef.of(signatures.MOE, validate=_validate, reference=moe)
