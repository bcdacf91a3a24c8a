"""Resident memory of each variant, each in its own process: after session creation, and the peak of
one run (VmHWM reset after creation, so the run's own extra memory shows).

`measure_rss` starts this file as a child per variant:
`python benchmarks/_memory.py MODEL {cpp,python,ort} TOKENS HIDDEN --threads N`, which prints one JSON
line of MB figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import onnx
import onnxruntime as ort

import moe_onnx
from moe_onnx.testing import random_hidden_states
from _models import ort_moe_model
from _timing import session_options

if TYPE_CHECKING:
    from _exports import Shape


def measure_rss(shape: Shape, models: dict[str, onnx.ModelProto], models_dir: Path, tokens: int, threads: int,
                skip: set[str]) -> dict[str, dict]:
    """Per variant (fused, unfused, com.microsoft::MoE, grouped; less those in `skip`), its child's
    figures at `tokens` tokens, or {"error": the child's last stderr line}. The models are read from
    models_dir (the optimized forms are cached there; the others are written first)."""
    variants = {"fused (cpp)": (models_dir / f"{shape.stem}.moe.onnx", "cpp", None),
                "unfused": (models_dir / f"{shape.stem}.export1.onnx", "ort", "unfused"),
                "com.microsoft::MoE": (models_dir / f"{shape.stem}.ortmoe.onnx", "ort", "ort_moe"),
                "grouped (cpp)": (models_dir / f"{shape.stem}.grouped.onnx", "cpp", "grouped")}
    variants = {v: (path, backend) for v, (path, backend, key) in variants.items() if key not in skip}
    if "unfused" in variants:
        onnx.save(models["export"], variants["unfused"][0])
    if "com.microsoft::MoE" in variants:
        onnx.save(ort_moe_model(models["moe"], shape), variants["com.microsoft::MoE"][0])
    out = {}
    for v, (path, backend) in variants.items():
        if not path.exists():
            continue
        cmd = [sys.executable, __file__, str(path), backend, str(tokens), str(shape.H), "--threads", str(threads)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            out[v] = {"error": (p.stderr.strip().splitlines() or ["failed"])[-1][:120]}
        else:
            out[v] = json.loads(p.stdout.strip().splitlines()[-1])
        r = out[v]
        print(f"[{shape.name}] RSS {v}: " + (f"created {r['created']:.0f} MB, peak {r['hwm']:.0f} MB"
                                                if "hwm" in r else r["error"]), flush=True)
    return out


def run_child(argv: list[str], capture: bool = False, **popen) -> tuple[float, float, int, str]:
    """``argv`` in a child process: (its own peak RSS in MiB from wait4's ru_maxrss, wall seconds, exit code, its
    stdout and stderr when ``capture``, else ""); ``popen`` goes to subprocess.Popen."""
    start = time.perf_counter()
    if capture:
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    child = subprocess.Popen(argv, **popen)
    output = child.stdout.read() if capture else ""
    _, status, usage = os.wait4(child.pid, 0)
    return usage.ru_maxrss / 1024, time.perf_counter() - start, os.waitstatus_to_exitcode(status), output


def status_mb(keys: tuple[str, ...] = ("VmRSS", "RssAnon", "RssFile", "VmHWM")) -> dict[str, float]:
    """Figures of /proc/self/status (kB there), in MB."""
    figures = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in keys:
            figures[key] = int(line.split()[1]) / 1024
    return figures


def child(path: str, backend: str, tokens: int, hidden: int, threads: int) -> dict[str, float | bool]:
    """Create one variant's session, run it once on `tokens` tokens; VmRSS and VmHWM (MB) around it."""
    base = status_mb()["VmRSS"]
    opts = session_options(threads)
    sess = (ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]) if backend == "ort"
            else moe_onnx.session(path, backend=backend, sess_options=opts))
    x = random_hidden_states(hidden, 1, tokens)
    created = status_mb()["VmRSS"]
    created_hwm = status_mb()["VmHWM"]
    try:  # reset VmHWM to the current RSS (Linux >= 4.0), so the peak below is the run's own
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    sess.run(None, {sess.get_inputs()[0].name: x})
    return {"base": base, "created": created, "created_hwm": created_hwm, "hwm": status_mb()["VmHWM"],
            "reset": reset, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("backend", choices=("cpp", "python", "ort"))
    ap.add_argument("tokens", type=int)
    ap.add_argument("hidden", type=int)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(json.dumps(child(args.model, args.backend, args.tokens, args.hidden, args.threads)))


if __name__ == "__main__":
    main()
