"""The tensor-parallel meaning of MoeRowParallelLinear: K-shards, bias-free partials, all-reduce, bias once."""

from __future__ import annotations

import numpy as np
import pytest
from cases.row_parallel_linear import BF16, CASES, make_inputs, oracle
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_onnx.ops import MoeOpError
from moe_onnx.ops._common import ArrayView
from moe_onnx.ops.row_parallel_linear import (
    ROW_PARALLEL_LINEAR,
    partial_product,
    rank_input,
    row_parallel_linear,
    row_parallel_linear_tensor_parallel,
)

K = 10
# widths of the ranks' K-slices, even and uneven, over 1 to 4 ranks
SPLITS = [(10,), (5, 5), (3, 7), (9, 1), (4, 3, 3), (1, 8, 1), (3, 3, 2, 2), (1, 1, 1, 7), (0, 10), (4, 0, 6)]
OFFSETS = (1, 3, 3, 9, 11)  # row 0 and rows 11.. belong to no expert, expert 1 is empty


def shard_k(array: np.ndarray, widths) -> list[np.ndarray]:
    """Cut the last axis into consecutive slices of the given widths, rank 0 first."""
    return np.split(array, np.cumsum(widths)[:-1], axis=-1)


def tensor_parallel(x, offsets, w, b, widths, input_is_parallel, **attrs):
    """Run the TP reference as the ranks would receive their inputs."""
    x_given = shard_k(x, widths) if input_is_parallel else x
    return row_parallel_linear_tensor_parallel(x_given, offsets, shard_k(w, widths), b,
                                               input_is_parallel=input_is_parallel, **attrs)[0]


@pytest.mark.parametrize("input_is_parallel", [0, 1])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("widths", SPLITS, ids=lambda w: "x".join(map(str, w)))
@pytest.mark.parametrize("dtype", [np.float32, np.int8], ids=["fp32", "int8"])
def test_sum_of_rank_partials_equals_one_process(dtype, widths, bias, input_is_parallel):
    x, offsets, w, b = make_inputs(offsets=OFFSETS, lead=(3, 4), k=K, n=6, dtype=dtype, bias=bias)
    expected = row_parallel_linear(x, offsets, w, b)[0]
    got = tensor_parallel(x, offsets, w, b, widths, input_is_parallel, in_features=K)
    assert got.dtype == expected.dtype and got.shape == expected.shape == (3, 4, 6)
    if dtype == np.int8:
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
def test_half_precision_partials_match_within_rounding(dtype):
    x, offsets, w, b = make_inputs(offsets=OFFSETS, lead=(12,), k=K, n=6, dtype=dtype)
    expected = row_parallel_linear(x, offsets, w, b)[0].astype(np.float64)
    got = tensor_parallel(x, offsets, w, b, (3, 3, 4), 1).astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)


def test_bias_is_added_once_after_the_all_reduce():
    x, offsets, w, b = make_inputs(offsets=OFFSETS, lead=(12,), k=K, n=6, dtype=np.int8)
    with_bias = tensor_parallel(x, offsets, w, b, (2, 3, 5), 0)
    without = tensor_parallel(x, offsets, w, None, (2, 3, 5), 0)
    owner = np.repeat(np.arange(4), np.diff(offsets))
    expected = np.zeros_like(with_bias)
    expected[offsets[0]:offsets[-1]] = b[owner]
    np.testing.assert_array_equal(with_bias - without, expected)


def test_rank_partials_carry_no_bias_and_sum_to_the_product():
    x, offsets, w, b = make_inputs(offsets=OFFSETS, lead=(12,), k=K, n=6, dtype=np.int8)
    partials = [partial_product(x_d, offsets, w_d) for x_d, w_d in zip(shard_k(x, (4, 6)), shard_k(w, (4, 6)))]
    assert all(p.dtype == np.int32 for p in partials)
    np.testing.assert_array_equal(partials[0] + partials[1], row_parallel_linear(x, offsets, w)[0])


