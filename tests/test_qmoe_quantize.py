"""QMOE's two layout directions: dequantize (bytes -> float32 [E, N, K]) and quantize (its inverse for
quant_type int), with the numbers each promises; and the int8-activation cases of the case table."""

from __future__ import annotations

import numpy as np
import pytest
from cases import qmoe as qmoe_table

import moe_onnx.ops.qmoe as qmoe_module
from moe_onnx.ops.qmoe import dequantize, pack_codes, quantize, unpack_codes

SHAPE = (3, 5, 64)  # E, N, K


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_and_unpack_are_inverse(bits):
    codes = np.random.default_rng(0).integers(0, 1 << bits, (3, 5, 7), dtype=np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 5, 7 if bits == 8 else 4)
    np.testing.assert_array_equal(unpack_codes(packed, bits, 7), codes)
    if bits == 4:  # the even index in the low nibble; an odd count leaves the last high nibble 0
        assert packed[0, 0, 0] == codes[0, 0, 0] | (codes[0, 0, 1] << 4)
        np.testing.assert_array_equal(packed[..., -1] >> 4, 0)


def test_dequantize_int_by_hand():
    """Two columns of K = 4, 4 bits, per column: column 0 without zero points (8), column 1 likewise;
    then with packed zero points 3 and 12."""
    weight = np.array([[[0x80, 0xF1], [0x08, 0x00]]], np.uint8)  # codes [0, 8, 1, 15] and [8, 0, 0, 0]
    scales = np.array([[0.5, 2.0]], np.float32)
    got = dequantize(weight, scales, None, bits=4, block_size=0, k_dim=4)
    np.testing.assert_array_equal(got, [[[-4.0, 0.0, -3.5, 3.5], [0.0, -16.0, -16.0, -16.0]]])
    zero_points = np.array([[0xC3]], np.uint8)  # column 0: 3, column 1: 12
    got = dequantize(weight, scales, zero_points, bits=4, block_size=0, k_dim=4)
    np.testing.assert_array_equal(got, [[[-1.5, 2.5, -1.0, 6.0], [-8.0, -24.0, -24.0, -24.0]]])


