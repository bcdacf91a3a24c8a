"""Generation with the KV cache on real-shape MoE models: prefill and decode tokens/s of the decoder
`moe-onnx export` makes, against the unfused export, onnxruntime-genai's model builder and llama.cpp.

  flock /work/wt/bigmem.lock python benchmarks/bench_generation.py --shape qwen3 --precision fp32 int4
  python benchmarks/bench_generation.py --smoke     # seconds: the committed tiny KV fixtures, no torch

Each shape is a 2-layer model with random weights at a real model's sizes, vocabulary cut to 8192:
Qwen3-30B-A3B (E=128, k=8, H=2048, I=768, 32/4 heads of 128, ~4.8 GB fp32) and GPT-OSS-20B (E=32, k=4,
H=I=2880, 64/8 heads of 64, ~6.5 GB). Made once in --work-dir (kept; --clean deletes each shape's files
after it): a checkpoint saved by transformers (torch needed), then

* ours: `moe_onnx.export.export_checkpoint` fused (fp32); `moe-onnx quantize` of it at int4, block 32:
  experts only (QMOE, float activations) and whole-model (`--linears`: attention, lm_head as MatMulNBits;
  int8 activations, its default accuracy_level 4, as Q4_0's);
* unfused (with --unfused): the same export with optimize=False (fp32 only: quantize needs fused MOE
  nodes);
* genai: `python -m onnxruntime_genai.models.builder -p fp32|int4 -e cpu` where it builds (GPT-OSS);
* llama.cpp (when llama_cpp imports and --llama-cpp-source names llama.cpp's source, e.g. the
  vendor/llama.cpp of the llama-cpp-python source package, with the `gguf` package installed): the
  checkpoint converted by its convert_hf_to_gguf.py to f32, then its default Q4_0 mix
  (llama_model_quantize; attention, embeddings and output quantized too). The checkpoint's tokenizer is a
  BPE one built here that the converter's table of known pre-tokenizers cannot know, so the conversion is
  told it is "default": token ids are fed directly, never text.

Timing, per precision and thread count: our reference model (fused fp32; whole-model int4) is loaded
once and each other contender beside it in turn (two models in memory at most); each round runs
both, back to back: a prefill of T = 128 tokens, then a 512-token prompt followed by 32 greedy decode
tokens (tokens/s of each). Ratios are ours / theirs in tokens/s (above 1: ours faster), the median over
rounds of each round's ratio, so a slow spell of a shared machine slows both sides. Ours and the unfused
export run through moe_onnx.generation's decoder loop (session.run time only; eos never stops it),
onnxruntime-genai through its Generator (append_tokens, generate_next_token), llama.cpp through
llama_cpp.Llama.eval (n_threads = n_threads_batch = threads; OMP_WAIT_POLICY=passive unless set: its
default spin collapses decode on shared cores; within one eval its threads wait for each other spinning).
Our sessions' pool threads spin for work while a run lasts and stop when it returns (`_timing.session_options`'
spin_in_runs): no session takes the cores between its runs. A benchmark, not a test: the figures depend on the
machine and its load.

Full depth (--shipped NAME, issue 34): a random checkpoint at the real shape, as it ships (benchmarks/_checkpoints.py:
GPT-OSS-20B, 24 layers, MXFP4 experts; Qwen3-30B-A3B, 48 layers, bf16; --layers for fewer), then `moe-onnx export`
of it (SHIPPED's options) and llama.cpp's convert_hf_to_gguf.py (+ llama_model_quantize where SHIPPED says), each
timed in a child with its peak RSS; then each model alone in a child process at each thread count: session start,
the same rounds, RSS while generating; the table and issue 34's targets. Steps can run apart (--step), the figures
kept in WORK_DIR/NAME/results.json; the work folder needs about 2.3x the checkpoint's size of disk:

  python benchmarks/bench_generation.py --shipped gpt_oss_20b --work-dir /big --rounds 1 \
      --llama-cpp-source llama_cpp_python-0.3.36/vendor/llama.cpp

Before and after a change (--compare-with CHECKOUT): the models of ours this run would time (--shape or --smoke at
--precision: fused fp32, int4 experts only and whole-model; --shipped's export; `--shape example`: the bundled
Qwen3-MoE decoder), made by this checkout's code, each timed by the other checkout's code ("before": its Python,
CHECKOUT/.venv/bin/python unless --compare-python, must import moe_onnx and its library from CHECKOUT) and by this
one's ("after"), each side a worker process (_contenders.py) holding its own session (no packed-weights file: each
library packs the weights in its own layout), in alternating rounds (ABAB..., the order swapped each round). Per
model, thread count and metric: each side's median (min) tokens/s, and after / before as the median of the rounds'
ratios with their min-max. `--compare-with .` runs this checkout against itself: the noise of the machine.

  python benchmarks/bench_generation.py --shape example --compare-with ../before --rounds 15

llama.cpp for both modes (docs/benchmarks.md has the commands): `pip install gguf` and llama-cpp-python built from
its source package (`pip install llama-cpp-python==0.3.36 --no-binary :all:`), whose unpacked sdist's
vendor/llama.cpp is the --llama-cpp-source.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_onnx  # noqa: E402
from _checkpoints import save_bpe_tokenizer  # noqa: E402
from _contenders import (  # noqa: E402
    METRICS, WORKER_LINE, GenaiContender, LlamaContender, OrtContender, measure, prompt_ids)
from _memory import run_child, status_mb  # noqa: E402
from _models import save_random_checkpoint  # noqa: E402
from _timing import session_options  # noqa: E402
from moe_onnx.cli import main as cli  # noqa: E402
from moe_onnx.genai_folder import GenaiFolder  # noqa: E402
from moe_onnx.generation import _Decoder  # noqa: E402

# llama.cpp's OpenMP pool otherwise spins between runs, taking the shared cores from the contender beside it
# (libgomp reads this when llama_cpp loads it)
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KV_FIXTURES = REPO / "models" / "fixtures" / "kv"
VOCAB = 8192


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmarked model: a transformers config (2 layers) and the token counts it is timed at."""

    name: str
    model_type: str
    config: dict
    prefill_tokens: int = 128
    prompt_tokens: int = 512
    decode_tokens: int = 32
    unfused_chunk: int | None = None  # the unfused export's prompt runs this many tokens a run
    block: int = 32  # int4 block size: llama.cpp's Q4_0 block; 0 (per column): experts only, no whole-model int4
    fixture: str | None = None  # --smoke: the committed KV fixture used as the fused fp32 model

    @property
    def vocab(self) -> int:
        return self.config.get("vocab_size", VOCAB)


