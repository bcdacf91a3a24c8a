"""``moe-onnx quantize`` as a function, and ``moe_onnx.quantize`` in memory: the MOE nodes of a fused model made
QMOE (:class:`moe_onnx.rewrite.quantize.Quantize`), the model written and checked, and its error against the fp32
model measured: both run on the same random inputs, one session after the other, for the error of every output
and of every quantized layer's output."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from .._ir import model_files
from ..check import check_model, read_valid
from ..compare import Difference, compare_arrays, worst
from ..ops import DOMAIN
from ..rewrite.quantize import (
    ErrorReport,
    ErrorStat,
    LayerReport,
    LinearReport,
    Quantize,
    QuantizeError,
    QuantizeReport,
    QuantizeSettings,
)
from ..runtime import session
from ..verify import DEFAULT_SIZES, InputDrawer, format_sizes
from ._files import load_input, write_json, write_output
from .genai import job_paths

__all__ = ["QuantizeResult", "measure_error", "quantize", "quantize_file"]


@dataclasses.dataclass
class QuantizeResult:
    """What :func:`quantize_file` did: the report (with the measured error) and the problems: those
    ``moe-onnx check`` finds in the written model, or why the error could not be measured."""

    report: QuantizeReport
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        lines = [self.report.summary()]
        if self.problems:
            lines.append("problems with the quantized model:")
            lines += [f"  {problem}" for problem in self.problems]
        return "\n".join(lines)

    def document(self) -> dict:
        return {**self.report.document(), "problems": self.problems}

    def write_json(self, path: str | os.PathLike) -> None:
        write_json(self.document(), path)


def quantize_file(source: str | os.PathLike, destination: str | os.PathLike, settings: QuantizeSettings, *,
                  measure: bool = True, backend: str = "cpp", sizes: Sequence[Sequence[int]] = DEFAULT_SIZES,
                  seed: int = 0, progress: Callable[[str], None] | None = None) -> QuantizeResult:
    """Quantize the MOE nodes of the fused model at ``source`` into QMOE nodes (with ``settings.linears``, its other
    linear layers into MatMulNBits; see :class:`moe_onnx.rewrite.quantize.Quantize`) and write it to ``destination``
    (the quantized weights are computed one expert at a time while writing; external data when large); then check it
    and, with ``measure``, run both models on ``backend`` on random inputs (seeded by ``seed``) at ``sizes`` and put
    the error of every output and every quantized layer in the report.

    A ``source`` that is an onnxruntime-genai model folder makes ``destination`` a complete one, as
    :func:`optimize_file` does: its decoder quantized, the folder's other files copied, our library copied and
    named in genai_config.json.

    Raises what :func:`optimize_file` raises for the files, and
    :class:`moe_onnx.rewrite.quantize.QuantizeError` for bad settings or a model with nothing to quantize
    (nothing is written then).
    """
    settings.check()
    if measure and seed < 0:  # refused before anything is written, not when the error is measured
        raise QuantizeError(f"seed is {seed}; expected an integer >= 0")
    say = progress or (lambda message: None)
    paths = job_paths(source, destination)
    model, _ = load_input(paths, say)
    quantize_pass = Quantize(settings, progress)
    quantize_pass(model)
    report = quantize_pass.report
    written = write_output(model, paths, progress, library=_has_our_ops(model))
    result = QuantizeResult(report, check_model(written))
    if measure and not result.problems:
        say(f"measuring the error on the {backend} backend at sizes {format_sizes(sizes)}")
        try:
            report.error = measure_error(paths.source, written, report.layers, linears=report.linears, backend=backend,
                                         sizes=sizes, seed=seed)
        except Exception as error:  # noqa: BLE001 -- onnxruntime's errors share no base class
            text = str(error).strip()
            result.problems.append(f"the error could not be measured on the {backend} backend: "
                                   f"{text.splitlines()[0] if text else type(error).__name__}")
    return result


def _has_our_ops(model: ir.Model) -> bool:
    return any(node.domain == DOMAIN for node in ir.traversal.RecursiveGraphIterator(model.graph))


def quantize(model, settings: QuantizeSettings, *, measure: bool = True, backend: str = "cpp",
             sizes: Sequence[Sequence[int]] = DEFAULT_SIZES, seed: int = 0,
             progress: Callable[[str], None] | None = None):
    """:func:`moe_onnx.quantize` in memory: quantize ``model`` (a path, read as ``moe-onnx quantize`` reads it
    (:func:`moe_onnx.check.read_valid`) and loaded whole with its external data, an ``onnx.ModelProto`` or an
    ``onnx_ir.Model``, changed in place) with ``settings`` (:class:`moe_onnx.rewrite.quantize.Quantize`)
    and, with ``measure``, put its error against the model as it was into the report (:func:`measure_error`
    on ``backend`` at ``sizes``, inputs seeded by ``seed``). Returns ``(quantized, report)``: an
    ``onnx_ir.Model`` for one, else a ModelProto. Both models are serialized to protos, so the model must be
    under 2 GB; :func:`quantize_file` streams larger ones to disk. Raises QuantizeError as
    the Quantize pass does, :class:`moe_onnx._ir.model_files.ModelFileError` for a path the command line
    refuses (with its message), and what onnxruntime raises when the error cannot be measured."""
    settings.check()
    if isinstance(model, ir.Model):
        ir_model = model
    elif isinstance(model, onnx.ModelProto):
        ir_model = ir.serde.deserialize_model(model)
    else:  # loaded whole (external data included), so that both models run from memory
        ir_model = ir.serde.deserialize_model(model_files.with_data(read_valid(model), model))
    original = ir.serde.serialize_model(ir_model) if measure else None
    quantize_pass = Quantize(settings, progress)
    quantize_pass(ir_model)
    report = quantize_pass.report
    quantized = ir.serde.serialize_model(ir_model)
    if measure:
        report.error = measure_error(original, quantized, report.layers, linears=report.linears, backend=backend,
                                     sizes=sizes, seed=seed)
    return (ir_model if isinstance(model, ir.Model) else quantized), report


def measure_error(original, quantized, layers: Sequence[LayerReport] = (), *, linears: Sequence[LinearReport] = (),
                  backend: str = "cpp", sizes: Sequence[Sequence[int]] = DEFAULT_SIZES, seed: int = 0) -> ErrorReport:
    """Run ``original`` and ``quantized`` (paths or ModelProtos) on the same random inputs at each size
    (values of the symbolic input dims, in order; drawn by :class:`moe_onnx.verify.InputDrawer`: a model with a
    cache runs each size as a prompt and as the next token) on ``backend``: the error of every floating-point
    graph output, of each of ``layers``' and ``linears``' outputs, and the tokens each layer routes to other
    experts than the original, over all sizes. One session at a time: ``original`` runs on every input first
    (its outputs kept) and is released before ``quantized`` is loaded, so the peak memory is the larger model's."""
    proto = _proto_without_data(original)
    graph_outputs = [o.name for o in proto.graph.output]
    extra = [name for layer in layers for name in (layer.output, layer.routing_weights, layer.indices)]
    extra += [linear.output for linear in linears]
    names = list(dict.fromkeys(graph_outputs + extra))
    with _with_outputs(original, extra) as original_model:
        reference_sess = session(original_model, backend=backend)
        drawer = InputDrawer.of(reference_sess, proto)
        runs = [dims for size in sizes for dims in drawer.runs(size)]
        feeds = [drawer.feeds(dims, seed=seed + index) for index, dims in enumerate(runs)]
        references = [dict(zip(names, reference_sess.run(names, run_feeds))) for run_feeds in feeds]
        del reference_sess  # one session at a time: the unquantized weights are freed before the quantized load
    errors = {name: _Error(name) for name in names}
    with _with_outputs(quantized, extra) as quantized_model:
        quantized_sess = session(quantized_model, backend=backend)
        for run_feeds, expected in zip(feeds, references):
            got = dict(zip(names, quantized_sess.run(names, run_feeds)))
            for name in names:
                errors[name].add(expected[name], got[name])
            for layer in layers:
                errors[layer.output].add_routing(expected[layer.indices], got[layer.indices],
                                                 expected[layer.routing_weights], got[layer.routing_weights])
    float_outputs = [name for name in graph_outputs if errors[name].floating]
    return ErrorReport(backend, [list(s) for s in sizes], seed, [errors[name].stat() for name in float_outputs],
                       [errors[layer.output].stat() for layer in layers],
                       [errors[linear.output].stat() for linear in linears])


