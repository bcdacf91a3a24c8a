"""Fused models in sessions of onnxruntime's aarch64 library, under qemu, against this machine's (custom_ops/arm64.sh
sessions; not a pytest module).

For each model (single nodes of every kernel family from the case tables, and a whole fused block: a Qwen3-MoE
export after ``moe-onnx optimize``), this machine's C++ kernels give the expected outputs; the aarch64 build of
``moe_onnx_session_check`` (custom_ops/tests/session_check.cc) then runs the model in the aarch64 libonnxruntime of
onnxruntime's PyPI wheel (the version installed here), with the aarch64 libmoe_onnx_ops, under qemu-aarch64-static
on each CPU model and MOE_ONNX_GEMM level of LEVELS. Printed: per model and level, "bits" where the outputs have
this machine's bits, else the largest difference relative to the largest |output|. Fails when an output differs
beyond the model's tolerance from this machine's, or when a model marked ``bits`` has other bits at a level of
``same_bits``.

Usage: python tests/arm64_sessions.py --build build/arm64 [--sysroot /usr/aarch64-linux-gnu] [--keep DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "models"))

BF16 = np.dtype(ml_dtypes.bfloat16)

# (name, qemu CPU model, MOE_ONNX_GEMM): each aarch64 level, where the CPU model has it
LEVELS = [("portable", "max", "portable"), ("neon", "cortex-a57", ""), ("dotprod", "neoverse-n1", ""),
          ("i8mm", "max", "i8mm"), ("bf16", "max", "")]


@dataclasses.dataclass
class Model:
    name: str
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    tolerance: float  # |aarch64 - x86| <= tolerance * max |x86 output|
    same_bits: tuple[str, ...] = ()  # the levels whose outputs must have this machine's bits


def models() -> list[Model]:
    """Single-node models of every kernel family, and a whole fused block."""
    from cases import Case
    from cases import moe as moe_cases
    from cases import qmoe as qmoe_cases
    from cases import row_parallel_linear as linear_cases

    simd = ("neon", "dotprod", "i8mm", "bf16")
    g2 = dict(expert_type=moe_cases.GEMM2, expert_alpha=1.702, expert_beta=7.0)
    g3 = dict(expert_type=moe_cases.GEMM3)
    rng = np.random.default_rng(3)
    indices = np.stack([rng.permutation(6)[:2] for _ in range(41)])  # ~14 rows per expert: row tiles and decode

    def moe(name, attrs, **kw):
        inputs = moe_cases.make_inputs(expert_type=attrs["expert_type"], **kw)
        return Case("MOE", name, inputs, attrs, constant=(3, 4, 5, 6, 7))

    def qmoe(name, attrs, level=None, **kw):
        inputs = qmoe_cases.make_inputs(expert_type=attrs["expert_type"], **kw)
        quant = {"bits": kw.get("bits", 4), **{key: kw[key] for key in ("block_size", "quant_type") if key in kw}}
        return Case("QMOE", name, inputs, {**attrs, **quant, **(level or {})}, constant=qmoe_cases.CONSTANT)

    cases = [
        # fp32 GEMMs (one FMA chain per element) and the activations: x86's bits on every SIMD level
        (moe("gemm2_fp32", g2, tokens=41, hidden=96, inter=80, experts=6, indices=indices), 1e-6, simd),
        (moe("gemm3_fp32_decode", g3, tokens=1, hidden=96, inter=80, experts=6, indices=indices[:1]), 1e-6, simd),
        (moe("gemm3_fp16", g3, tokens=41, hidden=64, inter=48, experts=6, indices=indices, dtype=np.float16), 1e-3,
         simd),
        (moe("gemm2_bf16", g2, tokens=41, hidden=64, inter=48, experts=6, indices=indices, dtype=BF16), 1e-2, simd),
        # accuracy_level 3: BFDOT/BFMMLA round to odd, AMX and AVX512-BF16 to nearest even: within bf16's error
        (moe("gemm2_bf16_compute", {**g2, "accuracy_level": 3}, tokens=41, hidden=96, inter=80, experts=6,
             indices=indices), 1.2e-2, ()),
        # QMOE: level 0 (decode-size rows and prefill rows), level 4 (int8 activations: exact dots; the portable
        # level's activations take libm's expf, a few ulp from the SIMD kernels', which can move an int8 code)
        (qmoe("int4_block32", g2, tokens=41, hidden=96, inter=64, experts=6, indices=indices, bits=4, block_size=32),
         1e-5, ()),
        (qmoe("int8_columns_decode", g3, tokens=3, hidden=96, inter=64, experts=6, indices=indices[:3], bits=8), 1e-5,
         ()),
        (qmoe("mxfp4", g2, tokens=41, hidden=96, inter=64, experts=6, indices=indices, quant_type="mxfp4",
              block_size=32), 1e-5, ()),
        (qmoe("int4_level4", g3, tokens=41, hidden=128, inter=64, experts=6, indices=indices, bits=4, block_size=64,
              zero_points=True, level={"accuracy_level": 4}), 1e-6, simd),
        (qmoe("int8_level4_decode", g3, tokens=2, hidden=96, inter=64, experts=6, indices=indices[:2], bits=8,
              block_size=32, level={"accuracy_level": 4}), 1e-6, simd),
        # int8 MoeRowParallelLinear: exact int32 sums on every level
        (Case("MoeRowParallelLinear", "int8", linear_cases.make_inputs(offsets=(0, 1, 4, 13, 40), lead=(40,), k=200,
                                                                       n=70, dtype=np.int8), {}, constant=(2, 3)),
         0.0, simd + ("portable",)),
        (Case("MoeRowParallelLinear", "fp32", linear_cases.make_inputs(offsets=(0, 1, 4, 13, 40), lead=(40,), k=200,
                                                                       n=70), {}, constant=(2, 3)), 1e-6, simd),
    ]
    out = [Model(f"{c.op}_{c.name}", c.model(), c.feeds(), tol, bits) for c, tol, bits in cases]
    out.append(fused_block())
    return out


def fused_block() -> Model:
    """A Qwen3-MoE block as transformers 5 exports it (batched_mm), fused by moe-onnx optimize: MoeGatingTopK's
    softmax takes libm's expf, whose last bit may differ between C libraries."""
    import moe_onnx

    source = HERE.parent / "models" / "fixtures" / "qwen3_moe_batched_mm_small.onnx"
    model, _ = moe_onnx.optimize(str(source), target="moe")
    data = np.load(source.with_suffix(".npz"))
    names = [i.name for i in model.graph.input]
    feeds = {name: data[name] for name in names}
    return Model("qwen3_moe_block_optimized", model, feeds, 1e-5)


