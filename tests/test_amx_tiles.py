"""The tile layer the AMX kernels are written against (custom_ops/src/kernels/x86/amx/amx_tiles.h), through its test hook
MoeOnnxTileDots (custom_ops/src/kernels/x86/amx/tile_dot.h): one TDPBUSD, TDPBSUD or TDPBF16PS per dot, on the model of the
instructions or on the AMX hardware.

On every machine the model must be: TDPBUSD and TDPBSUD numpy's exact int32 (wrapping); TDPBF16PS the instruction's
pseudocode (two chains of fp32 fused multiply-adds, DAZ, FTZ after rounding, x86's NaN rules), computed
here independently in exact rational arithmetic, and within that summation's error bound of the exact
result; for partial configurations (fewer rows, narrower rows) and on several threads at once. Where
this CPU has AMX (and the OS grants it) the hardware must give the model's bits, for random tiles, tiles
of random bit patterns (NaN, infinities, denormals) and the special cases below, each thread
configuring its own tiles; elsewhere those tests skip, naming the feature.

The ISA table's AMX state and its switches (MOE_ONNX_AMX=model|off, MOE_ONNX_GEMM) are checked in
fresh processes: the table is filled once per process.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import moe_onnx
from moe_onnx.runtime import kernel_report

TDPBUSD, TDPBF16PS, TDPBSUD = 0, 1, 2


class TileDot(ctypes.Structure):
    """tile_dot.h's TileDot."""

    _fields_ = [("instruction", ctypes.c_int32), ("rows", ctypes.c_int32), ("a_colsb", ctypes.c_int32),
                ("c_colsb", ctypes.c_int32), ("a", ctypes.c_void_p), ("a_stride", ctypes.c_int64),
                ("b", ctypes.c_void_p), ("b_stride", ctypes.c_int64), ("c", ctypes.c_void_p),
                ("c_stride", ctypes.c_int64)]


def _hook():
    lib = ctypes.CDLL(moe_onnx.custom_ops_library())
    lib.MoeOnnxTileDots.argtypes = [ctypes.c_int, ctypes.POINTER(TileDot), ctypes.c_int64, ctypes.c_int,
                                    ctypes.c_char_p, ctypes.c_int64]
    lib.MoeOnnxTileDots.restype = ctypes.c_int
    return lib.MoeOnnxTileDots


