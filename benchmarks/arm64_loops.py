"""The aarch64 kernels' inner loops on paper (not a test): instructions per useful multiply-add from the
disassembly of the cross-built library, and llvm-mca's cycles per iteration on Neoverse cores.

For each kernel object of build/arm64 (custom_ops/arm64.sh builds it), every innermost loop (a backward branch
and its target) that multiplies is found with aarch64-linux-gnu-objdump; its multiply-adds are counted by
instruction (FMLA .4s: 4, BFDOT .4s: 8, BFMMLA: 16, SDOT .4s: 16, SMMLA/USMMLA: 32, SMULL/SMULL2 .8h: 8; SADALP,
EOR and the loads do none), the loop with the most per function is printed with its instruction count and the
instructions per multiply-add; with --mca, llvm-mca runs the loop body (-iterations 200) for each CPU model and
prints the cycles per iteration and the multiply-adds per cycle. Speed on a real machine also depends on memory
and on what runs between the loops: docs/building.md ("aarch64") puts these numbers next to MLAS's and ggml's.

Usage: python benchmarks/arm64_loops.py [--build build/arm64] [--mca llvm-mca-19] [--cpus neoverse-n1 neoverse-v1]
       python benchmarks/arm64_loops.py --object OTHER.o [--match REGEX] [--mca ...]   (another library's kernels, built
       for aarch64 with the cross compiler: the same count on them, for docs/building.md's comparison)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The kernel objects, by the slot they serve.
OBJECTS = {
    "gemm_panels (fp32/fp16/bf16 weights)": "kernels_arm64_neon.dir/src/kernels/arm64/neon/gemm_neon.cc.o",
    "quant_fused (QMOE level 0, <= 4 rows)": "kernels_arm64_neon.dir/src/kernels/arm64/neon/qgemm_neon.cc.o",
    "int8_gemm neon (SMULL + SADALP)": "kernels_arm64_neon.dir/src/kernels/arm64/neon/int8_gemm_neon.cc.o",
    "int8_gemm dotprod (SDOT)": "kernels_arm64_dotprod.dir/src/kernels/arm64/dotprod/int8_gemm_dotprod.cc.o",
    "quant_dots dotprod (QMOE level 4)": "kernels_arm64_dotprod.dir/src/kernels/arm64/dotprod/qgemm_dotprod.cc.o",
    "int8_gemm i8mm (SMMLA)": "kernels_arm64_i8mm.dir/src/kernels/arm64/i8mm/int8_gemm_i8mm.cc.o",
    "bf16_gemm (BFDOT)": "kernels_arm64_bf16.dir/src/kernels/arm64/bf16/bf16_gemm_bfdot.cc.o",
    "bf16_gemm_tiles (BFMMLA)": "kernels_arm64_bf16.dir/src/kernels/arm64/bf16/bf16_gemm_bfmmla.cc.o",
}

LINE = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")
FUNCTION = re.compile(r"^[0-9a-f]+ <(.+)>:$")
BRANCH = re.compile(r"^(b|b\.\w+|cbz|cbnz|tbz|tbnz)$")
LATCH = re.compile(r"^(b\.\w+|cbz|cbnz|tbz|tbnz)$")  # a loop ends in a conditional branch back


def macs(mnemonic: str, operands: str) -> int:
    """Useful multiply-adds of one instruction (per 128-bit register)."""
    if mnemonic in ("fmla", "fmls"):
        return 4 if ".4s" in operands.split(",")[0] else 2 if ".2s" in operands.split(",")[0] else 1
    if mnemonic in ("sdot", "udot", "usdot", "sudot"):
        return 16 if ".4s" in operands.split(",")[0] else 8
    if mnemonic in ("smmla", "ummla", "usmmla"):
        return 32
    if mnemonic == "bfdot":
        return 8 if ".4s" in operands.split(",")[0] else 4
    if mnemonic == "bfmmla":
        return 16
    if mnemonic in ("smull", "smull2", "umull", "umull2"):
        return 8 if ".8h" in operands.split(",")[0] else 4
    return 0


def functions(obj: Path) -> dict[str, list[tuple[int, str, str]]]:
    """Each function's instructions: (address, mnemonic, operands)."""
    text = subprocess.run(["aarch64-linux-gnu-objdump", "-d", "-C", "--no-show-raw-insn", str(obj)], check=True,
                          capture_output=True, text=True).stdout
    out: dict[str, list[tuple[int, str, str]]] = {}
    current = None
    for line in text.splitlines():
        m = FUNCTION.match(line)
        if m:
            current = m.group(1)
            out[current] = []
            continue
        m = LINE.match(line)
        if m and current is not None:
            out[current].append((int(m.group(1), 16), m.group(2), m.group(3).split("//")[0].strip()))
    return out