def npy_input(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype == BF16 else a


def aarch64_cpuinfo(work: Path) -> Path:
    """An aarch64 /proc/cpuinfo for this machine's CPUs (a Neoverse N1's identity; the extensions each run has
    come from qemu's HWCAP, as on Linux). qemu-user 7 passes the host's x86 /proc/cpuinfo through, on which
    onnxruntime's cpuinfo dereferences NULL while the library loads; the checks see this file there instead
    (``in_aarch64_view``)."""
    entry = ("processor\t: {}\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp "
             "asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
             "CPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n")
    path = work / "cpuinfo"
    path.write_text("".join(entry.format(i) for i in range(os.cpu_count() or 1)))
    return path


def in_aarch64_view(cpuinfo: Path, command: list[str]) -> list[str]:
    """`command` in a mount namespace of its own where /proc/cpuinfo is `cpuinfo` (root: unshare -m; otherwise
    an unprivileged user namespace, unshare -r -m)."""
    unshare = ["unshare", "-m", "--propagation", "private"] if os.geteuid() == 0 else \
        ["unshare", "-r", "-m", "--propagation", "private"]
    return [*unshare, "sh", "-c", 'mount --bind "$0" /proc/cpuinfo && exec "$@"', str(cpuinfo), *command]


def aarch64_onnxruntime(build: Path) -> Path:
    """The aarch64 libonnxruntime of the onnxruntime version installed here, from its PyPI wheel (kept in the
    build folder)."""
    import onnxruntime

    folder = build / "onnxruntime"
    library = folder / f"libonnxruntime.so.{onnxruntime.__version__}"
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--platform", "manylinux_2_28_aarch64", "--python-version", version, "--implementation", "cp",
                    "-d", str(folder), f"onnxruntime=={onnxruntime.__version__}"], check=True)
    wheel = next(folder.glob(f"onnxruntime-{onnxruntime.__version__}-*aarch64.whl"))
    with zipfile.ZipFile(wheel) as z:
        member = f"onnxruntime/capi/{library.name}"
        library.write_bytes(z.read(member))
    wheel.unlink()
    return library


