"""Text generation from a model folder in onnxruntime-genai's format (read by
:class:`moe_onnx.genai_folder.GenaiFolder`), on :func:`moe_onnx.session` (our ops run).

The folder holds ``genai_config.json``, the decoder it names (``model.decoder.filename``) and, for text prompts,
``tokenizer.json`` (read by the optional ``tokenizers`` package: ``pip install 'moe-onnx[generate]'``). What the
decoder takes is read from the config, as onnxruntime-genai reads it, not from a model family:

* ``inputs``/``outputs``: the names of ``input_ids``, ``attention_mask``, ``position_ids`` and ``logits``, and the
  per-layer patterns of the caches (``past_key_names`` -> ``present_key_names``, the values likewise, and
  ``past_conv_names`` -> ``present_conv_names``, LFM2's convolution states); a layer whose name the decoder lacks
  has no such cache (LFM2's convolution layers have no keys);
* ``num_key_value_heads``, ``head_size``: the symbolic head and head-size dims of the caches;
* ``sliding_window``: the layers it lists (all, when it lists none) start with a cache of ``window_size`` slots,
  which GroupQueryAttention (``sliding_window_cache``) fills and slides itself; the other layers start empty and
  grow by the step's tokens;
* ``eos_token_id`` (one or a list; none: generation stops at its length only), ``vocab_size`` (the prompt's ids
  must lie in it), ``context_length``; ``search``'s ``temperature``, ``top_k`` and ``top_p`` for
  sampling.

Prefill is one run over the prompt; each later token is one run of that token, the presents fed back as the pasts
(onnxruntime values, never copied out); ``attention_mask`` is ones over every token so far, ``position_ids`` the
new tokens' positions. Generation stops at an eos token (left out of the tokens, as onnxruntime-genai leaves it),
after ``max_new_tokens`` or when the sequence fills the context. The times are measured around ``session.run``
only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ._ir.model_files import ModelFileError
from .genai_folder import GENAI_CONFIG, TOKENIZER_FILE, GenaiFolder
from .runtime import BACKENDS
from .runtime import session as moe_session

_STOPS = {"eos": "an eos token", "max_new_tokens": "-n tokens", "context": "the context length"}
_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class GenerateError(ValueError):
    """Settings generation cannot take (an empty or too long prompt, no tokens to generate, a decoder input the
    config does not describe); the command line exits 2."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings: logits / ``temperature``, the ``top_k`` largest kept (0: all), then the smallest set of
    them whose probabilities sum to ``top_p`` (1: all); the draw is numpy's ``default_rng(seed)``."""

    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature > 0:
            raise GenerateError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise GenerateError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise GenerateError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed < 0:  # numpy's generators take none
            raise GenerateError(f"seed must be >= 0, got {self.seed}")


@dataclass
class Generation:
    """What :func:`generate` did: the prompt's and the generated token ids (an eos token that ended generation not
    among them, as onnxruntime-genai leaves it out), the text of the generated ones (None without a tokenizer), why
    it stopped (``"eos"``, ``"max_new_tokens"``, ``"context"``) and the seconds spent in ``session.run`` for the
    prefill (one run, giving the first token) and the decode (``decode_runs``: one run per later token)."""

    prompt_ids: list[int]
    tokens: list[int]
    text: str | None
    stop: str
    prefill_seconds: float
    decode_seconds: float
    decode_runs: int

    @property
    def prefill_tokens_per_second(self) -> float:
        return len(self.prompt_ids) / self.prefill_seconds if self.prefill_seconds else float("inf")

    @property
    def decode_tokens_per_second(self) -> float | None:
        if not self.decode_runs:
            return None
        return self.decode_runs / self.decode_seconds if self.decode_seconds else float("inf")

    def summary(self) -> str:
        lines = [] if self.text is None else [self.text]
        lines.append(f"tokens: {' '.join(map(str, self.tokens))} (stopped: {_STOPS[self.stop]})")
        lines.append(f"prefill: {len(self.prompt_ids)} tokens in {self.prefill_seconds * 1e3:.2f} ms, "
                     f"{self.prefill_tokens_per_second:.1f} tokens/s")
        if self.decode_runs:
            lines.append(f"decode: {self.decode_runs} tokens in {self.decode_seconds * 1e3:.2f} ms, "
                         f"{self.decode_tokens_per_second:.1f} tokens/s")
        else:
            lines.append("decode: no tokens after the first")
        lines.append("(times: session.run only)")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Cache:
    """One cache input and the output that becomes it at the next step, with its first value's shape."""

    past: str
    present: str
    initial_shape: tuple[int, ...]
    dtype: type


