"""AMX's kernels (int8 MoeRowParallelLinear on TDPBUSD, QMOE accuracy_level 4 on TDPBSUD, its rows
quantized once per run) give the bits of the kernels they stand in for: on the model of the tile
instructions (MOE_ONNX_AMX=model) on any CPU, and on the instructions where AMX is usable.

The ISA table is filled once per process, so each configuration runs the cases in a child process,
at 1 and 2 threads (the same bits), and writes their outputs; the parent compares them bit for bit with
the outputs of the same ISA level without AMX (MOE_ONNX_AMX=off), and the int8 outputs with numpy's
int32 (wrapping) products. The cases cross the tile kernels' edges: int8 experts with 0, 1, 7, 8
(int8's tile threshold), 16, 17 and 33 rows (row tiles of 16, a lone last tile), QMOE experts with
1, 3, 4 (level 4's tile threshold), 17, 33 and 58 rows and one with none, K not a multiple
of 64 (a tail step) or of 4, an odd number of 16-column panels, sums that wrap modulo 2^32, QMOE
blocks of 64 to 256 k (8-bit ones read in place) and per column (K = 100, 102: blocks padded to
whole tile rows, the codes copied), zero points or none, no rows at all, and activations whose
quantized value a / s lies within an ulp of a half (where a * (1 / s) can round to the other integer).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from backends import run_case
from cases import Case
from cases import qmoe as qmoe_cases
from cases import row_parallel_linear as linear_cases
from cases.moe import GEMM2, GEMM2_ACT, GEMM3

from moe_onnx.runtime import kernel_report

# each kernel path runs in a child process (the ISA table is filled once); the module's tests share those children's
# results (module fixtures), so one xdist worker runs them all (pyproject's --dist loadgroup) and they run once
pytestmark = [pytest.mark.subprocess, pytest.mark.xdist_group("int8_amx")]

ROWS = (0, 1, 7, 8, 16, 17, 33)  # rows per expert


def _linear(name: str, k: int, n: int, rows=ROWS, **kw) -> Case:
    offsets = tuple(int(o) for o in np.cumsum((0, *rows)))
    return linear_cases._case(name, dtype=np.int8, lead=(offsets[-1],), k=k, n=n, offsets=offsets, **kw)


def _wrapping(k: int) -> Case:
    """Sums past 2^31 (x = w = -128 along k) in 9 rows, above the tile threshold."""
    case = _linear("int8_amx_wrapping", k=k, n=20, rows=(9,))
    x, offsets, w, b = case.inputs
    x[:4] = -128
    w[0, :5] = -128
    return dataclasses.replace(case, inputs=[x, offsets, w, b])


def _qmoe(name: str, bits: int, block_size: int, hidden: int, inter: int, **kw) -> Case:
    """Experts 0-4 with 1, 3, 4, 17 and 33 rows, expert 5 every token's second (58 rows), 6 none."""
    indices = [[e, 5] for e, n in enumerate((1, 3, 4, 17, 33)) for _ in range(n)]
    return qmoe_cases._case(name, kw.pop("attrs", {"expert_type": GEMM3}), bits=bits, block_size=block_size,
                            accuracy_level=4, hidden=hidden, inter=inter, tokens=len(indices), experts=7, k=2,
                            indices=np.array(indices), scale=0.3, **kw)


LINEAR_CASES = [_linear(f"int8_amx_k{k}", k=k, n=37) for k in (1, 64, 65, 202)]
LINEAR_CASES += [_linear("int8_amx_no_rows", k=70, n=16, rows=(0, 0)), _wrapping(k=131073)]
G2 = {"expert_type": GEMM2, "expert_alpha": 1.702, "expert_beta": 7.0}
QMOE_CASES = [
    _qmoe("amx_int4_block64_zero_points", 4, 64, hidden=192, inter=128, zero_points=True, attrs=G2),
    _qmoe("amx_int8_block128", 8, 128, hidden=256, inter=128),
    _qmoe("amx_int4_block256", 4, 256, hidden=256, inter=256),
    _qmoe("amx_int4_columns_zero_points", 4, 0, hidden=100, inter=84, zero_points=True),
    _qmoe("amx_int8_columns", 8, 0, hidden=102, inter=90),
]


