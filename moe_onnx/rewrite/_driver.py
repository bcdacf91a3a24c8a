"""The optimization pass: run every fusion family in a fixed order and report what changed."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.rewriter import MatchingTracer, MatchStatus, RewriteRuleSet
from onnxscript.rewriter._basics import MatchInfo  # pinned onnxscript 0.7 (pyproject)

from .._ir import model_files
from .._ir.inference import declare_runtime_domains, infer_shapes, lower_versions
from .._ir.weights import sliced_as_references
from ..check import read_valid
from ..ops import DOMAIN, OPSET_VERSION
from ..runtime.versions import onnxruntime_versions
from . import (batched_mm, compute as compute_pass, gating, grouped, grouped_query, loop, loop_dynamo, ort_export,
               ort_import, parallel_experts, shared_expert, tiled)
from ._match import MoeFusion
from ._ort_contrib import CONTRIB_OPS, ORT_DOMAIN
from ._unfused import PartialMatch, unfused_blocks
from .portable import add_function_bodies, require_opset, summary
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


def optimize_ir(model: ir.Model, target: str = "moe", progress: Callable[[str], None] | None = None, *,
                fuse_routers: bool = True, portable: bool = False, compute: str = "fp32") -> OptimizeReport:
    """Fuse the MoE blocks of ``model`` in place; returns the report. ``progress`` receives stage messages;
    ``fuse_routers`` also replaces each fused block's router by MoeGatingTopK (gating.py); ``portable``
    adds each moe_onnx node's function body (:func:`moe_onnx.rewrite.portable.add_function_bodies`);
    ``compute`` sets the accuracy_level of our expert nodes (:mod:`moe_onnx.rewrite.compute`)."""
    _check_settings(target, compute)
    say = progress or (lambda message: None)
    if portable:
        require_opset(model)  # before the work, not after it
    nodes_before, parameters_before = _node_counts(model), _parameters(model)
    fused, notes = {}, declare_runtime_domains(model)
    missed: list[tuple[ir.Node | None, dict[str, str]]] = []  # (root node, near-miss)
    say("shape inference")  # static shapes let the rules check weight layouts without loading data
    _infer_shapes(model)
    say("onnxruntime MoE/QMoE nodes")  # first: the passes below see the imported ops
    fused[ort_import.RULE], refused = ort_import.import_ort_nodes(model)
    missed += [(None, miss) for miss in refused]

    say("fusing the MoE blocks")
    block_fused, block_notes, block_missed, partial = _fuse_blocks(model)
    fused.update(block_fused)
    notes += block_notes
    missed += block_missed
    if fuse_routers:
        say("routers")
        fused[gating.RULE], router_notes = gating.fuse_routers(model)
        notes += router_notes
    if target != "ort":  # the contrib MoE has no experts every token takes: the shared MLP stays beside it
        say("folding shared experts")
        fused[shared_expert.RULE_NAME], fold_notes = shared_expert.fold_shared_experts(model)
        notes += fold_notes
    say("attention reading the kv heads unrepeated")
    notes += grouped_query.ungroup_repeated_kv(model)
    fused = {name: count for name, count in fused.items() if count}
    common_passes.RemoveUnusedNodesPass()(model)
    say("looking for MoE blocks left unfused")
    roots = [root for root, _ in missed if root is not None]
    near_misses = [miss for _, miss in missed] + unfused_blocks(model, roots, partial)
    # before the target's passes: the grouped chain and the contrib ops take the level from the MOE nodes
    changed, compute_notes = compute_pass.apply_compute(model, compute)
    notes += compute_notes
    if changed and compute == "fp32":
        notes.append("compute fp32: accuracy_level 3 (bf16 operands) reset to 0 on "
                     + ", ".join(f"{count} {op_type}" for op_type, count in changed.items()))
    if target == "grouped":
        say("expanding MOE nodes into the grouped chain")
        fused.update(grouped.expand_moe_nodes(model))
        notes += [f"QMOE node '{node.name}' stays QMOE: the grouped chain has no quantized linear"
                  for node in model.graph if node.domain == DOMAIN and node.op_type == "QMOE"]
    elif target == "ort":
        say("writing onnxruntime's com.microsoft::MoE")
        exported, refused = ort_export.export_moe_nodes(model)
        fused.update(exported)
        near_misses += refused
        if compute == "bf16":
            notes += ort_export.accuracy_notes(model)
    common_passes.RemoveUnusedNodesPass()(model)
    common_passes.RemoveUnusedFunctionsPass()(model)
    common_passes.RemoveUnusedOpsetsPass()(model)
    if any(node.domain == DOMAIN for node in ir.traversal.RecursiveGraphIterator(model.graph)):
        model.opset_imports[DOMAIN] = OPSET_VERSION
    notes += [note for note in [lower_versions(model, *onnxruntime_versions())] if note]
    if portable:
        say("portable function bodies")
        _infer_shapes(model)  # the element types some bodies depend on
        add_function_bodies(model)
        notes.append(summary(model))
    return OptimizeReport(target, fused, near_misses, notes, nodes_before, _node_counts(model),
                          parameters_before, _parameters(model), compute, compute_pass.bf16_blocks(model))


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


def _fuse_blocks(model: ir.Model) -> tuple[dict[str, int], list[str], list[tuple[ir.Node, dict[str, str]]],
                                          list[PartialMatch]]:
    """Every fusion rule in one rule set, applied once (for each node the rules in :data:`FAMILIES`' order): the
    blocks fused per rule, the rules' notes, and, on the nodes still in the graph, each rule's failed checks (near-
    misses: (root, miss)) and the patterns that did not match all the way (how far they got)."""
    tracer = _NearMissTracer()
    rules = {fusion.as_rule(tracer): fusion for fusion in fusions()}
    RewriteRuleSet(list(rules)).apply_to_model(model)
    live = set(ir.traversal.RecursiveGraphIterator(model.graph))
    fused, notes, missed, partial = {}, [], [], []
    for rule, fusion in rules.items():
        fused[fusion.name] = fusion.fused
        notes += fusion.notes
        for match in tracer.furthest(rule, live):
            reason = match.match_result.reason or "check failed"
            if match.status == MatchStatus.CONDITION_FAILED:
                missed.append((match.root_node, {"rule": fusion.name, "node": match.root_node.name or "",
                                                 "reason": reason}))
            elif match.status == MatchStatus.NO_MATCH:
                partial.append(PartialMatch(fusion.name, match.root_node, tuple(match.match_result.nodes), reason))
    return fused, notes, missed, partial


def _check_settings(target: str, compute: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"optimize: target is {target!r}; expected one of {', '.join(TARGETS)}")
    compute_pass.check_compute(compute)


def _infer_shapes(model: ir.Model) -> None:
    """onnx shape inference, copied onto the IR values that lack a static shape.

    Serializing keeps external tensors as references, so no weight is loaded. Raises
    :class:`moe_onnx._ir.inference.ShapeInferenceError` (one line) when inference fails.
    """
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
            shape = ir.serde.deserialize_type_proto_for_shape(info.type)
            if shape is not None and (value.shape is None or not value.shape.is_static()):
                value.shape = shape


def optimize(model: Any, target: str = "moe", *, fuse_routers: bool = True, portable: bool = False,
             compute: str = "fp32") -> tuple[Any, OptimizeReport]:
    """Fuse the MoE blocks of an exported model into moe_onnx ops.

    ``model`` is a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; the result has the same kind
    and comes with an :class:`OptimizeReport`. A path is read as ``moe-onnx optimize`` reads it
    (:func:`moe_onnx.check.read_valid`) and gives a ModelProto that holds every weight, those of its external data
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
        ir_model = model_files.load(model, read_valid(model))  # weights stay on disk while the rules run
        report = optimize_ir(ir_model, target, **options)
        return model_files.with_data(ir.serde.serialize_model(ir_model), model), report
    ir_model = ir.serde.deserialize_model(model)
    report = optimize_ir(ir_model, target, **options)
    return ir.serde.serialize_model(ir_model), report
