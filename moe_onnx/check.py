"""Model validation: the onnx checker, strict shape inference and the moe_onnx ops' own rules.

``check_model`` reports every problem it finds as a readable line that names the node and the
input or attribute; an empty list means the model is valid (a file that cannot be read is a problem too,
never an exception). ``read_valid`` (``require_valid`` on a model read) is the input check of ``moe-onnx
optimize`` and ``quantize``, from the command line and from Python alike; its shape inference is the one the
optimize passes reuse. Models with external data are read without loading their weights,
except the few constants a rule needs (such as expert offsets).
A model is checked as onnxruntime reads it: a domain onnxruntime registers that the model uses without
importing it counts as imported at the version onnxruntime assumes (``check_file`` prints a note).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import numpy_helper

from ._ir import model_files
from ._ir.graph import Scope, graphs, walk
from ._ir.inference import (RUNTIME_DOMAINS, ShapeInferenceError, for_onnx_checks, infer_shapes, onnx_registers,
                            runtime_registers, with_runtime_domains)
from .ops import DOMAIN, OPS, OPSET_VERSION, MoeOpError
from .ops._common import Dim, GraphView, fmt_shape

INT64_MAX = 2**63 - 1


def check_model(model: str | os.PathLike | onnx.ModelProto) -> list[str]:
    """Validate a model (path or ModelProto); returns the problems found, empty when valid. Never raises: a path
    that cannot be read as a model (missing, a folder, empty, truncated, not ONNX) is one problem, "cannot read
    the model: ...", and external data that is missing or short is one problem per tensor, as ``moe-onnx check``
    prints them."""
    if isinstance(model, onnx.ModelProto):
        return check_loaded(model)
    return _read_and_check(model)[1]


def read_valid(path: str | os.PathLike) -> onnx.ModelProto:
    """The model at ``path`` (without its external data) once it passes the check: what ``moe-onnx optimize``
    and ``quantize`` and their Python functions read. Raises :class:`moe_onnx._ir.model_files.ModelFileError`
    when it cannot be read or is invalid (:func:`require_valid`)."""
    proto = model_files.read_proto(path)
    require_valid(path, proto)
    return proto


def require_valid(path: str | os.PathLike, proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """ModelFileError "the input model is invalid: ..." with the first problem the check finds in ``proto``, read
    from ``path``, if any. Returns the model as the check's shape inference typed it (strict, data propagated;
    None for a valid model whose declared shapes onnxruntime tolerates but onnx does not), so that the optimize
    passes do not infer it again (:class:`moe_onnx.rewrite._driver.InferShapes`)."""
    review = _review(proto, Path(path))
    if review.problems:
        raise model_files.invalid_input(path, review.problems)
    return review.inferred


def check_loaded(proto: onnx.ModelProto, path: Path | None = None) -> list[str]:
    """check_model of a model already loaded (without its external data) from `path`, if any.
    Never raises: a failure of the checks themselves (a model no rule foresaw) is a problem too."""
    return _review(proto, path).problems


@dataclasses.dataclass
class _Review:
    """What the check found: the problems, the notes (what onnxruntime reads differently from onnx) and the model
    as strict shape inference typed it (None where it failed)."""

    problems: list[str]
    notes: list[str]
    inferred: onnx.ModelProto | None = None


def _review(proto: onnx.ModelProto, path: Path | None) -> _Review:
    """The problems of the model (check_loaded), and the notes on what onnxruntime reads differently from onnx:
    the domains it imports (:func:`moe_onnx._ir.inference.with_runtime_domains`), the defects it tolerates."""
    try:
        review = _problems(proto, path)
    except Exception as error:  # noqa: BLE001 -- still one line naming what went wrong
        return _Review([f"cannot check the model: {type(error).__name__}: {error}"], [])
    review.notes[:0] = with_runtime_domains(proto)[1]
    return review


def _problems(proto: onnx.ModelProto, path: Path | None) -> _Review:
    """The problems, and the defects onnxruntime tolerates (each a note)."""
    base_dir = "" if path is None else str(path.parent)
    if path is not None:
        problems = model_files.external_data_problems(proto, base_dir)
        if problems:  # the rules below read constants from that data
            return _Review(problems, [])
    checked = for_onnx_checks(proto)
    # the checker reads external data files itself when given the path (models over 2 GB included). A model that
    # for_onnx_checks changes (imports onnxruntime assumes, ops only onnxruntime defines) is checked in memory,
    # where the checker would look for its data files from the working directory: external_data_problems has
    # checked those already, so it sees the tensors emptied
    external = next(model_files.external_tensors(proto), None) is not None
    if not external:
        checkable = checked
    else:
        checkable = path if path is not None and checked is proto else _without_external_data(checked)
    proto = with_runtime_domains(proto)[0]
    inferred, inference_error = _infer_strictly(proto)  # the one inference of a valid model
    problems = (_check_opset(proto) + _check_declared_sizes(proto) + _check_registered(proto)
                + _check_our_nodes(inferred or _infer_leniently(proto), base_dir))
    if problems:  # each names its node; the generic checkers would only repeat them less clearly
        return _Review(problems, [])
    structural = _check_structure(checkable)
    if structural:
        return _Review(structural, [])
    return _Review(*_check_full(proto, inference_error), inferred)


def check_file(path: str | os.PathLike) -> tuple[bool, str]:
    """``moe-onnx check`` of one model file: whether it is valid, and the verdict to print (a line,
    then one per problem of :func:`check_model`, then the notes). Nothing raises."""
    proto, problems, notes = _read_and_check(path)
    notes = [f"  note: {note}" for note in notes]
    if problems:
        heading = f"{path}: INVALID ({len(problems)} problem{'s' if len(problems) > 1 else ''})"
        return False, "\n".join([heading] + [f"  {problem}" for problem in problems] + notes)
    return True, "\n".join([f"{path}: OK ({summarize(proto)})"] + notes)


def _read_and_check(path: str | os.PathLike) -> tuple[onnx.ModelProto | None, list[str], list[str]]:
    """The model at ``path`` without its external data (None when it cannot be read), its problems and the
    notes (:func:`_review`)."""
    try:
        proto = model_files.read_proto(path)
    except model_files.ModelFileError as error:
        return None, [f"cannot read the model: {error}"], []
    review = _review(proto, Path(path))
    return proto, review.problems, review.notes


def summarize(model: onnx.ModelProto) -> str:
    """One line: node count and the moe_onnx ops used."""
    counts = collections.Counter(n.op_type for n, _ in walk(model.graph) if n.domain == DOMAIN)
    ours = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items())) or "none"
    return f"{len(model.graph.node)} nodes; moe_onnx ops: {ours}"


def _check_structure(model: onnx.ModelProto | Path) -> list[str]:
    try:
        onnx.checker.check_model(str(model) if isinstance(model, Path) else model, full_check=False)
    except (onnx.checker.ValidationError, MoeOpError) as error:
        return [f"onnx checker: {error}"]
    return []


def _without_external_data(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``proto`` whose external tensors are empty (shape [0]): what the structural checker may read."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for tensor in model_files.external_tensors(copy):
        tensor.ClearField("external_data")
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.ClearField("dims")
        tensor.dims.append(0)
    return copy


def _check_opset(model: onnx.ModelProto) -> list[str]:
    versions = {o.domain: o.version for o in model.opset_import}
    uses_ours = any(n.domain == DOMAIN for n, _ in walk(model.graph))
    if (uses_ours or DOMAIN in versions) and versions.get(DOMAIN) != OPSET_VERSION:
        return [f"model: opset_import for domain '{DOMAIN}' is {versions.get(DOMAIN)}; expected {OPSET_VERSION}"]
    return []


def _check_declared_sizes(model: onnx.ModelProto) -> list[str]:
    """Declared shapes (inputs, outputs, value infos, initializers) no tensor can have."""
    problems = []
    for graph in graphs(model.graph):
        for tensor in graph.initializer:
            too_large = _too_large(tuple(tensor.dims), tensor.data_type)
            if too_large:
                problems.append(f"initializer '{tensor.name}' {too_large}")
        for info in list(graph.input) + list(graph.output) + list(graph.value_info):
            if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
                dims = tuple(d.dim_value if d.HasField("dim_value") else None
                             for d in info.type.tensor_type.shape.dim)
                too_large = _too_large(dims, info.type.tensor_type.elem_type)
                if too_large:
                    problems.append(f"value '{info.name}' {too_large}")
    return problems


def _too_large(shape: Sequence[Dim] | None, elem_type: int) -> str | None:
    """Why a tensor of this shape cannot exist (its byte size overflows int64), or None."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    try:
        item_bytes = onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize
    except (KeyError, ValueError, TypeError):  # string, undefined: at least a byte each
        item_bytes = 1
    total = math.prod(shape) * item_bytes
    if total > INT64_MAX:
        return (f"has shape {fmt_shape(shape)}: {total:.3g} bytes overflow int64; expected a size "
                f"onnxruntime can allocate")
    return None


