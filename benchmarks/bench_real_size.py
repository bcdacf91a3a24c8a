"""Real-size MoE decoders: the time and peak resident memory of every step from a checkpoint to running, against
plain onnxruntime on the original export (not a test: it needs torch and minutes).

  flock /work/wt/bigmem.lock python benchmarks/bench_real_size.py --shape qwen3    # ~10 GB of fp32 weights
  python benchmarks/bench_real_size.py --smoke                                    # seconds: tiny shapes

Each shape is a causal LM with random weights at a real model's sizes, vocabulary cut to 8192, with enough
layers for >= 8 GB of fp32 weights: Qwen3-30B-A3B (4 layers of E=128, k=8, H=2048, I=768, 32/4 heads of 128;
9.4 GiB) and GPT-OSS-20B (3 layers of E=32, k=4, H=I=2880, 64/8 heads of 64; 9.4 GiB). In --work-dir, one
shape at a time, each file deleted once no later step reads it (at most two models on disk, ~20 GB):

1. a checkpoint saved by transformers (std 0.02 weights, norms 1); the qwen3 smoke shape copies the README's
   quick-start checkpoint instead (models/fixtures/checkpoints/qwen3_moe: 2 layers of 4 experts, H = 32);
2. `moe-onnx export --no-optimize`: the original decoder with its KV cache (torch's dynamo exporter);
3. plain onnxruntime on the original: session creation, then the first run: a prefill of 16 tokens (Qwen3)
   or 8 (GPT-OSS), short because the original gathers one expert weight matrix per token and slot (T * k of
   them: 12 MiB each for Qwen3, 63 MiB for GPT-OSS) before its MatMuls;
4. `moe-onnx optimize`, then our session on the fused model: creation and the first run (which packs the
   experts it uses: sessions pack on first use per expert and release onnxruntime's mapped pages);
5. `moe-onnx pack` of the fused model, then our session again, mapping the packed files instead of packing
   (the files are deleted after it);
6. `moe-onnx shard --ep 2` of the fused model;
7. `moe-onnx quantize --bits 4 --block-size 32` of the fused model (per column for the quick-start checkpoint,
   whose K = 24; with its error measurement, one session at a time), then our session on it, `moe-onnx pack` of
   it and our session on its packed files.

Every step runs in a child process of its own: its wall time and peak resident memory (VmHWM: anonymous +
file-backed, from wait4's ru_maxrss for the commands), and for a session the resident memory after creation
and after the first run, anonymous + file-backed (MiB). Ratios are against plain onnxruntime's session on the
original. A benchmark, not a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from _memory import run_child
from _models import save_random_checkpoint
from startup_memory import status_mb

REPO = Path(__file__).resolve().parents[1]
QUICK_START = REPO / "models" / "fixtures" / "checkpoints" / "qwen3_moe"
TOKENIZER = QUICK_START  # ids are fed directly; any tokenizer does
_COMMON = dict(vocab_size=8192, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               tie_word_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmarked model: a transformers config and the prompt of the first run."""

    name: str
    model_type: str
    config: dict
    prompt: int
    committed: Path | None = None  # a committed checkpoint copied instead of one made by transformers
    block: int = 32  # the int4 block size (0: per column)


def _qwen3(layers, E, k, H, I, heads, kv_heads, head_dim, **extra) -> dict:
    return dict(_COMMON, num_hidden_layers=layers, hidden_size=H, moe_intermediate_size=I, intermediate_size=4 * I,
                num_experts=E, num_experts_per_tok=k, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **extra)


def _gpt_oss(layers, E, k, H, heads, kv_heads, head_dim, **extra) -> dict:
    return dict(_COMMON, num_hidden_layers=layers, hidden_size=H, intermediate_size=H, num_local_experts=E,
                num_experts_per_tok=k, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                sliding_window=128, layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
                **extra)


SHAPES = {
    "qwen3": Shape("qwen3", "qwen3_moe", _qwen3(4, E=128, k=8, H=2048, I=768, heads=32, kv_heads=4, head_dim=128),
                   prompt=16),
    "gpt_oss": Shape("gpt_oss", "gpt_oss", _gpt_oss(3, E=32, k=4, H=2880, heads=64, kv_heads=8, head_dim=64),
                     prompt=8),
}
SMOKE_SHAPES = {
    "qwen3": Shape("qwen3 (smoke)", "qwen3_moe", json.loads((QUICK_START / "config.json").read_text()), prompt=8,
                   committed=QUICK_START, block=0),
    "gpt_oss": Shape("gpt_oss (smoke)", "gpt_oss", _gpt_oss(2, E=4, k=2, H=64, heads=4, kv_heads=2, head_dim=16,
                                                             vocab_size=256), prompt=8),
}


