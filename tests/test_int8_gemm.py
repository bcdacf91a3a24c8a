"""The int8 MoeRowParallelLinear on every int8 GEMM kernel this machine has (x86-64: AVX512-VNNI `vpdpbusd`
on quad panels, AVX2 `vpmaddwd` on pair panels; aarch64: SMMLA, SDOT or SMULL + SADALP on octet panels;
portable), each exactly the numpy reference's int32; and the kernel in use is the best one the CPU has.

The kernel is chosen once per process (MOE_ONNX_GEMM caps it), so each level runs its cases in a
child process. Besides the case tables' int8 cases and test_kernels' larger ones (several k blocks,
every row-tile remainder), the cases here cover every K modulo 4 (the quad padding) and sums that
wrap modulo 2^32 (the VNNI kernel's -128 * column-sum correction must wrap with them).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import isa_levels
import numpy as np
import pytest
from cases import Case
from cases import row_parallel_linear as linear_cases

from moe_onnx.runtime import kernel_report, run, session

# MOE_ONNX_GEMM values with int8 kernels of their own
LEVELS = ("portable", "neon", "dotprod", "i8mm") if isa_levels.ARM64 else ("portable", "avx2", "avx512")
CPU = isa_levels.cpu_flags()
HAS_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= CPU
HAS_VNNI = HAS_AVX512 and "avx512_vnni" in CPU
# What each level needs of the CPU besides the one before it (/proc/cpuinfo's names)
NEEDS = {"avx2": {"avx2"}, "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl"}, "dotprod": {"asimddp"},
         "i8mm": {"asimddp", "i8mm"}}


def _kernel_for(level: str) -> str:
    """The int8 kernel MOE_ONNX_GEMM=level selects on this CPU."""
    if level == "portable" or isa_levels.ARM64:
        return level
    return "avx512-vnni" if level == "avx512" and HAS_VNNI else "avx2"


def _best_kernel() -> str:
    """The int8 kernel this CPU's highest level runs."""
    if isa_levels.ARM64:
        return next(level for level in ("i8mm", "dotprod", "neon") if NEEDS.get(level, set()) <= CPU)
    return "avx512-vnni" if HAS_VNNI else "avx2" if "avx2" in CPU else "portable"


def _wrapping_case(name: str, k: int) -> Case:
    """Columns whose sums pass 2^31 (x = w = -128 all along k), and random ones, with a bias."""
    case = linear_cases._case(name, dtype=np.int8, lead=(3,), k=k, n=20, offsets=(0, 3))
    x, offsets, w, b = case.inputs
    x[:2] = -128
    w[0, :5] = -128
    return dataclasses.replace(case, inputs=[x, offsets, w, b])


EDGE_CASES = [linear_cases._case(f"int8_k{k}", dtype=np.int8, lead=(11,), k=k, n=37, offsets=(0, 3, 3, 11))
              for k in (1, 2, 3, 5, 6, 7, 65)]
EDGE_CASES.append(_wrapping_case("int8_wrapping_sums", k=131073))  # 128 * 128 * k > 2^31


def int8_gemm_isa() -> str:
    return kernel_report()["int8_gemm"]


def run_exact(cases) -> int:
    """Runs each case on the C++ kernels; its output must be the reference's, bit for bit."""
    for case in cases:
        got = run(session(case.model()), case.feeds())[0]
        expected = case.run_reference()[0]
        assert got.dtype == np.int32 and expected.dtype == np.int32, case.id
        np.testing.assert_array_equal(got, expected, err_msg=case.id)
    return len(cases)


def test_best_int8_kernel_in_use():
    """With no MOE_ONNX_GEMM cap, a CPU runs its best int8 kernel: vpdpbusd with AVX512-VNNI, SMMLA with
    aarch64's i8mm, SDOT with its dotprod."""
    if os.environ.get("MOE_ONNX_GEMM") or os.environ.get("MOE_ONNX_AMX"):
        pytest.skip("MOE_ONNX_GEMM or MOE_ONNX_AMX chooses the kernels")
    assert int8_gemm_isa() == _best_kernel()


@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: c.id)
def test_int8_edge_case(case):
    run_exact([case])


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("level", LEVELS)
def test_int8_cases_on_kernel(level):
    """The edge cases, exactly, with MOE_ONNX_GEMM=level (in a fresh process); the case tables' int8
    cases run at every level in test_kernels.py::test_isa_level."""
    if not NEEDS.get(level, set()) <= CPU:
        pytest.skip(f"this CPU lacks {sorted(NEEDS[level] - CPU)} for the {level} level")
    code = f"""
import sys
sys.path.insert(0, sys.argv[1])
from test_int8_gemm import EDGE_CASES, int8_gemm_isa, run_exact
assert int8_gemm_isa() == {_kernel_for(level)!r}, int8_gemm_isa()
print(run_exact(EDGE_CASES))
"""
    inherited = {k: v for k, v in os.environ.items() if k != "MOE_ONNX_AMX"}  # the level's own kernel, no model
    env = {**inherited, "MOE_ONNX_GEMM": level}
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) == len(EDGE_CASES)