def loops(code: list[tuple[int, str, str]]) -> list[list[tuple[int, str, str]]]:
    """The bodies of the loops (a conditional branch back to an address of the function), shortest first."""
    index = {address: i for i, (address, _, _) in enumerate(code)}
    found = []
    for i, (_, mnemonic, operands) in enumerate(code):
        if not LATCH.match(mnemonic):
            continue
        target = re.search(r"\b([0-9a-f]+) <", operands)
        if target and int(target.group(1), 16) in index and index[int(target.group(1), 16)] <= i:
            found.append(code[index[int(target.group(1), 16)]:i + 1])
    return sorted(found, key=len)


def inner_loop(code: list[tuple[int, str, str]]) -> list[tuple[int, str, str]] | None:
    """The kernel's inner loop: of the loops that multiply and hold no other loop that does (a prefetch's
    loop inside counts with it), the one with the most multiply-adds (the main loop, not a tail's)."""
    def count(body):
        return sum(macs(m, o) for _, m, o in body)

    multiplying = [body for body in loops(code) if count(body)]
    inner = [body for body in multiplying
             if not any(other is not body and other[0][0] >= body[0][0] and other[-1][0] <= body[-1][0]
                        for other in multiplying)]
    return max(inner, key=count, default=None)


def mca(body: list[tuple[int, str, str]], tool: str, cpu: str) -> float | None:
    """llvm-mca's cycles per iteration of the loop body on `cpu` (the branch left out)."""
    lines = [f"{m} {ops}" for _, m, ops in body if not BRANCH.match(m)]
    lines = [re.sub(r"\s*<[^>]*>", "", line) for line in lines]
    result = subprocess.run([tool, "-mtriple=aarch64", f"-mcpu={cpu}", "-mattr=+dotprod,+i8mm,+bf16",
                             "-iterations=200"], input="\n".join(lines) + "\n", capture_output=True, text=True)
    cycles = re.search(r"Total Cycles:\s+(\d+)", result.stdout)
    return int(cycles.group(1)) / 200 if cycles else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, default=ROOT / "build" / "arm64")
    parser.add_argument("--mca", help="an llvm-mca with Neoverse models (LLVM 17 or later: llvm-mca-19)")
    parser.add_argument("--cpus", nargs="+", default=["neoverse-n1", "neoverse-v1", "neoverse-v2"])
    parser.add_argument("--object", type=Path, nargs="+", help="count these objects' functions instead")
    parser.add_argument("--match", default="", help="with --object: only the functions whose name has this regex")
    args = parser.parse_args()
    if not shutil.which("aarch64-linux-gnu-objdump"):
        print("arm64_loops: aarch64-linux-gnu-objdump not found (scripts/install_arm64_tools.sh)", file=sys.stderr)
        return 1
    header = f"{'kernel':40s} {'function':34s} {'instr':>6s} {'MACs':>6s} {'instr/MAC':>9s}"
    if args.mca:
        header += "".join(f" {cpu + ' cyc':>16s} {'MAC/cyc':>8s}" for cpu in args.cpus)
    print(header)
    objects = ({path.name: path for path in args.object} if args.object else
               {kernel: args.build / "CMakeFiles" / relative for kernel, relative in OBJECTS.items()})
    for kernel, obj in objects.items():
        if not obj.is_file():
            print(f"{kernel:40s} (no {obj})")
            continue
        for name, code in functions(obj).items():
            if args.match and not re.search(args.match, name):
                continue
            best = inner_loop(code)
            if best is None:
                continue
            count = sum(macs(m, o) for _, m, o in best)
            short = re.sub(r"\((moe_onnx::\w+|anonymous namespace)\)(::)?", "", name).replace("moe_onnx::detail::", "")
            short = re.sub(r"\(.*", "", re.sub(r"^void ", "", short))
            row = f"{kernel:40s} {short[:34]:34s} {len(best):6d} {count:6d} {len(best) / count:9.3f}"
            for cpu in args.cpus if args.mca else []:
                cycles = mca(best, args.mca, cpu)
                row += f" {cycles:16.2f} {count / cycles:8.1f}" if cycles else f" {'-':>16s} {'-':>8s}"
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