def test_dequantize_mxfp4_by_hand():
    weight = np.zeros((1, 1, 16), np.uint8)
    weight[0, 0, 0] = 0x21  # k 0: code 1 (0.5), k 1: code 2 (1.0)
    weight[0, 0, 1] = 0xF9  # k 2: code 9 (-0.5), k 3: code 15 (-6)
    scales = np.array([[[128]]], np.uint8)  # 2^(128 - 127) = 2
    got = dequantize(weight, scales, None, bits=4, block_size=32, quant_type="mxfp4", k_dim=32)
    np.testing.assert_array_equal(got[0, 0, :5], [1.0, 2.0, -1.0, -12.0, 0.0])
    assert np.isnan(dequantize(weight, np.full((1, 1, 1), 255, np.uint8), None, bits=4, block_size=32,
                               quant_type="mxfp4", k_dim=32)).all()


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero_points"])
@pytest.mark.parametrize("block_size", [0, 16, 32])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_error_is_at_most_half_a_step(bits, block_size, symmetric):
    w = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    weight, scales, zero_points = quantize(w, bits=bits, block_size=block_size, symmetric=symmetric)
    assert weight.dtype == np.uint8 and weight.shape == (*SHAPE[:2], SHAPE[2] * bits // 8)
    blocks = SHAPE[2] // block_size if block_size else 1
    assert scales.dtype == np.float32 and scales.shape == ((*SHAPE[:2], blocks) if block_size else SHAPE[:2])
    assert (zero_points is None) == symmetric
    if not symmetric:
        assert zero_points.shape == ((*SHAPE[:2], -(-blocks * bits // 8)) if block_size
                                     else (SHAPE[0], -(-SHAPE[1] * bits // 8)))
    got = dequantize(weight, scales, zero_points, bits=bits, block_size=block_size, k_dim=SHAPE[2])
    step = np.repeat(scales.reshape(*SHAPE[:2], blocks), SHAPE[2] // blocks, axis=-1)
    assert (np.abs(got - w) <= step * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("block_size", [0, 16])
@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_quantize_of_dequantize_gives_the_codes_back(bits, block_size):
    """Codes whose blocks each reach the full symmetric range come back exactly, scales within a rounding."""
    rng = np.random.default_rng(2)
    half = 1 << (bits - 1)
    codes = rng.integers(1, 2 * half, SHAPE).astype(np.uint8)  # 1 .. 2^bits - 1: symmetric around half
    size = block_size or SHAPE[2]
    codes[..., ::size] = 2 * half - 1  # every block reaches +(half - 1)
    blocks = SHAPE[2] // size
    scales = rng.uniform(0.01, 1.0, (*SHAPE[:2], blocks) if block_size else SHAPE[:2]).astype(np.float32)
    weight = pack_codes(codes, bits)
    w = dequantize(weight, scales, None, bits=bits, block_size=block_size, k_dim=SHAPE[2])
    again, again_scales, zero_points = quantize(w, bits=bits, block_size=block_size, symmetric=True)
    assert zero_points is None
    np.testing.assert_array_equal(again, weight)
    np.testing.assert_allclose(again_scales, scales, rtol=2 ** -23, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_asymmetric_quantize_keeps_zero_exact(bits):
    """The zero point is an integer code: a weight of 0 dequantizes to exactly 0."""
    w = np.random.default_rng(3).uniform(-0.2, 1.0, SHAPE).astype(np.float32)
    w[..., 5] = 0.0
    weight, scales, zero_points = quantize(w, bits=bits, block_size=32, symmetric=False)
    got = dequantize(weight, scales, zero_points, bits=bits, block_size=32, k_dim=SHAPE[2])
    np.testing.assert_array_equal(got[..., 5], 0.0)


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_block_of_zeros(symmetric):
    w = np.zeros((1, 2, 32), np.float32)
    weight, scales, zero_points = quantize(w, bits=4, block_size=16, symmetric=symmetric)
    np.testing.assert_array_equal(scales, 0.0)
    got = dequantize(weight, scales, zero_points, bits=4, block_size=16, k_dim=32)
    np.testing.assert_array_equal(got, 0.0)


def test_quantize_rejects_a_block_size_not_dividing_k():
    with pytest.raises(ValueError, match="K = 48 must be a multiple of block_size 32"):
        quantize(np.zeros((1, 1, 48), np.float32), bits=4, block_size=32)


def test_int8_activation_cases_are_clear_of_rounding_ties(monkeypatch):
    """In the case table's accuracy_level 4 cases every int8 activation is at least 1e-4 steps from a
    rounding tie, so kernels that sum in another order (float32 differences ~1e-6 relative, upstream of the
    down projection's activations) still take the same codes and must match the reference closely."""
    closest = []

    def recording(a, codes, scale, zp, block_size):
        rows, k_dim = a.shape
        blocks = scale.shape[1]
        if a.size:
            a_blocks = a.reshape(rows, blocks, block_size or k_dim)
            with np.errstate(divide="ignore", invalid="ignore"):
                steps = a_blocks / (np.abs(a_blocks).max(axis=-1, keepdims=True) / np.float32(127))
            steps = steps[np.isfinite(steps)]
            if steps.size:
                closest.append(float(np.abs(np.abs(steps - np.floor(steps)) - 0.5).min()))
        return qmoe_linear(a, codes, scale, zp, block_size)

    qmoe_linear = qmoe_module.int8_linear
    monkeypatch.setattr(qmoe_module, "int8_linear", recording)
    cases = [c for c in qmoe_table.CASES if c.error is None and c.attrs.get("accuracy_level") == 4]
    assert len(cases) >= 8
    for case in cases:
        closest.clear()
        case.run_reference()
        assert min(closest, default=1.0) > 1e-4, case.name
