"""moe_onnx.compare: the one rule for comparing two models' outputs (verify, quantize's error, run --check)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from moe_onnx.compare import Difference, OutputMismatch, compare_arrays, compare_outputs, worst

NAN, INF = math.nan, math.inf


def test_finite_values_give_the_largest_absolute_and_relative_difference():
    difference = compare_arrays(np.array([1.0, -4.0, 0.0], np.float32), np.array([1.5, -4.0, 1e-3], np.float32))
    assert difference.max_abs == 0.5
    assert difference.max_rel == pytest.approx(np.float32(1e-3) / 1e-12)  # against 0: over the 1e-12 floor
    assert difference.reference_peak == 4.0 and difference.relative_to_peak == 0.5 / 4.0
    assert not difference.within_tolerance  # rtol = atol = 0 by default: only equal values pass
    assert compare_arrays([1.0, 2.0], [1.0, 2.0]).within_tolerance
    assert compare_arrays([1.0, 2.0], [1.0, 2.5], atol=0.5).within_tolerance


@pytest.mark.parametrize("expected, got", [
    ([1.0, NAN], [1.0, 2.0]),  # NaN expected, a number got
    ([1.0, 2.0], [1.0, NAN]),  # a number expected, NaN got
    ([1.0, 2.0], [1.0, INF]),
    ([1.0, -INF], [1.0, 2.0]),
    ([1.0, INF], [1.0, -INF]),
    ([1.0, INF], [1.0, NAN]),
])
def test_a_nan_or_inf_on_one_side_is_an_infinite_difference(expected, got):
    difference = compare_arrays(np.array(expected, np.float32), np.array(got, np.float32))
    assert (difference.max_abs, difference.max_rel, difference.relative_to_peak) == (INF, INF, INF)
    assert not difference.within_tolerance
    assert not compare_arrays(expected, got, rtol=1.0, atol=1e30).within_tolerance  # no tolerance takes it


@pytest.mark.parametrize("value", [NAN, -NAN, INF, -INF])
def test_the_same_non_finite_value_on_both_sides_is_equal(value):
    difference = compare_arrays(np.array([3.0, value]), np.array([2.0, value]))
    assert (difference.max_abs, difference.max_rel) == (1.0, pytest.approx(1 / 3))
    assert difference.reference_peak == 3.0  # the largest finite |expected|
    assert compare_arrays(np.array([value]), np.array([value])) == Difference()


def test_nan_payloads_and_signs_count_as_the_same_nan():
    quiet = np.array([NAN], np.float32)
    other = np.array([0x7FC00001], np.uint32).view(np.float32)  # another payload
    assert compare_arrays(quiet, other).max_abs == 0.0 and compare_arrays(quiet, -quiet).max_abs == 0.0


def test_within_tolerance_is_isclose_of_expected():
    expected = np.array([100.0, 1.0, 0.0])
    assert compare_arrays(expected, expected + [1.0, 0.01, 0.01], rtol=0.01, atol=0.01).within_tolerance
    assert not compare_arrays(expected, expected + [1.0, 0.0201, 0.0], rtol=0.01, atol=0.01).within_tolerance
    assert compare_arrays([INF, NAN], [INF, NAN], rtol=0.0, atol=0.0).within_tolerance  # rtol * inf is no NaN


def test_shapes_that_differ_name_the_output_and_both_shapes():
    with pytest.raises(OutputMismatch, match=r"^output 'logits' has shape \[2, 4\]; expected \[2, 3\]$"):
        compare_arrays(np.zeros((2, 3)), np.zeros((2, 4)), name="logits")
    with pytest.raises(OutputMismatch, match=r"output 'y' has shape \[3\]; expected \[1, 3\]"):
        compare_arrays(np.zeros((1, 3)), np.zeros(3), name="y")  # no broadcasting


def test_empty_arrays_differ_by_nothing():
    assert compare_arrays(np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32)) == Difference()
    with pytest.raises(OutputMismatch):
        compare_arrays(np.zeros((0, 4)), np.zeros((4, 0)))


def test_integer_and_bool_outputs_compare_as_numbers():
    difference = compare_arrays(np.array([3, 7, -2], np.int64), np.array([3, 9, -2], np.int64))
    assert (difference.max_abs, difference.reference_peak) == (2.0, 7.0)
    assert compare_arrays(np.array([0, 255], np.uint8), np.array([255, 0], np.uint8)).max_abs == 255.0  # no wrap
    assert compare_arrays(np.array([True, False]), np.array([True, True])).max_abs == 1.0


def test_bfloat16_and_float16_outputs():
    bf16 = ml_dtypes.bfloat16
    difference = compare_arrays(np.array([1.0, NAN, INF], bf16), np.array([1.5, NAN, INF], bf16))
    assert difference.max_abs == 0.5 and difference.reference_peak == 1.0
    assert compare_arrays(np.array([1.0], bf16), np.array([NAN], bf16)).max_abs == INF
    assert compare_arrays(np.array([2.0], np.float16), np.array([2.0], bf16)).max_abs == 0.0  # mixed dtypes
    assert compare_arrays(np.array([1.0], np.float16), np.array([INF], np.float16)).max_abs == INF


def test_strings_compare_by_equality():
    assert compare_arrays(np.array(["a", "b"]), np.array(["a", "b"])).max_abs == 0.0
    assert compare_arrays(np.array(["a", "b"]), np.array(["a", "c"])).max_abs == INF


def test_outputs_are_compared_by_position_and_named():
    differences = compare_outputs(["a", "b"], [np.ones(2), np.ones(3)], [np.ones(2), np.array([1.0, NAN, 1.0])])
    assert {name: d.max_abs for name, d in differences.items()} == {"a": 0.0, "b": INF}
    with pytest.raises(OutputMismatch, match=r"^1 outputs; expected 2 \(a, b\)$"):
        compare_outputs(["a", "b"], [np.ones(2), np.ones(3)], [np.ones(2)])
    with pytest.raises(OutputMismatch, match="output 'b' has shape"):
        compare_outputs(["a", "b"], [np.ones(2), np.ones(3)], [np.ones(2), np.ones(2)])


def test_worst_takes_the_largest_of_each_measure():
    a, b = Difference(1.0, 5.0, 2.0, True), Difference(3.0, 0.5, 10.0, False)
    assert worst([a, b]) == Difference(3.0, 5.0, 10.0, False)
    assert worst([]) == Difference() and worst([a]) == a


def test_relative_to_peak_against_a_reference_of_zeros():
    assert compare_arrays([0.0, 0.0], [0.0, 0.0]).relative_to_peak == 0.0
    assert compare_arrays([0.0, 0.0], [0.0, 0.5]).relative_to_peak == 1.0
    assert compare_arrays([0.0, 0.0], [0.0, NAN]).relative_to_peak == INF
