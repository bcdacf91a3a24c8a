"""Session start and resident memory of fused expert models at any size, against plain onnxruntime
on the same weights.

`build` writes a synthetic model of `layers` chained MOE (fp32) or QMOE (int4 or int8, blocks of --block-size, 32
by default, optionally with zero points) nodes of GEMM3_SWIGLU experts with random weights, streamed to its
external data file expert by expert (so building a 5 GB model needs little memory), or inline (--inline: the
weights inside the .onnx, < 2 GB), and beside it a plain-onnxruntime model on the same weights (Gather one expert
of each weight, Cast, ReduceSum: standard ops that leave the weights where onnxruntime put them). `measure` runs
each in a child process of its own and prints, per model: session creation time, resident memory (MiB: VmRSS =
RssAnon + RssFile) after creation and after each run, and each run's time (a run packs the experts it is the first
to use: the first run of the default ones, 16 tokens, routes rows to every expert of a model of up to 128, and its
time less the second's, the same tokens packed, gives the packing rate in GB of weights per second, of wall-clock
time and of the process's CPU time, which a busy machine changes less; then a decode of 1 token and two prefills of
512). `measure --packed` compares instead sessions that map packed-weights files (`moe-onnx pack`, written first
into MODEL.packed when missing, its time printed) with sessions that pack, in alternating child processes, --rounds
of each, and prints the medians side by side; with --library OLD.so also sessions of another build of our library
(e.g. main before a change) that pack and that map that library's own files (packed into MODEL.packed-library
when missing), and each variant's decode and prefill time over the packing session's: the check that a change
keeps the run's speed. `checksum` prints the rate (GB/s, one thread) of the packed-weights files' checksum over a
buffer in the caches and one much larger (packed_file.h's checksum, through the library's test hook).

    python benchmarks/startup_memory.py build DIR --format fp32 --experts 128 --hidden 2048 --inter 768
    python benchmarks/startup_memory.py build DIR --format int4 --block-size 64 --zero-points --experts 64 --layers 1
    flock /work/wt/bigmem.lock python benchmarks/startup_memory.py measure DIR/moe_fp32.onnx --threads 2
    flock /work/wt/bigmem.lock python benchmarks/startup_memory.py measure DIR/moe_fp32.onnx --packed --rounds 3 \
        [--library OLD/libmoe_onnx_ops.so] [--runs 16 16 1 1 1 1 512 512 512]
    python benchmarks/startup_memory.py checksum
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

import _memory
from _timing import session_options
from moe_onnx.runtime.library import LIBRARY_ENV

TOP_K = 8
ALIGN = 4096  # external data offsets, page aligned as onnxruntime maps them


class _ExternalData:
    """Appends arrays to one external data file and names them as initializers that point there."""

    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("wb")

    def tensor(self, name: str, elem: int, shape: list[int], chunks) -> TensorProto:
        """An initializer of `shape` whose bytes are the arrays `chunks` yields, written in order."""
        offset = self.file.tell()
        pad = -offset % ALIGN
        self.file.write(b"\0" * pad)
        offset += pad
        for chunk in chunks:
            self.file.write(np.ascontiguousarray(chunk).tobytes())
        t = TensorProto(name=name, data_type=elem, dims=shape, data_location=TensorProto.EXTERNAL)
        for key, value in (("location", self.path.name), ("offset", str(offset)),
                           ("length", str(self.file.tell() - offset))):
            t.external_data.add(key=key, value=value)
        return t

    def close(self) -> None:
        self.file.close()


def _weights(fmt: str, E: int, H: int, I: int, layer: int, block: int, zero_points: bool):
    """(name, elem type, shape, chunks per expert) of one layer's weight inputs in QMOE/MOE order."""
    rng = np.random.default_rng(layer)
    bits = 8 if fmt == "int8" else 4

    def floats(n, k):
        return lambda: (rng.standard_normal((n, k), dtype=np.float32) * k ** -0.5 for _ in range(E))

    def codes(n, k):
        return lambda: (rng.integers(0, 256, (n, k * bits // 8), dtype=np.uint8) for _ in range(E))

    def scales(n, k):
        return lambda: (rng.uniform(0.5, 1.5, (n, k // block)).astype(np.float32) * 0.1 * k ** -0.5
                        for _ in range(E))

    def zero_point_bytes(k):
        return -(-k // block * bits // 8)

    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    if fmt == "fp32":
        return [(f"l{layer}.{w}", TensorProto.FLOAT, [E, n, k], floats(n, k)) for w, (n, k) in shapes.items()]
    return ([(f"l{layer}.{w}", TensorProto.UINT8, [E, n, k * bits // 8], codes(n, k)) for w, (n, k) in shapes.items()]
            + [(f"l{layer}.{w}.scales", TensorProto.FLOAT, [E, n, k // block], scales(n, k))
               for w, (n, k) in shapes.items()]
            + [(f"l{layer}.{w}.zero_points", TensorProto.UINT8, [E, n, zero_point_bytes(k)],
                lambda n=n, k=k: (rng.integers(0, 256, (n, zero_point_bytes(k)), dtype=np.uint8) for _ in range(E)))
               for w, (n, k) in shapes.items() if zero_points])


def build(out_dir: Path, fmt: str, E: int, H: int, I: int, layers: int, inline: bool, block: int = 32,
          zero_points: bool = False) -> tuple[Path, Path]:
    """Writes the fused model and its plain-onnxruntime twin on the same weights (one data file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    quantized = f"{'' if block == 32 else f'_b{block}'}{'_zp' if zero_points else ''}" if fmt != "fp32" else ""
    stem = f"moe_{fmt}{quantized}{'_inline' if inline else ''}"
    data = None if inline else _ExternalData(out_dir / f"{stem}.data")
    inits, fused_nodes, plain_nodes, x = [], [], [], "x"
    for layer in range(layers):
        names = []
        for name, elem, shape, chunks in _weights(fmt, E, H, I, layer, block, zero_points):
            if data:
                inits.append(data.tensor(name, elem, shape, chunks()))
            else:
                array = np.concatenate([c[None] for c in chunks()])
                inits.append(onnx.numpy_helper.from_array(array, name))
            names.append(name)
            plain_nodes += [helper.make_node("Gather", [name, "expert"], [f"{name}.one"], axis=0),
                            helper.make_node("Cast", [f"{name}.one"], [f"{name}.f"], to=TensorProto.FLOAT),
                            helper.make_node("ReduceSum", [f"{name}.f"], [f"{name}.sum"], keepdims=0)]
        y = f"y{layer}"
        if fmt == "fp32":
            fused_nodes.append(helper.make_node("MOE", [x, "routing", "indices", names[0], "", names[1], "", names[2]],
                                                [y], domain="moe_onnx", expert_type="GEMM3_SWIGLU"))
        else:
            fused_nodes.append(helper.make_node(
                "QMOE", [x, "routing", "indices", names[0], "", names[1], "", names[2], *names[3:]], [y],
                domain="moe_onnx", expert_type="GEMM3_SWIGLU", bits=8 if fmt == "int8" else 4, block_size=block))
        x = y
    if data:
        data.close()
    sums = [n.output[0] for n in plain_nodes if n.op_type == "ReduceSum"]
    plain_nodes.append(helper.make_node("Sum", sums, ["total"]))
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("moe_onnx", 1)]
    fused = helper.make_graph(
        fused_nodes, "fused",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H]),
         helper.make_tensor_value_info("routing", TensorProto.FLOAT, ["T", TOP_K]),
         helper.make_tensor_value_info("indices", TensorProto.INT64, ["T", TOP_K])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["T", H])], inits)
    plain = helper.make_graph(plain_nodes, "plain", [helper.make_tensor_value_info("expert", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])], inits)
    paths = out_dir / f"{stem}.onnx", out_dir / f"{stem}.plain.onnx"
    for graph, path in zip((fused, plain), paths):
        onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=10), path)
    return paths


def status_mb() -> dict[str, float]:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, in whole MB."""
    return {key: round(value) for key, value in _memory.status_mb().items()}


def feeds(H: int, E: int, tokens: int, seed: int = 0) -> dict[str, np.ndarray]:
    """`tokens` tokens whose slots cycle through every expert (prefill: each expert gets rows)."""
    rng = np.random.default_rng(seed)
    slots = (np.arange(tokens * TOP_K) * 7 + seed) % E
    return {"x": rng.standard_normal((tokens, H), dtype=np.float32),
            "routing": np.full((tokens, TOP_K), 1 / TOP_K, np.float32),
            "indices": slots.reshape(tokens, TOP_K).astype(np.int64)}


def child(path: str, threads: int, runs: list[int], experts: int, packed: str | None = None) -> dict:
    """Creates a session on `path` (mapping the files of the folder `packed`, else packing) and runs it on
    each token count in `runs` (a plain model: once); when the first two runs have the same tokens, enough to
    route rows to all `experts`, the packing rate too (the model's weight bytes over the first run's time less
    the second's)."""
    import onnxruntime as ort

    import moe_onnx
    from moe_onnx._ir import model_files  # noqa: F401  (imported here: its import is not the session's time)
    report = {"start": status_mb()}
    t0 = time.perf_counter()
    opts = session_options(threads)
    plain = path.endswith(".plain.onnx")
    sess = (ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]) if plain
            else moe_onnx.session(path, backend="cpp", sess_options=opts, packed_weights=packed))
    report["create_s"] = round(time.perf_counter() - t0, 3)
    report["created"] = status_mb()
    if plain:
        t0 = time.perf_counter()
        sess.run(None, {"expert": np.array(0, np.int64)})
        report["run"] = {"s": round(time.perf_counter() - t0, 4), **status_mb()}
        return report
    shape = {i.name: i.shape for i in sess.get_inputs()}
    H = shape["x"][1]
    times, cpu = [], []
    for n, tokens in enumerate(runs):
        f = feeds(H, experts, tokens, seed=n)
        t0, c0 = time.perf_counter(), time.process_time()
        sess.run(None, f)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        report[f"run{n}_T{tokens}"] = {"s": round(times[-1], 6), **status_mb()}
    if len(runs) > 1 and runs[0] == runs[1] and runs[0] * TOP_K >= experts:
        # the first run packs every expert, the second (same tokens) none: the difference is the packing
        gb = sum(f.stat().st_size for f in Path(path).parent.glob(Path(path).stem + ".*")
                 if f.suffix in (".onnx", ".data") and not f.name.endswith(".plain.onnx")) / 1e9
        report["packing_GB_per_s"] = round(gb / (times[0] - times[1]), 2)
        report["packing_GB_per_cpu_s"] = round(gb / (cpu[0] - cpu[1]), 2)  # all threads' CPU time
    return report


def _child_report(path: str, threads: int, runs: list[int], experts: int, packed: Path | None = None,
                  library: str | None = None) -> dict | None:
    """child() in a process of its own, with our library at `library` when given (None, the error printed, when it
    fails)."""
    cmd = [sys.executable, __file__, "child", path, "--threads", str(threads), "--runs", *map(str, runs),
           "--experts", str(experts), *(["--packed-folder", str(packed)] if packed else [])]
    env = dict(os.environ, **({LIBRARY_ENV: library} if library else {}))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        print(f"{path}: failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(models: list[str], threads: int, runs: list[int]) -> None:
    for path in models:
        experts = onnx.load(path, load_external_data=False).graph.initializer[0].dims[0]
        for p in (path, path.replace(".onnx", ".plain.onnx")):
            report = _child_report(p, threads, runs, experts)
            if report is not None:
                print(f"{Path(p).name}: {json.dumps(report)}", flush=True)


def measure_packed(models: list[str], threads: int, runs: list[int], rounds: int, library: str | None) -> None:
    """Per model: `moe-onnx pack` into MODEL.packed when it is missing (its time and peak RSS); then sessions
    that map those files, sessions that pack and, with `library` (another build of our library, e.g. main
    before a change), sessions of that library that pack and that map its own files (MODEL.packed-library,
    packed by it when missing), alternating, `rounds` of each; the medians side by side: creation, the first
    run, a decode (the median of a process's runs of 1 token), a prefill (of its runs of 512 after the first),
    resident anonymous and file-backed memory after the first run, and each variant's decode and prefill time
    over the packing session's."""
    from moe_onnx.runtime.packed_weights import default_directory

    for path in models:
        experts = onnx.load(path, load_external_data=False).graph.initializer[0].dims[0]
        folders = {None: default_directory(path)}
        if library:
            folders[library] = Path(str(default_directory(path)) + "-library")
        for packer, folder in folders.items():
            if not folder.is_dir():
                peak, seconds, code, output = _memory.run_child(
                    [sys.executable, "-m", "moe_onnx.cli", "pack", path, "--threads", str(threads), "--dir",
                     str(folder)], capture=True, env=dict(os.environ, **({LIBRARY_ENV: packer} if packer else {})))
                print(f"pack{', --library' if packer else ''} ({seconds:.1f} s wall with the interpreter, peak RSS "
                      f"{peak:.0f} MiB, exit {code}):\n{output.strip()}", flush=True)
        variants = {"packed file": dict(packed=folders[None]), "packing": {}}
        if library:
            variants["packed file, --library"] = dict(packed=folders[library], library=library)
            variants["packing, --library"] = dict(library=library)
        reports: dict[str, list[dict]] = {variant: [] for variant in variants}
        for n in range(rounds):
            for variant in (list(variants) if n % 2 == 0 else list(variants)[::-1]):
                report = _child_report(path, threads, runs, experts, **variants[variant])
                if report is not None:
                    print(f"round {n + 1} {variant}: {json.dumps(report)}", flush=True)
                    reports[variant].append(report)

        def per_process(report: dict, tokens: int, skip_first: bool) -> float:
            times = [v["s"] for k, v in report.items() if k.startswith("run") and k.endswith(f"_T{tokens}")]
            times = times[1:] if skip_first and len(times) > 1 else times
            return float(np.median(times)) * 1e3 if times else float("nan")

        first = f"run0_T{runs[0]}"
        print(f"{Path(path).name}, medians of {rounds} rounds, {threads} threads:")
        print(f"{'':20} {'create s':>9} {'first run s':>12} {'decode ms':>10} {'prefill ms':>11} "
              f"{'RssAnon MiB':>12} {'RssFile MiB':>12} {'decode / packing':>17} {'prefill / packing':>18}")
        rows = {}
        for variant, got in reports.items():
            if got:
                rows[variant] = [float(np.median([pick(r) for r in got])) for pick in (
                    lambda r: r["create_s"], lambda r: r[first]["s"], lambda r: per_process(r, 1, False),
                    lambda r: per_process(r, 512, True), lambda r: r[first]["RssAnon"], lambda r: r[first]["RssFile"])]
        base = rows.get("packing")
        for variant, (create, first_run, decode, prefill, anon, file) in rows.items():
            ratios = f"{decode / base[2]:17.3f} {prefill / base[3]:18.3f}" if base else ""
            print(f"{variant:20} {create:9.2f} {first_run:12.2f} {decode:10.2f} {prefill:11.1f} {anon:12.0f} "
                  f"{file:12.0f} {ratios}", flush=True)


def checksum_rate() -> None:
    """The packed-weights files' checksum over 1 MiB (in the caches, many times) and 1 GiB (from memory), one
    thread: GB/s, the best of 5."""
    import ctypes

    import moe_onnx

    lib = ctypes.CDLL(moe_onnx.custom_ops_library())
    lib.MoeOnnxChecksum.restype = ctypes.c_uint64
    lib.MoeOnnxChecksum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64]
    for size, repeats in ((1 << 20, 1024), (1 << 30, 1)):
        data = np.random.default_rng(0).integers(0, 256, size, np.uint8)
        best = min(_timed(lambda: [lib.MoeOnnxChecksum(data.ctypes.data, size, 0) for _ in range(repeats)])
                   for _ in range(5))
        print(f"checksum of {size >> 20} MiB x {repeats}: {size * repeats / best / 1e9:.1f} GB/s", flush=True)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir", type=Path)
    b.add_argument("--format", choices=("fp32", "int4", "int8"), default="fp32")
    b.add_argument("--block-size", type=int, default=32, help="QMOE: the scales' block size")
    b.add_argument("--zero-points", action="store_true", help="QMOE: with zero points")
    b.add_argument("--experts", type=int, default=128)
    b.add_argument("--hidden", type=int, default=2048)
    b.add_argument("--inter", type=int, default=768)
    b.add_argument("--layers", type=int, default=2)
    b.add_argument("--inline", action="store_true")
    for name in ("measure", "child"):
        m = sub.add_parser(name)
        m.add_argument("models", nargs="+")
        m.add_argument("--threads", type=int, default=2)
        m.add_argument("--runs", type=int, nargs="+", default=[16, 16, 1, 512, 512])
    sub.choices["measure"].add_argument("--packed", action="store_true",
                                        help="sessions on MODEL.packed's files against packing")
    sub.choices["measure"].add_argument("--rounds", type=int, default=3, help="--packed: processes of each kind")
    sub.choices["measure"].add_argument("--library", help="--packed: also sessions of this build of our library")
    sub.choices["child"].add_argument("--experts", type=int, required=True)
    sub.choices["child"].add_argument("--packed-folder", help="map the files of this folder")
    sub.add_parser("checksum")
    args = parser.parse_args()
    if args.command == "build":
        for p in build(args.dir, args.format, args.experts, args.hidden, args.inter, args.layers, args.inline,
                       args.block_size, args.zero_points):
            print(p)
    elif args.command == "measure" and args.packed:
        measure_packed(args.models, args.threads, args.runs, args.rounds, args.library)
    elif args.command == "measure":
        measure(args.models, args.threads, args.runs)
    elif args.command == "checksum":
        checksum_rate()
    else:
        print(json.dumps(child(args.models[0], args.threads, args.runs, args.experts, args.packed_folder)))


if __name__ == "__main__":
    main()
