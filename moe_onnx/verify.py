"""Check that an optimized model computes what the original does, and time both.

The original runs in plain onnxruntime, the optimized model in a moe_onnx session on the chosen
backend, on the same random inputs at several (batch, sequence) sizes, one session after the other (never both
models' weights at once). An optimized model whose expert
blocks compute with bfloat16 operands (``accuracy_level`` 3, ``moe-onnx optimize --compute bf16``) is
judged against :data:`BF16_COMPUTE_TOLERANCE` per block instead of float32's tolerance.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort

from .compare import OutputMismatch, compare_outputs, worst
from .runtime import session

DEFAULT_SIZES = ((1, 1), (2, 5), (3, 17))
#: bfloat16 keeps 8 significant bits: rounding to nearest even moves a value by at most 2^-9 of itself
BF16_ROUNDING = 2.0 ** -9
#: What bfloat16 GEMM operands (accuracy_level 3) may cost one expert block, as a fraction of the magnitude
#: of its terms: every product of the first GEMM(s) has both operands rounded (2 x 2^-9); the gated
#: activation multiplies two of those results, gate by up (2 x 2 x 2^-9); the second GEMM takes that with
#: its own two roundings (+ 2 x 2^-9): 6 x 2^-9, about 1.2%. Biases, the activation, the routing weights
#: and the sum over the slots are float32. The roundings are independent and of either sign, so their sum
#: grows like the output (not like the sum of |terms|): verify holds each output's max |difference| to it
#: times the output's largest |value|, times the blocks computed so (docs/cli.md).
BF16_COMPUTE_TOLERANCE = 6 * BF16_ROUNDING
#: the tolerance (rtol = atol) of the comparison by the original's precision (:func:`model_precision`): float32's
#: 1e-4; a float16 or bfloat16 model rounds every tensor it computes (by up to 2^-11, 2^-8 of a value), and a
#: kernel that sums in another order or keeps float32 intermediates differs from onnxruntime's by several such
#: roundings (float16 fixtures: up to 4 of them measured), so 16 of them
PRECISION_TOLERANCE = {"float64": 1e-4, "float32": 1e-4, "float16": 16 * 2.0 ** -11, "bfloat16": 16 * 2.0 ** -8}
_NARROWEST_FIRST = ((onnx.TensorProto.BFLOAT16, "bfloat16"), (onnx.TensorProto.FLOAT16, "float16"),
                    (onnx.TensorProto.FLOAT, "float32"), (onnx.TensorProto.DOUBLE, "float64"))
#: random inputs tried at a size before deciding the original cannot run at it: a TorchScript loop
#: export runs only inputs routed to the experts its trace reached (its Split sizes are constants)
ATTEMPTS = 8
#: integer inputs of no known role that index no embedding table (flags) are drawn from [0, DEFAULT_INT_HIGH)
DEFAULT_INT_HIGH = 2


def parse_sizes(text: str) -> tuple[tuple[int, ...], ...]:
    """Sizes written as ``"1x1,2x5"`` (the notation of ``moe-onnx optimize --sizes``) -> ``((1, 1), (2, 5))``.
    Raises ValueError unless every dim is a positive integer."""
    sizes = tuple(tuple(int(d) for d in size.split("x")) for size in text.split(","))
    if any(d < 1 for size in sizes for d in size):
        raise ValueError(f"sizes {text!r} have a dim < 1")
    return sizes


def format_sizes(sizes: Sequence[Sequence[int]]) -> str:
    """The inverse of :func:`parse_sizes`."""
    return ",".join("x".join(str(d) for d in size) for size in sizes)


@dataclasses.dataclass
class SizeResult:
    """One size: the differences when both models ran (``compared``), else ``note`` says why not;
    ``note`` also holds the error of an optimized model that failed (``ok`` False)."""

    sizes: dict[str, int]
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    ok: bool = True
    compared: bool = False
    note: str | None = None
    peak_rel_diff: float | None = None  # bf16 compute: the largest max |difference| / max |value| of an output

    def summary(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.sizes.items()) or "static shapes"
        if self.compared:
            of_peak = "" if self.peak_rel_diff is None else f" ({self.peak_rel_diff:.2e} of the output's peak)"
            return (f"  {dims}: max abs diff {self.max_abs_diff:.2e}, max rel diff {self.max_rel_diff:.2e}{of_peak} "
                    f"{'OK' if self.ok else 'MISMATCH'}")
        return f"  {dims}: {'not compared' if self.ok else 'FAILED'}: {self.note}"


@dataclasses.dataclass
class VerifyResult:
    """The comparison at each size, the timings, and ``error`` when a model could not be loaded."""

    backend: str
    results: list[SizeResult]
    original_ms: float | None = None
    optimized_ms: float | None = None
    timed_sizes: dict[str, int] | None = None
    error: str | None = None
    bf16_tolerance: float | None = None  # of each output's peak, when blocks compute with bf16 operands
    tolerance: float = PRECISION_TOLERANCE["float32"]  # rtol = atol of the comparison
    precision: str = "float32"  # the original's (model_precision), which chose the tolerance

    @property
    def ok(self) -> bool:
        """Both models loaded, matched at every size compared, and at least one size was compared."""
        return self.error is None and all(r.ok for r in self.results) and any(r.compared for r in self.results)

    def summary(self) -> str:
        lines = [r.summary() for r in self.results]
        if self.bf16_tolerance is not None:
            lines.append(f"  bf16 compute: each output within {self.bf16_tolerance:.2e} of its peak |value| + "
                         f"{self.tolerance:.2e} (BF16_COMPUTE_TOLERANCE per block, docs/cli.md)")
        elif any(r.compared for r in self.results):
            lines.append(f"  tolerance: |a - b| <= {self.tolerance:.2e} + {self.tolerance:.2e} * |b| "
                         f"(a {self.precision} model)")
        if self.original_ms is not None:
            dims = ", ".join(f"{k}={v}" for k, v in (self.timed_sizes or {}).items())
            lines.append(f"  time ({dims}, median): original {self.original_ms:.2f} ms, optimized "
                         f"{self.optimized_ms:.2f} ms, speed-up {self.original_ms / self.optimized_ms:.1f}x")
        if self.error is not None:
            lines.append(f"  {self.error}")
        elif all(r.ok and not r.compared for r in self.results):
            lines.append("  nothing compared: the original model runs at none of these sizes")
        return "\n".join(lines)


_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
                "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}
#: inputs drawn by their role, known by name (case-insensitive): an attention mask gets ones (every token
#: attends), a past key/value cache the past length's random values, position ids past .. past + sequence - 1
ATTENTION_MASK = re.compile(r"attention_mask|(^|[._])mask$", re.IGNORECASE)
PAST = re.compile(r"^past[._]", re.IGNORECASE)
PRESENT = re.compile(r"^present[._]", re.IGNORECASE)
POSITIONS = re.compile(r"position_ids|cache_position", re.IGNORECASE)


def integer_input_ranges(model: onnx.ModelProto) -> dict[str, int]:
    """The vocabulary of each graph input used as the indices of a Gather (or com.microsoft's
    GatherBlockQuantized) over an initializer (an embedding table): that table's size along the gather axis."""
    inputs = {i.name for i in model.graph.input}
    tables = {t.name: list(t.dims) for t in model.graph.initializer if t.name not in inputs}
    gathers = {("", "Gather"): "axis", ("ai.onnx", "Gather"): "axis",
               ("com.microsoft", "GatherBlockQuantized"): "gather_axis"}
    ranges: dict[str, int] = {}
    for node in model.graph.node:
        axis_name = gathers.get((node.domain, node.op_type))
        if axis_name and len(node.input) >= 2 and node.input[1] in inputs and node.input[0] in tables:
            dims = tables[node.input[0]]
            axis = next((a.i for a in node.attribute if a.name == axis_name), 0)
            if dims and -len(dims) <= axis < len(dims):
                ranges.setdefault(node.input[1], dims[axis])
    return ranges