# ----------------------------------------------------------------------------- the child processes

def make_checkpoint(shape: Shape, folder: Path) -> None:
    """A checkpoint of `shape` with random weights (std 0.02, norms 1, sinks 0) and a tokenizer beside it (or the
    committed checkpoint it names)."""
    if shape.committed is not None:
        shutil.copytree(shape.committed, folder)
        return
    save_random_checkpoint(shape.model_type, shape.config, folder,
                           max_shard_size="2GB")  # safetensors holds a shard's bytes while writing it
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)


def session_child(folder: Path, backend: str, prompt: int, threads: int) -> dict:
    """Creates a session on `folder`'s decoder (plain onnxruntime or our C++ kernels) and runs its first prefill
    of `prompt` random tokens; the seconds of each and the resident memory after each (MiB)."""
    import onnxruntime as ort

    import moe_onnx
    from _timing import session_options
    from moe_onnx.genai_folder import GenaiFolder
    from moe_onnx.generation import _Decoder

    genai = GenaiFolder(folder)
    opts = session_options(threads)
    start = time.perf_counter()
    session = (ort.InferenceSession(str(genai.decoder_path), opts, providers=["CPUExecutionProvider"])
               if backend == "ort" else moe_onnx.session(genai.decoder_path, backend="cpp", sess_options=opts))
    report = {"create_s": time.perf_counter() - start, "created": status_mb()}
    vocab = session.get_outputs()[0].shape[-1]
    prompt_ids = np.random.default_rng(0).integers(3, vocab, prompt).tolist()
    start = time.perf_counter()
    _Decoder(genai, session).run(prompt_ids, 1, None)
    report.update(run_s=time.perf_counter() - start, ran=status_mb())
    return report


# ----------------------------------------------------------------------------- the parent

