"""The bf16 GEMM's kernel paths (accuracy_level 3, custom_ops/src/kernels/bf16_gemm.h) through the ops, on a few
shapes with edges: one row, row counts that fill a tile partly (and several tiles), K and N that are not
multiples of the pair panel's 32 k and 16 columns, K of several AMX steps (32 k each), an expert
with no tokens, QMOE's decode and prefill.

Each path runs in a fresh process (the ISA table is filled once per process), on first use; the fast lane runs
the first only:

  amx          the hardware's TDPBF16PS from kBf16TileRows (4) rows, vdpbf16ps below (where AMX is usable)
  amx-model    MOE_ONNX_AMX=model: the same kernel code on the model of the tiles (any CPU)
  avx512-bf16  MOE_ONNX_AMX=off: vdpbf16ps for every call (where the CPU has AVX512-BF16)
  portable     MOE_ONNX_GEMM=portable MOE_ONNX_AMX=model: vdpbf16ps's arithmetic in portable code below
               the model's tiles
  fallback     MOE_ONNX_GEMM=avx2 (aarch64: i8mm): no bf16 instruction, so level 3 computes level 0's kernels
  arm-bf16     aarch64 only, the bf16 level: BFDOT below kBf16TileRows rows, BFMMLA from there (where the CPU
               has FEAT_BF16); both round to odd, so MoeRowParallelLinear's bound is 2^-23 a step, not 2^-24

Checked: the error against float64 references within a bf16 bound (MoeRowParallelLinear, a bare GEMM:
within fp32 summation error of the product of the bf16-rounded operands); results the same bits at 1
and 3 threads; the hardware's bits the model's; the portable kernel's bits vdpbf16ps's; the fallback's
and QMOE decode's bits level 0's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import isa_levels
import ml_dtypes
import numpy as np
import pytest
from cases import Case
from cases import moe as moe_cases
from cases import qmoe as qmoe_cases
from cases import row_parallel_linear as linear_cases

# each kernel path runs in a child process (the ISA table is filled once); the module's tests share those children's
# results (module fixtures), so one xdist worker runs them all (pyproject's --dist loadgroup) and they run once
pytestmark = [pytest.mark.subprocess, pytest.mark.xdist_group("bf16_kernels")]

BF16 = np.dtype(ml_dtypes.bfloat16)
BF16_BOUND = 6 * 2.0**-9  # MOE/QMOE: the largest |error| relative to the largest |output| (three bf16 roundings)
G2 = dict(expert_type=moe_cases.GEMM2, expert_alpha=1.702, expert_beta=7.0)
G3 = dict(expert_type=moe_cases.GEMM3)
MODES = {  # this architecture's
    **({"arm-bf16": {}} if isa_levels.ARM64 else {"amx": {}, "avx512-bf16": {"MOE_ONNX_AMX": "off"}}),
    "amx-model": {"MOE_ONNX_AMX": "model"},
    "portable": {"MOE_ONNX_GEMM": "portable", "MOE_ONNX_AMX": "model"},
    "fallback": {"MOE_ONNX_GEMM": "i8mm" if isa_levels.ARM64 else "avx2"},
}
THREADS = (1, 3)


def _moe(name: str, attrs: dict, **inputs) -> Case:
    return Case("MOE", name, moe_cases.make_inputs(expert_type=attrs["expert_type"], **inputs), attrs,
                constant=(3, 4, 5, 6, 7))


def cases() -> list[Case]:
    """The cases, at accuracy_level 0 (each path also runs them at 3)."""
    rng = np.random.default_rng(7)
    no_expert_3 = np.stack([rng.permutation(3)[:2] for _ in range(37)])  # experts 0-2: ~25 rows each, 3: none
    linear = linear_cases.make_inputs(offsets=(0, 3, 3, 7, 58), lead=(60,), k=70, n=40)
    long_k = linear_cases.make_inputs(offsets=(0, 20, 37), lead=(37,), k=300, n=40)  # K of 10 tile steps
    return [
        _moe("gemm2_one_row", G2, tokens=1, hidden=40, inter=24, experts=4),
        _moe("gemm2_k_and_n_tails_idle_expert", G2, tokens=37, hidden=40, inter=24, experts=4, indices=no_expert_3),
        _moe("gemm3_several_row_tiles", G3, tokens=50, hidden=64, inter=48, experts=2, bias=False),
        _moe("gemm2_bf16_weights", G2, tokens=20, hidden=32, inter=16, experts=2, k=1, dtype=BF16),
        Case("MoeRowParallelLinear", "rows_3_0_4_51_of_60", linear, {}, constant=(2, 3)),
        Case("MoeRowParallelLinear", "k_300_rows_20_17", long_k, {}, constant=(2, 3)),
        Case("QMOE", "int4_prefill", qmoe_cases.make_inputs(tokens=40, hidden=64, inter=40, experts=2, **_q(G2)),
             dict(G2, bits=4), constant=qmoe_cases.CONSTANT),
        Case("QMOE", "int8_block32_decode", qmoe_cases.make_inputs(tokens=3, hidden=64, inter=32, experts=2, bits=8,
                                                                   block_size=32, **_q(G3)),
             dict(G3, bits=8, block_size=32), constant=qmoe_cases.CONSTANT),
    ]


def _q(attrs: dict) -> dict:
    return {"expert_type": attrs["expert_type"]}


def at_level(case: Case, level: int) -> Case:
    return case.mutated(case.name, None, accuracy_level=level)


# ----------------------------------------------------------------------------- one path, in its own process

def child(out: str) -> None:
    """Every case at levels 0 and 3 on THREADS thread counts, into the npz `out`; prints the kernel report."""
    from backends import run_case

    from moe_onnx.runtime import kernel_report

    try:
        report = kernel_report()
    except ValueError as error:  # a level this CPU or build lacks
        print(json.dumps({"unsupported": str(error)}))
        return
    arrays = {}
    for case in cases():
        for level in (0, 3):
            for threads in THREADS:
                y = run_case(at_level(case, level), "cpp", threads=threads)[0]
                arrays[f"{case.id}/{level}/{threads}"] = y.view(np.uint16) if y.dtype == BF16 else y  # npz: no bf16
    np.savez(out, **arrays)
    print(json.dumps(report))


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> Callable[[str], tuple[dict, dict | None]]:
    """``paths(mode)``: the mode's kernel report and outputs (None where the mode is unsupported here), from its
    child process, run on first use."""
    here = Path(__file__).parent
    base = {k: v for k, v in os.environ.items() if k not in ("MOE_ONNX_AMX", "MOE_ONNX_GEMM")}
    cache = {}

    def path(mode: str) -> tuple[dict, dict | None]:
        if mode not in cache:
            out = tmp_path_factory.mktemp("bf16") / f"{mode}.npz"
            code = f"import sys; sys.path.insert(0, {str(here)!r}); import test_bf16_kernels as t; t.child({str(out)!r})"
            run = subprocess.run([sys.executable, "-c", code], env={**base, **MODES[mode]}, capture_output=True,
                                 text=True, timeout=300)
            assert run.returncode == 0, f"{mode}: {run.stderr[-3000:]}"
            report = json.loads(run.stdout.splitlines()[-1])
            cache[mode] = (report, None if "unsupported" in report else dict(np.load(out)))
        return cache[mode]

    return path


def _usable(paths, mode: str) -> tuple[dict, dict]:
    if mode not in MODES:
        pytest.skip(f"{mode} is not a path of this architecture")
    report, outputs = paths(mode)
    if outputs is None:
        pytest.skip(f"{mode}: {report['unsupported']}")
    if mode == "amx" and (report["amx"] != "usable" or report["amx_bf16"] != "yes"):
        pytest.skip(f"AMX-BF16 is not usable here: {report['amx']} ({report['amx_reason']})")
    if mode == "avx512-bf16" and report["avx512_bf16"] != "yes":
        pytest.skip("this CPU has no AVX512-BF16")
    if mode == "arm-bf16" and report["bf16_gemm"] != "bfdot":
        pytest.skip(f"this CPU has no FEAT_BF16 (level {report['level']})")
    return report, outputs


# ----------------------------------------------------------------------------- references

def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32).astype(BF16).astype(np.float64)


def linear_bound(case: Case, unit: float = 2.0**-24) -> tuple[np.ndarray, np.ndarray]:
    """MoeRowParallelLinear's X @ W^T + B on X and W rounded to bf16, in float64, and the fp32 summation
    error bound of each element: (K + 2) `unit` (a rounding's largest relative error: 2^-24 to nearest, 2^-23
    to odd) times the sum of the |terms|."""
    x, offsets, w, b = case.inputs
    exact, magnitude = np.zeros((x.shape[0], w.shape[1])), np.zeros((x.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        rows = slice(offsets[e], offsets[e + 1])
        exact[rows] = _bf16(x[rows]) @ _bf16(w[e]).T + b[e]
        magnitude[rows] = np.abs(_bf16(x[rows])) @ np.abs(_bf16(w[e])).T + np.abs(b[e])
    return exact, (w.shape[2] + 2) * unit * magnitude


def oracle(case: Case) -> np.ndarray:
    """The case's exact result at level 0, in float64."""
    module = {"MOE": moe_cases, "QMOE": qmoe_cases}[case.op]
    return module.oracle(*case.padded_inputs(), **case.attrs)


