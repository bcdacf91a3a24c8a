"""One rank of the C++ tensor-parallel check (tests/test_comm_mpi.py), every configuration in one launch:

    mpirun -n W python tests/mpi/tp_driver.py OUT_DIR

Every rank runs single-node MOE (the three expert types, float32/float16, with and without bias,
T = 0, 1 and 7) and MoeRowParallelLinear (float32 and int8, input_is_parallel 0 and 1, uneven K slices,
W as initializer or input) on the cpp backend with its slice of the weights, in TP groups of W ranks
and (W = 4) of 2 ranks, and compares its output with the same op on one process over the full
weights; K slices that do not add up, and layouts the world does not fit, must fail on every rank.
Writes OUT_DIR/rank<r>.json: a list of {"name", "ok", "max_error" or "error"}.
"""

from __future__ import annotations

import functools
import json
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the case tables

import onnxruntime as ort  # noqa: E402
from cases import Case  # noqa: E402
from cases import moe as moe_cases  # noqa: E402
from cases import row_parallel_linear as rpl_cases  # noqa: E402
from mpi4py import MPI  # noqa: E402

from moe_onnx.runtime import run, session  # noqa: E402

WORLD = MPI.COMM_WORLD
HIDDEN, INTER, EXPERTS, K_TOP = 8, 6, 4, 2
RPL_K, RPL_OFFSETS = 10, (1, 3, 3, 9, 11)  # rows 0 and 11.. belong to no expert, expert 1 is empty
MOE_CONSTANT = (3, 4, 5, 6, 7)  # the MOE inputs given as initializers
EXTRA_ATTRS = {moe_cases.GEMM2: {"expert_beta": 7.0}, moe_cases.GEMM2_ACT: {"activation": "gelu"}}
# Slices of I per TP group size: as moe-onnx shard cuts it ([I * q // tp, I * (q + 1) // tp)), and
# one where rank 0, which adds the down bias, has none.
I_SLICES = {2: [(3, 3), (0, 6)], 4: [(1, 2, 1, 2), (0, 3, 0, 3)]}
# Uneven K slices per TP group size (a rank may get none).
K_SLICES = {2: [(3, 7), (0, 10)], 4: [(1, 1, 1, 7), (4, 0, 6, 0)]}


def options() -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return opts


def run_node(op: str, inputs: list, attrs: dict, constant: tuple[int, ...]) -> np.ndarray:
    case = Case(op=op, name="tp", inputs=inputs, attrs=attrs, constant=constant)
    return run(session(case.model(), backend="cpp", sess_options=options()), case.feeds())[0]


def rank_slice(widths: tuple[int, ...], q: int) -> slice:
    """TP rank q's part of an axis cut into consecutive slices of these widths."""
    start = sum(widths[:q])
    return slice(start, start + widths[q])


def moe_rank_inputs(inputs: list, expert_type: str, part: slice) -> list:
    """TP rank's MOE inputs (docs/distributed.md): the weights cut to its I-slice, bias_1 whole."""
    x, weights, idx, w0, b0, w1, b1, w2 = inputs
    if expert_type == moe_cases.GEMM2:  # interleaved gate/up pairs: columns 2*i0 .. 2*i1
        pairs = slice(2 * part.start, 2 * part.stop)
        return [x, weights, idx, w0[:, :, pairs], None if b0 is None else b0[:, pairs], w1[:, part], b1, None]
    if expert_type == moe_cases.GEMM2_ACT:
        return [x, weights, idx, w0[:, part], None if b0 is None else b0[:, part], w1[:, :, part], b1, None]
    return [x, weights, idx, w0[:, part], None, w1[:, part], None, w2[:, :, part]]


def compare(name: str, got: np.ndarray, expected: np.ndarray, tol: float) -> dict:
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return {"name": name, "ok": False, "error": f"{got.dtype}{got.shape} != {expected.dtype}{expected.shape}"}
    diff = np.abs(got.astype(np.float64) - expected.astype(np.float64))
    error = float(diff.max()) if diff.size else 0.0
    ok = bool(np.all(diff <= tol + tol * np.abs(expected.astype(np.float64))))
    return {"name": name, "ok": ok, "max_error": error}


def moe_configs(tp: int):
    for widths in I_SLICES[tp]:
        for expert_type in (moe_cases.GEMM2, moe_cases.GEMM3, moe_cases.GEMM2_ACT):
            for dtype in (np.float32, np.float16):
                for bias in ((True, False) if expert_type != moe_cases.GEMM3 else (False,)):
                    for tokens in (0, 1, 7):
                        yield widths, expert_type, dtype, bias, tokens


@functools.cache
def moe_reference(expert_type: str, dtype: type, bias: bool, tokens: int) -> tuple[list, np.ndarray]:
    """A MOE case's inputs and its output on one process over the full weights (the same for every slicing)."""
    inputs = moe_cases.make_inputs(tokens=tokens, hidden=HIDDEN, inter=INTER, experts=EXPERTS, k=K_TOP,
                                   expert_type=expert_type, dtype=dtype, bias=bias)
    attrs = {"expert_type": expert_type, **EXTRA_ATTRS.get(expert_type, {})}
    return inputs, run_node("MOE", inputs, attrs, MOE_CONSTANT)


