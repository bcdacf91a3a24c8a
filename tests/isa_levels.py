"""The C++ library's ISA levels on this machine's architecture (custom_ops/src/kernels/isa.h), in ascending
order, and the CPU's features the tests name: the tests that run every level (MOE_ONNX_GEMM) or expect a kernel
use these rather than one architecture's names."""

from __future__ import annotations

import platform
from pathlib import Path

ARM64 = platform.machine().lower() in ("aarch64", "arm64")
X86_LEVELS = ("portable", "avx2", "avx512", "amx")
ARM64_LEVELS = ("portable", "neon", "dotprod", "i8mm", "bf16")
LEVELS = ARM64_LEVELS if ARM64 else X86_LEVELS


def cpu_flags() -> set[str]:
    """/proc/cpuinfo's feature names: x86's ``flags`` (avx2, avx512_vnni, ...), aarch64's ``Features``
    (asimd, asimddp, i8mm, bf16, ...); empty where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith(("flags", "Features"))
            for f in line.split(":", 1)[1].split()}


def gemm_kernel(level: str) -> str:
    """The float GEMM's kernel at ``level`` (gemm_panels in the kernel report): amx has none of its own (AVX-512's),
    nor do aarch64's levels above neon."""
    return {"amx": "avx512", "dotprod": "neon", "i8mm": "neon", "bf16": "neon"}.get(level, level)
