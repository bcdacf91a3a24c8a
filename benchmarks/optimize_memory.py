"""Peak memory of `moe-onnx optimize` on a model larger than 2 GB (not a test).

Exports (once) a GPT-OSS-shaped block with E=32, H=I=2880 (3.2 GB of weights, external data) with the
models/ export script, then runs `moe-onnx optimize` on it for each target in a child process and
prints the model size, the peak resident memory of the child and the wall time.

usage: python benchmarks/optimize_memory.py [--models-dir /tmp/moe-big] [--export-python PY]

The export needs torch and transformers 4.57 (see models/README.md); without them, point
--models-dir at a directory that already holds gpt_oss_tiled_big.onnx.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPORT = ["--family", "gpt_oss", "--style", "tiled", "--hidden", "2880", "--intermediate", "2880",
          "--experts", "32", "--topk", "4"]


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
    parser.add_argument("--export-python", default="/work/export-venv-457/bin/python",
                        help="a Python with torch and transformers 4.57 (models/requirements-export-457.txt)")
    args = parser.parse_args()
    args.models_dir.mkdir(parents=True, exist_ok=True)
    source = args.models_dir / "gpt_oss_tiled_big.onnx"
    export = [args.export_python, str(ROOT / "models" / "export_moe_blocks.py"), *EXPORT, "-o", str(source)]
    if not source.exists():
        print("exporting:", " ".join(export), flush=True)
        if subprocess.run(export).returncode != 0:
            print("export failed; run the command above in an environment with torch", file=sys.stderr)
            return 1

    print(f"model: {source} ({model_bytes(source) / 2**30:.2f} GiB with external data)")
    print("| target | peak RSS of `moe-onnx optimize` | wall time | output size |")
    print("|---|---|---|---|")
    for target in ("moe", "grouped"):
        out = args.models_dir / f"optimized_{target}.onnx"
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "moe_onnx.cli", "optimize", str(source), "-o", str(out),
                                  "--target", target], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS (KiB on Linux)
        seconds = time.perf_counter() - start
        if status != 0:
            print(f"moe-onnx optimize --target {target} failed", file=sys.stderr)
            return 1
        print(f"| {target} | {usage.ru_maxrss / 1024:.0f} MiB | {seconds:.1f} s | {model_bytes(out) / 2**30:.2f} GiB |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
