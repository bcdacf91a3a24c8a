"""The one onnx shape inference every input model goes through, reading the model's opset imports as
onnxruntime does, and the versions a model may be written with for an onnxruntime that loads older ones.

A hand-written script (``onnx.helper.make_model(graph)``) imports the default domain only, whatever
domains its nodes use. onnxruntime adds every domain it registers that a model leaves out, at that
domain's newest version (``Model::Model`` in onnxruntime/core/graph/model.cc: each domain of
``GetLatestOpsetVersions`` missing from the model's imports goes into its ``domain_to_version`` and
its opset_import), so a com.microsoft::QMoE node without a com.microsoft import runs there; onnx's
checker and shape inference refuse it ("No opset import for domain com.microsoft").
"""

from __future__ import annotations

import functools
from collections.abc import Container, Iterable

import onnx
import onnx_ir as ir
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from .graph import walk

#: onnxruntime's contrib ops' domain (MoE, QMoE, MatMulNBits, GroupQueryAttention, ...)
ORT_DOMAIN = "com.microsoft"
#: the domains onnxruntime registers besides ai.onnx, each at the version it reads a model that leaves
#: it out with (onnxruntime 1.31: the imports of such a model as onnxruntime saves it;
#: tests/test_handbuilt_models.py checks them against the onnxruntime installed)
RUNTIME_DOMAINS = {
    "ai.onnx.ml": 5, "ai.onnx.preview": 1, "ai.onnx.preview.training": 1, "ai.onnx.training": 1,
    ORT_DOMAIN: 1, "com.microsoft.experimental": 1, "com.microsoft.nchwc": 1, "org.pytorch.aten": 1,
}

#: the element types each IR version added (onnx.proto), newest first: a model with none of them can be
#: written with an older IR version and mean the same
_TYPES_SINCE_IR = {
    14: {"FLOAT6E2M3", "FLOAT6E3M2"},
    13: {"UINT2", "INT2"},
    12: {"FLOAT8E8M0"},
    11: {"FLOAT4E2M1"},
    10: {"UINT4", "INT4"},
}


#: the domain that stands, in the copy onnx checks, for the default domain of the ops only onnxruntime defines
#: (SimplifiedLayerNormalization, ...): onnx treats an op of a domain it does not know as a custom op
CONTRIB_STANDIN_DOMAIN = "moe_onnx.onnxruntime_contrib"


class ShapeInferenceError(ValueError):
    """The model fails onnx shape inference; the message is one line."""


def undeclared_runtime_domains(used: Iterable[str], declared: Container[str]) -> dict[str, int]:
    """The domains in ``used`` that ``declared`` lacks and onnxruntime registers, with the version it reads them as."""
    return {domain: RUNTIME_DOMAINS[domain] for domain in sorted(set(used))
            if domain in RUNTIME_DOMAINS and domain not in declared}


def declaration_note(domain: str, version: int) -> str:
    return (f"the model uses domain '{domain}' without importing it: read as version {version}, as onnxruntime "
            "does (the import is written into the output)")


def declare_runtime_domains(model: ir.Model) -> list[str]:
    """Import, into ``model``, each domain its nodes use without importing it that onnxruntime registers, at the
    version onnxruntime reads it as; returns a note for each."""
    used = [node.domain for node in ir.traversal.RecursiveGraphIterator(model.graph)]
    used += [node.domain for function in model.functions.values() for node in function]
    added = undeclared_runtime_domains(used, model.opset_imports)
    model.opset_imports.update(added)
    return [declaration_note(domain, version) for domain, version in added.items()]