def _caches(genai: GenaiFolder, decoder: ort.InferenceSession) -> list[_Cache]:
    """The decoder's cache inputs paired with their outputs, each with its empty (or window-sized) first value.
    GenerateError for a cache input the config's patterns do not name or whose dims it cannot give."""
    inputs = {value.name: value for value in decoder.get_inputs()}
    outputs = {value.name for value in decoder.get_outputs()}
    patterns = [("past_key_names", "present_key_names", "past_key_values.%d.key", "present.%d.key"),
                ("past_value_names", "present_value_names", "past_key_values.%d.value", "present.%d.value"),
                ("past_conv_names", "present_conv_names", None, None)]
    caches = []
    for past_key, present_key, past_default, present_default in patterns:
        past_pattern = genai.inputs.string(past_key, past_default)
        present_pattern = genai.outputs.string(present_key, present_default)
        if past_pattern is None or present_pattern is None:
            continue
        for layer in _cache_layers(genai, past_key, past_pattern, inputs):
            past, present = past_pattern % layer, _layer_name(present_key, present_pattern, layer)
            if present not in outputs:
                raise GenerateError(f"{genai.decoder_path}: input {past!r} has no output {present!r} "
                                    f"({GENAI_CONFIG}'s {present_key})")
            value = inputs.pop(past)
            shape = _initial_shape(genai, value, layer, conv=past_key == "past_conv_names")
            dtype = _NUMPY_TYPES.get(value.type)
            if dtype is None:
                raise GenerateError(f"{genai.decoder_path}: cache input {past!r} is {value.type}, expected "
                                    f"float or float16")
            caches.append(_Cache(past, present, shape, dtype))
    known = {genai.name("input_ids", "input_ids"), genai.name("attention_mask", "attention_mask"),
             genai.name("position_ids", "position_ids")}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise GenerateError(f"{genai.decoder_path}: inputs {unknown} are neither the token inputs nor a cache "
                            f"that {GENAI_CONFIG} names")
    return caches


def _layer_name(key: str, pattern: str, layer: int) -> str:
    """``pattern`` (the config's ``key``) with its one ``%d`` made ``layer``; GenerateError for another pattern."""
    if pattern.count("%") != 1 or "%d" not in pattern:
        raise GenerateError(f"{GENAI_CONFIG}'s {key} {pattern!r}: expected a name with one %d (the layer)")
    return pattern % layer


def _cache_layers(genai: GenaiFolder, key: str, pattern: str, inputs: dict) -> list[int]:
    """The layers, in order, whose name by ``pattern`` (the config's ``key``) is an input of the decoder; each must
    be below num_hidden_layers (found from the decoder's inputs: the config's layer count is not iterated)."""
    _layer_name(key, pattern, 0)  # one %d
    head, tail = pattern.split("%d")
    layers = []
    for name in inputs:
        digits = name[len(head):len(name) - len(tail)] if name.startswith(head) and name.endswith(tail) else ""
        if digits.isdigit() and pattern % int(digits) == name:
            layers.append(int(digits))
    beyond = [layer for layer in layers if layer >= genai.layers]
    if beyond:
        raise GenerateError(f"{genai.decoder_path}: cache input {pattern % max(beyond)!r} is beyond "
                            f"{GENAI_CONFIG}'s num_hidden_layers {genai.layers}")
    return sorted(layers)


def _initial_shape(genai: GenaiFolder, value: ort.NodeArg, layer: int, conv: bool) -> tuple[int, ...]:
    shape = list(value.shape)
    if not conv:
        if len(shape) != 4:
            raise GenerateError(f"{genai.decoder_path}: cache input {value.name!r} has shape {shape}, expected "
                                f"[batch, kv_heads, past_length, head_size]")
        window = genai.window(layer)
        symbolic = {1: genai.kv_heads, 2: 0 if window is None else window, 3: genai.head_size}
        shape = [dim if isinstance(dim, int) else symbolic.get(axis, dim) for axis, dim in enumerate(shape)]
    shape[0] = 1
    if not all(isinstance(dim, int) for dim in shape):
        raise GenerateError(f"{genai.decoder_path}: cache input {value.name!r} has dims {value.shape} that "
                            f"{GENAI_CONFIG} does not give")
    return tuple(shape)