def test_full_and_pre_split_input_agree():
    x, offsets, w, b = make_inputs(offsets=OFFSETS, lead=(12,), k=K, n=6)
    np.testing.assert_array_equal(tensor_parallel(x, offsets, w, b, (3, 7), 0),
                                  tensor_parallel(x, offsets, w, b, (3, 7), 1))


@pytest.mark.parametrize("offsets,lead", [((0, 0, 0), (0,)), ((0, 0, 0), (2, 0)), ((2, 2, 2), (5,)),
                                          ((0, 5), (5,)), ((0, 1, 1), ())],
                         ids=["zero_rows", "zero_rows_rank3", "no_row_covered", "one_expert", "x_rank1"])
def test_edge_shapes(offsets, lead):
    x, offsets, w, b = make_inputs(offsets=offsets, lead=lead, k=K, n=3, dtype=np.int8)
    np.testing.assert_array_equal(tensor_parallel(x, offsets, w, b, (1, 4, 5), 1),
                                  row_parallel_linear(x, offsets, w, b)[0])


@pytest.mark.fuzz
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_splits_and_offsets(data):
    rows, k, experts = data.draw(st.integers(0, 9)), data.draw(st.integers(1, 12)), data.draw(st.integers(1, 5))
    cuts = sorted(data.draw(st.lists(st.integers(0, rows), min_size=experts + 1, max_size=experts + 1)))
    ranks = data.draw(st.integers(1, 4))
    edges = sorted(data.draw(st.lists(st.integers(0, k), min_size=ranks - 1, max_size=ranks - 1)))
    widths = np.diff([0, *edges, k])
    dtype = data.draw(st.sampled_from([np.float32, np.int8]))
    x, offsets, w, b = make_inputs(offsets=cuts, lead=(rows,), k=k, n=4, dtype=dtype, seed=rows * 31 + k)
    got = tensor_parallel(x, offsets, w, b, widths, data.draw(st.sampled_from([0, 1])))
    np.testing.assert_allclose(got, row_parallel_linear(x, offsets, w, b)[0], rtol=1e-5, atol=1e-5)
    if dtype == np.int8:
        np.testing.assert_array_equal(got, oracle(x, offsets, w, b))


def test_in_features_means_the_full_k():
    x, offsets, w, b = make_inputs(offsets=OFFSETS, lead=(12,), k=K, n=6)
    tensor_parallel(x, offsets, w, b, (4, 6), 1, in_features=K)
    with pytest.raises(MoeOpError, match=r"expected K = 4 \(from attribute 'in_features'\)"):
        tensor_parallel(x, offsets, w, b, (4, 6), 1, in_features=4)


@pytest.mark.parametrize("shards,input_is_parallel,error", [
    (lambda x, w: (x, []), 0, r"W_shards is empty; expected one W_d \[E, N, K_d\] per rank"),
    (lambda x, w: (x, [w[:, :, :4], w[:3, :, 4:]]), 0, r"W shard 1 has shape \[3, 6, 6\]; expected \[4, 6, K_d\]"),
    (lambda x, w: (x, [w[:, :, :4], w[:, :5, 4:]]), 0, r"W shard 1 has shape \[4, 5, 6\]; expected \[4, 6, K_d\]"),
    (lambda x, w: ([x[:, :4]], [w[:, :, :4], w[:, :, 4:]]), 1, r"1 X shards for 2 W shards"),
    (lambda x, w: ([x[:, :4], x[:, 4:9]], [w[:, :, :4], w[:, :, 4:]]), 1,
     r"X shard 1 has shape \[12, 5\]; expected \[12, 6\] \(leading dims of X shard 0, K_d of W shard 1\)"),
    (lambda x, w: ([x[:, :4], x[:6, 4:]], [w[:, :, :4], w[:, :, 4:]]), 1,
     r"X shard 1 has shape \[6, 6\]; expected \[12, 6\]"),
    (lambda x, w: (x, [w[:, :, :4], w[:, :, 4:]]), 1, r"X is one array; expected the list of every rank's X_d"),
], ids=["no_rank", "shard_e", "shard_n", "x_shard_count", "x_shard_width", "x_shard_rows", "x_not_split"])
def test_shards_that_do_not_form_a_node_are_rejected(shards, input_is_parallel, error):
    x, offsets, w, b = make_inputs(offsets=OFFSETS, lead=(12,), k=K, n=6)
    x_given, w_shards = shards(x, w)
    with pytest.raises(MoeOpError, match=r"^MoeRowParallelLinear: " + error):
        row_parallel_linear_tensor_parallel(x_given, offsets, w_shards, b, input_is_parallel=input_is_parallel)


