"""QMOE case table and an independent per-token oracle (its own bit decoding, float64)."""

from __future__ import annotations

import math

import numpy as np

from . import Case, bf16_compute
from .moe import BF16, GEMM2, GEMM2_ACT, GEMM3, SCALAR_ACTIVATIONS, TOL, routed_tokens

OP = "QMOE"
CONSTANT = tuple(range(3, 14))  # weights, biases, scales, zero points
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def make_inputs(tokens=7, hidden=32, inter=32, experts=4, k=2, expert_type=GEMM2, dtype=np.float32, bits=4,
                block_size=0, zero_points=False, quant_type="int", scale_dtype=None, index_dtype=np.int64, bias=True,
                lead=None, indices=None, seed=0, scale=1.0):
    """Random QMOE inputs (14, by position): random codes in every byte, positive scales sized so that
    the dequantized weights are ~0.1, random zero points (every nibble of the last byte too)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    scale_dtype = np.dtype(np.uint8 if quant_type == "mxfp4" else scale_dtype or dtype)
    x, weights, indices = routed_tokens(rng, tokens, hidden, experts, k, dtype, index_dtype, lead, indices, scale)

    shapes = {GEMM2: [(2 * inter, hidden), (hidden, inter)], GEMM3: [(inter, hidden), (inter, hidden), (hidden, inter)],
              GEMM2_ACT: [(inter, hidden), (hidden, inter)]}[expert_type]
    quantized, scales, zps = [None] * 3, [None] * 3, [None] * 3
    for j, (n, kdim) in enumerate(shapes):
        quantized[j] = rng.integers(0, 256, (experts, n, kdim * bits // 8), dtype=np.uint8)
        blocks = kdim // block_size if block_size else 1
        scale_shape = (experts, n, blocks) if block_size else (experts, n)
        if quant_type == "mxfp4":  # 2^-6 .. 2^-3 times codes up to 6
            scales[j] = rng.integers(121, 125, scale_shape, dtype=np.uint8)
        else:
            step = 0.1 / (1 << (bits - 1))
            scales[j] = (rng.uniform(0.5, 1.5, scale_shape) * step).astype(np.float32).astype(scale_dtype)
        if zero_points:
            zp_shape = (experts, n, -(-blocks * bits // 8)) if block_size else (experts, -(-n * bits // 8))
            zps[j] = rng.integers(0, 256, zp_shape, dtype=np.uint8)
    biases = [None, None]
    if bias and expert_type != GEMM3:
        biases = [(rng.standard_normal((experts, shapes[0][0])) * 0.3).astype(dtype),
                  (rng.standard_normal((experts, hidden)) * 0.3).astype(dtype)]
    return [x, weights, indices, quantized[0], biases[0], quantized[1], biases[1], quantized[2], *scales, *zps]


# ----------------------------------------------------------------------------- oracle

def _decode(weight, scales, zero_points, k_dim, bits, block_size, quant_type):
    """One expert's float64 weights [N, K], element by element from the bytes (index arithmetic, no reshapes)."""
    n_dim = weight.shape[0]
    n, kk = np.meshgrid(np.arange(n_dim), np.arange(k_dim), indexing="ij")
    byte = weight[n, kk * bits // 8].astype(np.int64)
    code = byte if bits == 8 else (byte >> (4 * (kk % 2))) & 0xF
    block = kk // block_size if block_size else np.zeros_like(kk)
    scale = (scales[n, block] if block_size else scales[n]).astype(np.float64)
    if quant_type == "mxfp4":
        magnitude = np.array(E2M1_MAGNITUDES)[code & 7]
        return np.where(code & 8, -magnitude, magnitude) * np.where(scale == 255, np.nan, np.exp2(scale - 127))
    return (code - _zero_point(zero_points, n, block, bits, block_size)) * scale


def _zero_point(zero_points, n, block, bits, block_size):
    if zero_points is None:
        return 1 << (bits - 1)
    position = block if block_size else n  # the element of its row: the block, or the column
    byte = (zero_points[n, position * bits // 8] if block_size else zero_points[position * bits // 8]).astype(np.int64)
    return byte if bits == 8 else (byte >> (4 * (position % 2))) & 0xF


def _int8_dot(a, weight, scales, zero_points, k_dim, bits, block_size):
    """accuracy_level 4, as the contract words it: float32 activation scales and codes, exact integer dots."""
    n_dim = weight.shape[0]
    n, kk = np.meshgrid(np.arange(n_dim), np.arange(k_dim), indexing="ij")
    byte = weight[n, kk * bits // 8].astype(np.int64)
    code = byte if bits == 8 else (byte >> (4 * (kk % 2))) & 0xF
    size = block_size or k_dim
    y = np.zeros(n_dim)
    for b in range(k_dim // size if size else 0):
        part = np.float32(a[b * size:(b + 1) * size].astype(np.float32))
        sa = np.float32(np.max(np.abs(part))) / np.float32(127)
        if np.isfinite(sa) and sa > 0:
            qa = np.clip(np.rint(part / sa), -127, 127).astype(np.int64)
        else:  # a zero block quantizes to 0; a NaN or Inf one to NaN outputs (sa * 0)
            qa = np.zeros(size, np.int64)
        block = np.full_like(kk[:, :size], b)
        zp = _zero_point(zero_points, n[:, :size], block, bits, block_size)
        dot = ((code[:, b * size:(b + 1) * size] - zp) * qa).sum(axis=1)
        scale = scales[:, b] if block_size else scales
        y += (np.float32(sa) * scale.astype(np.float32)).astype(np.float64) * dot
    return y


def oracle(x, weights, indices, w0, b0, w1, b1, w2, s0, s1, s2, z0, z1, z2, *, expert_type, bits, block_size=0,
           quant_type="int", accuracy_level=0, expert_alpha=1.0, expert_beta=0.0, gate_parity=0, activation=""):
    """Token by token, slot by slot, in float64 (the int8 activations as the contract computes them)."""
    flat = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).astype(np.float64)
    k = indices.shape[-1]
    idx = indices.reshape(-1, k)
    wts = weights.reshape(-1, k).astype(np.float64)

    def linear(w, s, z, e, a):  # a has the K of w
        k_dim, zp = a.shape[0], None if z is None else z[e]
        if accuracy_level == 4:
            return _int8_dot(a, w[e], s[e], zp, k_dim, bits, block_size)
        return _decode(w[e], s[e], zp, k_dim, bits, block_size, quant_type) @ a

    def bias(b, e):
        return 0 if b is None else b[e].astype(np.float64)

    out = np.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(k):
            e = int(idx[t, j])
            if expert_type == GEMM2:
                gu = linear(w0, s0, z0, e, flat[t]) + bias(b0, e)
                gate = np.minimum(gu[gate_parity::2], expert_beta)
                up = np.clip(gu[1 - gate_parity::2], -expert_beta, expert_beta)
                y = linear(w1, s1, z1, e, (up + 1) * gate / (1 + np.exp(-expert_alpha * gate))) + bias(b1, e)
            elif expert_type == GEMM2_ACT:
                up = linear(w0, s0, z0, e, flat[t]) + bias(b0, e)
                act = np.array([SCALAR_ACTIVATIONS[activation](float(v)) for v in up])
                y = linear(w1, s1, z1, e, act) + bias(b1, e)
            else:
                gate = linear(w0, s0, z0, e, flat[t])
                up = linear(w1, s1, z1, e, flat[t])
                y = linear(w2, s2, z2, e, gate / (1 + np.exp(-expert_alpha * gate)) * up)
            out[t] += wts[t, j] * y
    return out.reshape(x.shape)


# ----------------------------------------------------------------------------- cases

G2 = dict(expert_type=GEMM2, expert_alpha=1.702, expert_beta=7.0)
G3 = dict(expert_type=GEMM3)


def _act(activation):
    return dict(expert_type=GEMM2_ACT, activation=activation)


def _case(name, attrs, *, bits=4, block_size=0, quant_type="int", accuracy_level=0, atol=None, **kw):
    """A valid case; the quantization attributes are written only where they differ from the defaults."""
    inputs = make_inputs(expert_type=attrs["expert_type"], bits=bits, block_size=block_size, quant_type=quant_type,
                         **kw)
    attrs = dict(attrs, bits=bits)
    for key, value, default in (("block_size", block_size, 0), ("quant_type", quant_type, "int"),
                                ("accuracy_level", accuracy_level, 0)):
        if value != default:
            attrs[key] = value
    rtol, default_atol = TOL.get(inputs[0].dtype, (1e-5, 1e-5))
    return Case(OP, name, inputs, attrs, constant=CONSTANT, rtol=rtol, atol=default_atol if atol is None else atol)


_base2 = _case("gemm2_int4_fp32", G2)
_base3 = _case("gemm3_int8_block32_zero_points", G3, bits=8, block_size=32, zero_points=True)
_base_act = _case("act_relu2_int4_block16", _act("relu2"), block_size=16, zero_points=True)
_mx = _case("gemm2_mxfp4", G2, quant_type="mxfp4", block_size=32)
_x, _w, _i = _base2.inputs[:3]


def _input(case, name):
    return case.inputs[["hidden_states", "routing_weights", "router_topk_output_indices", "weight_0", "bias_0",
                        "weight_1", "bias_1", "weight_2", "scales_0", "scales_1", "scales_2", "zero_points_0",
                        "zero_points_1", "zero_points_2"].index(name)]


def _garbage_high_nibbles(case):
    """block-wise 4-bit zero points of 3 blocks: 2 bytes a row, the last high nibble unused (set to 0xF)."""
    zps = {f"zero_points_{j}": _input(case, f"zero_points_{j}").copy() for j in range(2)}
    for zp in zps.values():
        zp[..., -1] |= 0xF0
    return case.mutated(case.name + "_unused_nibble_set", None, **zps)


_three_blocks = _case("gemm2_int4_three_blocks_zero_points", G2, hidden=48, inter=48, block_size=16,
                      zero_points=True)

def _extreme_scales(case, name):
    """``case`` with E8M0 scales at their ends, which the kernels widen with exceptions: 0 (2^-127, a subnormal
    float) on expert 1's first gate/up block, 1 (2^-126) on a row of expert 0, 255 (NaN) on one block of
    expert 2's down linear (NaN in that output column of its tokens)."""
    gate_up, down = _input(case, "scales_0").copy(), _input(case, "scales_1").copy()
    gate_up[1, :, 0], gate_up[0, 5, :], down[2, 3, 0] = 0, 1, 255
    return case.mutated(name, None, scales_0=gate_up, scales_1=down)


CASES = [
    _base2,
    _base3,
    _base_act,
    _mx,
    _extreme_scales(_mx, "gemm2_mxfp4_extreme_scales"),  # up to 4 rows an expert: decoded in registers
    _extreme_scales(_case("gemm2_mxfp4_more_tokens", G2, tokens=40, quant_type="mxfp4", block_size=32),
                    "gemm2_mxfp4_extreme_scales_more_tokens"),  # dequantized panels, then the fp32 GEMM
    # int4 / int8, per column / block-wise (16, 32, 256), with and without zero points
    _case("gemm2_int4_zero_points", G2, zero_points=True),
    _case("gemm2_int4_block16", G2, block_size=16),
    _case("gemm2_int4_block32_zero_points", G2, block_size=32, zero_points=True),
    _case("gemm2_int8", G2, bits=8),
    _case("gemm2_int8_zero_points", G2, bits=8, zero_points=True),
    _case("gemm2_int8_block16_zero_points", G2, bits=8, block_size=16, zero_points=True),
    _case("gemm2_int4_block256", G2, tokens=5, hidden=256, inter=256, block_size=256, zero_points=True,
          scale=0.3, atol=1e-4),
    _case("gemm3_int8_block256", G3, tokens=5, hidden=256, inter=256, bits=8, block_size=256, scale=0.3, atol=1e-4),
    _case("gemm3_int4", G3),
    _case("gemm3_int4_block32_zero_points", G3, block_size=32, zero_points=True),
    _case("gemm3_int8_zero_points", G3, bits=8, zero_points=True),
    _three_blocks,
    _garbage_high_nibbles(_three_blocks),
    _case("act_silu_int8", _act("silu"), bits=8),
    _case("act_gelu_int4_zero_points", _act("gelu"), zero_points=True),
    _case("act_identity_int8_block32", _act("identity"), bits=8, block_size=32),
    _case("act_relu2_no_bias", _act("relu2"), bias=False),
    _base_act.mutated("act_up_bias_only", None, bias_1=None),
    # float types, and float32 scales beside float16 / bfloat16 tokens
    _case("gemm2_int4_fp16", G2, dtype=np.float16, block_size=16),
    _case("gemm2_int8_bf16", G2, dtype=BF16, bits=8, zero_points=True),
    _case("gemm3_int4_fp16_zero_points", G3, dtype=np.float16, zero_points=True),
    _case("gemm3_int8_bf16_block32", G3, dtype=BF16, bits=8, block_size=32),
    _case("act_silu_int4_fp16", _act("silu"), dtype=np.float16, block_size=32),
    _case("gemm2_int4_fp16_float32_scales", G2, dtype=np.float16, scale_dtype=np.float32, zero_points=True),
    _case("gemm3_int8_bf16_float32_scales", G3, dtype=BF16, bits=8, scale_dtype=np.float32, block_size=16),
    # mxfp4
    _case("gemm3_mxfp4", G3, quant_type="mxfp4", block_size=32),
    _case("act_gelu_tanh_mxfp4", _act("gelu_tanh"), quant_type="mxfp4", block_size=32),
    _case("gemm2_mxfp4_fp16", G2, quant_type="mxfp4", block_size=32, dtype=np.float16),
    _case("gemm2_mxfp4_bf16", G2, quant_type="mxfp4", block_size=32, dtype=BF16),
    # accuracy_level 4: int8 activations
    _case("gemm2_int4_block32_int8_activations", G2, block_size=32, accuracy_level=4),
    _case("gemm2_int8_int8_activations", G2, bits=8, zero_points=True, accuracy_level=4, seed=4),
    _case("gemm3_int4_zero_points_int8_activations", G3, zero_points=True, accuracy_level=4),
    _case("gemm3_int8_block16_int8_activations", G3, bits=8, block_size=16, accuracy_level=4),
    _case("act_relu_int4_block16_int8_activations", _act("relu"), block_size=16, zero_points=True, accuracy_level=4),
    _case("gemm2_int4_fp16_int8_activations", G2, dtype=np.float16, block_size=16, accuracy_level=4),
    _case("gemm3_int8_bf16_int8_activations", G3, dtype=BF16, bits=8, accuracy_level=4),
    _base2.mutated("zero_tokens_int8_activations", None, accuracy_level=4,
                   hidden_states=np.where(np.arange(7)[:, None] == 2, 0, _x).astype(np.float32)),
    # accuracy_level 3: bfloat16 GEMM operands allowed (40 tokens: rows enough for the dequantizing prefill path)
    bf16_compute(_case("gemm2_int4_block32_more_tokens", G2, tokens=40, block_size=32), "gemm2_int4_bf16_compute"),
    bf16_compute(_case("gemm3_int8_zero_points_fp16_more_tokens", G3, tokens=40, bits=8, zero_points=True,
                       dtype=np.float16), "gemm3_int8_fp16_bf16_compute"),
    bf16_compute(_case("gemm2_mxfp4_more_tokens", G2, tokens=40, quant_type="mxfp4", block_size=32),
                 "gemm2_mxfp4_bf16_compute"),
    bf16_compute(_case("act_relu2_int4", _act("relu2"), tokens=3), "act_relu2_decode_bf16_compute"),
    # routing and shapes
    _case("gemm2_gate_parity_1", {**G2, "gate_parity": 1}, block_size=16),
    _case("gemm2_no_clamp", {**G2, "expert_beta": float("inf")}, scale=3.0),
    _case("gemm2_no_bias", G2, bias=False, bits=8),
    _case("gemm2_int32_indices", G2, index_dtype=np.int32),
    _case("gemm3_rank3", G3, tokens=6, lead=(2, 3), block_size=16),
    _case("one_token", G2, tokens=1, block_size=32),
    _case("gemm3_one_token_int8_activations", G3, tokens=1, bits=8, accuracy_level=4),
    _case("empty", G2, tokens=0),
    _case("gemm3_empty_rank3", G3, tokens=0, lead=(0, 5), block_size=16),
    _case("empty_int8_activations", G2, tokens=0, accuracy_level=4),
    _case("hidden_size_zero", G3, hidden=0),
    _case("hidden_size_zero_int8_activations", G3, hidden=0, bits=8, accuracy_level=4),
    _case("act_inter_zero", _act("relu2"), inter=0, zero_points=True),  # y = down bias only
    _case("all_on_one_expert", G2, k=1, indices=np.full(7, 2), bits=8),
    _case("experts_without_tokens", G3, experts=8, k=2, indices=np.tile([1, 3], (7, 1)), zero_points=True),
    _case("k_equals_e", G2, experts=4, k=4, block_size=16),
    _case("gemm3_k_equals_e_mxfp4", G3, experts=3, k=3, quant_type="mxfp4", block_size=32),
    _case("same_expert_twice", G2, k=2, indices=np.tile([1, 1], (7, 1))),
    _case("more_tokens", G3, tokens=65, hidden=64, inter=32, experts=8, k=2, block_size=32, zero_points=True),
    # GEMM3's gate and up share the C++ kernel's panels: zero points on one of them only
    _base3.mutated("gemm3_zero_points_on_gate_only", None, zero_points_1=None),
    _base3.mutated("gemm3_zero_points_on_up_only", None, zero_points_0=None),
    _base2.mutated("nan_propagates", None,
                   hidden_states=np.where(np.arange(7)[:, None] == 3, np.nan, _x).astype(np.float32)),
    _base2.mutated("inf_int8_activations_nan", None, accuracy_level=4,
                   hidden_states=np.where((np.arange(7)[:, None] == 3) & (np.arange(32) == 5), np.inf, _x)
                   .astype(np.float32)),
]

_w0, _s0 = _input(_base2, "weight_0"), _input(_base2, "scales_0")
_z3, _s3 = _input(_base3, "zero_points_0"), _input(_base3, "scales_0")
_odd = _case("act_int8_odd_hidden", _act("relu"), hidden=7, inter=6, bits=8)

CASES += [
    _odd,
    # errors: values
    _base2.mutated("index_too_large", runtime=True, error=r"router_topk_output_indices\[.*\] = 4 is outside \[0, 4\)",
                   router_topk_output_indices=np.where(_i == _i[2, 1], 4, _i)),
    _base3.mutated("index_negative", runtime=True, error=r"router_topk_output_indices\[.*\] = -1 is outside \[0, 4\)",
                   router_topk_output_indices=np.where(_i == _i[0, 0], -1, _i)),
    # errors: quantization attributes
    _base2.mutated("bits_3", r"attribute 'bits' is 3; expected one of 4, 8$", bits=3),
    _base2.mutated("bits_missing", r"attribute 'bits' is required$", bits=None),
    _base2.mutated("block_size_8", r"attribute 'block_size' is 8; expected 0 or a power of two in \[16, 256\]$",
                   block_size=8),
    _base2.mutated("block_size_48", r"attribute 'block_size' is 48; expected 0 or a power of two in \[16, 256\]$",
                   block_size=48),
    _base2.mutated("block_size_512", r"attribute 'block_size' is 512; expected 0 or a power of two", block_size=512),
    _base2.mutated("block_size_negative", r"attribute 'block_size' is -16; expected 0 or a power of two",
                   block_size=-16),
    _three_blocks.mutated("block_size_not_dividing_k", r"attribute 'block_size' is 32; expected a divisor of H = 48 "
                          r"\(the K of input 'weight_0'\)$", block_size=32),
    _base2.mutated("quant_type_unknown", r"attribute 'quant_type' is 'fp4'; expected one of 'int', 'mxfp4'$",
                   quant_type="fp4"),
    _base2.mutated("accuracy_level_1", r"attribute 'accuracy_level' is 1; expected one of 0, 3, 4$",
                   accuracy_level=1),
    _mx.mutated("mxfp4_bits_8", r"attribute 'bits' is 8; quant_type 'mxfp4' expects 4$", bits=8),
    _mx.mutated("mxfp4_block_size_0", r"attribute 'block_size' is 0; quant_type 'mxfp4' expects 32$",
                block_size=None),
    _mx.mutated("mxfp4_block_size_16", r"attribute 'block_size' is 16; quant_type 'mxfp4' expects 32$",
                block_size=16),
    _mx.mutated("mxfp4_int8_activations", r"attribute 'accuracy_level' is 4; quant_type 'mxfp4' expects 0 or 3 "
                r"\(int8 activations are for quant_type 'int'\)$", accuracy_level=4),
    _mx.mutated("mxfp4_zero_points", r"input 'zero_points_0' is given; quant_type 'mxfp4' has no zero points: "
                r"leave it empty$", zero_points_0=np.zeros((4, 64, 1), np.uint8)),
    _mx.mutated("mxfp4_float_scales", r"input 'scales_0' has type float32; quant_type 'mxfp4' expects uint8$",
                scales_0=_input(_mx, "scales_0").astype(np.float32)),
    _base2.mutated("int_uint8_scales", r"input 'scales_0' has type uint8; quant_type 'int' expects float32$",
                   scales_0=np.ones(_s0.shape, np.uint8)),
    _case("gemm2_int4_fp16", G2, dtype=np.float16).mutated(
        "int_bf16_scales_for_fp16", r"input 'scales_1' has type bfloat16; quant_type 'int' expects float32 or "
        r"float16$", scales_1=_input(_base2, "scales_1").astype(BF16)),
    _base2.mutated("scales_int8", r"input 'scales_0' has type int8; expected float32, float16, bfloat16, uint8$",
                   scales_0=np.ones(_s0.shape, np.int8)),
    # errors: attribute types and names
    _base2.mutated("attr_bits_float", r"attribute 'bits' has type FLOAT; expected INT$", bits=4.0),
    _base2.mutated("attr_block_size_string", r"attribute 'block_size' has type STRING; expected INT$",
                   block_size="32"),
    _base2.mutated("attr_quant_type_int", r"attribute 'quant_type' has type INT; expected STRING$", quant_type=1),
    _base2.mutated("attr_accuracy_level_float", r"attribute 'accuracy_level' has type FLOAT; expected INT$",
                   accuracy_level=4.0),
    _base2.mutated("attr_misspelled", r"attribute 'block' is not an attribute of QMOE; expected one of "
                   r"'expert_type', .*'accuracy_level'$", session=True, block=32),
    # errors: packed weights
    _base2.mutated("weight_float", r"input 'weight_0' has type float32; expected uint8$",
                   weight_0=_w0.astype(np.float32)),
    _base2.mutated("weight_rank2", r"input 'weight_0' has rank 2 .*expected rank 3$", weight_0=_w0[0]),
    _base2.mutated("weight_packed_dim", r"input 'weight_0' dim 2 is 15; expected H \* bits / 8 = 16 \(H = 32, "
                   r"bits = 4\)$", weight_0=_w0[:, :, :15]),
    _base2.mutated("weight_unpacked_int4", r"input 'weight_1' dim 2 is 32; expected I \* bits / 8 = 16 \(I = 32, "
                   r"bits = 4\)$", weight_1=np.zeros((4, 32, 32), np.uint8)),
    _odd.mutated("odd_k_for_int4", r"input 'weight_0' packs H = 7 weights of 4 bits per row; expected an even H "
                 r"\(two weights per byte\)$", bits=4),
    _base2.mutated("weight_rows", r"input 'weight_1' dim 1 is 31; expected H = 32", weight_1=_input(_base2,
                                                                                              "weight_1")[:, :31]),
    _base2.mutated("weight_experts", r"input 'weight_1' dim 0 is 3; expected E = 4",
                   weight_1=_input(_base2, "weight_1")[:3]),
    _base2.mutated("weight_0_odd_rows", r"input 'weight_0' dim 1 is 63; expected an even size \(2I\)",
                   weight_0=_w0[:, :63]),
    _base3.mutated("gemm3_missing_down", r"input 'weight_2' is required$", weight_2=None),
    _base2.mutated("weight_2_for_gemm2", r"input 'weight_2' is given, but GEMM2_BIAS_SWIGLU_CLAMP does not use it",
                   weight_2=_input(_base3, "weight_2")),
    _base3.mutated("bias_for_gemm3", r"input 'bias_0' is given, but GEMM3_SWIGLU does not use it",
                   bias_0=_input(_base2, "bias_0")),
    # errors: scales
    _base2.mutated("scales_missing", r"input 'scales_1' is required$", scales_1=None),
    _base3.mutated("gemm3_scales_2_missing", r"input 'scales_2' is required$", scales_2=None),
    _base2.mutated("scales_2_for_gemm2", r"input 'scales_2' is given, but GEMM2_BIAS_SWIGLU_CLAMP does not use it",
                   scales_2=_s0),
    _base2.mutated("scales_rank3_per_column", r"input 'scales_0' has rank 3 .*expected rank 2$",
                   scales_0=_s0[:, :, None]),
    _base3.mutated("scales_rank2_block_wise", r"input 'scales_0' has rank 2 .*expected rank 3$", scales_0=_s3[:, :, 0]),
    _base3.mutated("scales_blocks", r"input 'scales_0' dim 2 is 2; expected H / block_size = 1$",
                   scales_0=np.concatenate([_s3, _s3], axis=2)),
    _base2.mutated("scales_columns", r"input 'scales_0' dim 1 \(= 2I\) is 16; expected I = 32", scales_0=_s0[:, :32]),
    _base2.mutated("scales_experts", r"input 'scales_1' dim 0 is 2; expected E = 4",
                   scales_1=_input(_base2, "scales_1")[:2]),
    # errors: zero points
    _base3.mutated("zero_points_int8", r"input 'zero_points_0' has type int8; expected uint8$",
                   zero_points_0=_z3.astype(np.int8)),
    _base3.mutated("zero_points_blocks", r"input 'zero_points_1' dim 2 is 2; expected ceil\(H / block_size \* bits "
                   r"/ 8\) = 1$", zero_points_1=np.zeros((4, 32, 2), np.uint8)),
    _base3.mutated("zero_points_rank2_block_wise", r"input 'zero_points_0' has rank 2 .*expected rank 3$",
                   zero_points_0=_z3[:, :, 0]),
    _case("gemm2_int4_zero_points", G2, zero_points=True).mutated(
        "zero_points_per_column", r"input 'zero_points_0' dim 1 is 64; expected ceil\(2I \* bits / 8\) = 32$",
        zero_points_0=np.zeros((4, 64), np.uint8)),
    _base2.mutated("zero_points_experts", r"input 'zero_points_1' dim 0 is 3; expected E = 4",
                   zero_points_1=np.zeros((3, 16), np.uint8)),
    _base2.mutated("zero_points_2_for_gemm2", r"input 'zero_points_2' is given, but GEMM2_BIAS_SWIGLU_CLAMP does "
                   r"not use it", zero_points_2=np.zeros((4, 16), np.uint8)),
    # errors: MOE's rules, as QMOE words them
    _base2.mutated("unknown_expert_type", r"attribute 'expert_type' is 'SWIGLU'; expected one of",
                   expert_type="SWIGLU"),
    _base2.mutated("clamp_bound_absent", r"attribute 'expert_beta' is 0.0; expected a value > 0", expert_beta=None),
    _base_act.mutated("act_missing_activation", r"attribute 'activation' is required for GEMM2_ACT$", activation=None),
    _base2.mutated("hidden_rank1", r"input 'hidden_states' has rank 1 .*expected rank >= 2", hidden_states=_x[0]),
    _base2.mutated("k_mismatch", r"input 'router_topk_output_indices' dim -1 is 1; expected k = 2",
                   router_topk_output_indices=_i[:, :1]),
    _base2.mutated("routing_fp16", r"input 'routing_weights' has type float16; expected float32",
                   routing_weights=_w.astype(np.float16)),
    _base2.mutated("bias_fp16", r"input 'bias_1' has type float16; expected float32",
                   bias_1=_input(_base2, "bias_1").astype(np.float16)),
    _base2.mutated("bias_1_wrong", r"input 'bias_1' dim 1 is 4; expected H = 32",
                   bias_1=_input(_base2, "bias_1")[:, :4]),
    _base2.mutated("index_float", r"input 'router_topk_output_indices' has type float32; expected int32, int64",
                   router_topk_output_indices=_i.astype(np.float32)),
]