def _infer_strictly(proto: onnx.ModelProto) -> tuple[onnx.ModelProto | None, ShapeInferenceError | None]:
    """Strict shape inference with type checks, standard ops included, the shapes' data propagated (the values
    that Shape ops compute: the rewriter's rules read the static shapes this gives): the model inferred, or its
    error."""
    try:
        return infer_shapes(proto, strict_mode=True, check_type=True, data_prop=True), None
    except ShapeInferenceError as error:
        return None, error


def _infer_leniently(proto: onnx.ModelProto) -> onnx.ModelProto:
    """What inference finds of a model strict inference fails on (the model itself where it finds nothing): the
    types our nodes' checks read."""
    try:
        return infer_shapes(proto, strict_mode=False)
    except ShapeInferenceError:  # best effort here; _check_full reports the strict error
        return proto


def _check_our_nodes(inferred: onnx.ModelProto, base_dir: str) -> list[str]:
    """The problems of our nodes in ``inferred`` (the model with the types inference found)."""
    problems = []
    for node, scope in walk(inferred.graph):
        if node.domain != DOMAIN:
            continue
        op = OPS.get(node.op_type)
        if op is None:
            problems.append(f"node '{node.name}': unknown op '{node.op_type}' in domain '{DOMAIN}'; "
                            f"expected one of {', '.join(OPS)}")
            continue
        view = GraphView(op, node, _types(scope), _constants(scope, base_dir))
        try:
            outputs = op.validate(view)
        except MoeOpError as error:
            problems.append(str(error))
            outputs = []
        problems += _check_arity(op, node)
        for name, info in zip(node.output, outputs):
            too_large = None if info is None or not name else _too_large(info.shape, info.elem_type)
            if too_large:
                problems.append(f"{op.name} node '{node.name}': output '{name}' {too_large}")
    return problems