def test_offsets_are_checked_in_tensor_parallel_too():
    x, offsets, w, b = make_inputs(offsets=OFFSETS, lead=(12,), k=K, n=6)
    with pytest.raises(MoeOpError, match=r"input 'expert_offset'\[2\] = 0 is less than expert_offset\[1\] = 3"):
        tensor_parallel(x, np.array([1, 3, 0, 9, 11]), w, b, (5, 5), 0)


@pytest.mark.parametrize("case", [c for c in CASES if c.error is None and c.inputs[0].dtype == np.int8],
                         ids=lambda c: c.id)
def test_int8_cases_match_the_oracle_exactly(case):
    got = case.run_reference()[0]
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, oracle(*case.padded_inputs(), **case.attrs))


def test_a_rank_node_binds_its_k_slice():
    """With tp_world_size > 1, W holds K_q: X [*, K] with input_is_parallel 0, X [*, K_q] with 1."""
    x, offsets, w, b = make_inputs(offsets=OFFSETS, lead=(12,), k=K, n=6)
    rank = dict(tp_world_size=2, tp_rank_id=1)
    validate = ROW_PARALLEL_LINEAR.validate
    assert validate(ArrayView(ROW_PARALLEL_LINEAR, [x, offsets, w[:, :, 4:], b], dict(rank, in_features=K)))[0].shape \
        == (12, 6)
    assert validate(ArrayView(ROW_PARALLEL_LINEAR, [x[:, 4:], offsets, w[:, :, 4:], b],
                              dict(rank, input_is_parallel=1, in_features=K)))[0].shape == (12, 6)
    with pytest.raises(MoeOpError, match=r"input 'W' dim 2 is 6; expected K_q = 4 \(from input 'X' dim -1\)"):
        validate(ArrayView(ROW_PARALLEL_LINEAR, [x[:, :4], offsets, w[:, :, 4:], b], dict(rank, input_is_parallel=1)))


def test_one_process_refuses_a_rank_of_a_larger_group():
    x, offsets, w, b = make_inputs(offsets=OFFSETS, lead=(12,), k=K, n=6)
    with pytest.raises(MoeOpError, match=r"^MoeRowParallelLinear: attribute 'tp_world_size' is 2: this node is one "
                       r"of 2 ranks and runs only with its group \(under MPI, docs/distributed.md\), not on one process$"):
        row_parallel_linear(x, offsets, w[:, :, :5], b, tp_world_size=2)


def test_tensor_parallel_reference_takes_the_group_size():
    x, offsets, w, b = make_inputs(offsets=OFFSETS, lead=(12,), k=K, n=6)
    expected = row_parallel_linear(x, offsets, w, b)[0]
    got = row_parallel_linear_tensor_parallel(x, offsets, shard_k(w, (3, 7)), b, tp_world_size=2)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(MoeOpError, match=r"do not fit 2 W shards; expected tp_world_size = 2 \(or none\) and no "
                       r"tp_rank_id"):
        row_parallel_linear_tensor_parallel(x, offsets, shard_k(w, (3, 7)), b, tp_world_size=3)


def test_rank_slices_must_add_up_to_k():
    x, offsets, w, b = make_inputs(offsets=OFFSETS, lead=(12,), k=K, n=6)
    view = ArrayView(ROW_PARALLEL_LINEAR, [x, offsets, w[:, :, :4], b], dict(tp_world_size=2, tp_rank_id=0))
    np.testing.assert_array_equal(rank_input(view, x, [4, 6]), x[:, :4])
    with pytest.raises(MoeOpError, match=r"input 'W' dim 2 adds up to 9 over the 2 TP ranks \(\[4, 5\]\); expected "
                       r"K = 10 \(from input 'X' dim -1\)"):
        rank_input(view, x, [4, 5])
