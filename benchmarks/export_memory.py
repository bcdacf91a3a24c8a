"""Peak resident memory of `moe-onnx export` against the checkpoint's size, phase by phase (not a test: it needs
torch and transformers, and minutes at the large size).

  python benchmarks/export_memory.py                    # tiny, small and large checkpoints at fp32
  python benchmarks/export_memory.py --size tiny large --dtype fp32 fp16 --work-dir /tmp/export-memory

Per size (tiny: 1 MiB; small: 142 MiB; large: 1469 MiB), a qwen3_moe checkpoint with random weights
(transformers' save_pretrained: one tensor per expert, which the export stacks a range of experts at a time) is
exported, fused, in a child process of its own. The child records its resident memory after the imports (Python,
torch, transformers, moe_onnx) and its peak (VmHWM, anonymous + file-backed) in each phase, resetting the peak
between phases (/proc/self/clear_refs): reading the checkpoint's headers, the trace on the meta device, the
constant folding, the optimize pass, the write (where every weight is read and converted). The figure is the peak
above the imports against the checkpoint's bytes; beside it, the peak above the tiny checkpoint's (what any model
costs: the exporter's own memory) against the checkpoint's bytes.

  python benchmarks/export_memory.py capped CHECKPOINT OUT --cap 2 -- --bits 4 --block-size 32 --linears --embedding

`capped`: `moe-onnx export CHECKPOINT -o OUT` (the options after --) in a memory cgroup (v1) made below this
process's, capped at --cap GiB of anonymous memory and page cache together, without swap: the export of a
checkpoint many times that size must finish within it, the page cache of what it read reclaimed as it goes. The
page cache is dropped first where this process may (root), so that the checkpoint is read from disk and charged to
the cap. Prints the wall time, the export's peak RSS, the cgroup's peak usage and how often it reached the cap. On
cgroup v2 run the export under `systemd-run --scope -p MemoryMax=2G -p MemorySwapMax=0` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _memory import status_mb
from _models import save_random_checkpoint

TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "checkpoints" / "qwen3_moe"


def _qwen3_moe(layers: int, E: int, H: int, I: int, heads: int, kv_heads: int, vocab: int) -> dict:
    return dict(num_hidden_layers=layers, hidden_size=H, moe_intermediate_size=I, intermediate_size=4 * I,
                num_experts=E, num_experts_per_tok=4, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=64, vocab_size=vocab, max_position_embeddings=4096, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)


SIZES = {"small": ("H = 512, 4 layers, E = 16, I = 256, vocabulary 9216",
                   _qwen3_moe(4, E=16, H=512, I=256, heads=8, kv_heads=2, vocab=9216)),
         "large": ("H = 1024, 6 layers, E = 32, I = 512, vocabulary 32768",
                   _qwen3_moe(6, E=32, H=1024, I=512, heads=16, kv_heads=4, vocab=32768)),
         "tiny": ("H = 64, 2 layers, E = 8, I = 32, vocabulary 256",
                  _qwen3_moe(2, E=8, H=64, I=32, heads=4, kv_heads=2, vocab=256))}


#: export_checkpoint's progress messages (their start) that start each phase
PHASES = {"reading ": "read", "tracing ": "trace", "folding ": "fold", "optimizing the decoder": "optimize",
          "writing /": "write"}


def export_child(checkpoint: Path, out: Path, dtype: str) -> dict:
    """Exports `checkpoint` to `out`; the resident MiB after the imports and the peak MiB of each phase (named by
    the export's progress messages)."""
    import torch  # noqa: F401 - the imports the export needs, counted before it starts
    import transformers  # noqa: F401

    from moe_onnx.export import _torch  # noqa: F401
    from moe_onnx.export import export_checkpoint

    report = {"imports": status_mb()["VmRSS"], "phases": []}
    phase = ["imports"]

    def close_phase(message: str) -> None:
        """At each of the export's own stage messages (not the optimize pass's), the phase before it ends."""
        next_phase = next((name for start, name in PHASES.items() if message.startswith(start)), None)
        if message and (next_phase is None or next_phase == phase[0]):
            return
        report["phases"].append([phase[0], status_mb()["VmHWM"]])
        Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from the resident memory now
        phase[0] = next_phase

    export_checkpoint(checkpoint, out, dtype, progress=close_phase)
    close_phase("")
    report["peak"] = max(peak for _, peak in report["phases"])
    return report


def measure(size: str, dtype: str, work: Path) -> dict:
    description, config = SIZES[size]
    checkpoint = work / f"{size}-checkpoint"
    if not checkpoint.is_dir():
        save_random_checkpoint("qwen3_moe", config, checkpoint)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (checkpoint / name).write_bytes((TOKENIZER / name).read_bytes())
    weights = sum(path.stat().st_size for path in checkpoint.glob("*.safetensors")) / 2**20
    child = subprocess.run([sys.executable, __file__, "export", str(checkpoint), str(work / f"{size}-{dtype}"),
                            "--dtype", dtype], capture_output=True, text=True)
    if child.returncode != 0:
        sys.exit(f"export of the {size} checkpoint at {dtype} failed: {child.stderr.strip()[-2000:]}")
    report = json.loads(child.stdout.strip().splitlines()[-1])
    report.update(size=size, description=description, dtype=dtype, checkpoint=weights,
                  ratio=(report["peak"] - report["imports"]) / weights)
    return report


def memory_cgroup() -> Path:
    """This process's memory cgroup (v1) as a folder of /sys/fs/cgroup/memory; SystemExit, saying why, where there
    is none this process can make groups in."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if group.is_dir() and os.access(group, os.W_OK):
                return group
            sys.exit(f"export_memory.py capped: {group}: cannot make a cgroup there (not a folder this process may "
                     "write)")
    sys.exit("export_memory.py capped: this process has no cgroup v1 memory controller (on cgroup v2: systemd-run "
             "--scope -p MemoryMax=... -p MemorySwapMax=0 moe-onnx export ...)")


def capped(checkpoint: Path, out: Path, cap_gib: float, options: list[str]) -> None:
    """`moe-onnx export checkpoint -o out *options` in a cgroup of its own capped at ``cap_gib`` (module docstring)."""
    group = memory_cgroup() / f"moe-onnx-export-{os.getpid()}"
    group.mkdir()
    try:
        limit = str(int(cap_gib * 2**30))
        (group / "memory.limit_in_bytes").write_text(limit)
        if (group / "memory.memsw.limit_in_bytes").exists():  # no swap either, where the kernel accounts it
            (group / "memory.memsw.limit_in_bytes").write_text(limit)
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1")
            print("page cache dropped: the checkpoint is read from disk", flush=True)
        except OSError:
            print("page cache kept (not root): pages of the checkpoint already in it are not charged to the cap",
                  flush=True)
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "moe_onnx.cli", "export", str(checkpoint), "-o", str(out),
                                  *options],
                                 preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        peak = int((group / "memory.max_usage_in_bytes").read_text()) / 2**30
        hits = int((group / "memory.failcnt").read_text())
    finally:
        group.rmdir()
    print(f"moe-onnx export: exit status {os.waitstatus_to_exitcode(status)} in {seconds:.0f} s; its peak RSS "
          f"{usage.ru_maxrss / 2**20:.2f} GiB; the cgroup capped at {cap_gib:g} GiB: peak {peak:.2f} GiB, at the cap "
          f"{hits} times (page cache reclaimed)")
    if status:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="child")
    e = sub.add_parser("export")
    e.add_argument("checkpoint", type=Path)
    e.add_argument("out", type=Path)
    e.add_argument("--dtype", required=True)
    c = sub.add_parser("capped", help="moe-onnx export in a memory cgroup capped at --cap GiB (cgroup v1); its "
                                      "options after --")
    c.add_argument("checkpoint", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--cap", type=float, required=True, help="GiB of anonymous memory and page cache together")
    parser.add_argument("--size", nargs="+", choices=SIZES, default=["tiny", "small", "large"])
    parser.add_argument("--dtype", nargs="+", choices=("fp32", "fp16"), default=["fp32"])
    parser.add_argument("--work-dir", type=Path, help="keeps the checkpoints there (default: a temporary folder)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # capped: moe-onnx export's options after --
    args = parser.parse_args(argv[:split])
    if args.child == "export":
        print(json.dumps(export_child(args.checkpoint, args.out, args.dtype)))
        return
    if args.child == "capped":
        capped(args.checkpoint, args.out, args.cap, argv[split + 1:])
        return
    with tempfile.TemporaryDirectory() as temporary:
        work = args.work_dir or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        rows = [measure(size, dtype, work) for size in args.size for dtype in args.dtype]
    fixed = next((r["peak"] for r in rows if r["size"] == "tiny"), None)  # what any model costs
    print("| qwen3_moe checkpoint (random weights) | --dtype | checkpoint | imports | peak RSS | above the imports "
          "| / checkpoint | above the tiny export / checkpoint | peak per phase |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        phases = ", ".join(f"{name} {peak:.0f}" for name, peak in r["phases"][1:])
        beyond_fixed = f"{(r['peak'] - fixed) / r['checkpoint']:.2f}x" if fixed and r["size"] != "tiny" else ""
        print(f"| {r['description']} | {r['dtype']} | {r['checkpoint']:.0f} MiB | {r['imports']:.0f} MiB "
              f"| {r['peak']:.0f} MiB | {r['peak'] - r['imports']:.0f} MiB | {r['ratio']:.2f}x | {beyond_fixed} "
              f"| {phases} |")

if __name__ == "__main__":
    main()
