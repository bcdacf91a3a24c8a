"""QMOE: MOE with quantized expert weights, in onnxruntime's com.microsoft::QMoE layout.

Meaning (docs/ops/QMOE.md): ``QMOE(...) == MOE(...)`` on the dequantized weights, every weight
``[E, N, K]`` (N outputs, K inputs) with K packed into bytes; with ``accuracy_level`` 4 each linear
takes int8 activations instead (:func:`int8_linear`); level 3 (bfloat16 GEMM operands allowed) is computed
exactly, as 0. :func:`dequantize` and :func:`quantize` are the layout's two directions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import numpy as np
from onnx import TensorProto

from . import signatures
from ._body import Config, abs_max, constant, float32, ints, reshape, scalar
from ._common import (
    BF16_OPERANDS,
    EXACT,
    ArrayView,
    Dim,
    DimBinder,
    NodeView,
    OpDef,
    TensorInfo,
    check_choice,
    elem_name,
    is_known,
)
from .moe import (
    B0,
    B1,
    GEMM2_BIAS_SWIGLU_CLAMP,
    LINEARS,
    ROUTING,
    W0,
    W1,
    W2,
    check_expert_inputs,
    experts_body,
    mix_experts,
    validate_expert_attrs,
    validate_tokens,
)

# input positions past MOE's eight, by the weight they belong to
SCALES = {W0: 8, W1: 9, W2: 10}
ZERO_POINTS = {W0: 11, W1: 12, W2: 13}

QUANT_INT, QUANT_MXFP4 = signatures.QMOE.attr_spec("quant_type").choices
MXFP4_BLOCK = 32
INT8_ACTIVATIONS = 4  # the accuracy_level of int8 activations
ACCURACY_LEVELS = (EXACT, BF16_OPERANDS, INT8_ACTIVATIONS)
# E2M1 (MXFP4's 4-bit float): the value of each code; bit 3 is the sign.
E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
E8M0_BIAS, E8M0_NAN = 127, 255


# ----------------------------------------------------------------------------- validation

def _validate(v: NodeView) -> list[TensorInfo | None]:
    expert_type = validate_expert_attrs(v)
    quant_type, bits, block_size = _validate_quant_attrs(v)
    dims = DimBinder(v)
    elem, hidden = validate_tokens(v, dims, float_inputs=(ROUTING, B0, B1))
    for i in (W0, W1, W2, *ZERO_POINTS.values()):
        if v.has(i):
            v.expect_elem(i)
    linears = LINEARS[expert_type]
    check_expert_inputs(v, expert_type, required_with=SCALES, optional_with=ZERO_POINTS)
    for weight, bias, n, _ in linears:
        dims.shape(weight, ("E", n), v.expect_rank(weight, rank=3))
        if bias is not None and v.has(bias):
            dims.shape(bias, ("E", n), v.expect_rank(bias, rank=2))
    for weight, _, n, k in linears:  # every N is bound now; K may come from a packed dim
        _validate_quantized(v, dims, weight, n, k, quant_type, bits, block_size, elem)
    return [TensorInfo(elem, hidden)]


def _validate_quant_attrs(v: NodeView) -> tuple[str, int, int]:
    """quant_type, bits, block_size and accuracy_level, alone and together."""
    quant_type = check_choice(v, "quant_type")
    bits = check_choice(v, "bits", (4, 8))
    block_size = v.attr("block_size")
    accuracy_level = check_choice(v, "accuracy_level", ACCURACY_LEVELS)
    if quant_type == QUANT_MXFP4:
        if bits != 4:
            v.fail("attribute 'bits'", f"is {bits}; quant_type 'mxfp4' expects 4")
        if block_size != MXFP4_BLOCK:
            v.fail("attribute 'block_size'", f"is {block_size}; quant_type 'mxfp4' expects {MXFP4_BLOCK}")
        if accuracy_level == INT8_ACTIVATIONS:
            v.fail("attribute 'accuracy_level'", f"is {accuracy_level}; quant_type 'mxfp4' expects {EXACT} or "
                   f"{BF16_OPERANDS} (int8 activations are for quant_type 'int')")
    elif block_size != 0 and not (16 <= block_size <= 256 and block_size & (block_size - 1) == 0):
        v.fail("attribute 'block_size'", f"is {block_size}; expected 0 or a power of two in [16, 256]")
    return quant_type, bits, block_size


def _validate_quantized(v: NodeView, dims: DimBinder, weight: int, n: str, k: str, quant_type: str, bits: int,
                        block_size: int, elem: int) -> None:
    """One weight's packed dim (K * bits / 8), the block size against its K, its scales and zero points."""
    shape = v.input(weight).shape
    k_dim = _bind_packed(v, dims, weight, k, None if shape is None else shape[2], bits)
    if block_size and is_known(k_dim) and k_dim % block_size:
        v.fail("attribute 'block_size'", f"is {block_size}; expected a divisor of {k} = {k_dim} (the K of "
               f"{v.input_name(weight)})")
    blocks = (k_dim // block_size if block_size else 1) if is_known(k_dim) else None

    scales = SCALES[weight]
    scale_elem = v.expect_elem(scales)
    allowed = (TensorProto.UINT8,) if quant_type == QUANT_MXFP4 else tuple(dict.fromkeys((TensorProto.FLOAT, elem)))
    if TensorProto.UNDEFINED not in (scale_elem, elem) and scale_elem not in allowed:
        v.fail(v.input_name(scales), f"has type {elem_name(scale_elem)}; quant_type '{quant_type}' expects "
               + " or ".join(elem_name(e) for e in allowed))
    if block_size:
        scale_shape = v.expect_rank(scales, rank=3)
        dims.shape(scales, ("E", n), scale_shape)
        _expect_dim(v, scales, scale_shape, 2, blocks, f"{k} / block_size")
    else:
        dims.shape(scales, ("E", n), v.expect_rank(scales, rank=2))

    zero_points = ZERO_POINTS[weight]
    if not v.has(zero_points):
        return
    if quant_type == QUANT_MXFP4:
        v.fail(v.input_name(zero_points), "is given; quant_type 'mxfp4' has no zero points: leave it empty")
    if block_size:
        zp_shape = v.expect_rank(zero_points, rank=3)
        dims.shape(zero_points, ("E", n), zp_shape)
        _expect_dim(v, zero_points, zp_shape, 2, _packed_bytes(blocks, bits), f"ceil({k} / block_size * bits / 8)")
    else:
        zp_shape = v.expect_rank(zero_points, rank=2)
        dims.shape(zero_points, ("E",), zp_shape)
        _expect_dim(v, zero_points, zp_shape, 1, _packed_bytes(_symbol_value(dims, n), bits), f"ceil({n} * bits / 8)")


def _bind_packed(v: NodeView, dims: DimBinder, i: int, k: str, packed: Dim, bits: int) -> Dim:
    """Input i's dim 2 holds K = ``k`` weights of ``bits`` bits: K * bits / 8 bytes. Returns K."""
    known = dims.get(k)
    if is_known(known):
        if known * bits % 8:
            v.fail(v.input_name(i), f"packs {k} = {known} weights of {bits} bits per row; expected an even {k} "
                   "(two weights per byte)")
        if is_known(packed) and packed != known * bits // 8:
            v.fail(v.input_name(i), f"dim 2 is {packed}; expected {k} * bits / 8 = {known * bits // 8} ({k} = "
                   f"{known}, bits = {bits})")
        return known
    if is_known(packed):
        return dims.bind(k, packed * 8 // bits, f"input '{v.op.inputs[i].name}' dim 2 (= {k} * bits / 8)")
    return None


def _symbol_value(dims: DimBinder, symbol: str) -> Dim:
    """The value of a shape symbol, "2I" being twice I."""
    if symbol.startswith("2"):
        half = dims.get(symbol[1:])
        return 2 * half if is_known(half) else None
    return dims.get(symbol)


def _packed_bytes(count: Dim, bits: int) -> Dim:
    return -(-count * bits // 8) if is_known(count) else None


def _expect_dim(v: NodeView, i: int, shape: tuple[Dim, ...] | None, axis: int, expected: Dim, what: str) -> None:
    if shape is not None and is_known(shape[axis], expected) and shape[axis] != expected:
        v.fail(v.input_name(i), f"dim {axis} is {shape[axis]}; expected {what} = {expected}")


# ----------------------------------------------------------------------------- the layout

def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first ``count`` codes along the last dim of ``packed`` (uint8): one per byte (bits 8), two (bits 4:
    the even index in the low nibble) or four (bits 2, onnxruntime's QMoE: the first in the lowest bits).
    Returns uint8 [..., count]."""
    if bits == 8:
        return packed[..., :count]
    per_byte = 8 // bits
    codes = (packed[..., None] >> (np.arange(per_byte, dtype=np.uint8) * bits)) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], per_byte * packed.shape[-1])[..., :count]


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of :func:`unpack_codes`: codes (< 2^bits) along the last dim into bytes; an odd
    count of 4-bit codes leaves the last high nibble 0."""
    codes = np.asarray(codes).astype(np.uint8)
    if bits == 8:
        return codes
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 1), np.uint8)], axis=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def block_params(scales: np.ndarray, zero_points: np.ndarray | None, *, bits: int, block_size: int, n: int,
                 k_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """quant_type int: the scale (float32) and zero point (int32) of every block, each [..., N, blocks]."""
    blocks = k_dim // block_size if block_size else 1
    lead = scales.shape[:-2] if block_size else scales.shape[:-1]
    scale = scales.astype(np.float32).reshape(*lead, n, blocks)
    if zero_points is None:
        zp = np.full(scale.shape, 1 << (bits - 1), np.int32)
    elif block_size:
        zp = unpack_codes(zero_points, bits, blocks).astype(np.int32)
    else:
        zp = unpack_codes(zero_points, bits, n).astype(np.int32)[..., None]
    return scale, zp


@runtime_checkable
class StoredMxfp4(Protocol):
    """A weight tensor in MOE's layout [E, K, N] whose values are MXFP4 as stored (a checkpoint's experts): each
    expert's codes and scales as QMOE takes them, without requantizing."""

    def mxfp4_expert(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert ``e``'s transposed matrix [N, K] as quant_type mxfp4: codes uint8 [N, K / 2] (the even k in the
        low nibble) and E8M0 scales uint8 [N, K / 32]."""


def dequantize(weight: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None = None, *, bits: int,
               block_size: int, quant_type: str = QUANT_INT, k_dim: int) -> np.ndarray:
    """The float32 weights [..., N, K] of packed ``weight`` [..., N, K * bits / 8] (any leading dims,
    [E] for a whole input). int: ``(q - zero_point) * scale`` per block (no zero points: 2^(bits-1));
    mxfp4: ``e2m1(q) * 2^(s - 127)`` (s = 255: NaN)."""
    n = weight.shape[-2]
    codes = unpack_codes(weight, bits, k_dim)
    blocks = k_dim // block_size if block_size else 1
    block = block_size or k_dim
    if quant_type == QUANT_MXFP4:
        exponent = np.minimum(scales.astype(np.int32), E8M0_NAN - 1) - E8M0_BIAS  # 255 (NaN) set apart below
        factor = np.where(scales == E8M0_NAN, np.float32(np.nan), np.ldexp(np.float32(1), exponent)).astype(np.float32)
        values = E2M1_VALUES[codes].reshape(*codes.shape[:-1], blocks, block)
        return (values * factor[..., None]).reshape(codes.shape)
    scale, zp = block_params(scales, zero_points, bits=bits, block_size=block_size, n=n, k_dim=k_dim)
    centred = codes.reshape(*codes.shape[:-1], blocks, block).astype(np.float32) - zp[..., None].astype(np.float32)
    return (centred * scale[..., None]).reshape(codes.shape)


def quantize(w: np.ndarray, *, bits: int, block_size: int, symmetric: bool = True
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Quantizes float weights ``w`` [..., N, K] (quant_type int) into (weight uint8 [..., N, K * bits / 8],
    scales float32 [..., N] or [..., N, K / block_size], zero points uint8 packed or None).

    Per block (all of K when ``block_size`` is 0), with ``qmax = 2^bits - 1`` and rounding half to even:

    * symmetric: ``scale = max|w| / (2^(bits-1) - 1)``, no zero points (the default 2^(bits-1));
      ``q = clip(round(w / scale), -(2^(bits-1) - 1), 2^(bits-1) - 1) + 2^(bits-1)``.
    * asymmetric: ``lo = min(w, 0)``, ``hi = max(w, 0)``, ``scale = (hi - lo) / qmax``,
      ``zero_point = clip(round(-lo / scale), 0, qmax)``, ``q = clip(round(w / scale) + zero_point, 0, qmax)``.

    Scales are computed in float64 and stored as float32; ``w / scale`` divides by the stored scale. A block
    of zeros gets scale 0 and q = its zero point. Symmetric ``quantize(dequantize(q, s))`` gives q back
    exactly when each block has a code at distance 2^(bits-1) - 1 from 2^(bits-1) (its scale within a float32
    rounding of s); dequantize(quantize(w)) is within scale / 2 of w.
    """
    w = np.asarray(w, dtype=np.float32)
    n, k_dim = w.shape[-2:]
    block = block_size or k_dim
    if (block_size and k_dim % block_size) or (bits == 4 and k_dim % 2):
        raise ValueError(f"quantize: K = {k_dim} must be a multiple of block_size {block_size} (and even for 4 bits)")
    blocks = w.astype(np.float64).reshape(*w.shape[:-1], k_dim // block if block else 1, block)
    if symmetric:
        half = 1 << (bits - 1)
        scale = (np.abs(blocks).max(axis=-1, initial=0.0) / (half - 1)).astype(np.float32)
        zp = np.full(scale.shape, half, np.int64)
        steps = np.clip(np.rint(blocks / _nonzero(scale)[..., None]), 1 - half, half - 1)
    else:
        qmax = (1 << bits) - 1
        lo = np.minimum(blocks.min(axis=-1, initial=0.0), 0.0)
        hi = np.maximum(blocks.max(axis=-1, initial=0.0), 0.0)
        scale = ((hi - lo) / qmax).astype(np.float32)
        zp = np.where(scale > 0, np.clip(np.rint(-lo / _nonzero(scale)), 0, qmax), 0).astype(np.int64)
        steps = np.clip(np.rint(blocks / _nonzero(scale)[..., None]) + zp[..., None], 0, qmax) - zp[..., None]
    codes = np.where(scale[..., None] > 0, steps, 0) + zp[..., None]
    weight = pack_codes(codes.reshape(w.shape), bits)
    if not block_size:
        scale, zp = scale[..., 0], zp[..., 0]
    zero_points = None if symmetric else pack_codes(zp, bits)
    return weight, scale, zero_points


def _nonzero(scale: np.ndarray) -> np.ndarray:
    """``scale`` as float64 with 1 for 0 (a block of zeros divides by 1: its codes are the zero point)."""
    return np.where(scale > 0, scale, 1.0).astype(np.float64)


def int8_linear(a: np.ndarray, codes: np.ndarray, scale: np.ndarray, zp: np.ndarray, block_size: int) -> np.ndarray:
    """``accuracy_level`` 4: ``a @ W^T`` with int8 activations. ``a`` [R, K] float32; ``codes`` [N, K];
    ``scale`` float32 and ``zp`` int [N, blocks]. Each row's block b: sa = max|a| / 127,
    qa = clip(round_half_even(a / sa), -127, 127) (0 where sa = 0); exact integer dots with q - zp;
    y = sum over b in order of (sa * scale) * dot, in float32. A block holding NaN or Inf (sa NaN or Inf)
    quantizes to 0 and makes the row's y NaN. Returns float32 [R, N]."""
    rows, k_dim = a.shape
    n, blocks = scale.shape
    block = block_size or k_dim
    a_blocks = a.astype(np.float32).reshape(rows, blocks, block)
    sa = (np.abs(a_blocks).max(axis=-1, initial=np.float32(0)) / np.float32(127)).astype(np.float32)
    quantizable = (sa > 0) & np.isfinite(sa)  # else qa = 0, and sa (NaN or Inf) makes the row's y NaN
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.clip(np.rint(a_blocks / sa[..., None]), -127, 127)
    qa = np.where(quantizable[..., None], steps, 0).astype(np.int64)
    qw = codes.reshape(n, blocks, block).astype(np.int64) - zp[..., None].astype(np.int64)
    dots = np.einsum("rbk,nbk->rnb", qa, qw).astype(np.float32)
    y = np.zeros((rows, n), np.float32)
    with np.errstate(invalid="ignore"):  # Inf * 0: NaN on purpose
        for b in range(blocks):
            y += (sa[:, b, None] * scale[None, :, b]) * dots[:, :, b]
    return y


# ----------------------------------------------------------------------------- reference

def qmoe(hidden_states, routing_weights, router_topk_output_indices, weight_0, bias_0=None, weight_1=None,
         bias_1=None, weight_2=None, scales_0=None, scales_1=None, scales_2=None, zero_points_0=None,
         zero_points_1=None, zero_points_2=None, *, expert_type=None, expert_alpha=None, expert_beta=None,
         gate_parity=None, activation=None, bits=None, block_size=None, quant_type=None, accuracy_level=None,
         _node_name="", _named_outputs=None):
    """numpy reference of QMOE; returns ``(y,)`` with the shape and dtype of ``hidden_states``.

    Dequantizes each selected expert's weights (only those with tokens) and runs MOE's computation;
    ``accuracy_level`` 4 takes :func:`int8_linear` instead; 3 computes 0's exact result. Raises MoeOpError
    for any input or attribute outside the contract.
    """
    attrs = dict(expert_type=expert_type, expert_alpha=expert_alpha, expert_beta=expert_beta, gate_parity=gate_parity,
                 activation=activation, bits=bits, block_size=block_size, quant_type=quant_type,
                 accuracy_level=accuracy_level)
    arrays = [hidden_states, routing_weights, router_topk_output_indices, weight_0, bias_0, weight_1, bias_1, weight_2,
              scales_0, scales_1, scales_2, zero_points_0, zero_points_1, zero_points_2]
    view = ArrayView(QMOE, arrays, attrs, node_name=_node_name, named_outputs=_named_outputs)
    QMOE.validate(view)
    bits, block_size = view.attr("bits"), view.attr("block_size")
    quant_type, int8_activations = view.attr("quant_type"), view.attr("accuracy_level") == INT8_ACTIVATIONS
    expert_type = view.attr("expert_type")
    inter = weight_0.shape[1] // (2 if expert_type == GEMM2_BIAS_SWIGLU_CLAMP else 1)
    k_dims = {weight: hidden_states.shape[-1] if k == "H" else inter for weight, _, _, k in LINEARS[expert_type]}

    def linear(i, e, a):
        weight, scales = arrays[i][e], arrays[SCALES[i]][e]
        zero_points = None if arrays[ZERO_POINTS[i]] is None else arrays[ZERO_POINTS[i]][e]
        if int8_activations:
            scale, zp = block_params(scales, zero_points, bits=bits, block_size=block_size, n=weight.shape[0],
                                     k_dim=k_dims[i])
            return int8_linear(a, unpack_codes(weight, bits, k_dims[i]), scale, zp, block_size)
        w = dequantize(weight, scales, zero_points, bits=bits, block_size=block_size, quant_type=quant_type,
                       k_dim=k_dims[i])
        return a @ w.T

    return (mix_experts(view, hidden_states, routing_weights, router_topk_output_indices, weight_0.shape[0], linear,
                        bias_0, bias_1),)


# ----------------------------------------------------------------------------- as standard ONNX ops

# The E8M0 scale's factor 2^(s - 127) by s, for a Gather (255: NaN)
_E8M0_FACTORS = np.append(np.ldexp(1.0, np.arange(E8M0_NAN) - E8M0_BIAS), np.nan).astype(np.float32)


def _function_body(op, c: Config, inputs: dict[str, Any]) -> dict[str, Any]:
    if int(c.attr("accuracy_level")) == INT8_ACTIVATIONS:
        return experts_body(op, c, inputs, lambda weight, a: _int8_product(op, c, inputs, weight, a))

    def product(weight: str, a):
        return op.MatMul(a, op.Transpose(_dequantized(op, c, inputs, weight), perm=[0, 2, 1]))

    return experts_body(op, c, inputs, product)


def _unpacked(op, packed, bits: int, count=None):
    """The codes (int32) along the last dim of uint8 ``packed``: one per byte, or two (the even index in the
    low nibble); the first ``count`` of them when given (:func:`unpack_codes`)."""
    codes = op.Cast(packed, to=TensorProto.INT32)
    if bits == 4:
        sixteen = constant(op, 16, np.int32)
        low, high = op.Mod(codes, sixteen), op.Div(codes, sixteen)
        pairs = op.Concat(op.Unsqueeze(low, ints(op, -1)), op.Unsqueeze(high, ints(op, -1)), axis=-1)
        codes = reshape(op, pairs, op.Shape(packed, end=-1), op.Mul(op.Shape(packed, start=-1), ints(op, 2)))
    return codes if count is None else op.Slice(codes, ints(op, 0), count, ints(op, -1))


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """One quantized weight input by blocks: codes [E, N, blocks, block] (int32), scale [E, N, blocks]
    (float32; mxfp4: the factor 2^(s - 127)), zero point [E, N, blocks, 1] or a scalar (int32, to subtract
    from the codes; None for mxfp4)."""

    codes: Any
    scale: Any
    zero_point: Any | None


def _blocks(op, c: Config, inputs: dict[str, Any], weight: str) -> _Blocks:
    bits, block_size = int(c.attr("bits")), int(c.attr("block_size"))
    suffix = weight[-1]  # weight_i goes with scales_i and zero_points_i
    packed, scales, zero_points = inputs[weight], inputs[f"scales_{suffix}"], inputs.get(f"zero_points_{suffix}")
    codes = _unpacked(op, packed, bits)
    if block_size:
        blocks, block = op.Div(op.Shape(codes, start=2), ints(op, block_size)), ints(op, block_size)
    else:
        blocks, block = ints(op, 1), op.Shape(codes, start=2)
    codes = reshape(op, codes, op.Shape(codes, end=2), blocks, block)
    if c.attr("quant_type") == QUANT_MXFP4:
        factor = op.Gather(constant(op, _E8M0_FACTORS, np.float32), op.Cast(scales, to=TensorProto.INT64), axis=0)
        return _Blocks(codes, factor, None)
    scale = float32(op, scales)
    if not block_size:
        scale = op.Unsqueeze(scale, ints(op, 2))
    if zero_points is None:
        zero_point = constant(op, 1 << (bits - 1), np.int32)
    elif block_size:
        zero_point = op.Unsqueeze(_unpacked(op, zero_points, bits, blocks), ints(op, -1))
    else:
        n = op.Shape(packed, start=1, end=2)
        zero_point = op.Unsqueeze(_unpacked(op, zero_points, bits, n), ints(op, 2, 3))
    return _Blocks(codes, scale, zero_point)


def _dequantized(op, c: Config, inputs: dict[str, Any], weight: str):
    """float32 W [E, N, K] of a quantized weight input (:func:`dequantize`)."""
    q = _blocks(op, c, inputs, weight)
    if q.zero_point is None:
        values = op.Gather(constant(op, E2M1_VALUES, np.float32), op.Cast(q.codes, to=TensorProto.INT64), axis=0)
    else:
        values = op.Cast(op.Sub(q.codes, q.zero_point), to=TensorProto.FLOAT)
    w = op.Mul(values, op.Unsqueeze(q.scale, ints(op, -1)))
    k = op.Mul(op.Shape(q.codes, start=2, end=3), op.Shape(q.codes, start=3))
    return reshape(op, w, op.Shape(inputs[weight], end=2), k)


def _int8_product(op, c: Config, inputs: dict[str, Any], weight: str, a):
    """accuracy_level 4 (:func:`int8_linear`): ``a`` [1 or E, T, K] in int8 per row and block, exact int32
    dots with q - zero point, then the blocks' (sa * scale) * dot summed: [E, T, N]."""
    q = _blocks(op, c, inputs, weight)
    a4 = reshape(op, a, op.Shape(a, end=-1), op.Shape(q.codes, start=2, end=3), op.Shape(q.codes, start=3))
    sa = op.Div(abs_max(op, a4, 3), scalar(op, 127.0))  # [., T, blocks, 1]
    steps = op.Clip(op.Round(op.Div(a4, sa)), scalar(op, -127.0), scalar(op, 127.0))
    qa = op.Cast(op.Where(op.Greater(sa, scalar(op, 0.0)), steps, scalar(op, 0.0)), to=TensorProto.INT32)
    qw = op.Sub(q.codes, q.zero_point)  # [E, N, blocks, block]
    qw_t = op.Transpose(qw, perm=[0, 2, 3, 1])  # [E, blocks, block, N]
    qa_t = op.Transpose(qa, perm=[0, 2, 1, 3])  # [1 or E, blocks, T, block]
    # expanded to E first: onnxruntime's int32 MatMul gives a wrong shape broadcasting over an empty K
    qa_t = op.Expand(qa_t, op.Concat(op.Shape(qw_t, end=1), op.Shape(qa_t, start=1), axis=0))
    dots = op.MatMul(qa_t, qw_t)  # [E, blocks, T, N]
    block_scale = op.Unsqueeze(op.Transpose(q.scale, perm=[0, 2, 1]), ints(op, 2))  # [E, blocks, 1, N]
    factor = op.Mul(op.Transpose(sa, perm=[0, 2, 1, 3]), block_scale)
    return op.ReduceSum(op.Mul(factor, op.Cast(dots, to=TensorProto.FLOAT)), ints(op, 1), keepdims=0)


QMOE = OpDef.of(signatures.QMOE, validate=_validate, reference=qmoe, body=_function_body)
