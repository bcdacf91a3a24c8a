"""Peak memory of `moe-onnx optimize` on a model larger than 2 GB (not a test).

Exports (once) a GPT-OSS-shaped block with E=32, H=I=2880 (3.2 GB of weights, external data) with the
models/ export script, then runs `moe-onnx optimize` on it for each target in a child process and
prints the model size, the peak resident memory of the child and the wall time.

usage: python benchmarks/optimize_memory.py [--models-dir /tmp/moe-big] [--export-python-457 PY]

The export needs torch and transformers 4.57: --export-python-457 (or MOE_ONNX_EXPORT_PYTHON_457)
names the python of such an environment (models/README.md); without one, the script prints the
commands that make it, or point --models-dir at a directory that already holds
gpt_oss_tiled_E32_k4_H2880_I2880.onnx.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from _exports import Shape, add_export_options, ensure_export, export_pythons, how_to_export
from _memory import run_child

BIG = Shape("gpt_oss_big", "gpt_oss", "tiled", "457", E=32, k=4, H=2880, I=2880, gemm2=True)


def model_bytes(path: Path) -> int:
    """The .onnx file plus every external data file beside it that it names."""
    import onnx

    proto = onnx.load(path, load_external_data=False)
    files = {path} | {path.parent / entry.value for t in proto.graph.initializer for entry in t.external_data
                      if entry.key == "location"}
    return sum(f.stat().st_size for f in files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/moe-big"))
    add_export_options(parser, [BIG.environment])
    args = parser.parse_args()
    args.models_dir.mkdir(parents=True, exist_ok=True)
    source = ensure_export(BIG, args.models_dir, export_pythons(args))
    if source is None:
        print("make the export with (models/README.md, 'Export environments'):\n"
              + how_to_export([BIG], args.models_dir), file=sys.stderr)
        return 1

    print(f"model: {source} ({model_bytes(source) / 2**30:.2f} GiB with external data)")
    print("| target | peak RSS of `moe-onnx optimize` | wall time | output size |")
    print("|---|---|---|---|")
    for target in ("moe", "grouped"):
        out = args.models_dir / f"optimized_{target}.onnx"
        peak, seconds, status, _ = run_child([sys.executable, "-m", "moe_onnx.cli", "optimize", str(source), "-o",
                                              str(out), "--target", target],
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if status != 0:
            print(f"moe-onnx optimize --target {target} failed", file=sys.stderr)
            return 1
        print(f"| {target} | {peak:.0f} MiB | {seconds:.1f} s | {model_bytes(out) / 2**30:.2f} GiB |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