def check_moe(tp: int, q: int) -> list[dict]:
    results = []
    for widths, expert_type, dtype, bias, tokens in moe_configs(tp):
        name = (f"MOE-{expert_type}-{np.dtype(dtype).name}-{'bias' if bias else 'nobias'}-T{tokens}-"
                f"{'x'.join(map(str, widths))}")
        try:
            inputs, expected = moe_reference(expert_type, dtype, bias, tokens)
            attrs = {"expert_type": expert_type, **EXTRA_ATTRS.get(expert_type, {})}
            mine = moe_rank_inputs(inputs, expert_type, rank_slice(widths, q))
            got = run_node("MOE", mine, {**attrs, "tp_world_size": tp, "tp_rank_id": q}, MOE_CONSTANT)
            results.append(compare(name, got, expected, 1e-5 if dtype == np.float32 else 2e-3))
        except Exception:
            results.append({"name": name, "ok": False, "error": traceback.format_exc(limit=2)})
    return results


@functools.cache
def rpl_reference(dtype: type, bias: bool, constant: tuple[int, ...]) -> tuple[list, np.ndarray]:
    """A MoeRowParallelLinear case's inputs and its output on one process over the full weights."""
    inputs = rpl_cases.make_inputs(offsets=RPL_OFFSETS, lead=(3, 4), k=RPL_K, n=6, dtype=dtype, bias=bias)
    return inputs, run_node("MoeRowParallelLinear", inputs, {}, constant)


def check_row_parallel_linear(tp: int, q: int) -> list[dict]:
    results = []
    for widths in K_SLICES[tp]:
        cols = rank_slice(widths, q)
        for dtype in (np.float32, np.int8):
            for parallel in (0, 1):
                for bias in (True, False):
                    for constant in ((2, 3), ()):
                        name = (f"RPL-{np.dtype(dtype).name}-par{parallel}-{'bias' if bias else 'nobias'}-"
                                f"{'constW' if constant else 'inputW'}-{'x'.join(map(str, widths))}")
                        try:
                            (x, offsets, w, b), expected = rpl_reference(dtype, bias, constant)
                            attrs = {"input_is_parallel": parallel, "in_features": RPL_K, "tp_world_size": tp,
                                     "tp_rank_id": q}
                            mine = [x[..., cols] if parallel else x, offsets, w[..., cols], b]
                            got = run_node("MoeRowParallelLinear", mine, attrs, constant)
                            results.append(compare(name, got, expected, 1e-5 if dtype == np.float32 else 0))
                        except Exception:
                            results.append({"name": name, "ok": False, "error": traceback.format_exc(limit=2)})
    return results


def expect_error(name: str, run_it, expected_end: str) -> dict:
    """The result of a run that must fail with a message ending in ``expected_end``."""
    try:
        run_it()
    except Exception as error:  # noqa: BLE001 - the error is the result
        if str(error).endswith(expected_end):
            return {"name": name, "ok": True, "max_error": 0.0}
        return {"name": name, "ok": False, "error": str(error)}
    return {"name": name, "ok": False, "error": "no error"}


def check_width_errors(tp: int, q: int) -> list[dict]:
    """K slices that do not add up to the full K: every rank fails with rank_input's words."""
    x, offsets, w, b = rpl_cases.make_inputs(offsets=RPL_OFFSETS, lead=(3, 4), k=RPL_K, n=6)
    widths = (*K_SLICES[tp][0][:-1], K_SLICES[tp][0][-1] - 1)  # the last rank's slice one short
    cols = rank_slice(widths, q)
    results = []
    for parallel, source in ((0, "input 'X' dim -1"), (1, "attribute 'in_features'")):
        attrs = {"input_is_parallel": parallel, "in_features": RPL_K, "tp_world_size": tp, "tp_rank_id": q}
        inputs = [x[..., cols] if parallel else x, offsets, w[..., cols], b]
        results.append(expect_error(
            f"RPL-width-error-par{parallel}", lambda: run_node("MoeRowParallelLinear", inputs, attrs, ()),
            f"MoeRowParallelLinear node 'MoeRowParallelLinear_node': input 'W' dim 2 adds up to {RPL_K - 1} over the "
            f"{tp} TP ranks ([{', '.join(map(str, widths))}]); expected K = {RPL_K} (from {source})"))
    return results


def check_layout_errors(rank: int, size: int) -> list[dict]:
    """Layouts the MPI world does not fit: every rank fails at its first run, before any collective."""
    inputs = moe_cases.make_inputs(tokens=3, inter=4, expert_type=moe_cases.GEMM3)
    where = "MOE node 'MOE_node': "
    layouts = {
        "world-not-a-multiple": (size + 1, 0, f"runs with {size} MPI ranks; the node needs a multiple of "
                                              f"tp_world_size {size + 1} (start it under mpirun -n {size + 1})"),
        "wrong-tp-rank": (size, (rank + 1) % size, f"runs as MPI rank {rank}, TP rank {rank} of its group, but the "
                                                   f"node has tp_rank_id {(rank + 1) % size}; expected rank {rank}'s "
                                                   "model"),
    }
    return [expect_error(f"layout-{name}", lambda: run_node("MOE", inputs, {"expert_type": moe_cases.GEMM3,
                                                                           "tp_world_size": tp, "tp_rank_id": q},
                                                           (3, 5, 7)), where + expected)
            for name, (tp, q, expected) in layouts.items()]


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    results = check_layout_errors(rank, size)
    for tp in sorted({size, 2} & set(K_SLICES)):  # the whole world, and groups of 2 (EP side: the rest)
        if size % tp == 0:
            results += check_moe(tp, rank % tp)
            results += check_row_parallel_linear(tp, rank % tp)
            results += check_width_errors(tp, rank % tp)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