def check_error(case: Case, got: np.ndarray, rounding_unit: float = 2.0**-24) -> None:
    got = (got.view(BF16) if case.inputs[0].dtype == BF16 else got).astype(np.float64)
    if case.op == "MoeRowParallelLinear":
        exact, bound = linear_bound(case, rounding_unit)
        excess = np.abs(got - exact) - bound
        assert excess.max() <= 0, f"{case.id}: beyond the fp32 summation bound by {excess.max():.3g}"
        return
    expected = oracle(case)
    error = np.abs(got - expected).max() / np.abs(expected).max()
    assert error <= BF16_BOUND, f"{case.id}: |error| {error:.3g} of the peak |output| > {BF16_BOUND:.3g}"


# ----------------------------------------------------------------------------- the tests

BF16_KERNELS = {  # mode: (bf16_gemm, bf16_gemm_tiles) in the kernel report
    "amx": ("avx512-bf16", "amx"),
    "amx-model": (None, "amx-model"),  # bf16_gemm: avx512-bf16 where the CPU has it, else portable
    "avx512-bf16": ("avx512-bf16", "none"),
    "portable": ("portable", "amx-model"),
    "arm-bf16": ("bfdot", "bfmmla"),
}
BF16_KERNELS = {mode: kernels for mode, kernels in BF16_KERNELS.items() if mode in MODES}