def fixed_cache_dims(model: onnx.ModelProto, output_shapes: Sequence[Sequence]) -> dict[str, int]:
    """The sizes a model fixes for symbolic dims of its cache inputs (``past*``), which are then no past length:
    the size one of its ``present*`` outputs (``output_shapes``: name and shape as onnxruntime infers them) of the
    same rank has at that place, and for a com.microsoft
    GroupQueryAttention that reads the cache, the head size (onnxruntime-genai's ``kv_cache_dim``: its query's
    declared width over its heads, the key and value heads too where the query input packs all three) and, with
    ``sliding_window_cache``, the capacity ``local_window_size`` of the cache's sequence axis."""
    graph = model.graph
    declared = {v.name: v.type.tensor_type.shape.dim for v in (*graph.input, *graph.value_info)}
    sizes: dict[str, int] = {}
    caches = [i for i in graph.input if PAST.search(i.name)]
    presents = [shape for name, shape in output_shapes if PRESENT.search(name)]
    for cache in caches:  # a present of the same rank with an int where the cache has a name
        dims = cache.type.tensor_type.shape.dim
        for present in (p for p in presents if len(p) == len(dims)):
            for mine, theirs in zip(dims, present):
                if mine.dim_param and isinstance(theirs, int):
                    sizes.setdefault(mine.dim_param, theirs)
    for node in graph.node:
        if (node.domain, node.op_type) != ("com.microsoft", "GroupQueryAttention") or len(node.input) < 5:
            continue
        attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
        query = declared.get(node.input[0])
        width = query[-1].dim_value if query else 0
        packed = not node.input[1]
        heads = attrs.get("num_heads", 0) + (2 * attrs.get("kv_num_heads", 0) if packed else 0)
        for cache in node.input[3:5]:
            dims = declared.get(cache)
            if not dims or len(dims) < 2:
                continue
            if width and heads and width % heads == 0 and dims[-1].dim_param:
                sizes.setdefault(dims[-1].dim_param, width // heads)
            if attrs.get("sliding_window_cache") and attrs.get("local_window_size", 0) > 0 and dims[-2].dim_param:
                sizes.setdefault(dims[-2].dim_param, attrs["local_window_size"])
    return sizes


def sliding_window_presents(model: onnx.ModelProto) -> set[str]:
    """The present key/value outputs of com.microsoft GroupQueryAttention nodes with ``sliding_window_cache``: a
    buffer of the window's capacity whose slots past the tokens seen so far are never written (not compared)."""
    return {name for node in model.graph.node
            if (node.domain, node.op_type) == ("com.microsoft", "GroupQueryAttention")
            and any(a.name == "sliding_window_cache" and a.i for a in node.attribute)
            for name in node.output[1:3] if name}


@dataclasses.dataclass
class InputDrawer:
    """How verify and quantize's error measurement draw a model's inputs (:meth:`of`), by name and role.

    ``size_dims``, the symbolic dims of the other inputs in order of first appearance, take a size's values
    (batch x sequence ...). A model with a cache (inputs named ``past_*``, ``past.*``) runs each size twice, as
    a generation does: the prompt (past length 0) and the next token after it (sequence 1, past length the
    size's sequence); the dims only the cache has are the past length (but those the model fixes:
    :func:`fixed_cache_dims`), those only an attention mask has the past plus the sequence."""

    inputs: list[tuple[str, list, type]]  # name, shape (ints and dim names), numpy type
    size_dims: list[str]
    past_dims: list[str]
    total_dims: list[str]
    int_ranges: dict[str, int]
    fixed_dims: dict[str, int]

    @classmethod
    def of(cls, sess: ort.InferenceSession, model: onnx.ModelProto) -> InputDrawer:
        """The drawer for ``sess``'s inputs; ``model`` (the same model) tells the embedding tables' sizes.
        Raises ValueError naming an input of a type it cannot draw."""
        inputs = []
        for info in sess.get_inputs():
            if info.type not in _NUMPY_TYPES:
                raise ValueError(f"verify: input '{info.name}' has type {info.type}, which verify cannot generate")
            inputs.append((info.name, [d if isinstance(d, int) else str(d) for d in info.shape],
                           _NUMPY_TYPES[info.type]))

        def dims(role) -> list[str]:
            return list(dict.fromkeys(d for name, shape, _ in inputs if role(name) for d in shape
                                      if isinstance(d, str)))

        size_dims = dims(lambda name: not PAST.search(name) and not ATTENTION_MASK.search(name))
        fixed_dims = fixed_cache_dims(model, [(o.name, o.shape) for o in sess.get_outputs()])
        past_dims = [d for d in dims(PAST.search) if d not in size_dims and d not in fixed_dims]
        total_dims = [d for d in dims(ATTENTION_MASK.search) if d not in size_dims and d not in past_dims]
        return cls(inputs, size_dims, past_dims, total_dims, integer_input_ranges(model), fixed_dims)

    def runs(self, size: Sequence[int]) -> list[dict[str, int]]:
        """The values of the symbolic dims for each run at ``size``: the prompt, and for a model with a cache
        the next token after it (see the class)."""
        sizes = dict(zip(self.size_dims, size))
        sequence = size[1] if len(size) > 1 else 1
        steps = [(0, sequence)]
        if any(PAST.search(name) for name, _, _ in self.inputs):
            steps.append((sequence, 1))
        runs = []
        for past, tokens in steps:
            dims = {**sizes, **self.fixed_dims}
            if len(self.size_dims) > 1:
                dims[self.size_dims[1]] = tokens
            dims.update({d: past for d in self.past_dims})
            dims.update({d: past + tokens for d in self.total_dims})
            runs.append(dims)
        return runs

    def tokens_seen(self, dims: dict[str, int]) -> int:
        """The past length plus the step's sequence in the run ``dims``."""
        past = next((dims[d] for d in self.past_dims if d in dims), 0)
        return past + (dims.get(self.size_dims[1], 1) if len(self.size_dims) > 1 else 1)

    def feeds(self, dims: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
        """Random inputs with the symbolic dims set to ``dims`` (one of :meth:`runs`; unknown dims: 1): an
        attention mask all ones, position ids from the past length on, integer inputs that index an embedding
        table within it (:func:`integer_input_ranges`), other integer inputs in ``[0, DEFAULT_INT_HIGH)``, booleans
        true, floats standard normal."""
        rng = np.random.default_rng(seed)
        past = next((dims[d] for d in self.past_dims if d in dims), 0)
        feeds = {}
        for name, shape, dtype in self.inputs:
            shape = [d if isinstance(d, int) else dims.get(d, 1) for d in shape]
            if ATTENTION_MASK.search(name) or dtype == np.bool_:
                feeds[name] = np.ones(shape, dtype=dtype)
            elif POSITIONS.search(name) and shape:
                feeds[name] = np.broadcast_to(np.arange(past, past + shape[-1]), shape).astype(dtype)
            elif np.issubdtype(dtype, np.floating):
                feeds[name] = rng.standard_normal(shape).astype(dtype)
            else:
                high = max(1, self.int_ranges.get(name, DEFAULT_INT_HIGH))
                feeds[name] = rng.integers(0, high, size=shape).astype(dtype)
        return feeds


def _median_ms(sess: ort.InferenceSession, feeds: dict, repeat: int) -> float:
    sess.run(None, feeds)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bf16_tolerance(blocks: int) -> float | None:
    """The fraction of each output's peak |value| that ``blocks`` expert blocks computing with bfloat16
    operands may cost (:data:`BF16_COMPUTE_TOLERANCE` each: their errors add, to first order); None for none."""
    return blocks * BF16_COMPUTE_TOLERANCE if blocks > 0 else None


def model_precision(model: onnx.ModelProto) -> str:
    """The narrowest floating-point type among the graph's inputs, outputs and initializers ("float32" when
    it has none): a key of :data:`PRECISION_TOLERANCE`."""
    graph = model.graph
    types = {v.type.tensor_type.elem_type for v in (*graph.input, *graph.output)}
    types |= {t.data_type for t in graph.initializer}
    return next((name for element, name in _NARROWEST_FIRST if element in types), "float32")


def verify(original, optimized, *, backend: str = "cpp", sizes: Sequence[Sequence[int]] = DEFAULT_SIZES,
           tolerance: float | None = None, time_it: bool = True, repeat: int = 10,
           threads: int | None = None, bf16_blocks: int = 0) -> VerifyResult:
    """Run both models (paths or ModelProtos) on random inputs at each size; compare every output.

    ``sizes`` gives values for the symbolic input dims in order (batch, sequence, ...); the inputs are drawn
    by :class:`InputDrawer` (a model with a cache runs each size as a prompt and as the next token). Where the
    original fails on :data:`ATTEMPTS` different random inputs, the run is reported as not
    compared (a trace-bound export); a model that cannot be loaded, or an optimized model that
    fails where the original ran, is reported in the result, not raised. With ``time_it`` both
    models are also timed at the largest size the original ran (median of ``repeat`` runs; not timed when the
    optimized model fails there).

    One session at a time: the original runs at every size (its outputs kept) and is released before the
    optimized model's session is created, so the peak memory is the larger model's, not both.

    An output matches when every element is within ``tolerance + tolerance * |expected|`` (None: the
    :data:`PRECISION_TOLERANCE` of the original's :func:`model_precision`); when ``bf16_blocks`` of the
    optimized model's expert blocks compute with bfloat16 operands (accuracy_level 3), when its max
    |difference| is within ``tolerance`` + :func:`bf16_tolerance` of its largest |expected| instead.
    """
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    try:
        original_sess = ort.InferenceSession(_as_input(original), options, providers=["CPUExecutionProvider"])
        proto = _proto(original)
    except Exception as error:  # noqa: BLE001 -- onnxruntime's errors share no base class
        return VerifyResult(backend, [], error=f"the input model is invalid: onnxruntime cannot load it: "
                                               f"{_first_line(error)}")
    precision = model_precision(proto)
    tolerance = PRECISION_TOLERANCE[precision] if tolerance is None else tolerance
    try:
        drawer = InputDrawer.of(original_sess, proto)
    except ValueError as error:
        return VerifyResult(backend, [], error=str(error))
    output_names = [o.name for o in original_sess.get_outputs()]
    runs = [dims for size in sizes for dims in drawer.runs(size)]
    seeds = [[index + attempt * len(runs) for attempt in range(ATTEMPTS)] for index in range(len(runs))]
    originals = [_run_original(original_sess, drawer, dims, run_seeds) for dims, run_seeds in zip(runs, seeds)]
    timed = max((index for index, (feeds, _, _) in enumerate(originals) if feeds is not None),
                key=lambda index: math.prod(runs[index].get(d, 1) for d in drawer.size_dims), default=None)
    original_ms = _median_ms(original_sess, originals[timed][0], repeat) if time_it and timed is not None else None
    del original_sess  # one session at a time: the original's weights are freed before the optimized model loads
    try:
        optimized_sess = session(optimized, backend=backend, sess_options=options)
    except Exception as error:  # noqa: BLE001
        return VerifyResult(backend, [], error=f"the optimized model cannot be loaded on the {backend} backend: "
                                               f"{_first_line(error)}")
    sliding = sliding_window_presents(proto)
    results = []
    result = VerifyResult(backend, results, bf16_tolerance=bf16_tolerance(bf16_blocks), tolerance=tolerance,
                          precision=precision)
    for index, (dims, (feeds, expected, failure)) in enumerate(zip(runs, originals)):
        if expected is None:
            results.append(SizeResult(dims, note=f"the original model cannot run at this size ({ATTEMPTS} random "
                                                 f"inputs tried; a trace-bound export?): {failure}"))
            continue
        try:
            got = optimized_sess.run(None, feeds)
        except Exception as error:  # noqa: BLE001
            results.append(SizeResult(dims, ok=False, note=f"the optimized model failed: {_first_line(error)}"))
            continue
        for position, name in enumerate(output_names):  # a sliding window's unwritten slots hold anything
            if name in sliding and expected[position].ndim >= 2:
                seen = drawer.tokens_seen(dims)
                expected[position], got[position] = expected[position][..., :seen, :], got[position][..., :seen, :]
        results.append(_compare(dims, output_names, expected, got, tolerance, bf16_tolerance(bf16_blocks)))
        if index == timed and original_ms is not None:
            result.timed_sizes, result.original_ms = dims, original_ms
            result.optimized_ms = _median_ms(optimized_sess, feeds, repeat)
    return result


def _run_original(sess: ort.InferenceSession, drawer: InputDrawer, dims: dict[str, int],
                  seeds: Sequence[int]) -> tuple[dict | None, list | None, str | None]:
    """The first random inputs (one per seed) the original runs on, with its outputs; else the first error."""
    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # a failed attempt is expected here; the result says so
    failure = None
    for seed in seeds:
        feeds = drawer.feeds(dims, seed=seed)
        try:
            return feeds, sess.run(None, feeds, quiet), None
        except Exception as error:  # noqa: BLE001
            failure = failure or _first_line(error)
    return None, None, failure


def _compare(dims: dict[str, int], names: Sequence[str], expected: list, got: list, tolerance: float,
             peak_tolerance: float | None = None) -> SizeResult:
    """Every output at one size (:mod:`moe_onnx.compare`, rtol = atol = ``tolerance``); outputs that cannot
    be compared fail the size. With ``peak_tolerance`` (bf16 compute) an output matches when its max
    |difference| is at most ``tolerance + peak_tolerance * its largest |expected|``."""
    try:
        differences = compare_outputs(names, expected, got, rtol=tolerance, atol=tolerance).values()
    except OutputMismatch as error:
        return SizeResult(dims, ok=False, note=f"the optimized model's outputs differ from the original's: {error}")
    difference = worst(differences)
    if peak_tolerance is None:
        return SizeResult(dims, difference.max_abs, difference.max_rel, difference.within_tolerance, compared=True)
    ok = all(d.max_abs <= tolerance + peak_tolerance * d.reference_peak for d in differences)
    return SizeResult(dims, difference.max_abs, difference.max_rel, ok, compared=True,
                      peak_rel_diff=max((d.relative_to_peak for d in differences), default=0.0))


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _proto(model) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    from ._ir import model_files  # onnx_ir (and sympy under it) only where a path is read: not for the tolerances

    return model_files.read_proto(model)


def _as_input(model):
    return model.SerializeToString() if hasattr(model, "SerializeToString") else str(model)
