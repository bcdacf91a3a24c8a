"""The optimization: its passes in a fixed order (:func:`optimize_passes`), their results added up in a report."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.rewriter import MatchingTracer, MatchStatus, RewriteRuleSet
from onnxscript.rewriter._basics import MatchInfo  # pinned onnxscript 0.7 (pyproject)

from .._ir import model_files
from .._ir.inference import declare_runtime_domains, infer_shapes, lower_versions
from .._ir.passes import RewritePass, RewriteResult, rewritten
from .._ir.weights import sliced_as_references
from ..check import require_valid
from ..ops import DOMAIN, OPSET_VERSION
from ..runtime.versions import onnxruntime_versions
from . import (batched_mm, compute as compute_pass, gating, grouped, grouped_query, loop, loop_dynamo, ort_export,
               ort_import, parallel_experts, shared_expert, tiled)
from ._match import MoeFusion
from ._ort_contrib import CONTRIB_OPS, ORT_DOMAIN
from ._unfused import PartialMatch, unfused_blocks
from .portable import AddFunctionBodies, require_opset
from .targets import TARGETS


# The export forms, in the order their rules run (a module each, with its list of FUSIONS).
FAMILIES = (tiled, batched_mm, loop, loop_dynamo, parallel_experts)


def fusions() -> list[MoeFusion]:
    """Every fusion rule, in the order they run (a fresh instance each call)."""
    return [cls() for family in FAMILIES for cls in family.FUSIONS]


@dataclasses.dataclass
class OptimizeReport:
    """What an optimization did: fused blocks per rule, near-misses with the check that failed, notes."""

    target: str
    fused: dict[str, int]
    near_misses: list[dict[str, str]]
    notes: list[str]
    nodes_before: dict[str, int]
    nodes_after: dict[str, int]
    parameters_before: int
    parameters_after: int
    compute: str = "fp32"
    bf16_blocks: int = 0  # the expert blocks whose GEMMs may take bfloat16 operands (accuracy_level 3)

    @property
    def total_fused(self) -> int:
        return sum(self.fused.values())

    @property
    def fused_blocks(self) -> int:
        """The MoE blocks of the optimized model: its MOE nodes (target "moe"), MoeFinalizeRouting
        nodes (target "grouped") or contrib MoE/QMoE nodes and the MOE nodes left (target "ort"), and its
        QMOE nodes; total_fused counts rule applications (grouped applies two per block)."""
        ours = self.nodes_after.get(f"{DOMAIN}::QMOE", 0)
        if self.target == "ort":
            contrib = sum(self.nodes_after.get(f"{ORT_DOMAIN}::{op}", 0) for op in CONTRIB_OPS.values())
            return contrib + ours + self.nodes_after.get(f"{DOMAIN}::MOE", 0)
        op_type = "MOE" if self.target == "moe" else "MoeFinalizeRouting"
        return self.nodes_after.get(f"{DOMAIN}::{op_type}", 0) + ours

    @property
    def needs_our_library(self) -> bool:
        """Target "ort" only: some moe_onnx op stays in the model (a block the export refused: its near-miss
        says why; or ops of ours the input had that have no contrib form, e.g. the grouped chain)."""
        return self.target == "ort" and any(key.startswith(f"{DOMAIN}::") for key in self.nodes_after)

    def our_ops_left(self) -> list[str]:
        """The moe_onnx op types in the optimized model."""
        return [key.split("::", 1)[1] for key in self.nodes_after if key.startswith(f"{DOMAIN}::")]

    def summary(self) -> str:
        lines = [f"target: {self.target}"]
        if self.compute != "fp32":
            lines.append(f"compute: {self.compute} ({self.bf16_blocks} block{'s' if self.bf16_blocks != 1 else ''} "
                         "at accuracy_level 3: bfloat16 GEMM operands, float32 accumulation, where the CPU has "
                         "AMX-BF16 or AVX512-BF16)")
        for rule, count in self.fused.items():
            lines.append(f"  {rule}: {count} block{'s' if count != 1 else ''} fused")
        for miss in self.near_misses:
            lines.append(f"  near-miss {miss['rule']} at node '{miss['node']}': {miss['reason']}")
        lines += [f"  note: {note}" for note in self.notes]
        before, after = sum(self.nodes_before.values()), sum(self.nodes_after.values())
        lines.append(f"nodes: {before} -> {after}")
        gone = sorted(op for op in self.nodes_before if op not in self.nodes_after)
        new = sorted(op for op in self.nodes_after if op not in self.nodes_before)
        if gone:
            lines.append(f"  op types removed: {', '.join(gone)}")
        if new:
            lines.append(f"  op types added: {', '.join(new)}")
        lines.append(f"parameters: {self.parameters_before:,} -> {self.parameters_after:,}")
        return "\n".join(lines)


def _node_counts(model: ir.Model) -> dict[str, int]:
    counts = collections.Counter(
        node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        for node in ir.traversal.RecursiveGraphIterator(model.graph))
    return dict(sorted(counts.items()))


def _parameters(model: ir.Model) -> int:
    return sum(v.const_value.size for v in model.graph.initializers.values() if v.const_value is not None)


def optimize_passes(target: str = "moe", *, fuse_routers: bool = True, portable: bool = False,
                    compute: str = "fp32", inferred: onnx.ModelProto | None = None) -> list[RewritePass]:
    """The passes of :func:`optimize_ir`, in the order they run (its arguments' meaning). Raises ValueError for
    an unknown target or compute."""
    _check_settings(target, compute)
    passes = [DeclareRuntimeDomains(), InferShapes(inferred),
              ort_import.ImportOrtNodes(),  # first: the passes below see the imported ops
              FuseBlocks()]
    if fuse_routers:
        passes.append(gating.FuseRouters())
    if target != "ort":  # the contrib MoE has no experts every token takes: the shared MLP stays beside it
        passes.append(shared_expert.FoldSharedExperts())
    passes += [grouped_query.UngroupRepeatedKv(),
               # before the target's passes: the grouped chain and the contrib ops take the level from the MOE nodes
               compute_pass.ApplyCompute(compute)]
    if target == "grouped":
        passes.append(grouped.ExpandToGrouped())
    elif target == "ort":
        passes.append(ort_export.ExportToOrt(compute))
    passes.append(Tidy())
    if portable:
        passes.append(AddFunctionBodies())
    return passes


def optimize_ir(model: ir.Model, target: str = "moe", progress: Callable[[str], None] | None = None, *,
                fuse_routers: bool = True, portable: bool = False, compute: str = "fp32",
                inferred: onnx.ModelProto | None = None) -> OptimizeReport:
    """Fuse the MoE blocks of ``model`` in place (:func:`optimize_passes`); returns the report. ``progress``
    receives stage messages; ``fuse_routers`` also replaces each fused block's router by MoeGatingTopK
    (gating.py); ``portable`` adds each moe_onnx node's function body
    (:func:`moe_onnx.rewrite.portable.add_function_bodies`); ``compute`` sets the accuracy_level of our expert
    nodes (:mod:`moe_onnx.rewrite.compute`); ``inferred`` is the model as the input check's shape inference typed
    it, taken instead of inferring again (:class:`InferShapes`)."""
    passes = optimize_passes(target, fuse_routers=fuse_routers, portable=portable, compute=compute,
                             inferred=inferred)
    say = progress or (lambda message: None)
    if portable:
        require_opset(model)  # before the work, not after it
    nodes_before, parameters_before = _node_counts(model), _parameters(model)
    fused: dict[str, int] = {}
    near_misses: list[dict[str, str]] = []
    notes: list[str] = []
    for graph_pass in passes:
        if graph_pass.stage:
            say(graph_pass.stage)
        result = graph_pass(model)
        fused.update(result.fused)
        near_misses += result.near_misses
        notes += result.notes
    return OptimizeReport(target, fused, near_misses, notes, nodes_before, _node_counts(model),
                          parameters_before, _parameters(model), compute, compute_pass.bf16_blocks(model))


class DeclareRuntimeDomains(RewritePass):
    """Import the domains the model uses that onnxruntime registers (a note each;
    :func:`moe_onnx._ir.inference.declare_runtime_domains`)."""

    def call(self, model: ir.Model) -> RewriteResult:
        notes = declare_runtime_domains(model)
        return rewritten(model, notes=notes, modified=bool(notes))


class InferShapes(RewritePass):
    """onnx shape inference, copied onto the IR values that lack a static shape: the one inference of the
    optimize path (the rules check weight layouts on static shapes without loading data; the passes after it
    type the values they make where a later pass reads the type).

    Serializing keeps external tensors as references, so no weight is loaded. Raises
    :class:`moe_onnx._ir.inference.ShapeInferenceError` (one line) when inference fails. ``inferred``, the model
    as onnx shape inference typed it already (with data propagation: the input check's,
    :func:`moe_onnx.check.require_valid`), is taken instead of inferring again.
    """

    stage = "shape inference"

    def __init__(self, inferred: onnx.ModelProto | None = None) -> None:
        self.inferred = inferred

    def call(self, model: ir.Model) -> RewriteResult:
        inferred = self.inferred
        if inferred is None:
            with sliced_as_references(model):
                proto = ir.serde.serialize_model(model)
            inferred = infer_shapes(proto, data_prop=True)
        known = {info.name: info for info in inferred.graph.value_info}
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            for value in node.outputs:
                info = known.get(value.name)
                if info is None or not info.type.HasField("tensor_type"):
                    continue
                if value.type is None:
                    value.type = ir.serde.deserialize_type_proto_for_type(info.type)
                if value.shape is None or not value.shape.is_static():
                    shape = ir.serde.deserialize_type_proto_for_shape(info.type)
                    if shape is not None:
                        value.shape = shape
        return rewritten(model, modified=True)


class _NearMissTracer(MatchingTracer):
    """Records, per rule and root node, the furthest match that failed (a success is no near-miss). onnxscript
    rewrites nothing when a rule set is applied with a tracer, so each rule logs here itself
    (:meth:`MoeFusion.as_rule`) while its set rewrites: one pass over the graph fuses and traces."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: dict[object, dict[ir.Node, MatchInfo]] = collections.defaultdict(dict)

    def log(self, rule, container, node, match_result, status) -> None:
        if status == MatchStatus.SUCCESS:
            return
        info = MatchInfo(match_result, node, container, status)
        best = self.failures[rule].get(node)
        if info.score() > (0 if best is None else best.score()):
            self.failures[rule][node] = info

    def furthest(self, rule, live: set[ir.Node]) -> list[MatchInfo]:
        """The failed matches of ``rule`` rooted at ``live`` nodes that got furthest (ties kept)."""
        found = [info for node, info in self.failures[rule].items() if node in live]
        top = max((info.score() for info in found), default=0)
        return [info for info in found if info.score() == top]


class FuseBlocks(RewritePass):
    """Every fusion rule in one rule set, applied once (for each node the rules in :data:`FAMILIES`' order): the
    blocks fused per rule, the rules' notes, and as near-misses each rule's failed checks on the nodes still in
    the graph, then every MoE block left unfused (:func:`moe_onnx.rewrite._unfused.unfused_blocks`, told how far
    each pattern got)."""

    stage = "fusing the MoE blocks"

    def call(self, model: ir.Model) -> RewriteResult:
        tracer = _NearMissTracer()
        rules = {fusion.as_rule(tracer): fusion for fusion in fusions()}
        RewriteRuleSet(list(rules)).apply_to_model(model)
        live = set(ir.traversal.RecursiveGraphIterator(model.graph))
        fused, notes, near_misses, roots, partial = {}, [], [], [], []
        for rule, fusion in rules.items():
            fused[fusion.name] = fusion.fused
            notes += fusion.notes
            for match in tracer.furthest(rule, live):
                reason = match.match_result.reason or "check failed"
                if match.status == MatchStatus.CONDITION_FAILED:
                    roots.append(match.root_node)
                    near_misses.append({"rule": fusion.name, "node": match.root_node.name or "", "reason": reason})
                elif match.status == MatchStatus.NO_MATCH:
                    partial.append(PartialMatch(fusion.name, match.root_node, tuple(match.match_result.nodes),
                                                reason))
        common_passes.RemoveUnusedNodesPass()(model)  # what the fused blocks no longer read
        near_misses += unfused_blocks(model, roots, partial)
        return rewritten(model, fused, near_misses=near_misses, notes=notes)


class Tidy(RewritePass):
    """Drop the nodes, functions and opset imports nothing uses, import our domain where our ops are, and
    write the model with the versions the installed onnxruntime loads where it means the same (a note)."""

    def call(self, model: ir.Model) -> RewriteResult:
        common_passes.RemoveUnusedNodesPass()(model)
        common_passes.RemoveUnusedFunctionsPass()(model)
        common_passes.RemoveUnusedOpsetsPass()(model)
        if any(node.domain == DOMAIN for node in ir.traversal.RecursiveGraphIterator(model.graph)):
            model.opset_imports[DOMAIN] = OPSET_VERSION
        note = lower_versions(model, *onnxruntime_versions())
        return rewritten(model, notes=[note] if note else [], modified=True)


def _check_settings(target: str, compute: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"optimize: target is {target!r}; expected one of {', '.join(TARGETS)}")
    compute_pass.check_compute(compute)


def optimize(model: Any, target: str = "moe", *, fuse_routers: bool = True, portable: bool = False,
             compute: str = "fp32") -> tuple[Any, OptimizeReport]:
    """Fuse the MoE blocks of an exported model into moe_onnx ops.

    ``model`` is a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; the result has the same kind
    and comes with an :class:`OptimizeReport`. A path is read as ``moe-onnx optimize`` reads it
    (:func:`moe_onnx.check.require_valid`) and gives a ModelProto that holds every weight, those of its external data
    included (:func:`moe_onnx._ir.model_files.with_data`), so it saves anywhere; a ModelProto or ``onnx_ir.Model``
    keeps its tensors as they were, external ones included. ``target="moe"`` makes one
    MOE node per block; ``"grouped"`` makes MoeInitRouting -> MoeRowParallelLinear -> activation ->
    MoeRowParallelLinear -> MoeFinalizeRouting; ``"ort"`` onnxruntime's com.microsoft::MoE/QMoE where they
    express the block (ort_export.py; shared experts are not folded). ``fuse_routers`` (default) makes each block's
    router one MoeGatingTopK where its chain is a known one (the report notes the others). ``portable`` also
    writes each moe_onnx node's function body into the model (moe_onnx/rewrite/portable.py). ``compute="bf16"``
    sets accuracy_level 3 on the result's expert nodes (moe_onnx/rewrite/compute.py).

    Read as onnxruntime reads it: a domain onnxruntime registers (com.microsoft, ...) that the model uses without
    importing it is imported at the version onnxruntime assumes, and an IR version or opset newer than the
    installed onnxruntime loads is lowered where the model means the same with it (a note in the report for
    each; :mod:`moe_onnx._ir.inference`). Raises ValueError for an unknown target or compute, or for ``portable``
    on a model whose default opset is below 18; :class:`moe_onnx._ir.model_files.ModelFileError` (a ValueError)
    for a path the command line refuses, with its message; and :class:`moe_onnx._ir.inference.ShapeInferenceError`
    (a ValueError, one line) for a ModelProto or ``onnx_ir.Model`` onnx shape inference rejects.
    """
    options = dict(fuse_routers=fuse_routers, portable=portable, compute=compute)
    if isinstance(model, ir.Model):
        return model, optimize_ir(model, target, **options)
    if isinstance(model, (str, os.PathLike)):
        _check_settings(target, compute)  # before reading the file
        proto = model_files.read_proto(model)
        inferred = require_valid(model, proto)
        ir_model = model_files.load(model, proto)  # weights stay on disk while the rules run
        report = optimize_ir(ir_model, target, inferred=inferred, **options)
        return model_files.with_data(ir.serde.serialize_model(ir_model), model), report
    ir_model = ir.serde.deserialize_model(model)
    report = optimize_ir(ir_model, target, **options)
    return ir.serde.serialize_model(ir_model), report