@pytest.mark.parametrize("mode", [mode if mode in ("amx", "arm-bf16") else pytest.param(mode, marks=pytest.mark.slow)
                                  for mode in BF16_KERNELS])  # the fast lane: this CPU's own path
def test_bf16_path_within_bf16_error(paths, mode):
    """The path's kernels are the ones named; level 3 rounds (its result is not level 0's) within the
    bf16 bound of the exact result, except QMOE's decode, which is level 0's; the same bits on 1 and 3
    threads."""
    report, outputs = _usable(paths, mode)
    small, tiles = BF16_KERNELS[mode]
    if small is None:
        small = "avx512-bf16" if report["avx512_bf16"] == "yes" else "portable"
    assert (report["bf16_gemm"], report["bf16_gemm_tiles"]) == (small, tiles)
    for case in cases():
        got = outputs[f"{case.id}/3/{THREADS[0]}"]
        for threads in THREADS[1:]:
            for level in (0, 3):
                assert outputs[f"{case.id}/{level}/{threads}"].tobytes() == outputs[f"{case.id}/{level}/1"].tobytes(), \
                    f"{case.id} level {level}: {threads} threads differ from 1"
        level_0 = outputs[f"{case.id}/0/{THREADS[0]}"]
        if case.name.endswith("decode"):
            assert got.tobytes() == level_0.tobytes(), f"{case.id}: decode is not level 0's"
        else:
            assert got.tobytes() != level_0.tobytes(), f"{case.id}: level 3 gave level 0's bits"
        check_error(case, got, 2.0**-23 if mode == "arm-bf16" else 2.0**-24)


@pytest.mark.slow
def test_amx_hardware_is_the_model(paths):
    """Where AMX-BF16 is usable: every level-3 result of the hardware kernel has the model's bits."""
    _, hardware = _usable(paths, "amx")
    _, model = _usable(paths, "amx-model")
    for key in hardware:
        assert hardware[key].tobytes() == model[key].tobytes(), key


@pytest.mark.slow
def test_portable_kernel_is_vdpbf16ps(paths):
    """The portable kernel (below the model's tiles on CPUs without AVX512-BF16) gives vdpbf16ps's bits:
    MoeRowParallelLinear's rows of the 3-row expert (the others run on the model's tiles in both)."""
    _, model = _usable(paths, "amx-model")
    _, portable = _usable(paths, "portable")
    if paths("amx-model")[0]["bf16_gemm"] != "avx512-bf16":
        pytest.skip("this CPU has no AVX512-BF16")
    for case in cases():
        if case.op == "MoeRowParallelLinear":
            key = f"{case.id}/3/1"
            assert portable[key].tobytes() == model[key].tobytes(), key


@pytest.mark.slow
def test_fallback_is_level_0(paths):
    """Without a bf16 instruction in the table, level 3 gives level 0's bits."""
    report, outputs = _usable(paths, "fallback")
    assert (report["bf16_gemm"], report["bf16_gemm_tiles"]) == ("none", "none")
    for case in cases():
        assert outputs[f"{case.id}/3/1"].tobytes() == outputs[f"{case.id}/0/1"].tobytes(), case.id