class Dot:
    """C += A x B: A [rows, a_colsb] bytes, B [a_colsb / 4, c_colsb] bytes, C [rows, c_colsb / 4] int32
    or fp32 bits (uint32), each a window of a larger buffer (its row stride longer than its row, the
    bytes around it random: the instruction must neither read nor write them)."""

    def __init__(self, rng: np.random.Generator, a: np.ndarray, b: np.ndarray, c: np.ndarray):
        def framed(view: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            rows, width = view.shape
            buffer = rng.integers(0, 256, (rows + 2, width + 4 * int(rng.integers(1, 4))), dtype=np.uint8)
            buffer[1:rows + 1, :width] = view
            return buffer, buffer[1:rows + 1, :width]

        self.a_buffer, self.a = framed(np.ascontiguousarray(a).view(np.uint8))
        self.b_buffer, self.b = framed(np.ascontiguousarray(b).view(np.uint8))
        self.c_buffer, self.c = framed(np.ascontiguousarray(c, dtype=np.uint32).view(np.uint8))
        self.c_before = self.c_buffer.copy()
        self.rows, self.a_colsb = self.a.shape
        self.c_colsb = self.c.shape[1]
        assert self.b.shape == (self.a_colsb // 4, self.c_colsb)

    def struct(self, instruction: int) -> TileDot:
        return TileDot(instruction, self.rows, self.a_colsb, self.c_colsb, self.a.ctypes.data, self.a_buffer.strides[0],
                       self.b.ctypes.data, self.b_buffer.strides[0], self.c.ctypes.data, self.c_buffer.strides[0])

    def result(self) -> np.ndarray:
        """C as uint32, after checking that nothing around it changed."""
        outside = np.ones(self.c_buffer.shape, bool)
        outside[1:self.rows + 1, :self.c_colsb] = False
        np.testing.assert_array_equal(self.c_buffer[outside], self.c_before[outside], err_msg="written outside C")
        return self.c.copy().view(np.uint32)


def run_dots(instruction: int, dots: list[Dot], hardware: bool = False, threads: int = 1) -> list[np.ndarray]:
    array = (TileDot * len(dots))(*[d.struct(instruction) for d in dots])
    error = ctypes.create_string_buffer(512)
    assert _hook()(int(hardware), array, len(dots), threads, error, len(error)) == 0, error.value.decode()
    return [d.result() for d in dots]


def run_on(instruction: int, make_dots, hardware: bool, threads: int = 1) -> list[np.ndarray]:
    """The dots `make_dots()` makes (fresh buffers each call), run on the model or the hardware."""
    return run_dots(instruction, make_dots(), hardware=hardware, threads=threads)


# ----------------------------------------------------------------------------- the data

SHAPES = [(16, 16, 16), (1, 1, 1), (16, 1, 16), (1, 16, 16), (16, 16, 1), (7, 5, 11), (3, 13, 2), (12, 9, 16)]
"""(rows, K, N): K quads (TDPBUSD) or pairs (TDPBF16PS) per row of A, N columns of C."""


def bf16(values) -> np.ndarray:
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def fp32_bits(values) -> np.ndarray:
    return np.asarray(values, np.float32).view(np.uint32)


def bf16_operands(rng, kind: str, shape) -> np.ndarray:
    """bf16 bits of a kind of data: "normal" (wide exponents), "cancelling" (small integers: exact
    cancellations), "tiny" (products near 2^-126 and below: FTZ and DAZ at work), "denormal" (bf16
    denormals mixed in), "bits" (any pattern: NaN, infinities, denormals)."""
    if kind == "normal":
        return bf16(rng.standard_normal(shape) * 2.0 ** rng.integers(-12, 12, shape))
    if kind == "cancelling":
        return bf16(rng.integers(-6, 7, shape))
    if kind == "tiny":
        return bf16(rng.choice([-1.0, 1.0], shape) * (1 + rng.random(shape)) * 2.0 ** rng.integers(-70, -56, shape))
    if kind == "denormal":
        values = bf16(rng.standard_normal(shape))
        mask = rng.random(shape) < 0.3
        values[mask] = rng.integers(1, 128, int(mask.sum())) | (rng.integers(0, 2, int(mask.sum())) << 15)
        return values.astype(np.uint16)
    assert kind == "bits"
    return rng.integers(0, 1 << 16, shape, dtype=np.uint16)


def fp32_accumulators(rng, kind: str, shape) -> np.ndarray:
    if kind == "tiny":  # around 2^-126, denormals included
        return fp32_bits(rng.choice([-1.0, 1.0], shape) * (1 + rng.random(shape)) * 2.0 ** rng.integers(-130, -120, shape))
    if kind == "bits":
        return rng.integers(0, 1 << 32, shape, dtype=np.uint32)
    return fp32_bits(rng.standard_normal(shape) * 2.0 ** rng.integers(-8, 8, shape))


def bf16_dots(rng, kind: str, count_per_shape: int = 2) -> list[Dot]:
    dots = []
    for rows, K, N in SHAPES:
        for _ in range(count_per_shape):
            a = bf16_operands(rng, kind, (rows, 2 * K))
            b = bf16_operands(rng, kind, (K, 2 * N))
            dots.append(Dot(rng, a, b, fp32_accumulators(rng, kind, (rows, N))))
    return dots


def int8_dots(rng, count_per_shape: int = 2) -> list[Dot]:
    dots = []
    for rows, K, N in SHAPES:
        for _ in range(count_per_shape):
            a = rng.integers(0, 256, (rows, 4 * K), dtype=np.uint8)
            b = rng.integers(-128, 128, (K, 4 * N), dtype=np.int8)
            dots.append(Dot(rng, a, b, rng.integers(-2**31, 2**31, (rows, N)).astype(np.int32).view(np.uint32)))
    return dots


def int8_extreme_dots(rng) -> list[Dot]:
    """All 255 x -128 (TDPBUSD's most negative products; TDPBSUD reads the same bytes as -1 x 128),
    255 x 127, 0 x anything, 128 x -1 (TDPBSUD's -128 x 255), onto accumulators at the ends of int32
    so that the sums wrap."""
    dots = []
    for a_value, b_value in ((255, -128), (255, 127), (0, -128), (128, -1)):
        for c_value in (-2**31, 2**31 - 1, 0, -1):
            a = np.full((16, 64), a_value, np.uint8)
            b = np.full((16, 64), b_value, np.int8)
            dots.append(Dot(rng, a, b, np.full((16, 16), c_value, np.int64).astype(np.int32).view(np.uint32)))
    return dots


# ----------------------------------------------------------------------------- the oracles

def int8_reference(dot: Dot, instruction: int = TDPBUSD) -> np.ndarray:
    """C + sum of A x B, exactly, wrapped to int32 (as bits): uint8 A x int8 B (TDPBUSD) or int8 A x
    uint8 B (TDPBSUD)."""
    signed_a = instruction == TDPBSUD
    a = dot.a.view(np.int8 if signed_a else np.uint8).astype(np.int64).reshape(dot.rows, -1, 4)
    b = dot.b.view(np.uint8 if signed_a else np.int8).astype(np.int64).reshape(dot.a_colsb // 4, -1, 4)
    c = dot.c_before[1:dot.rows + 1, :dot.c_colsb].copy().view(np.uint32).astype(np.int64)
    return ((c + np.einsum("mki,kni->mn", a, b)) & 0xFFFFFFFF).astype(np.uint32)


DEFAULT_NAN = 0xFFC00000
QUIET = 0x00400000


def _is_nan(bits: int) -> bool:
    return (bits & 0x7F800000) == 0x7F800000 and (bits & 0x7FFFFF) != 0


def _is_inf(bits: int) -> bool:
    return (bits & 0x7FFFFFFF) == 0x7F800000


def _negative(bits: int) -> bool:
    return bool(bits >> 31)


def _daz(bits: int) -> int:
    return bits & 0x80000000 if (bits & 0x7F800000) == 0 else bits


def _exact(bits: int) -> Fraction:
    """A finite fp32 (bits) exactly."""
    exponent, fraction = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    magnitude = Fraction(fraction, 1 << 23) * Fraction(2) ** -126 if exponent == 0 else \
        Fraction((1 << 23) | fraction, 1 << 23) * Fraction(2) ** (exponent - 127)
    return -magnitude if _negative(bits) else magnitude


def _round(x: Fraction, zero_sign: int) -> int:
    """x rounded to fp32 bits: nearest even with an unbounded exponent, then +-inf past the range and a
    zero of x's sign below 2^-126 (FTZ after rounding); an exact zero gets `zero_sign`."""
    if x == 0:
        return zero_sign
    sign = 0x80000000 if x < 0 else 0
    x = abs(x)
    exponent = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** exponent > x:
        exponent -= 1
    scaled = x / Fraction(2) ** (exponent - 23)  # in [2^23, 2^24)
    q, rest = divmod(scaled.numerator, scaled.denominator)
    if 2 * rest > scaled.denominator or (2 * rest == scaled.denominator and q & 1):
        q += 1
    if q == 1 << 24:
        q, exponent = q >> 1, exponent + 1
    if exponent > 127:
        return sign | 0x7F800000
    if exponent < -126:
        return sign
    return sign | ((exponent + 127) << 23) | (q & 0x7FFFFF)


def _fma(a: int, b: int, c: int) -> int:
    """a * b + c on fp32 bits as TDPBF16PS's chains compute it (a and b: DAZ'd bf16 as fp32)."""
    for operand in (a, b, c):
        if _is_nan(operand):
            return operand | QUIET
    product_zero = (a & 0x7FFFFFFF) == 0 or (b & 0x7FFFFFFF) == 0
    product_negative = _negative(a) != _negative(b)
    if _is_inf(a) or _is_inf(b):
        if product_zero or (_is_inf(c) and _negative(c) != product_negative):
            return DEFAULT_NAN
        return (0x80000000 if product_negative else 0) | 0x7F800000
    if _is_inf(c):
        return c
    both_negative_zero = product_zero and product_negative and c == 0x80000000
    return _round(_exact(a) * _exact(b) + _exact(c), 0x80000000 if both_negative_zero else 0)


def _add(a: int, b: int) -> int:
    for operand in (a, b):
        if _is_nan(operand):
            return operand | QUIET
    if _is_inf(a) or _is_inf(b):
        if _is_inf(a) and _is_inf(b) and a != b:
            return DEFAULT_NAN
        return a if _is_inf(a) else b
    return _round(_exact(a) + _exact(b), 0x80000000 if a == b == 0x80000000 else 0)


def tdpbf16ps_element(c: int, a_row: np.ndarray, b_column: np.ndarray) -> int:
    """TDPBF16PS's pseudocode on one element (bits): c + (chain of the first elements of the pairs +
    chain of the second), each chain fused multiply-adds from +0 in increasing k."""
    a = [_daz(int(x) << 16) for x in a_row]
    b = [_daz(int(x) << 16) for x in b_column]
    first = second = 0
    for k in range(len(a) // 2):
        first = _fma(a[2 * k], b[2 * k], first)
        second = _fma(a[2 * k + 1], b[2 * k + 1], second)
    return _add(_daz(c), _add(first, second))


def tdpbf16ps_reference(dot: Dot) -> np.ndarray:
    a = dot.a.copy().view(np.uint16)
    b = dot.b.copy().view(np.uint16).reshape(dot.a_colsb // 4, -1, 2)
    c = dot.c_before[1:dot.rows + 1, :dot.c_colsb].copy().view(np.uint32)
    out = np.empty_like(c)
    for m in range(dot.rows):
        for n in range(c.shape[1]):
            out[m, n] = tdpbf16ps_element(int(c[m, n]), a[m], b[:, n].reshape(-1))
    return out


def assert_same_bits(got: np.ndarray, expected: np.ndarray, what: str):
    if not np.array_equal(got, expected):
        where = np.argwhere(got != expected)[:5]
        pytest.fail(f"{what}: {int((got != expected).sum())} of {got.size} elements differ, first at "
                    f"{where.tolist()}: {[hex(int(got[tuple(w)])) for w in where]} vs "
                    f"{[hex(int(expected[tuple(w)])) for w in where]}")


# ----------------------------------------------------------------------------- the model, everywhere

@pytest.mark.parametrize("instruction", [TDPBUSD, TDPBSUD], ids=["tdpbusd", "tdpbsud"])
def test_model_int8_products_are_exact(instruction):
    """The same bytes read as u8 A x s8 B (TDPBUSD) or s8 A x u8 B (TDPBSUD): 255 x -128 is the one,
    -1 x 128 the other."""
    rng = np.random.default_rng(1)
    dots = int8_dots(rng, count_per_shape=3) + int8_extreme_dots(rng)
    for i, (dot, got) in enumerate(zip(dots, run_dots(instruction, dots))):
        assert_same_bits(got, int8_reference(dot, instruction), f"dot {i} {dot.rows}x{dot.a_colsb}x{dot.c_colsb}")


# The exact-arithmetic pseudocode takes about a second a kind: the fast lane checks any-bits data (NaN,
# infinities, denormals and normal numbers of every exponent).
@pytest.mark.parametrize("kind", [pytest.param(kind, marks=pytest.mark.slow) for kind in
                                  ("normal", "cancelling", "tiny", "denormal")] + ["bits"])
def test_model_tdpbf16ps_is_the_pseudocode(kind):
    rng = np.random.default_rng(["normal", "cancelling", "tiny", "denormal", "bits"].index(kind))
    dots = bf16_dots(rng, kind)
    for i, (dot, got) in enumerate(zip(dots, run_dots(TDPBF16PS, dots))):
        assert_same_bits(got, tdpbf16ps_reference(dot), f"{kind} dot {i} {dot.rows}x{dot.a_colsb}x{dot.c_colsb}")


@pytest.mark.parametrize("kind", ["normal", "cancelling", "tiny"])
def test_model_tdpbf16ps_error_bound(kind):
    """Within the chains' bound of the exact result: each of the K + 2 roundings a chain element sees
    errs by at most 2^-24 of the sum of the absolute terms S (products and accumulator, DAZ applied),
    and each of the 2K + 2 flushes by less than 2^-126."""
    rng = np.random.default_rng(10 + ["normal", "cancelling", "tiny"].index(kind))
    dots = bf16_dots(rng, kind)
    for dot, got in zip(dots, run_dots(TDPBF16PS, dots)):
        K = dot.a_colsb // 4
        def daz(bits: np.ndarray) -> np.ndarray:
            return np.where((bits & 0x7F800000) == 0, bits & 0x80000000, bits).astype(np.uint32)

        a = daz(dot.a.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        b = daz(dot.b.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        c = daz(dot.c_before[1:dot.rows + 1, :dot.c_colsb].copy().view(np.uint32)).view(np.float32)
        b = b.reshape(K, -1, 2).transpose(1, 0, 2).reshape(dot.c_colsb // 4, 2 * K)
        for m in range(dot.rows):
            for n in range(b.shape[0]):
                exact = sum((Fraction(x) * Fraction(y) for x, y in zip(a[m], b[n])), Fraction(float(c[m, n])))
                terms = float(np.sum(np.abs(a[m] * b[n]))) + abs(float(c[m, n]))
                bound = (K + 2) * 2.0 ** -24 * terms * (1 + 2.0 ** -20) + (2 * K + 2) * 2.0 ** -126
                value = float(got[m, n:n + 1].view(np.float32)[0])
                assert math.isfinite(value) and abs(Fraction(value) - exact) <= Fraction(bound), (m, n, value, exact)


SPECIAL_CASES = {
    # name: (C bits, A's row of bf16 pairs, B's column of bf16 pairs, the result's bits). One element,
    # pairs k = 0, 1, ...: A[2k], A[2k + 1] times B[2k], B[2k + 1]. 0x3f80 is 1.0.
    "bf16 denormals read as zero": (0, [0x0001, 0x0040], [0x7180, 0x7180], 0),  # (2^-133 ...) * 2^100
    "a denormal accumulator reads as zero": (0x00400000, [0x0080, 0], [0x3F80, 0], 0x00800000),
    "a tiny chain is flushed": (0, [0x0080, 0x0080], [0x3F00, 0x3F00], 0),  # 2^-127 + 2^-127
    "a tiny product is flushed before the accumulator": (0x80800000, [0x0080, 0], [0x3F7F, 0], 0x80800000),
    "a tiny sum keeps its sign": (0x80C00000, [0x0080, 0], [0x3F80, 0], 0x80000000),
    "tininess after rounding: 2^-126 - 2^-150 is flushed": (0, [0x0080, 0, 0x1A00, 0, 0x1A40, 0],
                                                            [0x3F80, 0, 0x1A80, 0, 0x9A80, 0], 0),
    "tininess after rounding: 2^-126 - 2^-152 rounds up": (0, [0x0080, 0, 0x1A00, 0, 0x1A10, 0],
                                                           [0x3F80, 0, 0x1A80, 0, 0x9A80, 0], 0x00800000),
    "-0 + -0 * 1 is +0 (the chains start at +0)": (0x80000000, [0x8000, 0x8000], [0x3F80, 0x3F80], 0),
    "a NaN accumulator wins, quieted": (0x7F812345, [0x7FC1, 0], [0x3F80, 0], 0x7FC12345),
    "a NaN of A, quieted": (0, [0x7F81, 0], [0x3F80, 0], 0x7FC10000),
    "the latest k's NaN within a chain": (0, [0x7FC1, 0, 0x7FC7, 0], [0x3F80, 0, 0x3F80, 0], 0x7FC70000),
    "the first chain's NaN over the second's": (0, [0x3F80, 0x7FC1], [0x7FC7, 0x3F80], 0x7FC70000),
    "A's NaN over B's in one product": (0, [0xFFC1, 0], [0x7FC7, 0], 0xFFC10000),
    "a NaN beats a later invalid product": (0, [0x7FC7, 0, 0x7F80, 0], [0x3F80, 0, 0, 0], 0x7FC70000),
    "inf * 0 is the default NaN": (0, [0x7F80, 0], [0, 0], DEFAULT_NAN),
    "inf - inf across the chains is the default NaN": (0, [0x7F80, 0xFF80], [0x3F80, 0x3F80], DEFAULT_NAN),
    "a product past the range is infinite": (0, [0x7F00, 0x7F00], [0x4000, 0xC000], DEFAULT_NAN),
    "no overflow inside a chain's fused multiply-add": (0, [0x7F00, 0x7F00, 0x7F00, 0], [0x3FC0, 0x3FC0, 0xC000, 0],
                                                        0x7F000000),
    "overflow of the sum": (0, [0x7F00, 0x7F00], [0x3FC0, 0x3FC0], 0x7F800000),
}


def special_dots(rng) -> list[Dot]:
    dots = []
    for c, a, b, _ in SPECIAL_CASES.values():
        K = len(a) // 2
        dots.append(Dot(rng, np.array([a], np.uint16), np.array(b, np.uint16).reshape(K, 2),
                        np.array([[c]], np.uint32)))
    return dots


@pytest.mark.parametrize("name", list(SPECIAL_CASES))
def test_model_tdpbf16ps_special_values(name):
    """What the hardware showed (the same cases run there below), and the pseudocode oracle agrees."""
    index = list(SPECIAL_CASES).index(name)
    dot = special_dots(np.random.default_rng(0))[index]
    got = int(run_dots(TDPBF16PS, [dot])[0][0, 0])
    expected = SPECIAL_CASES[name][3]
    assert got == expected, f"{got:#010x} != {expected:#010x}"
    assert int(tdpbf16ps_reference(dot)[0, 0]) == expected


@pytest.mark.parametrize("instruction", [TDPBUSD, TDPBF16PS])
def test_model_on_several_threads(instruction):
    """Shapes interleaved on 4 threads (each configuring its own tiles, again at each change of shape)
    give the bits of one thread."""
    make = (lambda: int8_dots(np.random.default_rng(5))) if instruction == TDPBUSD else \
        (lambda: bf16_dots(np.random.default_rng(5), "normal"))
    one = run_on(instruction, make, hardware=False)
    four = run_on(instruction, make, hardware=False, threads=4)
    for i, (x, y) in enumerate(zip(one, four)):
        assert_same_bits(y, x, f"dot {i}")


@pytest.mark.parametrize("field, value, message", [
    ("instruction", 3, "dot 0: instruction must be 0 (TDPBUSD), 1 (TDPBF16PS) or 2 (TDPBSUD)"),
    ("rows", 17, "dot 0: rows must be in 1..16"),
    ("a_colsb", 6, "dot 0: a_colsb and c_colsb must be multiples of 4 in 4..64"),
    ("c_colsb", 68, "dot 0: a_colsb and c_colsb must be multiples of 4 in 4..64"),
    ("a_stride", 4, "dot 0: a row stride is shorter than its row"),
])
def test_hook_refuses_invalid_dots(field, value, message):
    valid = int8_dots(np.random.default_rng(0), count_per_shape=1)[0]
    dot = valid.struct(TDPBUSD)
    setattr(dot, field, value)
    error = ctypes.create_string_buffer(256)
    assert _hook()(0, (TileDot * 1)(dot), 1, 1, error, len(error)) == 1
    assert error.value.decode() == message


# ----------------------------------------------------------------------------- the hardware, where it exists

def _hardware_or_skip():
    report = kernel_report()
    if report["amx"] != "usable":
        pytest.skip(f"AMX (amx_tile, amx_int8, amx_bf16) is not usable here: {report['amx']} "
                    f"({report['amx_reason']})")


@pytest.mark.parametrize("instruction", [TDPBUSD, TDPBSUD], ids=["tdpbusd", "tdpbsud"])
def test_hardware_int8_products_are_the_model(instruction):
    _hardware_or_skip()
    make = lambda: int8_dots(np.random.default_rng(20), count_per_shape=4) + int8_extreme_dots(np.random.default_rng(21))  # noqa: E731
    for i, (h, m) in enumerate(zip(run_on(instruction, make, hardware=True), run_on(instruction, make, hardware=False))):
        assert_same_bits(h, m, f"dot {i}")


@pytest.mark.parametrize("kind", ["normal", "cancelling", "tiny", "denormal", "bits"])
def test_hardware_tdpbf16ps_is_the_model(kind):
    _hardware_or_skip()
    make = lambda: bf16_dots(np.random.default_rng(30 + len(kind)), kind, count_per_shape=20)  # noqa: E731
    for i, (h, m) in enumerate(zip(run_on(TDPBF16PS, make, hardware=True), run_on(TDPBF16PS, make, hardware=False))):
        assert_same_bits(h, m, f"{kind} dot {i}")


def test_hardware_tdpbf16ps_special_values():
    _hardware_or_skip()
    got = run_dots(TDPBF16PS, special_dots(np.random.default_rng(0)), hardware=True)
    for (name, case), result in zip(SPECIAL_CASES.items(), got):
        assert int(result[0, 0]) == case[3], f"{name}: {int(result[0, 0]):#010x} != {case[3]:#010x}"


@pytest.mark.parametrize("instruction", [TDPBUSD, TDPBF16PS])
def test_hardware_configures_each_thread(instruction):
    """4 threads at once, shapes interleaved: each thread loads its own configuration (a thread that
    did not would fault), and the bits are the model's."""
    _hardware_or_skip()
    make = (lambda: int8_dots(np.random.default_rng(40), count_per_shape=3)) if instruction == TDPBUSD else \
        (lambda: bf16_dots(np.random.default_rng(40), "bits", count_per_shape=3))
    for i, (h, m) in enumerate(zip(run_on(instruction, make, hardware=True, threads=4),
                                   run_on(instruction, make, hardware=False))):
        assert_same_bits(h, m, f"dot {i}")


# ----------------------------------------------------------------------------- the table's AMX state

def _report_in(env: dict[str, str]) -> dict[str, str] | str:
    """kernel_report() in a fresh process with `env`, or its error message."""
    code = ("import json\nfrom moe_onnx.runtime import kernel_report\ntry:\n    print(json.dumps(kernel_report()))\n"
            "except ValueError as e:\n    print(json.dumps(str(e)))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _without_switches() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("MOE_ONNX_AMX", "MOE_ONNX_GEMM")}


@pytest.mark.slow
@pytest.mark.subprocess
def test_amx_model_switch():
    """MOE_ONNX_AMX=model: the AMX slots on the model, on any CPU; the hardware hook refuses, saying so."""
    report = _report_in({**_without_switches(), "MOE_ONNX_AMX": "model"})
    assert (report["amx"], report["amx_int8"], report["amx_bf16"]) == ("modelled", "yes", "yes")
    assert report["amx_reason"] == "MOE_ONNX_AMX=model: the scalar model of the tiles"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import numpy as np, ctypes, test_amx_tiles as t\n"
            "d = t.int8_dots(np.random.default_rng(0), 1)[0]; e = ctypes.create_string_buffer(256)\n"
            "print(t._hook()(1, (t.TileDot * 1)(d.struct(0)), 1, 1, e, 256), e.value.decode())")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)],
                         env={**_without_switches(), "MOE_ONNX_AMX": "model"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "1 AMX is not usable here (modelled: MOE_ONNX_AMX=model: the scalar model of the tiles)"


@pytest.mark.slow
@pytest.mark.subprocess
def test_amx_switch_errors():
    assert _report_in({**_without_switches(), "MOE_ONNX_AMX": "fast"}) == (
        "MOE_ONNX_AMX='fast' is not a mode; expected 'model' (the AMX kernels on the scalar model of the tile "
        "instructions) or 'off' (unset: the hardware where it is usable)")
    report = _report_in({**_without_switches(), "MOE_ONNX_AMX": "model", "MOE_ONNX_GEMM": "amx"})
    assert report.startswith("MOE_ONNX_GEMM=amx: this CPU (or this build of the library) supports up to '")
    assert report.endswith("(AMX: MOE_ONNX_AMX=model: the scalar model of the tiles)")


@pytest.mark.slow
@pytest.mark.subprocess
def test_amx_off_and_capped():
    """Where AMX is usable: MOE_ONNX_AMX=off and MOE_ONNX_GEMM below amx leave it unused, saying why."""
    _hardware_or_skip()
    off = _report_in({**_without_switches(), "MOE_ONNX_AMX": "off"})
    assert (off["level"], off["amx"], off["amx_reason"], off["amx_int8"]) == ("avx512", "off", "MOE_ONNX_AMX=off", "no")
    capped = _report_in({**_without_switches(), "MOE_ONNX_GEMM": "avx512"})
    assert (capped["level"], capped["amx"], capped["amx_reason"]) == ("avx512", "capped", "MOE_ONNX_GEMM=avx512")