def with_runtime_domains(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``proto`` as onnxruntime reads it: itself, or a copy that imports the domains it uses without importing
    them (:func:`declare_runtime_domains`); with a note for each."""
    used = [node.domain for node, _ in walk(proto.graph)]
    used += [node.domain for function in proto.functions for node in function.node]
    added = undeclared_runtime_domains(used, {opset.domain for opset in proto.opset_import})
    if not added:
        return proto, []
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    copy.opset_import.extend(onnx.helper.make_opsetid(domain, version) for domain, version in added.items())
    return copy, [declaration_note(domain, version) for domain, version in added.items()]


@functools.cache
def runtime_op_versions() -> dict[tuple[str, str], int]:
    """Every op the installed onnxruntime defines, standard and contrib ops alike, as (domain, op type) -> the
    oldest version of the domain that has it ("" for the default domain)."""
    versions: dict[tuple[str, str], int] = {}
    for schema in ort_state.get_all_operator_schema():
        key = (schema.domain, schema.name)
        versions[key] = min(versions.get(key, schema.since_version), schema.since_version)
    return versions


def runtime_registers(domain: str, op_type: str, version: int) -> bool:
    """Whether onnxruntime defines ``domain::op_type`` at version ``version`` of that domain."""
    since = runtime_op_versions().get(("" if domain == "ai.onnx" else domain, op_type))
    return since is not None and since <= version


def onnx_registers(domain: str, op_type: str, version: int) -> bool:
    """Whether onnx itself (or a schema registered with it, such as the moe_onnx ops) defines the op there."""
    try:
        onnx.defs.get_schema(op_type, version, domain)
    except onnx.defs.SchemaError:
        return False
    return True


def for_onnx_checks(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` read as onnxruntime reads it (:func:`with_runtime_domains`), in a form onnx's checker and shape
    inference judge as onnxruntime does: the default-domain ops that only onnxruntime defines (its contrib ops
    SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, ...) moved to CONTRIB_STANDIN_DOMAIN, where
    onnx leaves them to their runtime as it does com.microsoft's ops (their outputs keep the declared types)."""
    proto, _ = with_runtime_domains(proto)
    default_version = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)

    def runtime_only(node: onnx.NodeProto) -> bool:
        return (node.domain in ("", "ai.onnx") and not onnx_registers("", node.op_type, default_version)
                and runtime_registers("", node.op_type, default_version))

    nodes = [node for node, _ in walk(proto.graph)] + [n for function in proto.functions for n in function.node]
    if not any(runtime_only(node) for node in nodes):
        return proto
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    nodes = [node for node, _ in walk(copy.graph)] + [n for function in copy.functions for n in function.node]
    for node in nodes:
        if runtime_only(node):
            node.domain = CONTRIB_STANDIN_DOMAIN
    copy.opset_import.append(onnx.helper.make_opsetid(CONTRIB_STANDIN_DOMAIN, 1))
    return copy


def infer_shapes(proto: onnx.ModelProto, **options) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes(proto, **options)`` of ``proto`` as onnxruntime reads it
    (:func:`for_onnx_checks`; the result's nodes keep their domains only where onnx defines their ops); any failure
    is a ShapeInferenceError with onnx's first line."""
    proto = for_onnx_checks(proto)
    try:
        return onnx.shape_inference.infer_shapes(proto, **options)
    except Exception as error:  # noqa: BLE001 -- onnx raises InferenceError, ValidationError, RuntimeError, ...
        text = str(error).strip()
        first = text.splitlines()[0] if text else type(error).__name__
        raise ShapeInferenceError(f"onnx shape inference fails: {first}") from None


def lower_versions(model: ir.Model, ir_version: int, opset: int) -> str | None:
    """Write ``model`` with IR version ``ir_version`` and ai.onnx opset ``opset`` where it declares newer ones and
    the older ones take it: no element type the newer IR versions added, and every standard op's definition at
    ``opset`` takes the node's element types (the definitions after the released opsets mostly widen the types;
    a meaning that changed with a wider type cannot be told from the schemas). Returns a note saying what changed
    or why it did not (None when the model's versions are not newer)."""
    declared_opset = model.opset_imports.get("", 0)
    if model.ir_version <= ir_version and declared_opset <= opset:
        return None
    what = f"IR version {model.ir_version}, ai.onnx opset {declared_opset}"
    added_types = set().union(*(_TYPES_SINCE_IR.get(v, set()) for v in range(ir_version + 1, model.ir_version + 1)))
    newer_types = sorted({value.dtype.name for value in _values(model) if value.dtype is not None
                          and value.dtype.name in added_types})
    refused = sorted({node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph)
                      if declared_opset > opset and node.domain in ("", "ai.onnx") and not _takes(node, opset)})
    if newer_types or refused:
        reasons = [f"element types {', '.join(newer_types)}"] * bool(newer_types)
        reasons += [f"the opset-{opset} definitions of {', '.join(refused)} do not take these nodes"] * bool(refused)
        return (f"{what} is newer than onnxruntime loads (IR {ir_version}, opset {opset}) and the model needs it "
                f"({'; '.join(reasons)}): kept, onnxruntime will not load the output")
    model.ir_version = min(model.ir_version, ir_version)
    if declared_opset > opset:
        model.opset_imports[""] = opset
    return (f"{what} is newer than onnxruntime loads: written as IR version {model.ir_version}, opset "
            f"{model.opset_imports.get('', 0)}, whose definitions take every node of the model")


def _values(model: ir.Model) -> Iterable[ir.Value]:
    yield from model.graph.inputs
    yield from model.graph.initializers.values()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        yield from node.outputs


def _takes(node: ir.Node, opset: int) -> bool:
    """Whether the definition of ``node``'s op in effect at ``opset`` takes its inputs' and outputs' element
    types (those known)."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    for values, formals in ((node.inputs, schema.inputs), (node.outputs, schema.outputs)):
        for position, value in enumerate(values):
            if value is None or value.dtype is None or not formals:
                continue
            formal = formals[min(position, len(formals) - 1)]
            types = allowed.get(formal.type_str)
            if types is not None and f"tensor({value.dtype.name.lower()})" not in types:
                return False
    return True
