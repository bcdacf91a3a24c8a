"""How the benchmark runs and times sessions: the session options, callables that run a session
(on numpy feeds, or on OrtValues bound once), and interleaved rounds with medians and side-by-side
ratios; the machine line every benchmark prints with its figures."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import onnxruntime as ort
from onnx import TensorProto


def session_options(threads: int, spin_in_runs: bool = False) -> ort.SessionOptions:
    """``threads`` intra-op threads whose pool does not spin between runs: the variants' sessions are alive side
    by side and run in turn, and a spinning pool of one would steal the cores from the next. Without
    ``spin_in_runs`` it never spins; with it, it spins for work while a run lasts (onnxruntime's default, what
    `moe-onnx generate` gets) and stops when the run returns (``session.force_spinning_stop``): a decode step's
    hundreds of small nodes then hand work to the pool thread without waking it each time (measured on the
    Qwen3-30B-A3B decoder at 2 threads: decode 1.13x, docs/benchmarks.md)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if spin_in_runs:
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    else:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def runner(sess: ort.InferenceSession, feeds: dict) -> Callable[[], list]:
    """Runs `sess` on numpy `feeds`, returning its first output."""
    names = [sess.get_outputs()[0].name]
    return lambda: sess.run(names, feeds)


class BoundRunner:
    """Runs `sess` on OrtValues made once (bfloat16 too) through an IOBinding, so no conversion is
    timed. (run_with_ort_values would add ~40 us per call in Python wrapping its outputs, the
    whole run time of a small decode.) `outputs()` returns the last run's outputs as numpy."""

    def __init__(self, sess: ort.InferenceSession, arrays):
        def value(a):
            if a.dtype == ml_dtypes.bfloat16:
                return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), TensorProto.BFLOAT16)
            return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a))
        self.sess = sess
        self.values = [value(a) for a in arrays]  # kept alive: the binding points at them
        self.binding = sess.io_binding()
        for i, v in zip(sess.get_inputs(), self.values):
            self.binding.bind_ortvalue_input(i.name, v)
        self.binding.bind_output(sess.get_outputs()[0].name)

    def __call__(self) -> None:
        self.sess.run_with_iobinding(self.binding)

    def outputs(self) -> list[np.ndarray]:
        return self.binding.copy_outputs_to_cpu()


def call_ms(call: Callable[[], object]) -> float:
    """The wall time of one call, in ms."""
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e3


def median_ms(call: Callable[[], object], budget_ms: float, at_least: int = 3) -> float:
    """The median wall time (ms) of ``call`` after one warm-up call: at least ``at_least`` calls, more while they
    fit ``budget_ms``."""
    call()
    samples, start = [], time.perf_counter()
    while len(samples) < at_least or (time.perf_counter() - start) * 1e3 < budget_ms:
        samples.append(call_ms(call))
    return statistics.median(samples)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def load() -> str:
    """The load averages (1, 5, 15 min): how busy the machine was around a figure."""
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def reps_for(ms: float, budget_ms: float) -> int:
    """Calls per round for a variant that takes `ms`: as many as fit `budget_ms`, 1 to 10."""
    return max(1, min(10, int(budget_ms / max(ms, 1e-3))))


class Timer:
    """Interleaved timing: each round runs every variant a few times; medians over all rounds."""

    def __init__(self):
        self.rounds: dict[str, list[list[float]]] = {}  # per variant, the times (ms) of each round

    def measure(self, name: str, fn: Callable[[], object], reps: int) -> None:
        """One round of `name`: `reps` calls."""
        self.rounds.setdefault(name, []).append([call_ms(fn) for _ in range(reps)])

    def first_ms(self, call: Callable[[], object]) -> float:
        """The time of one call (ms) that sets a variant's calls per round."""
        return call_ms(call)

    def run_rounds(self, calls: dict[str, Callable[[], object]], rounds: int, budget_ms: float) -> None:
        """Warm each call up, time one call of each, then `rounds` rounds over all of them in turn,
        each call repeated to fill `budget_ms` per round."""
        for call in calls.values():
            call()
        first = {name: self.first_ms(call) for name, call in calls.items()}
        for _ in range(rounds):
            for name, call in calls.items():
                self.measure(name, call, reps_for(first[name], budget_ms))

    def median(self, name: str) -> float | None:
        values = [t for r in self.rounds.get(name, []) for t in r]
        return statistics.median(values) if values else None

    def round_medians(self, name: str) -> list[float]:
        return [statistics.median(r) for r in self.rounds[name]]

    def paired_ratio(self, a: str, b: str) -> float:
        """Median over rounds of a / b, each round's two medians taken side by side: a slow spell of
        the (shared) machine slows both. `bound` is max(bytes, dense) of the same round."""
        def per_round(name):
            if name == "bound":
                return [max(x, y) for x, y in zip(self.round_medians("bytes"), self.round_medians("dense"))]
            return self.round_medians(name)
        return statistics.median(x / y for x, y in zip(per_round(a), per_round(b)))