_COMMON = dict(num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
               pad_token_id=0, tie_word_embeddings=False)
SHAPES = {
    "qwen3": Shape("qwen3", "qwen3_moe", dict(
        _COMMON, hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
        num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[]), unfused_chunk=16),
    "gpt_oss": Shape("gpt_oss", "gpt_oss", dict(
        _COMMON, hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"]), unfused_chunk=8),
}
# the bundled example (the committed decoder of models/fixtures/checkpoints/qwen3_moe: H=32, E=4, k=2, context 256)
# at as many tokens as its context holds; no torch needed
SHAPES["example"] = Shape("example", "qwen3_moe", {"vocab_size": 96}, prefill_tokens=64, prompt_tokens=192,
                          decode_tokens=32, block=0, fixture="qwen3_moe")
SMOKE_SHAPES = {name: Shape(f"{name} (smoke)", SHAPES[name].model_type, {"vocab_size": 96}, prefill_tokens=8,
                            prompt_tokens=16, decode_tokens=4, block=0, fixture=fixture)
                for name, fixture in (("qwen3", "qwen3_moe"), ("gpt_oss", "gpt_oss"))}


# ----------------------------------------------------------------------------- making the models

class Models:
    """The model files of one shape in its work folder, each made when missing."""

    def __init__(self, shape: Shape, folder: Path, llama_source: Path | None):
        self.shape, self.folder, self.llama_source = shape, folder, llama_source
        folder.mkdir(parents=True, exist_ok=True)
        self.checkpoint = folder / "checkpoint"

    def _say(self, message: str) -> None:
        print(f"[{self.shape.name}] {message}", flush=True)

    def _run(self, what: str, command: list[str]) -> bool:
        self._say(f"{what} ...")
        start = time.perf_counter()
        completed = subprocess.run(command, capture_output=True, text=True)
        if completed.returncode != 0:
            tail = (completed.stderr.strip() or completed.stdout.strip()).splitlines()[-3:]
            self._say(f"{what} failed (exit {completed.returncode}): {' | '.join(tail)}")
            return False
        self._say(f"{what}: {time.perf_counter() - start:.0f} s")
        return True

    def make_checkpoint(self) -> bool:
        """A checkpoint with random weights (std 0.02, norms 1, GPT-OSS's sinks 0) and a tokenizer over the
        vocabulary (`_checkpoints.save_bpe_tokenizer`)."""
        if (self.checkpoint / "config.json").is_file():
            return True
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
            self._say("no torch/transformers: cannot make the checkpoint")
            return False
        self._say("making the random checkpoint")
        save_random_checkpoint(self.shape.model_type, self.shape.config, self.checkpoint)
        save_bpe_tokenizer(self.checkpoint, self.shape.vocab)
        return True

    def ours(self, precision: str, unfused: bool = False) -> dict[str, Path]:
        """Our contenders at `precision`: name -> genai folder (the reference one first); the unfused export
        too with `unfused`."""
        fused = self.folder / "fused"
        if self.shape.fixture:
            fused = KV_FIXTURES / self.shape.fixture
        elif not (fused / "genai_config.json").is_file():
            if not self.make_checkpoint() or not self._export(fused, optimize=True):
                return {}
        if precision == "fp32":
            out = {"ours fused": fused}
            folder = self.folder / "unfused"
            if unfused and not self.shape.fixture and ((folder / "genai_config.json").is_file()
                                                       or self._export(folder, optimize=False)):
                out["unfused export"] = folder
            return out
        out = {}
        for name, linears in (("ours int4 whole", True), ("ours int4 experts", False)):
            if linears and not self.shape.block:
                continue  # MatMulNBits needs blocks
            folder = self.folder / name.replace(" ", "_")
            if (folder / "genai_config.json").is_file() or self._quantize(fused, folder, linears):
                out[name] = folder
        return out

    def _export(self, out: Path, optimize: bool) -> bool:
        """export_checkpoint in a child process: torch's export peaks at ~2.3x the weights, given back on exit."""
        script = ("import sys; from moe_onnx.export import export_checkpoint; "
                  "r = export_checkpoint(sys.argv[1], sys.argv[2], optimize=sys.argv[3] == '1'); "
                  "print(r.summary()); sys.exit(0 if r.ok else 1)")
        return self._run(f"export_checkpoint(optimize={optimize}) -> {out.name}",
                         [sys.executable, "-c", script, str(self.checkpoint), str(out), "1" if optimize else "0"])

    def _quantize(self, fused: Path, out: Path, linears: bool) -> bool:
        """`moe-onnx quantize` of the fused genai folder at int4 (block `shape.block`) into a genai folder."""
        command = ["quantize", str(fused), "-o", str(out), "--bits", "4", "--block-size", str(self.shape.block),
                   "--no-measure"] + (["--linears"] if linears else [])
        self._say(f"moe-onnx {shlex.join(command)}")
        start = time.perf_counter()
        if cli(command) != 0:
            return False
        self._say(f"quantized in {time.perf_counter() - start:.0f} s")
        return True

    def genai(self, precision: str) -> Path | None:
        """onnxruntime-genai's builder model of the checkpoint at `precision` (None where it does not build)."""
        folder = self.folder / f"genai_{precision}"
        if (folder / "genai_config.json").is_file():
            return folder
        if self.shape.fixture or self.shape.model_type != "gpt_oss" or not self.make_checkpoint():
            return None  # onnxruntime-genai 0.18's builder has no Qwen3-MoE
        ok = self._run(f"onnxruntime-genai builder -p {precision}", [
            sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(self.checkpoint), "-o", str(folder),
            "-p", precision, "-e", "cpu", "-c", str(self.folder / "genai_cache")])
        shutil.rmtree(self.folder / "genai_cache", ignore_errors=True)
        if not ok:
            shutil.rmtree(folder, ignore_errors=True)
        return folder if ok else None

    def gguf(self, precision: str) -> Path | None:
        """The checkpoint as GGUF: f32 (fp32) or llama.cpp's default Q4_0 mix (int4); None without llama.cpp."""
        if self.shape.fixture or self.llama_source is None:
            return None
        f32 = self.folder / "model-f32.gguf"
        if not f32.is_file():
            if not self.make_checkpoint():
                return None
            if not self._run("convert_hf_to_gguf.py --outtype f32",
                             convert_command(self.llama_source, self.checkpoint, f32, "f32")):
                return None
        if precision == "fp32":
            return f32
        q4 = self.folder / "model-q4_0.gguf"
        if not q4.is_file():
            if not _llama_cpp_available():
                return None
            import llama_cpp
            self._say("llama_model_quantize Q4_0 ...")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
            if llama_cpp.llama_model_quantize(str(f32).encode(), str(q4).encode(), params) != 0:
                self._say("llama_model_quantize failed")
                return None
        return q4


def convert_command(llama_source: Path, checkpoint: Path, outfile: Path, outtype: str | None) -> list[str]:
    """llama.cpp's convert_hf_to_gguf.py as its command line (``outtype`` None: its default), told the
    pre-tokenizer of our made-up tokenizer, which its table of known ones cannot know (token ids are fed directly)."""
    script = ("import runpy, sys; source = sys.argv[1]; sys.path.insert(0, source); "
              "import conversion.base as base; "
              "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'default'; "
              "sys.argv = ['convert_hf_to_gguf.py', *sys.argv[2:]]; "
              "runpy.run_path(source + '/convert_hf_to_gguf.py', run_name='__main__')")
    return [sys.executable, "-c", script, str(llama_source), str(checkpoint), "--outfile", str(outfile),
            *(["--outtype", outtype] if outtype else [])]


def _llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def load(kind: str, path: Path, threads: int, shape: Shape):
    if kind == "unfused":
        return OrtContender(path, threads, chunk=shape.unfused_chunk)
    if kind == "llama.cpp":
        return LlamaContender(path, threads, context=shape.prompt_tokens + shape.decode_tokens + 16)
    if kind == "genai":
        return GenaiContender(path, threads)
    return OrtContender(path, threads)


def run_pairs(shape: Shape, reference: tuple[str, Path], others: list[tuple[str, str, Path]], threads: int,
              rounds: int) -> dict:
    """The reference (ours) and each other contender in turn beside it, `rounds` alternating rounds per pair.
    Returns {name: {metric: median tokens/s}} and {name: {metric: median of the rounds' ours/theirs}}."""
    prompt = prompt_ids(shape.vocab, shape.prompt_tokens)
    ref_name, ref_path = reference
    ours = load("ours", ref_path, threads, shape)
    measure(ours, prompt, shape.prefill_tokens, shape.decode_tokens)  # warm-up
    ours_rounds, speeds, ratios = [], {}, {}
    for name, kind, path in others:
        print(f"  {threads} thread(s): {ref_name} vs {name}", flush=True)
        try:
            theirs = load(kind, path, threads, shape)
            measure(theirs, prompt, shape.prefill_tokens, shape.decode_tokens)
        except Exception as error:  # noqa: BLE001 - a contender that does not run is a row, not a crash
            print(f"  {name} does not run: {type(error).__name__}: {str(error).splitlines()[0][:200]}", flush=True)
            continue
        pair_ours, pair_theirs = [], []
        for _ in range(rounds):
            pair_ours.append(measure(ours, prompt, shape.prefill_tokens, shape.decode_tokens))
            pair_theirs.append(measure(theirs, prompt, shape.prefill_tokens, shape.decode_tokens))
        del theirs
        gc.collect()
        ours_rounds += pair_ours
        speeds[name] = {m: statistics.median(r[m] for r in pair_theirs) for m in METRICS}
        ratios[name] = {m: statistics.median(a[m] / b[m] for a, b in zip(pair_ours, pair_theirs)) for m in METRICS}
    if not ours_rounds:
        ours_rounds = [measure(ours, prompt, shape.prefill_tokens, shape.decode_tokens) for _ in range(rounds)]
    speeds = {ref_name: {m: statistics.median(r[m] for r in ours_rounds) for m in METRICS}, **speeds}
    return {"speeds": speeds, "ratios": ratios}


def contenders(models: Models, precision: str, unfused: bool = False
                ) -> tuple[tuple[str, Path] | None, list[tuple[str, str, Path]]]:
    """(our reference (name, folder), the others (name, kind, path)) at `precision`; `unfused`: with the unfused
    export."""
    ours = models.ours(precision, unfused)
    if not ours:
        return None, []
    (ref_name, ref_path), *rest = ours.items()
    others = [(name, "unfused" if name == "unfused export" else "ours", path) for name, path in rest]
    if precision == "int4":  # what int4 gains over our fp32
        others += [(f"{name} fp32", "ours", path) for name, path in list(models.ours("fp32").items())[:1]]
    genai = models.genai("int4" if precision == "int4" else "fp32")
    if genai is not None:
        others.append((f"genai builder {precision}", "genai", genai))
    gguf = models.gguf(precision)
    if gguf is not None:
        others.append(("llama.cpp " + ("f32" if precision == "fp32" else "Q4_0"), "llama.cpp", gguf))
    return (ref_name, ref_path), others


# ----------------------------------------------------------------------------- where the time goes

def profile(folder: Path, shape: Shape, threads: int, top: int = 6) -> list[str]:
    """onnxruntime's profile of one generation (a `prompt_tokens` prefill, then `decode_tokens` decode runs) of the
    decoder in `folder`: per phase, the share of each op type's kernel time and the slowest nodes."""
    options = session_options(threads, spin_in_runs=True)
    options.enable_profiling = True
    options.profile_file_prefix = str(folder.parent / f"profile_{folder.name}")
    genai = GenaiFolder(folder)
    genai.eos = set()
    session = moe_onnx.session(genai.decoder_path, sess_options=options)
    prompt = prompt_ids(shape.vocab, shape.prompt_tokens)
    _Decoder(genai, session).run(prompt, shape.decode_tokens + 1, None)
    trace = Path(session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    out = [f"profile of {folder.name}, {threads} thread(s); kernels: "
           + ", ".join(f"{k}={v}" for k, v in moe_onnx.runtime.kernel_report().items() if k in (
               "level", "gemm_panels", "quant_dots", "amx"))]
    for phase, (first, last) in (("prefill", (0, 1)), ("decode", (1, len(runs)))):
        spans = runs[first:last]
        picked = [e for e in nodes if any(a <= e["ts"] <= b for a, b in spans)]
        total = sum(e["dur"] for e in picked) or 1
        wall = sum(b - a for a, b in spans) / len(spans) / 1e3
        by_op: dict[str, float] = {}
        by_node: dict[str, float] = {}
        for e in picked:
            by_op[e["args"]["op_name"]] = by_op.get(e["args"]["op_name"], 0) + e["dur"]
            name = f"{e['name'].removesuffix('_kernel_time')} ({e['args']['op_name']})"
            by_node[name] = by_node.get(name, 0) + e["dur"]
        ops = sorted(by_op.items(), key=lambda kv: -kv[1])
        slow = sorted(by_node.items(), key=lambda kv: -kv[1])[:top]
        out.append(f"  {phase}: {wall:.2f} ms a run; kernel time by op: "
                   + ", ".join(f"{op} {100 * t / total:.0f}%" for op, t in ops[:top]))
        out.append("    slowest nodes: " + ", ".join(f"{n} {100 * t / total:.0f}%" for n, t in slow))
    return out


# ----------------------------------------------------------------------------- report

def table(shape: Shape, precision: str, threads: int, result: dict) -> list[str]:
    head = (f"| {shape.name} {precision}, {threads} thread(s) | prefill T={shape.prefill_tokens} tok/s | "
            f"prefill T={shape.prompt_tokens} tok/s | decode tok/s ({shape.decode_tokens} after "
            f"{shape.prompt_tokens}) | ours / it: prefill T={shape.prefill_tokens}, T={shape.prompt_tokens}, decode |")
    lines = [head, "|---|---|---|---|---|"]
    for name, speed in result["speeds"].items():
        ratio = result["ratios"].get(name)
        ratio_cell = ", ".join(f"{ratio[m]:.2f}x" for m in METRICS) if ratio else "(reference)"
        lines.append(f"| {name} | " + " | ".join(f"{speed[m]:.1f}" for m in METRICS) + f" | {ratio_cell} |")
    return lines


def targets(shape: Shape, results: dict) -> list[str]:
    """The issue's targets: with the KV cache, prefill and decode tokens/s at least llama.cpp's at the same
    precision and set of quantized tensors (fp32 vs f32, whole-model int4 vs its Q4_0 mix), 1 and 2 threads."""
    out = []
    for (precision, threads), result in results.items():
        for name, ratio in result["ratios"].items():
            if not name.startswith("llama.cpp"):
                continue
            ok = all(ratio[m] >= 1 for m in METRICS)
            figures = ", ".join(f"{m} {ratio[m]:.2f}x" for m in METRICS)
            out.append(f"- [{'met' if ok else 'NOT met'}] {shape.name} {precision} {threads} thread(s): ours >= "
                       f"{name} (tokens/s ours / its): {figures}")
    return out


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"


# ----------------------------------------------------------------------------- checkpoints as they ship, full depth

@dataclasses.dataclass(frozen=True)
class Shipped:
    """A full-depth checkpoint as it ships (benchmarks/_checkpoints.py), our export of it and llama.cpp's
    conversion of it: ``export`` our `moe-onnx export` options, ``outtype`` the converter's (None: its default),
    ``quantize`` a llama.cpp type to quantize the GGUF to (like for like with ours: then the GGUF ours is compared
    with, and the converted one deleted once quantized, as the checkpoint is before quantizing: the disk holds the
    checkpoint and one GGUF at a time), or None."""

    name: str
    export: tuple[str, ...]
    outtype: str | None
    quantize: str | None = None

    @property
    def gguf_name(self) -> str:
        """The llama.cpp contender ours is compared with: its converter's GGUF, or that quantized."""
        return f"llama.cpp {self.quantize}" if self.quantize else "llama.cpp"


SHIPPED = {
    # MXFP4 experts as stored; attention, lm_head and the embedding int8 (the GGUF: MXFP4 experts, the rest bf16)
    "gpt_oss_20b": Shipped("gpt_oss_20b", ("--bits", "8", "--block-size", "32", "--linears", "--embedding"), None),
    # int4 experts, MatMulNBits linears and int4 embedding straight from bf16; the GGUF bf16 as converted, then
    # llama.cpp's Q4_0 mix (embedding, attention and output quantized too)
    "qwen3_30b_a3b": Shipped("qwen3_30b_a3b", ("--bits", "4", "--block-size", "32", "--linears", "--embedding"),
                             "bf16", "Q4_0"),
}
SHIPPED_TOKENS = dict(prefill_tokens=128, prompt_tokens=512, decode_tokens=32)


def _measured(step: str, argv: list[str], results: dict, **env: str) -> bool:
    """Run ``argv`` in a child; record its wall seconds and peak RSS (wait4's ru_maxrss) as ``results[step]``."""
    print(f"{step} ...", flush=True)
    peak, seconds, status, output = run_child(argv, capture=True, env={**os.environ, **env})
    if status != 0:
        print(f"{step} failed (exit {status}): {' | '.join(output.strip().splitlines()[-4:])}", flush=True)
        return False
    results[step] = {"seconds": seconds, "peak_mib": peak}
    print(f"{step}: {seconds:.0f} s, peak {peak / 1024:.2f} GiB", flush=True)
    return True


def _gib(path: Path) -> float:
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file() and f.suffix != ".so"]
    return sum(f.stat().st_size for f in files) / 2**30


def shipped_checkpoint(spec: Shipped, folder: Path, layers: int, results: dict) -> bool:
    """The checkpoint in ``folder``/checkpoint at ``layers`` (written tensor by tensor, timed with its peak RSS;
    kept when it is there already at that depth). Returns whether it is there."""
    from _checkpoints import SHIPPED as MAKERS

    checkpoint = folder / "checkpoint"
    if (checkpoint / "config.json").is_file():
        made = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
        if made != layers:
            print(f"{checkpoint} has {made} layers, not {layers}: delete it first", flush=True)
            return False
        return True
    script = ("import sys, json; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
              "import _checkpoints as c; config, tensors = c." + MAKERS[spec.name][0].__name__ + "(int(sys.argv[3])); "
              "print(c.write_checkpoint(Path(sys.argv[2]), config, tensors))")
    results["layers"] = layers
    if not _measured("checkpoint (random, written tensor by tensor)",
                     [sys.executable, "-c", script, str(Path(__file__).parent), str(checkpoint), str(layers)], results):
        return False
    results["checkpoint_gib"] = _gib(checkpoint)
    return True


def shipped_prepare(spec: Shipped, folder: Path, layers: int, llama_source: Path | None, results: dict) -> None:
    """Our export of the checkpoint (`shipped_checkpoint`) and llama.cpp's conversion, each timed with its peak RSS;
    the checkpoint is deleted after (its figures kept)."""
    checkpoint, ours = folder / "checkpoint", folder / "ours"
    if not shipped_checkpoint(spec, folder, layers, results):
        return
    if _measured("ours: moe-onnx export " + " ".join(spec.export),
                 [sys.executable, "-m", "moe_onnx.cli", "export", str(checkpoint), "-o", str(ours), *spec.export],
                 results):
        results["ours_gib"] = _gib(ours / "model.onnx") + _gib(ours / "model.onnx.data")
    if llama_source is not None:
        gguf = folder / "model.gguf"
        if _measured(f"llama.cpp: convert_hf_to_gguf.py{' --outtype ' + spec.outtype if spec.outtype else ''}",
                     convert_command(llama_source, checkpoint, gguf, spec.outtype), results):
            results["gguf_gib"] = _gib(gguf)
        if spec.quantize and gguf.is_file():
            shutil.rmtree(checkpoint)
            script = ("import sys, llama_cpp; p = llama_cpp.llama_model_quantize_default_params(); "
                      "p.ftype = getattr(llama_cpp, 'LLAMA_FTYPE_MOSTLY_' + sys.argv[3]); "
                      "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
            quantized = folder / f"model-{spec.quantize.lower()}.gguf"
            if _measured(f"llama.cpp: llama_model_quantize {spec.quantize}",
                         [sys.executable, "-c", script, str(gguf), str(quantized), spec.quantize], results):
                results["gguf_quantized_gib"] = _gib(quantized)
                gguf.unlink()
    shutil.rmtree(checkpoint, ignore_errors=True)


def contend(kind: str, path: Path, threads: int, rounds: int, vocab: int) -> dict:
    """One contender alone in this process: its load (session creation) time and resident memory, `rounds` rounds
    of SHIPPED_TOKENS' metrics, and the resident memory while generating (after the rounds, and the peak)."""
    shape = Shape("shipped", "", {"vocab_size": vocab}, **SHIPPED_TOKENS)
    start = time.perf_counter()
    contender = load(kind, path, threads, shape)
    loaded = {"seconds": time.perf_counter() - start, **status_mb()}
    prompt = prompt_ids(vocab, shape.prompt_tokens)
    # the first round warms up
    speeds = [measure(contender, prompt, shape.prefill_tokens, shape.decode_tokens) for _ in range(rounds + 1)][1:]
    return {"loaded": loaded, "speeds": speeds, "generating": status_mb()}


def shipped_time(folder: Path, spec: Shipped, threads_list: list[int], rounds: int, results: dict,
                 with_profile: bool = False) -> None:
    """Each contender in a child process of its own (two full-depth models do not fit in memory together), at
    each thread count: its load, speeds and memory (`contend`); ``with_profile``: then onnxruntime's profile of ours
    at each thread count (`profile`), kept as ``results["profile"]``."""
    vocab = json.loads((folder / "ours" / "genai_config.json").read_text())["model"]["vocab_size"]
    if with_profile:
        for threads in threads_list:
            print(f"profile of ours, {threads} thread(s) ...", flush=True)
            child = subprocess.run([sys.executable, __file__, "contend", "ours", str(folder / "ours"), "--threads",
                                    str(threads), "--rounds", "0", "--vocab", str(vocab), "--profile"],
                                   capture_output=True, text=True)
            if child.returncode == 0:
                results.setdefault("profile", {})[str(threads)] = json.loads(child.stdout.strip().splitlines()[-1])
                print("\n".join(results["profile"][str(threads)]), flush=True)
            else:
                print(f"profile failed: {' | '.join(child.stderr.strip().splitlines()[-3:])}", flush=True)
        return
    contenders = [("ours", "ours", folder / "ours")]
    for name, file in (("llama.cpp", folder / "model.gguf"),
                       (f"llama.cpp {spec.quantize}", folder / f"model-{(spec.quantize or '').lower()}.gguf")):
        if file.is_file():
            contenders.append((name, "llama.cpp", file))
    for threads in threads_list:
        for name, kind, path in contenders:
            print(f"{name}, {threads} thread(s) ...", flush=True)
            child = subprocess.run([sys.executable, __file__, "contend", kind, str(path), "--threads", str(threads),
                                    "--rounds", str(rounds), "--vocab", str(vocab)], capture_output=True, text=True)
            if child.returncode != 0:
                print(f"{name} failed: {' | '.join(child.stderr.strip().splitlines()[-3:])}", flush=True)
                continue
            results.setdefault("timing", {})[f"{name}|{threads}"] = json.loads(child.stdout.strip().splitlines()[-1])


def shipped_report(spec: Shipped, results: dict) -> list[str]:
    """The side-by-side table of a full-depth run (ours, then each llama.cpp model) and the targets."""
    timing = results.get("timing", {})
    threads_list = sorted({int(key.split("|")[1]) for key in timing})
    medians = {key: {m: statistics.median(r[m] for r in value["speeds"]) for m in METRICS}
               for key, value in timing.items()}
    files = {"ours": results.get("ours_gib"), "llama.cpp": results.get("gguf_gib"),
             f"llama.cpp {spec.quantize}": results.get("gguf_quantized_gib")}
    gguf = files[spec.gguf_name]
    made = {"ours": next((v for k, v in results.items() if k.startswith("ours: moe-onnx export")), None),
            "llama.cpp": next((v for k, v in results.items() if k.startswith("llama.cpp: convert")), None),
            f"llama.cpp {spec.quantize}": next((v for k, v in results.items() if k.startswith("llama.cpp: llama_model")),
                                               None)}
    # the contenders made or timed (an export-only run: its rows without speeds)
    names = list(dict.fromkeys([name for name, step in made.items() if step] + [key.split("|")[0] for key in timing]))
    lines = [f"{spec.name}: {results.get('layers')} layers, checkpoint {results.get('checkpoint_gib', 0):.2f} GiB "
             f"(written in {results.get('checkpoint (random, written tensor by tensor)', {}).get('seconds', 0):.0f} s)",
             "| " + " | ".join(["", "made in (s)", "peak RSS making it (GiB)", "file (GiB)", f"/ {spec.gguf_name}",
                                 "session start (s)", "RSS generating (GiB)", "/ file",
                                 *(f"{t} thread{'s' if t > 1 else ''}: prefill 128, 512, decode (tok/s)"
                                   for t in threads_list)]) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(threads_list)]
    for name in names:
        file, step = files.get(name), made.get(name) or {}
        first = timing.get(f"{name}|{threads_list[0]}", {}) if threads_list else {}
        rss = first.get("generating", {}).get("VmRSS", 0) / 1024
        cells = []
        for t in threads_list:
            m = medians.get(f"{name}|{t}")
            ours = medians.get(f"ours|{t}")
            if m is None:
                cells.append("")
                continue
            speeds = ", ".join(f"{m[k]:.1f}" for k in METRICS)
            ratio = "" if name == "ours" or ours is None else " (ours / it: " + ", ".join(
                f"{ours[k] / m[k]:.2f}x" for k in METRICS) + ")"
            cells.append(speeds + ratio)
        versus_gguf = f"{file / gguf:.2f}x" if file and gguf else ""
        loaded = f"{first['loaded']['seconds']:.1f}" if first else ""
        generating = f"{rss:.2f} | {rss / file:.2f}x" if first and file else " | "
        lines.append("| " + " | ".join([name, f"{step.get('seconds', 0):.0f}", f"{step.get('peak_mib', 0) / 1024:.2f}",
                                        f"{file or 0:.2f}", versus_gguf, loaded, generating, *cells]) + " |")
    return lines + shipped_targets(spec, results, files, made.get("ours"), medians)


def shipped_targets(spec: Shipped, results: dict, files: dict, export: dict | None, medians: dict) -> list[str]:
    """Issue 34's full-depth targets against ``spec.gguf_name``: export peak <= 4 GiB, file <= 1.1x the GGUF,
    RSS while generating <= 1.15x the file, prefill and decode tokens/s >= 1.0x, at each thread count timed."""
    def line(ok: bool, text: str) -> str:
        return f"- [{'met' if ok else 'NOT met'}] {text}"

    out, ours, gguf = [], files.get("ours"), files.get(spec.gguf_name)
    if export:
        out.append(line(export["peak_mib"] <= 4096, f"export peak RSS {export['peak_mib'] / 1024:.2f} GiB <= 4 GiB"))
    if ours and gguf:
        out.append(line(ours <= 1.1 * gguf, f"file {ours:.2f} GiB = {ours / gguf:.2f}x {spec.gguf_name}'s (<= 1.1x)"))
    for key, value in results.get("timing", {}).items():
        name, threads = key.split("|")
        rss = value["generating"]["VmRSS"] / 1024
        if name == "ours" and ours:
            out.append(line(rss <= 1.15 * ours, f"RSS generating ({threads} thread(s)) {rss:.2f} GiB = "
                                                f"{rss / ours:.2f}x the file (<= 1.15x)"))
        theirs = medians.get(f"{spec.gguf_name}|{threads}")
        if name == "ours" and theirs:
            ratios = {m: medians[key][m] / theirs[m] for m in METRICS}
            out.append(line(all(r >= 1 for r in ratios.values()), f"{threads} thread(s), ours / {spec.gguf_name} in "
                            "tokens/s (>= 1.0x): " + ", ".join(f"{m} {r:.2f}x" for m, r in ratios.items())))
    return out


# ----------------------------------------------------------------------------- before/after: another checkout's code

class Worker:
    """One of our genai folders served by `_contenders.py` in a process of `python` (whose moe_onnx package and
    library it times): the worker's identity (its Python, package, library and ISA level), then a round per call."""

    def __init__(self, side: str, python: str, folder: Path, threads: int):
        self.side, self.log = side, tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen([python, str(HERE / "_contenders.py"), str(folder), "--threads", str(threads)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.identity = self._reply()

    def _reply(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(WORKER_LINE):
                return json.loads(line.removeprefix(WORKER_LINE))
        self.process.wait()
        self.log.seek(0)
        tail = " | ".join(self.log.read().strip().splitlines()[-3:])
        raise RuntimeError(f"the {self.side} worker ({self.process.args[0]}) ended, exit {self.process.returncode}: "
                           f"{tail}")

    def round(self, prompt: list[int], prefill_tokens: int, decode_tokens: int) -> dict[str, float]:
        """Tokens/s of each metric (`_contenders.measure`) of one round."""
        request = {"prompt": prompt, "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        self.process.wait()
        self.log.close()


def check_sides(identities: dict[str, dict], checkouts: dict[str, Path]) -> None:
    """Refuses a comparison whose "before" worker does not run the other checkout's code: its moe_onnx package and
    C++ library must lie in that checkout, unless the other checkout is this one (an A/A run: the same code on both
    sides, the machine's noise). Raises ValueError saying what it ran instead."""
    before, after = identities["before"], identities["after"]
    if checkouts["before"].resolve() == checkouts["after"].resolve() and before == after:
        return
    for key in ("moe_onnx", "library"):
        if not Path(before[key]).resolve().is_relative_to(checkouts["before"].resolve()):
            raise ValueError(f"--compare-with {checkouts['before']}: its Python ({before['python']}) loads {key} "
                             f"{before[key]}, not the checkout's (install it there: docs/benchmarks.md)")


def compare_rounds(workers: dict[str, Worker], prompt: list[int], prefill_tokens: int, decode_tokens: int,
                   rounds: int) -> dict[str, list[dict[str, float]]]:
    """A warm-up round of each worker, then `rounds` rounds of both back to back, the order alternating (the first
    worker first in even rounds): each side's rounds (tokens/s of each metric)."""
    for worker in workers.values():
        worker.round(prompt, prefill_tokens, decode_tokens)
    sides, out = list(workers), {side: [] for side in workers}
    for index in range(rounds):
        for side in sides if index % 2 == 0 else sides[::-1]:
            out[side].append(workers[side].round(prompt, prefill_tokens, decode_tokens))
    return out


def start_order_halves(rounds: int) -> list[tuple[tuple[str, str], int]]:
    """A row's rounds in two halves, each (the order its workers start in, its rounds): the second half on fresh
    workers started the other way round, so that what the start order does (whose memory is placed first) falls on
    both sides alike."""
    halves = ((("before", "after"), rounds - rounds // 2), (("after", "before"), rounds // 2))
    return [(start, count) for start, count in halves if count]


def compare_rows(label: str, threads: int, shape: Shape, rounds: dict[str, list[dict[str, float]]]) -> list[str]:
    """One row a metric: each side's median and min tokens/s, after / before as the median of the rounds' ratios
    (each round's two runs side by side) with their min-max, and whether every round went the same way."""
    metric_names = {"prefill_short": f"prefill T={shape.prefill_tokens}",
                    "prefill_long": f"prefill T={shape.prompt_tokens}",
                    "decode": f"decode {shape.decode_tokens} after {shape.prompt_tokens}"}
    lines = []
    for metric in METRICS:
        before = [r[metric] for r in rounds["before"]]
        after = [r[metric] for r in rounds["after"]]
        ratios = [a / b for a, b in zip(after, before, strict=True)]
        same_way = "" if len(ratios) < 3 else ("after faster every round" if min(ratios) > 1 else
                                                "after slower every round" if max(ratios) < 1 else "")
        lines.append(f"| {label} | {threads} | {metric_names[metric]} | {statistics.median(before):.1f} "
                     f"({min(before):.1f}) | {statistics.median(after):.1f} ({min(after):.1f}) | "
                     f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) | {same_way} |")
    return lines


COMPARE_HEAD = ["| model | threads | metric | before tok/s median (min) | after tok/s median (min) | "
                "after / before median (min-max over rounds) | |",
                "|---|---|---|---|---|---|---|"]


def compare_models(args: argparse.Namespace) -> list[tuple[str, Path, Shape]]:
    """The models a comparison times, made by this checkout's code when missing: --shipped's export of ours, or each
    shape's models of ours at each precision (fused fp32; int4 experts only and whole-model)."""
    if args.shipped:
        from _checkpoints import SHIPPED as MAKERS

        spec, folder = SHIPPED[args.shipped], args.work_dir / args.shipped
        if not (folder / "ours" / "genai_config.json").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            shipped_prepare(spec, folder, args.layers or MAKERS[spec.name][1], None, {})
        config = json.loads((folder / "ours" / "genai_config.json").read_text())["model"]
        shape = Shape(args.shipped, "", {"vocab_size": config["vocab_size"]}, **SHIPPED_TOKENS)
        label = f"{args.shipped}, {config['decoder']['num_hidden_layers']} layers"
        return [(label, folder / "ours", shape)]
    out = []
    for shape in [SMOKE_SHAPES[name] if args.smoke else SHAPES[name] for name in args.shape]:
        folder = args.work_dir / (f"smoke_{shape.fixture}" if args.smoke else shape.name)
        models = Models(shape, folder, None)
        out += [(f"{shape.name} {name}", path, shape) for precision in args.precision
                for name, path in models.ours(precision).items()]
    return out


def compare_main(args: argparse.Namespace) -> int:
    """--compare-with: each of our models timed by the other checkout's code ("before") and this one's ("after"),
    each side a worker process of its own Python, in alternating rounds (`compare_rounds`), half of them on workers
    started in the other order (`start_order_halves`); one table."""
    checkouts = {"before": args.compare_with, "after": REPO}
    pythons = {"before": str(args.compare_python or args.compare_with / ".venv" / "bin" / "python"),
               "after": sys.executable}
    rounds = 1 if args.smoke else args.rounds
    print(f"machine: {machine()}; onnxruntime {ort.__version__}; {rounds} rounds", flush=True)
    models, shown = compare_models(args), False
    if not models:
        print("no model to compare (see above)", file=sys.stderr)
        return 1
    for label, folder, shape in models:
        prompt = prompt_ids(shape.vocab, shape.prompt_tokens)
        for threads in args.threads:
            result = {"before": [], "after": []}
            for start, count in start_order_halves(rounds):
                with contextlib.ExitStack() as stack:
                    started = {side: stack.enter_context(contextlib.closing(
                        Worker(side, pythons[side], folder, threads))) for side in start}
                    workers = {side: started[side] for side in ("before", "after")}
                    identities = {side: worker.identity for side, worker in workers.items()}
                    try:
                        check_sides(identities, checkouts)
                    except ValueError as error:
                        print(f"bench_generation: {error}", file=sys.stderr)
                        return 2
                    if not shown:
                        for side, identity in identities.items():
                            print(f"{side} ({checkouts[side]}): {identity['python']}, moe_onnx "
                                  f"{identity['moe_onnx']}, library {identity['library']}, level {identity['level']}",
                                  flush=True)
                        print("\n".join(COMPARE_HEAD), flush=True)
                        shown = True
                    half = compare_rounds(workers, prompt, shape.prefill_tokens, shape.decode_tokens, count)
                for side in result:
                    result[side] += half[side]
            print("\n".join(compare_rows(label, threads, shape, result)), flush=True)
    print(f"done: {machine()}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["qwen3", "gpt_oss"])
    parser.add_argument("--precision", nargs="+", choices=("fp32", "int4"), default=["fp32", "int4"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per pair")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/moe-bench-generation"))
    parser.add_argument("--llama-cpp-source", type=Path, default=os.environ.get("LLAMA_CPP_SOURCE"),
                        help="llama.cpp's source (convert_hf_to_gguf.py; default: $LLAMA_CPP_SOURCE)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile our reference model (op types, slowest nodes; prefill and decode); "
                             "with --shipped --step time: profile ours instead of timing (kept for the report)")
    parser.add_argument("--unfused", action="store_true",
                        help="also the unfused export (fp32; beside the fused session it needs ~3.5x the fp32 "
                             "weights' memory, and minutes a round)")
    parser.add_argument("--prepare", action="store_true", help="make the models only (no timing)")
    parser.add_argument("--clean", action="store_true", help="delete each shape's files once it is timed")
    parser.add_argument("--smoke", action="store_true",
                        help="the committed tiny KV fixtures at a few tokens, 1 round: a check of the script")
    parser.add_argument("--shipped", choices=sorted(SHIPPED),
                        help="a full-depth checkpoint as it ships (GPT-OSS-20B MXFP4, Qwen3-30B-A3B bf16), our "
                             "export and llama.cpp's conversion side by side, each contender in its own process")
    parser.add_argument("--layers", type=int, help="with --shipped: the depth (default: the model's)")
    parser.add_argument("--step", choices=("checkpoint", "prepare", "time", "report"), nargs="+",
                        default=["prepare", "time", "report"],
                        help="with --shipped: write the checkpoint only (kept for a later prepare), make the models "
                             "(the checkpoint unless kept, our export, llama.cpp's conversion; the checkpoint deleted "
                             "after), time them, print the table (results kept in WORK_DIR/<name>/results.json "
                             "between steps)")
    parser.add_argument("--compare-with", type=Path, metavar="CHECKOUT",
                        help="time our models (those of --shape/--smoke at --precision, or --shipped's) by another "
                             "checkout's code (\"before\") and this one's (\"after\") side by side instead: each "
                             "side a worker process of its own Python, alternating rounds; no other contender")
    parser.add_argument("--compare-python", type=Path, metavar="PYTHON",
                        help="with --compare-with: the Python whose moe_onnx is that checkout's (default: "
                             "CHECKOUT/.venv/bin/python)")
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "contend":
        child = argparse.ArgumentParser()
        child.add_argument("kind")
        child.add_argument("path", type=Path)
        child.add_argument("--threads", type=int, required=True)
        child.add_argument("--rounds", type=int, required=True)
        child.add_argument("--vocab", type=int, required=True)
        child.add_argument("--profile", action="store_true")
        c = child.parse_args(sys.argv[2:])
        if c.profile:
            shape = Shape("shipped", "", {"vocab_size": c.vocab}, **SHIPPED_TOKENS)
            print(json.dumps(profile(c.path, shape, c.threads)))
        else:
            print(json.dumps(contend(c.kind, c.path, c.threads, c.rounds, c.vocab)))
        return 0
    args = parser.parse_args(argv)
    if args.compare_with:
        return compare_main(args)
    if args.shipped:
        return _shipped_main(args)
    shapes = [SMOKE_SHAPES[name] if args.smoke else SHAPES[name] for name in args.shape]
    rounds = 1 if args.smoke else args.rounds
    print(f"machine: {machine()}; onnxruntime {ort.__version__}", flush=True)
    for shape in shapes:
        folder = args.work_dir / shape.name.split()[0] if not args.smoke else args.work_dir / f"smoke_{shape.fixture}"
        models = Models(shape, folder, args.llama_cpp_source)
        results = {}
        for precision in args.precision:
            reference, others = contenders(models, precision, args.unfused)
            if reference is None:
                print(f"[{shape.name}] {precision}: no model of ours (see above)", flush=True)
                continue
            if args.prepare:
                print(f"[{shape.name}] {precision}: {reference[0]}, " + ", ".join(o[0] for o in others), flush=True)
                continue
            for threads in args.threads:
                if args.profile:
                    print("\n".join(profile(reference[1], shape, threads)), flush=True)
                results[precision, threads] = run_pairs(shape, reference, others, threads, rounds)
                print("\n".join(table(shape, precision, threads, results[precision, threads])) + "\n", flush=True)
        if args.prepare:
            continue
        lines = targets(shape, results)
        print("\n".join(lines or [f"- {shape.name}: no llama.cpp figures (llama_cpp not installed or no source)"]))
        if args.clean:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


def _shipped_main(args: argparse.Namespace) -> int:
    from _checkpoints import SHIPPED as MAKERS

    spec, folder = SHIPPED[args.shipped], args.work_dir / args.shipped
    folder.mkdir(parents=True, exist_ok=True)
    store = folder / "results.json"
    results = json.loads(store.read_text()) if store.is_file() else {}
    print(f"machine: {machine()}; onnxruntime {ort.__version__}", flush=True)
    if "checkpoint" in args.step:
        shipped_checkpoint(spec, folder, args.layers or MAKERS[spec.name][1], results)
        store.write_text(json.dumps(results, indent=2))
    if "prepare" in args.step:
        shipped_prepare(spec, folder, args.layers or MAKERS[spec.name][1], args.llama_cpp_source, results)
        store.write_text(json.dumps(results, indent=2))
    if "time" in args.step:
        shipped_time(folder, spec, args.threads, args.rounds, results, with_profile=args.profile)
        store.write_text(json.dumps(results, indent=2))
    if "report" in args.step:
        print("\n".join(shipped_report(spec, results) + [
            f"where ours spends it: {line}" for threads in sorted(results.get("profile", {}))
            for line in results["profile"][threads]]))
    if args.clean:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
