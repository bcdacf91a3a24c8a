"""Check that an optimized model computes what the original does, and time both.

The original runs in plain onnxruntime, the optimized model in a moe_onnx session on the chosen
backend, on the same random inputs at several (batch, sequence) sizes.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from .runtime import session

DEFAULT_SIZES = ((1, 1), (2, 5), (3, 17))


def parse_sizes(text: str) -> tuple[tuple[int, ...], ...]:
    """Sizes written as ``"1x1,2x5"`` (the notation of ``moe-onnx optimize --sizes``) -> ``((1, 1), (2, 5))``."""
    return tuple(tuple(int(d) for d in size.split("x")) for size in text.split(","))


def format_sizes(sizes: Sequence[Sequence[int]]) -> str:
    """The inverse of :func:`parse_sizes`."""
    return ",".join("x".join(str(d) for d in size) for size in sizes)


@dataclasses.dataclass
class SizeResult:
    sizes: dict[str, int]
    max_abs_diff: float
    max_rel_diff: float
    ok: bool


@dataclasses.dataclass
class VerifyResult:
    backend: str
    results: list[SizeResult]
    original_ms: float | None = None
    optimized_ms: float | None = None
    timed_sizes: dict[str, int] | None = None

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def summary(self) -> str:
        lines = []
        for r in self.results:
            dims = ", ".join(f"{k}={v}" for k, v in r.sizes.items()) or "static shapes"
            lines.append(f"  {dims}: max abs diff {r.max_abs_diff:.2e}, max rel diff {r.max_rel_diff:.2e} "
                         f"{'OK' if r.ok else 'MISMATCH'}")
        if self.original_ms is not None:
            dims = ", ".join(f"{k}={v}" for k, v in (self.timed_sizes or {}).items())
            lines.append(f"  time ({dims}, median): original {self.original_ms:.2f} ms, optimized "
                         f"{self.optimized_ms:.2f} ms, speed-up {self.original_ms / self.optimized_ms:.1f}x")
        return "\n".join(lines)


def _symbolic_dims(sess: ort.InferenceSession) -> list[str]:
    """Names of the symbolic input dims, in order of first appearance."""
    names: list[str] = []
    for info in sess.get_inputs():
        for dim in info.shape:
            if not isinstance(dim, int) and dim not in names:
                names.append(str(dim))
    return names


_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
                "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def random_feeds(sess: ort.InferenceSession, sizes: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs with the symbolic dims set to ``sizes`` (unnamed or unknown dims: 1)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in sess.get_inputs():
        shape = [d if isinstance(d, int) else sizes.get(str(d), 1) for d in info.shape]
        dtype = _NUMPY_TYPES.get(info.type)
        if dtype is None:
            raise ValueError(f"verify: input '{info.name}' has type {info.type}, which verify cannot generate")
        if np.issubdtype(dtype, np.floating):
            feeds[info.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[info.name] = np.ones(shape, dtype=dtype)
        else:
            feeds[info.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def _median_ms(sess: ort.InferenceSession, feeds: dict, repeat: int) -> float:
    sess.run(None, feeds)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def verify(original, optimized, *, backend: str = "cpp", sizes: Sequence[Sequence[int]] = DEFAULT_SIZES,
           rtol: float = 1e-4, atol: float = 1e-4, time_it: bool = True, repeat: int = 10,
           threads: int | None = None) -> VerifyResult:
    """Run both models (paths or ModelProtos) on random inputs at each size; compare every output.

    ``sizes`` gives values for the symbolic input dims in order (batch, sequence, ...). With
    ``time_it`` both models are also timed at the largest size (median of ``repeat`` runs).
    """
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    original_sess = ort.InferenceSession(_as_input(original), options, providers=["CPUExecutionProvider"])
    optimized_sess = session(optimized, backend=backend, sess_options=options)
    names = _symbolic_dims(original_sess)
    results = []
    for size in sizes:
        dims = dict(zip(names, size))
        feeds = random_feeds(original_sess, dims, seed=len(results))
        expected = original_sess.run(None, feeds)
        got = optimized_sess.run(None, feeds)
        max_abs = max_rel = 0.0
        ok = len(expected) == len(got)
        for e, g in zip(expected, got):
            e64, g64 = np.asarray(e, np.float64), np.asarray(g, np.float64)
            if e64.shape != g64.shape:
                ok = False
                continue
            diff = np.abs(e64 - g64)
            if diff.size:
                max_abs = max(max_abs, float(np.nanmax(diff)))
                max_rel = max(max_rel, float(np.nanmax(diff / np.maximum(np.abs(e64), 1e-12))))
            ok = ok and bool(np.allclose(g64, e64, rtol=rtol, atol=atol, equal_nan=True))
        results.append(SizeResult(dims, max_abs, max_rel, ok))
    result = VerifyResult(backend, results)
    if time_it and sizes:
        dims = dict(zip(names, max(sizes, key=lambda s: np.prod(s))))
        feeds = random_feeds(original_sess, dims)
        result.timed_sizes = dims
        result.original_ms = _median_ms(original_sess, feeds, repeat)
        result.optimized_ms = _median_ms(optimized_sess, feeds, repeat)
    return result


def _as_input(model):
    return model.SerializeToString() if hasattr(model, "SerializeToString") else str(model)