def _near_halves(amax: float, count: int) -> np.ndarray:
    """amax, then count - 1 values a of |a| <= amax with a / s (s = amax / 127, float32) on a half or
    an ulp beside it, where a * (1 / s) rounds to a different integer from a / s in a few of them."""
    s = np.float32(amax) / np.float32(127)
    halves = (np.arange(count // 3 + 1, dtype=np.float32) * 5 - 60.5) * s
    near = np.stack([np.nextafter(halves, -np.inf), halves, np.nextafter(halves, np.inf)], axis=1).ravel()
    return np.concatenate([[np.float32(amax)], near[: count - 1]]).astype(np.float32)


def _special_rows(case: Case) -> Case:
    """Row 0 with a NaN, row 1 with an infinity, row 2 all zero (the quantization's special blocks), row
    3's blocks near halves."""
    x = case.inputs[0].copy()
    x[0, 5], x[1, 70], x[2] = np.nan, np.inf, 0.0
    x[3] = np.tile(_near_halves(1.91089547, 64), x.shape[1] // 64)
    return dataclasses.replace(case, inputs=[x, *case.inputs[1:]])


# relu (exact) between the GEMMs: QMOE's level 4 has the same bits at every ISA level
EVERY_LEVEL_CASES = [_special_rows(_qmoe("amx_relu_int8_block64", 8, 64, hidden=192, inter=128, zero_points=True,
                                         attrs={"expert_type": GEMM2_ACT, "activation": "relu"})),
                     _qmoe("amx_relu_int4_block16", 4, 16, hidden=96, inter=64, attrs={"expert_type": GEMM2_ACT,
                                                                                       "activation": "relu"})]
QMOE_CASES += EVERY_LEVEL_CASES
CASES = LINEAR_CASES + QMOE_CASES


def write_outputs(path: str) -> None:
    """(In a child process.) Every case's output at 1 and 2 threads (they must agree bitwise), and
    the kernel report's AMX slots, into the .npz file `path`."""
    outputs = {}
    for case in CASES:
        one, two = (run_case(case, "cpp", threads=t)[0] for t in (1, 2))
        np.testing.assert_array_equal(one.view(np.uint8), two.view(np.uint8), err_msg=case.id)
        outputs[case.id] = one
    report = kernel_report()
    np.savez(path, **outputs, **{key: report[key] for key in ("int8_gemm_tiles", "quant_tiles", "amx", "amx_reason")})


def outputs_with(env: dict[str, str], tmp_path: Path) -> dict[str, np.ndarray]:
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}.npz"
    code = f"import sys; sys.path.insert(0, sys.argv[1]); from test_int8_amx import write_outputs; write_outputs({str(path)!r})"
    base = {k: v for k, v in os.environ.items() if k not in ("MOE_ONNX_AMX", "MOE_ONNX_GEMM")}
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env={**base, **env},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


@pytest.fixture(scope="module")
def without_amx(tmp_path_factory):
    """The outputs of the kernels AMX stands in for, per MOE_ONNX_GEMM level ("": this CPU's best),
    the int8 ones checked against numpy's int32 products."""
    cache = {}

    def outputs(gemm: str) -> dict[str, np.ndarray]:
        if gemm not in cache:
            cache[gemm] = outputs_with({"MOE_ONNX_GEMM": gemm, "MOE_ONNX_AMX": "off"}, tmp_path_factory.mktemp("off"))
            assert str(cache[gemm]["int8_gemm_tiles"]) == "none"
            for case in LINEAR_CASES:
                x, offsets, w, b = case.inputs
                expert = np.searchsorted(offsets, np.arange(x.shape[0]), side="right") - 1
                wide = np.zeros((x.shape[0], w.shape[1]), np.int64)
                for r, (e, row) in enumerate(zip(expert, x)):
                    wide[r] = w[e].astype(np.int64) @ row.astype(np.int64) + b[e]
                np.testing.assert_array_equal(cache[gemm][case.id], wide.astype(np.int32), err_msg=case.id)  # wraps
        return cache[gemm]

    return outputs


def assert_same_bits(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]):
    for case in CASES:
        np.testing.assert_array_equal(got[case.id].view(np.uint8), expected[case.id].view(np.uint8), err_msg=case.id)


@pytest.mark.parametrize("gemm", [pytest.param("portable", marks=pytest.mark.slow), ""], ids=["portable", "best"])
def test_model_gives_the_bits_of_the_kernels_it_replaces(without_amx, gemm, tmp_path):
    """The AMX kernels on the model of the tiles, over the portable level (every row count on the
    tiles, the portable steps) and this CPU's best (the tiles from the threshold's rows), give the
    level's bits without AMX (QMOE's other kernels, the activations, differ between levels)."""
    model = outputs_with({"MOE_ONNX_AMX": "model", "MOE_ONNX_GEMM": gemm}, tmp_path)
    assert (str(model["int8_gemm_tiles"]), str(model["quant_tiles"])) == ("amx-model", "amx-model")
    assert_same_bits(model, without_amx(gemm))


@pytest.mark.slow  # a fresh process or a measurement: seconds, outside the fast lane
def test_hardware_gives_the_bits_of_the_kernels_it_replaces(without_amx, tmp_path):
    """Where AMX-INT8 is usable (no switches set), the instructions give the same bits."""
    hardware = outputs_with({}, tmp_path)
    if str(hardware["int8_gemm_tiles"]) != "amx":
        pytest.skip(f"AMX-INT8 is not usable here (amx: {hardware['amx']}, {hardware['amx_reason']})")
    assert str(hardware["quant_tiles"]) == "amx"
    assert_same_bits(hardware, without_amx(""))


@pytest.mark.slow  # the portable level's child process
def test_level_4_bits_at_every_level(without_amx):
    """Level 4 (activations quantized, dots, scales) gives the same bits on the portable kernels and
    this CPU's best (the activation between the GEMMs exact); int8 too."""
    portable, best = without_amx("portable"), without_amx("")
    for case in LINEAR_CASES + EVERY_LEVEL_CASES:
        np.testing.assert_array_equal(best[case.id].view(np.uint8), portable[case.id].view(np.uint8), err_msg=case.id)
