"""The contenders a generation benchmark times and one round of them: ours (and the unfused export) through
moe_onnx.generation's decoder loop, onnxruntime-genai's Generator, llama.cpp; `measure` times prefill and decode.

Run as a script it is the worker of `bench_generation.py --compare-with`: it serves one of our genai folders, in the
Python (and so the moe_onnx package and library) that runs it, one round a request:

  PYTHON benchmarks/_contenders.py FOLDER --threads N

It prints one line, WORKER_LINE and a JSON object naming its Python, moe_onnx package and C++ library; then reads
one JSON request a line ({"prompt": [ids], "prefill_tokens": n, "decode_tokens": n}) and prints WORKER_LINE and the
round's tokens/s (`measure`) for each, until its input ends. Its session packs its own weights (no packed-weights
file: another checkout's library may read another layout version). It imports nothing of moe_onnx that an older
checkout lacks, so the other side of a comparison can be the code of an earlier commit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

import moe_onnx
from _timing import session_options
from moe_onnx.generation import _Decoder

try:
    from moe_onnx.genai_folder import GenaiFolder
except ImportError:  # a checkout before the house of issue 35 (bench_generation --compare-with fa96e15)
    from moe_onnx.generation import GenaiFolder

#: what starts each line of the worker's replies (anything else it prints is not a reply)
WORKER_LINE = "contender-worker "
METRICS = ("prefill_short", "prefill_long", "decode")


class OrtContender:
    """A genai folder run through moe_onnx.generation's decoder loop on our session (any decoder: fused or not).
    With `chunk`, the prompt runs `chunk` tokens a run, each run's presents fed back (the unfused export: its
    experts gather every (token, expert) pair's weights, T * k expert matrices at once, more memory than the
    machine has at T = 128). `session`: more keyword arguments of moe_onnx.session (e.g. packed_weights=None)."""

    def __init__(self, folder: Path, threads: int, chunk: int | None = None, **session: object):
        genai = GenaiFolder(folder)
        genai.eos = set()  # random weights: never stop early
        options = session_options(threads, spin_in_runs=True)
        self.decoder = _Decoder(genai, moe_onnx.session(genai.decoder_path, sess_options=options, **session))
        self.chunk = chunk

    def prefill(self, ids: list[int]) -> float:
        return self.generate(ids, 0)[0]

    def generate(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        if self.chunk is None:
            seconds = self.decoder.run(ids, new_tokens + 1, None)[2]
            return seconds[0], sum(seconds[1:])
        d = self.decoder
        pasts = {c.past: ort.OrtValue.ortvalue_from_numpy(np.zeros(c.initial_shape, c.dtype)) for c in d.caches}
        chunks = [ids[i:i + self.chunk] for i in range(0, len(ids), self.chunk)]
        seconds, length, outputs = [], 0, None
        for run in range(len(chunks) + new_tokens):
            step = chunks[run] if run < len(chunks) else [int(np.argmax(outputs[0].numpy()[0, -1]))]
            feeds = {**pasts, **d._token_feeds(step, length)}
            start = time.perf_counter()
            outputs = d.decoder.run_with_ort_values(d.output_names, feeds)
            seconds.append(time.perf_counter() - start)
            pasts = {c.past: value for c, value in zip(d.caches, outputs[1:], strict=True)}
            length += len(step)
        return sum(seconds[:len(chunks)]), sum(seconds[len(chunks):])


class GenaiContender:
    """An onnxruntime-genai model folder through its Generator (greedy; min_length keeps eos from stopping it)."""

    def __init__(self, folder: Path, threads: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(folder))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))  # no key to stop its pool spinning
        self.model = og.Model(config)

    def _generator(self, length: int):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=length, min_length=length)
        return self.og.Generator(self.model, params)

    def prefill(self, ids: list[int]) -> float:
        generator = self._generator(len(ids) + 1)
        start = time.perf_counter()
        generator.append_tokens(np.array([ids], np.int32))
        generator.generate_next_token()
        return time.perf_counter() - start

    def generate(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        generator = self._generator(len(ids) + new_tokens + 1)
        start = time.perf_counter()
        generator.append_tokens(np.array([ids], np.int32))
        generator.generate_next_token()
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(new_tokens):
            generator.generate_next_token()
        return prefill, time.perf_counter() - start


class LlamaContender:
    """A GGUF through llama_cpp.Llama: eval of the prompt, then one eval per greedy token."""

    def __init__(self, path: Path, threads: int, context: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=context,
                                   n_batch=512, n_ubatch=512, verbose=False)

    def _eval(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - start

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        return self._eval(ids)

    def generate(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        self.llm.reset()
        prefill, decode = self._eval(ids), 0.0
        for _ in range(new_tokens):
            decode += self._eval([int(np.argmax(self._last_logits()))])
        return prefill, decode

    def _last_logits(self) -> np.ndarray:
        import llama_cpp

        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))



def prompt_ids(vocab: int, tokens: int) -> list[int]:
    """The prompt every contender is timed on: `tokens` ids drawn (seed 0) from 4 to the vocabulary's end (past the
    special ids)."""
    return [int(t) for t in np.random.default_rng(0).integers(4, vocab, tokens)]


def measure(contender, prompt: list[int], prefill_tokens: int, decode_tokens: int) -> dict[str, float]:
    """One round of a contender: tokens/s of a prefill of the prompt's first `prefill_tokens`, then of the whole
    prompt followed by `decode_tokens` greedy tokens (prefill_short, prefill_long, decode)."""
    prefill_short = contender.prefill(prompt[:prefill_tokens])
    prefill_long, decode = contender.generate(prompt, decode_tokens)
    return {"prefill_short": prefill_tokens / prefill_short, "prefill_long": len(prompt) / prefill_long,
            "decode": decode_tokens / decode}


def serve(folder: Path, threads: int) -> None:
    """The worker: our model in `folder` on `threads` threads, a round (`measure`) per request line of stdin."""
    contender = OrtContender(folder, threads, packed_weights=None)
    identity = {"python": sys.executable, "moe_onnx": moe_onnx.__file__, "library": moe_onnx.custom_ops_library(),
                "level": moe_onnx.runtime.kernel_report().get("level", "?")}
    print(WORKER_LINE + json.dumps(identity), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        speeds = measure(contender, request["prompt"], request["prefill_tokens"], request["decode_tokens"])
        print(WORKER_LINE + json.dumps(speeds), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()
    serve(args.folder, args.threads)
