"""The expert activations MOE computes, matched and checked once for every export form.

- SwiGLU (GEMM3_SWIGLU): ``swish(gate) * up`` with ``swish(g) = g * Sigmoid(alpha * g)`` (alpha 1: SiLU).
- GPT-OSS's clamped SwiGLU (GEMM2_BIAS_SWIGLU_CLAMP): gate and up are the interleaved columns of one
  projection (the gate's start is ``gate_parity``), ``gate = Clip(gate, max=limit)``,
  ``up = Clip(up, -limit, limit)``, then ``(up + 1) * swish(gate)``.
- A pointwise activation of one projection (GEMM2_ACT, non-gated experts): relu, relu², GELU (erf or
  tanh), SiLU or none. :func:`read_pointwise` tells which by evaluating the matched elementwise
  subgraph on probe points against moe.py's ACTIVATIONS, so any association or expansion an exporter
  writes is read the same way.

Two front ends with one meaning. The pattern fragments (:func:`swiglu`, :func:`clamped_swiglu`)
tell the onnxscript-matched forms (tiled, batched_mm) which nodes their rule replaces; each
names its output ``act``. The readers (:func:`read_swiglu`, :func:`read_clamped_swiglu`) take the
activation's output value, walk its graph (products in any order and association) and are the one
place the constants are checked: alpha finite, the clamp bound > 0 (or inf: no clamp) with the up
clamp symmetric, the +1; they raise MatchFailure naming the constant. The loop form, matched by
hand, uses the readers alone. Checked values always satisfy MOE's own attribute validation
(moe_onnx/ops/moe.py), so a fused MOE passes ``moe-onnx check``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from .._ir.nodes import standard
from ..ops.moe import ACTIVATIONS
from ._match import MatchFailure, constant, constant_ints, constant_scalar, constant_text, require

# ----------------------------------------------------------------------------- pattern fragments


def swish(op, gate):
    """``gate * Sigmoid(gate * alpha)`` or ``gate * Sigmoid(gate)``; binds ``alpha`` (None when absent)."""
    return op.Mul(gate, op.Sigmoid(pattern.OrValue([op.Mul(gate, pattern.Var("alpha")), gate])))


def swiglu(op, a, b):
    """``swish(a) * b`` or ``swish(b) * a``, output named ``act`` (:func:`read_swiglu` says which is the gate)."""
    return pattern.OrValue([op.Mul(swish(op, a), b), op.Mul(swish(op, b), a)], name="act")


def clamped_swiglu(op, gate_up):
    """GPT-OSS's activation of ``gate_up``: Slice and Clip each half (the gate's upper clamp may be a
    ``Min(gate, limit)``, as the float16/bfloat16 exports write it), ``(up + 1) * gate * Sigmoid(...)``
    in either association; output named ``act``."""
    gate_half = op.Slice(gate_up, _allow_other_inputs=True)
    gate = pattern.OrValue([op.Clip(gate_half, _allow_other_inputs=True), op.Min(gate_half, pattern.Var("gate_max"))])
    up = op.Clip(op.Slice(gate_up, _allow_other_inputs=True), _allow_other_inputs=True)
    up_plus_one = op.Add(up, pattern.Var("one"))
    sigmoid = op.Sigmoid(pattern.OrValue([op.Mul(gate, pattern.Var("alpha")), gate]))
    return pattern.OrValue([op.Mul(op.Mul(up_plus_one, gate), sigmoid), op.Mul(up_plus_one, op.Mul(gate, sigmoid))],
                           name="act")


def pointwise(op, z):
    """A pointwise activation of ``z`` in the forms exporters write (relu; relu² as Pow or Mul; SiLU;
    Gelu; GELU erf and the two tanh expansions of torch's exporter; or ``z`` itself), output named
    ``act``; last, any other one or two ops with ``z`` first, so that an activation MOE lacks is a
    near-miss with its reason. The constants are left free: :func:`read_pointwise` checks what the
    subgraph computes."""

    def free(name):
        return pattern.Var(f"pointwise_{name}")

    def any_op(x):
        return op.submodule("")(x, _allow_other_inputs=True)  # a standard op of any type, x its first input

    relu = op.Relu(z)
    erf_cdf = op.Mul(free("erf_half"), op.Add(op.Erf(op.Div(z, free("erf_sqrt2"))), free("erf_one")))
    tanh_cdf = op.Mul(free("tanh_half"), op.Add(op.Tanh(op.Mul(free("tanh_scale"), op.Add(
        z, op.Mul(free("tanh_cubic"), op.Pow(z, free("tanh_three")))))), free("tanh_one")))
    new_tanh = op.Add(op.Tanh(op.Mul(op.Add(z, op.Mul(op.Pow(z, free("new_three")), free("new_cubic"))),
                                     free("new_scale"))), free("new_one"))
    return pattern.OrValue([
        relu, op.Pow(relu, free("exponent")), op.Mul(relu, relu),
        op.Mul(z, op.Sigmoid(z)), op.Mul(op.Sigmoid(z), z),
        op.Gelu(z, _allow_other_attributes=True),
        op.Mul(z, erf_cdf), op.Mul(z, tanh_cdf), op.Mul(op.Mul(z, free("new_half")), new_tanh),
        z,
        any_op(z), any_op(any_op(z)),
    ], name="act")


# ----------------------------------------------------------------------------- readers

@dataclasses.dataclass(frozen=True)
class Swiglu:
    """``swish(gate) * up``: the two projections' outputs and the swish alpha."""

    gate: ir.Value
    up: ir.Value
    alpha: float


@dataclasses.dataclass(frozen=True)
class ClampedSwiglu:
    """GPT-OSS's activation: the gate's columns (``gate_parity``::2), the clamp bound, the swish alpha, and
    the projection whose columns gate and up are."""

    gate_parity: int
    limit: float
    alpha: float
    gate_up: ir.Value


def _close(a: float, b: float) -> bool:
    """The one tolerance of every constant compared here: equal, or within 1e-6 (relative above 1)."""
    return a == b or abs(a - b) <= 1e-6 * max(1.0, abs(b))


def swish_alpha(value: ir.Value) -> float:
    """The scalar ``alpha`` of ``Sigmoid(alpha * g)``: a finite constant (MOE's expert_alpha)."""
    alpha = constant_scalar(value)
    require(alpha is not None and math.isfinite(alpha),
            f"the swish alpha (the Mul before Sigmoid) is {constant_text(value)}; expected a finite scalar constant")
    return alpha


def _factors(value: ir.Value) -> list[ir.Value]:
    """The factors of a product of Muls (``value`` itself when it is no Mul)."""
    node = value.producer()
    if not standard(node, "Mul") or len(node.inputs) != 2:
        return [value]
    return _factors(node.inputs[0]) + _factors(node.inputs[1])


def _swish_in(factors: list[ir.Value]) -> tuple[ir.Value, float, list[ir.Value]] | None:
    """``(g, alpha, other factors)`` when the factors hold ``g`` and ``Sigmoid(alpha * g)``."""
    for s, sigmoid in enumerate(factors):
        node = sigmoid.producer()
        if not standard(node, "Sigmoid"):
            continue
        z = node.inputs[0]
        scale = z.producer()
        for g, gate in enumerate(factors):
            if g == s:
                continue
            others = [f for i, f in enumerate(factors) if i not in (s, g)]
            if z is gate:
                return gate, 1.0, others
            if standard(scale, "Mul") and gate in scale.inputs:
                return gate, swish_alpha(scale.inputs[1] if scale.inputs[0] is gate else scale.inputs[0]), others
    return None


def _gated(act: ir.Value, form: str) -> tuple[ir.Value, float, ir.Value]:
    """``(g, alpha, u)`` of ``act = g * Sigmoid(alpha * g) * u`` (any order and association)."""
    factors = _factors(act)
    found = _swish_in(factors) if len(factors) == 3 else None
    if found is None:
        ops = ", ".join("(input)" if f.producer() is None else f.producer().op_type for f in factors)
        raise MatchFailure(f"the activation is not {form} with swish(g) = g * Sigmoid(alpha * g): "
                           f"its factors are {ops}")
    gate, alpha, (other,) = found
    return gate, alpha, other


def read_swiglu(act: ir.Value) -> Swiglu:
    """``act = swish(gate) * up``: which factor is the gate follows from the dataflow."""
    gate, alpha, up = _gated(act, "swish(gate) * up")
    return Swiglu(gate, up, alpha)


def _clip_bounds(clip: ir.Node, role: str) -> tuple[float, float]:
    """[min, max] of a Clip (-inf and inf where absent), or of ``Min(x, max)`` (-inf, max)."""
    bounds = []
    limits = [None, clip.inputs[1]] if clip.op_type == "Min" else (list(clip.inputs) + [None, None])[1:3]
    for value, absent, which in zip(limits, (-math.inf, math.inf), ("min", "max")):
        bound = absent if value is None else constant_scalar(value)
        require(bound is not None, f"the {role} clamp {which} is {constant_text(value)}; expected a scalar constant")
        bounds.append(bound)
    return bounds[0], bounds[1]


def _clamp_limit(gate_clip: ir.Node, up_clip: ir.Node) -> float:
    """The clamp bound: the gate is clamped to [-inf, limit], up to [-limit, limit]; limit > 0 or inf."""
    (gate_min, limit), (up_min, up_max) = _clip_bounds(gate_clip, "gate"), _clip_bounds(up_clip, "up")
    require(gate_min == -math.inf, f"gate Clip bounds [{gate_min}, {limit}]: the gate clamp has a lower bound; "
            "MOE clamps the gate from above only")
    require(limit > 0, f"gate Clip bounds [{gate_min}, {limit}]: the gate clamp bound is {limit}, must be > 0")
    require(_close(up_min, -limit) and _close(up_max, limit),
            f"up Clip bounds: up is clamped to [{up_min}, {up_max}], expected [-{limit}, {limit}] (the gate's bound)")
    return limit


def _interleaved_start(half: ir.Node, width: int, role: str) -> int:
    """0 or 1: the start of a Slice taking every other column [start::2] of the last axis (``width`` columns)."""
    starts, ends, axes, steps = (constant_ints(v) for v in (list(half.inputs) + [None] * 5)[1:5])
    data = half.inputs[0].shape
    last_axes = ([-1],) if data is None else ([-1], [len(data) - 1])
    every_other = (starts in ([0], [1]) and steps == [2] and axes in last_axes and ends is not None
                   and len(ends) == 1 and len(range(starts[0], min(ends[0], width), 2)) == width // 2)
    require(every_other, f"the {role} Slice starts={starts} ends={ends} axes={axes} steps={steps}; expected "
            f"[0] or [1], past the last of the {width} columns, the last axis, [2] (every other column)")
    return starts[0]


def read_clamped_swiglu(act: ir.Value, width: int) -> ClampedSwiglu:
    """``act = (Clip(up, -limit, limit) + 1) * swish(Clip(gate, max=limit))`` (or ``Min(gate, limit)``), gate
    and up interleaved Slices of one projection of ``width`` = 2I columns."""
    gate, alpha, up_plus_one = _gated(act, "(up + 1) * swish(gate)")
    add = up_plus_one.producer()
    gate_clip = gate.producer()
    require(standard(add, "Add") and (standard(gate_clip, "Clip") or standard(gate_clip, "Min")),
            "the activation is not (up + 1) * swish(gate) with a clamped gate")
    up, one = add.inputs if standard(add.inputs[0].producer(), "Clip") else reversed(add.inputs)
    up_clip = up.producer()
    require(standard(up_clip, "Clip"), "up (the factor with the + 1) is not clamped")
    offset = constant_scalar(one)
    require(offset is not None and _close(offset, 1.0),
            f"up is offset by {constant_text(one)} (the constant added to up), expected +1")
    gate_slice, up_slice = gate_clip.inputs[0].producer(), up_clip.inputs[0].producer()
    require(standard(gate_slice, "Slice") and standard(up_slice, "Slice")
            and gate_slice.inputs[0] is up_slice.inputs[0], "gate and up are not Slices of one projection")
    gate_start, up_start = _interleaved_start(gate_slice, width, "gate"), _interleaved_start(up_slice, width, "up")
    require(gate_start != up_start, f"the gate and up Slices start at [{gate_start}] and [{up_start}]: both start "
            f"at {gate_start}; expected one at 0 and one at 1 (interleaved)")
    return ClampedSwiglu(gate_start, _clamp_limit(gate_clip, up_clip), alpha, gate_slice.inputs[0])


# elementwise ops a pointwise activation may be built of, as numpy on float64
_ELEMENTWISE = {
    "Relu": lambda x: np.maximum(x, 0.0),
    "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "Tanh": np.tanh,
    "Erf": np.vectorize(math.erf, otypes=[np.float64]),
    "Neg": np.negative,
    "Mul": np.multiply,
    "Add": np.add,
    "Sub": np.subtract,
    "Div": np.divide,
    "Pow": np.power,
}
# Where an activation is compared with each of ACTIVATIONS: both sides of its kinks and its
# saturation, and far out.
_PROBES = np.concatenate([np.linspace(-8.0, 8.0, 129), [-1e3, -40.0, -20.0, 20.0, 40.0, 1e3]])


def _evaluate(value: ir.Value, z: ir.Value, at: np.ndarray) -> np.ndarray:
    """``value`` as a function of ``z`` (= ``at``): an elementwise subgraph of z and scalar constants."""
    if value is z:
        return at
    scalar = constant(value)
    if scalar is not None:
        require(scalar.size == 1, f"the activation uses a constant of shape {list(scalar.shape)}; expected scalars")
        return np.full_like(at, float(scalar.reshape(-1)[0]))
    node = value.producer()
    if standard(node, "Gelu"):
        approximate = node.attributes.get_string("approximate", "none")
        return ACTIVATIONS["gelu_tanh" if approximate == "tanh" else "gelu"](_evaluate(node.inputs[0], z, at))
    require(node is not None and node.domain in ("", "ai.onnx") and node.op_type in _ELEMENTWISE,
            f"the activation uses {'an input' if node is None else node.op_type}; expected a pointwise function "
            f"of the up projection ({', '.join(_ELEMENTWISE)}, Gelu and scalar constants)")
    with np.errstate(all="ignore"):
        return _ELEMENTWISE[node.op_type](*(_evaluate(x, z, at) for x in node.inputs))


def read_pointwise(act: ir.Value, z: ir.Value) -> str:
    """The name (moe.py's ACTIVATIONS) of the pointwise function ``act`` computes of ``z``: the one it
    equals on every probe point (float64, relative 1e-5: float32 constants pass, GELU erf and tanh
    differ by 1e-4 and more)."""
    got = _evaluate(act, z, _PROBES)
    for name, function in ACTIVATIONS.items():
        if np.allclose(got, function(_PROBES), rtol=1e-5, atol=1e-6, equal_nan=True):
            return name
    at = [-2.0, -0.5, 0.5, 2.0]
    shown = ", ".join(f"f({x}) = {float(_evaluate(act, z, np.array([x]))[0]):.6g}" for x in at)
    raise MatchFailure(f"the activation of the up projection is none of {', '.join(ACTIVATIONS)} ({shown})")