def read_tokenizer(folder: Path, required: bool):
    """The folder's tokenizer.json as a ``tokenizers.Tokenizer``. When ``required`` (a text prompt): ModelFileError
    when the file is missing, GenerateError when the ``tokenizers`` package is not installed; otherwise None for
    either."""
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        if not required:
            return None
        raise ModelFileError(f"{folder}: no {TOKENIZER_FILE} to read the prompt with (give --prompt-ids instead)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        if not required:
            return None
        raise GenerateError("a text prompt needs the tokenizers package: pip install 'moe-onnx[generate]' (or "
                            "give the prompt's token ids)") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises its own Exception subclass for a file it cannot parse
        raise ModelFileError(f"{path}: not a tokenizer the tokenizers package reads ({error})") from None


def generate(folder: str | os.PathLike, prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
             max_new_tokens: int, threads: int | None = None, sample: bool = False, seed: int | None = None,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             backend: str = "cpp") -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` (text, read by the folder's tokenizer) or
    ``prompt_ids`` (token ids): greedy, or drawn when ``sample`` (:func:`search_sampling`: ``seed``, default 0, and
    the settings given, the others from the config's search section). See the module's docstring for what the
    folder gives; :class:`Generation` for the result. Raises ModelFileError (a folder, config, decoder or
    tokenizer that cannot be read, a decoder whose logits are NaN) or GenerateError (bad settings, a prompt that
    leaves no room in the context)."""
    if (prompt is None) == (prompt_ids is None):
        raise GenerateError("give a prompt or prompt_ids (one of them)")
    if max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    given = [name for name, value in (("seed", seed), ("temperature", temperature), ("top_k", top_k),
                                      ("top_p", top_p)) if value is not None]
    if given and not sample:
        raise GenerateError(f"{', '.join(given)} only apply with sample=True (greedy otherwise)")
    if threads is not None and threads < 1:
        raise GenerateError(f"threads must be >= 1, got {threads}")
    if backend not in BACKENDS:
        raise GenerateError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    genai = GenaiFolder(folder)
    sampling = search_sampling(genai, 0 if seed is None else seed, temperature, top_k, top_p) if sample else None
    tokenizer = read_tokenizer(genai.folder, required=prompt is not None)
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:  # bytes a shell passed that are not UTF-8 (surrogate escapes)
            raise GenerateError(f"the prompt is not UTF-8 text (at character {error.start})") from None
    prompt_ids = tokenizer.encode(prompt).ids if prompt is not None else list(prompt_ids)
    if not prompt_ids:
        raise GenerateError("the prompt has no tokens")
    for position, token in enumerate(prompt_ids):
        if not genai.is_token(token):
            raise GenerateError(f"prompt token {position} is {token!r}: expected a token id in [0, "
                                f"{genai.vocab_size}) ({GENAI_CONFIG}'s vocab_size)")
    prompt_ids = [int(token) for token in prompt_ids]
    if len(prompt_ids) >= genai.context_length:
        raise GenerateError(f"the prompt's {len(prompt_ids)} tokens leave no room in the context of "
                            f"{genai.context_length} tokens ({GENAI_CONFIG}'s context_length)")
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a failing run's error is raised with its message, not logged as well
    if threads is not None:
        options.intra_op_num_threads = threads
    try:
        decoder = moe_session(genai.decoder_path, backend=backend, sess_options=options)
    except ModelFileError:
        raise
    except Exception as error:  # noqa: BLE001 -- onnxruntime's errors share no base class
        raise ModelFileError(f"{genai.decoder_path} ({GENAI_CONFIG}'s model.decoder.filename): not a decoder "
                             f"onnxruntime loads: {' '.join(str(error).split())}") from None
    tokens, stop, seconds = _Decoder(genai, decoder).run(prompt_ids, max_new_tokens, sampling)
    text = tokenizer.decode(tokens) if tokenizer is not None else None
    return Generation(prompt_ids, tokens, text, stop, seconds[0], sum(seconds[1:]), len(seconds) - 1)


class _Decoder:
    """One sequence's generation loop on a decoder session: its feeds, caches and timing."""

    def __init__(self, genai: GenaiFolder, decoder: ort.InferenceSession):
        self.genai, self.decoder = genai, decoder
        self.caches = _caches(genai, decoder)
        inputs = {value.name for value in decoder.get_inputs()}
        self.input_ids = genai.name("input_ids", "input_ids")
        self.attention_mask = genai.name("attention_mask", "attention_mask")
        self.position_ids = genai.name("position_ids", "position_ids")
        self.has_mask, self.has_positions = self.attention_mask in inputs, self.position_ids in inputs
        self.logits = genai.name("logits", "logits")
        self.output_names = [self.logits] + [cache.present for cache in self.caches]

    def run(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling | None):
        """(generated tokens, stop reason, seconds of each run)."""
        rng = np.random.default_rng(sampling.seed) if sampling else None
        pasts = {cache.past: ort.OrtValue.ortvalue_from_numpy(np.zeros(cache.initial_shape, cache.dtype))
                 for cache in self.caches}
        step, past_length, tokens, seconds = list(prompt_ids), 0, [], []
        while True:
            feeds = dict(pasts)
            feeds.update(self._token_feeds(step, past_length))
            start = time.perf_counter()
            outputs = self.decoder.run_with_ort_values(self.output_names, feeds)
            seconds.append(time.perf_counter() - start)
            logits = outputs[0].numpy()[0, -1].astype(np.float64)
            if np.isnan(logits).any():  # argmax would take the first NaN's token, as if it were the best
                raise ModelFileError(f"{self.genai.decoder_path}: its logits at run {len(seconds)} hold NaN; expected "
                                     "numbers (the decoder's weights are damaged, or its type overflows)")
            token = _sample(logits, sampling, rng) if sampling else int(np.argmax(logits))
            past_length += len(step)
            if token in self.genai.eos:
                return tokens, "eos", seconds
            tokens.append(token)
            if len(tokens) == max_new_tokens:
                return tokens, "max_new_tokens", seconds
            if past_length + 1 >= self.genai.context_length:  # the sequence, the new token included, fills it
                return tokens, "context", seconds
            pasts = {cache.past: value for cache, value in zip(self.caches, outputs[1:], strict=True)}
            step = [token]

    def _token_feeds(self, step: list[int], past_length: int) -> dict[str, ort.OrtValue]:
        total = past_length + len(step)
        feeds = {self.input_ids: np.array([step], np.int64)}
        if self.has_mask:
            feeds[self.attention_mask] = np.ones((1, total), np.int64)
        if self.has_positions:
            feeds[self.position_ids] = np.arange(past_length, total, dtype=np.int64)[None]
        return {name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in feeds.items()}


def _sample(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """One token drawn from ``logits`` (float64) as :class:`Sampling` says."""
    order = np.argsort(-logits, kind="stable")
    if sampling.top_k:
        order = order[:sampling.top_k]
    scaled = logits[order] / sampling.temperature
    probabilities = np.exp(scaled - scaled.max())
    probabilities /= probabilities.sum()
    if sampling.top_p < 1:
        kept = int(np.searchsorted(np.cumsum(probabilities), sampling.top_p)) + 1
        order, probabilities = order[:kept], probabilities[:kept] / probabilities[:kept].sum()
    return int(order[rng.choice(len(order), p=probabilities)])


def search_sampling(genai: GenaiFolder, seed: int, temperature: float | None = None, top_k: int | None = None,
                    top_p: float | None = None) -> Sampling:
    """Sampling with the settings given, the others from the config's ``search`` section (where it lacks one:
    temperature 1, top_k 50, top_p 1, onnxruntime-genai's defaults). Its ``do_sample`` is not read: the caller
    asks for sampling."""
    search = genai.search
    return Sampling(temperature=float(search.number("temperature", 1.0)) if temperature is None else temperature,
                    top_k=search.integer("top_k", 50) if top_k is None else top_k,
                    top_p=float(search.number("top_p", 1.0)) if top_p is None else top_p, seed=seed)