def x86_outputs(m: Model) -> dict[str, np.ndarray]:
    from moe_onnx.runtime import run, session

    sess = session(m.model)
    return dict(zip([o.name for o in sess.get_outputs()], run(sess, m.feeds)))


def compare(got: np.ndarray, want: np.ndarray) -> tuple[bool, float]:
    """(same bits, largest |difference| relative to the largest |want|)."""
    if want.dtype == BF16:
        got = got.view(BF16)
    same = got.shape == want.shape and got.tobytes() == want.tobytes()
    if got.shape != want.shape:
        return False, float("inf")
    a, b = got.astype(np.float64), want.astype(np.float64)
    scale = max(float(np.abs(b).max(initial=0.0)), 1e-30)
    return same, float(np.abs(a - b).max(initial=0.0)) / scale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, default=HERE.parent / "build" / "arm64")
    parser.add_argument("--sysroot", default="/usr/aarch64-linux-gnu")
    parser.add_argument("--keep", type=Path, help="write the models, inputs and outputs here")
    args = parser.parse_args()
    checker = args.build / "moe_onnx_session_check"
    ops = args.build / "libmoe_onnx_ops.so"
    for path in (checker, ops):
        if not path.is_file():
            print(f"arm64_sessions: {path} not found (custom_ops/arm64.sh builds it)", file=sys.stderr)
            return 1
    ort_library = aarch64_onnxruntime(args.build)
    work = args.keep or Path(tempfile.mkdtemp(prefix="arm64_sessions_"))
    work.mkdir(parents=True, exist_ok=True)
    cpuinfo = aarch64_cpuinfo(work)
    failures = []
    header = f"{'model':46s}" + "".join(f"{name:>12s}" for name, _, _ in LEVELS)
    print(header)
    for m in models():
        folder = work / m.name
        (folder / "inputs").mkdir(parents=True, exist_ok=True)
        onnx.save(m.model, folder / "model.onnx")
        for name, value in m.feeds.items():
            np.save(folder / "inputs" / f"{name}.npy", npy_input(value))
        expected = x86_outputs(m)
        row = f"{m.name:46s}"
        for level, cpu, gemm in LEVELS:
            out = folder / level
            out.mkdir(exist_ok=True)
            env = {k: v for k, v in os.environ.items() if k not in ("MOE_ONNX_GEMM", "MOE_ONNX_AMX")}
            if gemm:
                env["MOE_ONNX_GEMM"] = gemm
            command = ["qemu-aarch64-static", "-L", args.sysroot, "-cpu", cpu, str(checker), str(ort_library), str(ops),
                       str(folder / "model.onnx"), str(folder / "inputs"), str(out)]
            run = subprocess.run(in_aarch64_view(cpuinfo, command), env=env, capture_output=True, text=True,
                                 timeout=600)
            if run.returncode != 0:
                failures.append(f"{m.name} at {level}: {run.stderr.strip()[-2000:]}")
                row += f"{'error':>12s}"
                continue
            worst, all_same = 0.0, True
            for name, want in expected.items():
                same, diff = compare(np.load(out / f"{name}.npy"), want)
                all_same &= same
                worst = max(worst, diff)
                if not diff <= m.tolerance:
                    failures.append(f"{m.name} at {level}: output {name} differs by {diff:.3g} of its peak "
                                    f"(tolerance {m.tolerance:.3g})")
            if level in m.same_bits and not all_same:
                failures.append(f"{m.name} at {level}: not this machine's bits (largest difference {worst:.3g})")
            row += f"{'bits' if all_same else f'{worst:.2e}':>12s}"
        print(row, flush=True)
    for failure in failures:
        print("FAIL", failure)
    if failures or args.keep:
        print(f"arm64_sessions: {'FAILED' if failures else 'all sessions agree'} (work folder {work})")
    else:
        shutil.rmtree(work)
        print("arm64_sessions: all sessions agree")
    return 1 if failures else 0


if __name__ == "__main__":
    start = time.perf_counter()
    code = main()
    print(f"arm64_sessions: {time.perf_counter() - start:.0f} s")
    sys.exit(code)