class _Error:
    """The running error of one tensor (and, for a layer's output, of its routing) over the sizes
    (:mod:`moe_onnx.compare`'s rule: a NaN or an infinity the unquantized model does not have is an infinite
    error)."""

    def __init__(self, name: str):
        self.name = name
        self.difference = Difference()
        self.floating = False
        self.tokens = self.rerouted = self.routing_weight_change = None

    def add(self, expected: np.ndarray, got: np.ndarray) -> None:
        if not np.issubdtype(expected.dtype, np.floating):
            return
        self.floating = True
        self.difference = worst([self.difference, compare_arrays(expected, got, name=self.name)])

    def add_routing(self, indices: np.ndarray, indices_now: np.ndarray, weights: np.ndarray,
                    weights_now: np.ndarray) -> None:
        """Count the tokens (rows of the [..., k] expert indices) whose set of experts differs; for the others,
        the largest change of an expert's routing weight."""
        k = indices.shape[-1]
        order, order_now = np.argsort(indices.reshape(-1, k), axis=1), np.argsort(indices_now.reshape(-1, k), axis=1)
        chosen = np.take_along_axis(indices.reshape(-1, k), order, axis=1)
        chosen_now = np.take_along_axis(indices_now.reshape(-1, k), order_now, axis=1)
        same = (chosen == chosen_now).all(axis=1)
        self.tokens = (self.tokens or 0) + chosen.shape[0]
        self.rerouted = (self.rerouted or 0) + int((~same).sum())
        change = compare_arrays(np.take_along_axis(weights.reshape(-1, k), order, axis=1)[same],
                                np.take_along_axis(weights_now.reshape(-1, k), order_now, axis=1)[same],
                                name=f"{self.name}'s routing weights")
        self.routing_weight_change = max(self.routing_weight_change or 0.0, change.max_abs)

    def stat(self) -> ErrorStat:
        return ErrorStat(self.name, self.difference.max_abs, self.difference.relative_to_peak,
                         self.difference.reference_peak, self.tokens, self.rerouted, self.routing_weight_change)


@contextlib.contextmanager
def _with_outputs(model, names: Sequence[str]):
    """``model`` (path or ModelProto) with the values ``names`` added as graph outputs (typed where the
    graph's value_info says): a ModelProto, or for a path a temporary copy beside it (so that its external
    data is found), removed afterwards."""
    if not names:
        yield model
        return
    proto = onnx.ModelProto()
    proto.CopyFrom(_proto_without_data(model))
    known = {v.name: v for v in (*proto.graph.value_info, *proto.graph.output)}
    declared = {o.name for o in proto.graph.output}
    for name in dict.fromkeys(names):
        if name not in declared:
            proto.graph.output.append(known[name] if name in known else onnx.helper.make_empty_tensor_value_info(name))
    if not isinstance(model, (str, os.PathLike)):
        yield proto
        return
    handle, path = tempfile.mkstemp(suffix=".onnx", prefix=".layers.", dir=Path(model).parent)
    os.close(handle)
    try:
        onnx.save(proto, path)
        yield path
    finally:
        os.unlink(path)


def _proto_without_data(model) -> onnx.ModelProto:
    return model if isinstance(model, onnx.ModelProto) else onnx.load(model, load_external_data=False)