def _check_arity(op, node: onnx.NodeProto) -> list[str]:
    where = f"{op.name} node '{node.name}'"
    if len(node.input) > len(op.inputs):
        return [f"{where}: has {len(node.input)} inputs; expected at most {len(op.inputs)}"]
    if len(node.output) > len(op.outputs):
        return [f"{where}: has {len(node.output)} outputs; expected at most {len(op.outputs)}"]
    return []  # attribute names and types: the op's own check (check_node_attributes)


def _check_full(proto: onnx.ModelProto, error: ShapeInferenceError | None) -> tuple[list[str], list[str]]:
    """What the full checker adds to the structural check, which has run already: the ``error`` of strict shape
    inference with type checks (:func:`_infer_strictly`), if any. A value_info shape that differs from the one
    inferred is a defect onnxruntime tolerates (it warns and merges them leniently:
    Graph::InferAndVerifyTypeMatch), so when inference passes without the value_info shapes (their element types
    kept; the graphs' inputs and outputs keep theirs), onnx's complaint is a note, not a problem."""
    if error is None:
        return [], []
    try:
        infer_shapes(_without_declared_shapes(proto), strict_mode=True, check_type=True)
    except ShapeInferenceError as undeclared_error:
        return [str(undeclared_error)], []
    return [], [f"a declared shape differs from the inferred one, which onnxruntime tolerates (it warns): {error}"]


def _without_declared_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for graph in graphs(copy.graph):
        for info in graph.value_info:
            if info.type.HasField("tensor_type"):
                info.type.tensor_type.ClearField("shape")
    return copy


def _check_registered(model: onnx.ModelProto) -> list[str]:
    """Nodes of onnxruntime's domains (com.microsoft, ...) whose op neither onnx nor onnxruntime defines (the
    default domain's: the onnx checker's own "No Op registered")."""
    versions = {o.domain: o.version for o in model.opset_import}
    problems = []
    for node, _ in walk(model.graph):
        version = versions.get(node.domain, 0)
        if (node.domain in RUNTIME_DOMAINS and not onnx_registers(node.domain, node.op_type, version)
                and not runtime_registers(node.domain, node.op_type, version)):
            problems.append(f"node '{node.name}': op '{node.op_type}' of domain '{node.domain}' (version {version}) "
                            f"is not defined by onnx or onnxruntime {onnxruntime.__version__}; expected an op "
                            "onnxruntime registers")
    return problems


def _types(scope: Scope) -> dict[str, onnx.TypeProto]:
    types: dict[str, onnx.TypeProto] = {}
    for graph in scope:
        for tensor in graph.initializer:
            types[tensor.name] = onnx.helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims))
        for info in list(graph.input) + list(graph.value_info) + list(graph.output):
            if info.type.HasField("tensor_type"):
                types[info.name] = info.type
    return types


def _constants(scope: Scope, base_dir: str) -> dict[str, Callable[[], np.ndarray]]:
    """Loaders of the values known before run time: initializers (not overridable) and Constant nodes."""
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    for graph in scope:
        inputs = {i.name for i in graph.input}
        for tensor in graph.initializer:
            if tensor.name not in inputs:
                loaders[tensor.name] = lambda t=tensor: numpy_helper.to_array(t, base_dir)
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.attribute:
                attr = node.attribute[0]
                if attr.name == "value":
                    loaders[node.output[0]] = lambda t=attr.t: numpy_helper.to_array(t, base_dir)
    return loaders