class Bench:
    """One shape's steps in its work folder, each measured in a child process, and the rows they give."""

    def __init__(self, shape: Shape, folder: Path, threads: int):
        self.shape, self.folder, self.threads = shape, folder, threads
        self.rows: list[tuple[str, float, float, str]] = []
        self.plain: dict | None = None
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)

    def _say(self, message: str) -> None:
        print(f"[{self.shape.name}] {message}", flush=True)

    def command(self, step: str, argv: list[str]) -> None:
        """Runs `argv`; its row: wall seconds and peak RSS (wait4's ru_maxrss). Exits on failure."""
        self._say(f"{step} ...")
        peak, seconds, status, output = run_child(argv, capture=True)
        if status != 0:
            sys.exit(f"[{self.shape.name}] {step} failed: {' | '.join(output.strip().splitlines()[-3:])}")
        self.rows.append((step, seconds, peak, ""))
        self._say(f"{step}: {seconds:.1f} s, peak {peak:.0f} MiB")

    def session(self, what: str, folder: Path, backend: str) -> None:
        """Session creation and the first run on `folder` in a child; two rows, ratios against plain onnxruntime's."""
        self._say(f"{what}: session ...")
        argv = [sys.executable, __file__, "session", str(folder), "--backend", backend,
                "--prompt", str(self.shape.prompt), "--threads", str(self.threads)]
        child = subprocess.run(argv, capture_output=True, text=True)
        if child.returncode != 0:
            sys.exit(f"[{self.shape.name}] {what} failed: {(child.stderr.strip().splitlines() or ['?'])[-1]}")
        r = json.loads(child.stdout.strip().splitlines()[-1])
        base = self.plain or r
        self.plain = base
        for step, seconds, after, base_s, base_after in (
                ("session creation", r["create_s"], r["created"], base["create_s"], base["created"]),
                (f"first run (prefill of {self.shape.prompt})", r["run_s"], r["ran"], base["run_s"], base["ran"])):
            ratio = f"{seconds / base_s:.2f}x time, {after['VmRSS'] / base_after['VmRSS']:.2f}x RSS"
            note = (f"RSS {after['VmRSS']} = {after['RssAnon']} anon + {after['RssFile']} file"
                    + ("" if backend == "ort" else f"; vs plain onnxruntime: {ratio}"))
            self.rows.append((f"{what}: {step}", seconds, after["VmHWM"], note))
        self._say(f"{what}: {r}")

    def packed_session(self, what: str, folder: Path) -> None:
        """`moe-onnx pack` of `folder`'s decoder, our session on its packed files, then the files deleted."""
        model = folder / "model.onnx"
        self.command(f"moe-onnx pack ({what.removeprefix('ours, ')})",
                     [sys.executable, "-m", "moe_onnx.cli", "pack", str(model), "--threads", str(self.threads)])
        self.session(f"{what}, packed file", folder, "cpp")
        shutil.rmtree(model.with_name(model.name + ".packed"))

    def run(self, smoke: bool, exported: Path | None = None) -> None:
        """Every step; from a copy of ``exported`` (what `moe-onnx export --no-optimize` wrote before) instead of
        the checkpoint and export steps where given."""
        cli = [sys.executable, "-m", "moe_onnx.cli"]
        checkpoint, original = self.folder / "checkpoint", self.folder / "original"
        fused, int4, shards = self.folder / "fused", self.folder / "int4", self.folder / "shards"
        if exported is not None:
            shutil.copytree(exported, original)
        else:
            self.command("checkpoint (copied)" if self.shape.committed else "checkpoint (transformers, random weights)",
                         [sys.executable, __file__, "checkpoint", str(checkpoint), "--shape",
                          self.shape.name.split()[0]] + (["--smoke"] if smoke else []))
            self.command("moe-onnx export --no-optimize (the original)",
                         cli + ["export", str(checkpoint), "-o", str(original), "--no-optimize"])
            shutil.rmtree(checkpoint)
        self.weights = _data_bytes(original)
        self.session("plain onnxruntime, original", original, "ort")
        fused.mkdir()
        self.command("moe-onnx optimize", cli + ["optimize", str(original / "model.onnx"), "-o",
                                                 str(fused / "model.onnx")])
        shutil.copy(original / "genai_config.json", fused)
        shutil.rmtree(original)
        self.session("ours, fused fp32", fused, "cpp")
        self.packed_session("ours, fused fp32", fused)
        self.command("moe-onnx shard --ep 2", cli + ["shard", str(fused / "model.onnx"), "-o", str(shards),
                                                     "--ep", "2"])
        shutil.rmtree(shards)
        int4.mkdir()
        self.command(f"moe-onnx quantize --bits 4 --block-size {self.shape.block} (error measured)",
                     cli + ["quantize", str(fused / "model.onnx"), "-o", str(int4 / "model.onnx"), "--bits", "4",
                            "--block-size", str(self.shape.block)])
        shutil.copy(fused / "genai_config.json", int4)
        shutil.rmtree(fused)
        self.session("ours, int4 experts", int4, "cpp")
        self.packed_session("ours, int4 experts", int4)
        shutil.rmtree(self.folder)

    def table(self) -> str:
        lines = [f"{self.shape.name}: {self.weights / 2**20:.0f} MiB of weights (the original's external data), "
                 f"{self.threads} threads",
                 "| step | time (s) | peak RSS (MiB) | resident after (MiB) |", "|---|---|---|---|"]
        lines += [f"| {step} | {seconds:.3f} | {peak:.0f} | {note} |" for step, seconds, peak, note in self.rows]
        return "\n".join(lines)


def _data_bytes(folder: Path) -> int:
    """The bytes of the external data files in `folder`."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix == ".data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="child")
    c = sub.add_parser("checkpoint")
    c.add_argument("folder", type=Path)
    c.add_argument("--shape", choices=SHAPES, required=True)
    c.add_argument("--smoke", action="store_true")
    s = sub.add_parser("session")
    s.add_argument("folder", type=Path)
    s.add_argument("--backend", choices=("ort", "cpp"), required=True)
    s.add_argument("--prompt", type=int, required=True)
    s.add_argument("--threads", type=int, required=True)
    parser.add_argument("--shape", nargs="+", choices=SHAPES, default=["qwen3"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (seconds)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/moe-real-size"))
    parser.add_argument("--original", type=Path, metavar="FOLDER",
                        help="start from this export of the shape's checkpoint (`moe-onnx export --no-optimize`'s "
                             "folder, copied; one --shape): the checkpoint and export steps are not run")
    args = parser.parse_args()
    if args.original is not None and len(args.shape) != 1:
        parser.error("--original is the export of one shape's checkpoint: give one --shape")
    if args.child == "checkpoint":
        make_checkpoint((SMOKE_SHAPES if args.smoke else SHAPES)[args.shape], args.folder)
        return
    if args.child == "session":
        print(json.dumps(session_child(args.folder, args.backend, args.prompt, args.threads)))
        return
    import onnxruntime

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    print(f"machine: {cpu}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; onnxruntime {onnxruntime.__version__}", flush=True)
    for name in args.shape:
        bench = Bench((SMOKE_SHAPES if args.smoke else SHAPES)[name], args.work_dir / name, args.threads)
        bench.run(args.smoke, args.original)
        print(bench.table(), flush=True)


if __name__ == "__main__":
    main()
