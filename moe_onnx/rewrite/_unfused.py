"""Finding the MoE blocks that no fusion took: no MoE-shaped subgraph may stay unfused silently.

A MoE block is recognised by its router, whatever form its experts take: a linear layer with a
constant [H, E] (or [E, H]) weight whose scores (through elementwise ops, Softmax, Sigmoid, masking)
reach an expert selection over their last axis, E: a ``TopK`` with k < E or an ``ArgMax`` (PhiMoE's
sparsemixer), and whose input tokens feed more than the router (the experts read them too; a
sampling TopK over an LM head's logits is no router). The selections of one router linear are one
block.

Every node of the main graph is *owned* by the latest selection it depends on (the graph is
topologically ordered and layers are sequential, so that is the selection of its own block). A block
is accounted for when it owns a fused MoE node or a near-miss the rules reported, or when its scores
reach a moe_onnx node (a router fused into MoeGatingTopK); any other block is reported as a near-miss
of :data:`RULE` at its first selection node, with the most specific reason known: the check of the
onnxscript pattern that got furthest into the block, or the export form its nodes resemble.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import onnx_ir as ir

from .._ir.nodes import standard
from .._ir.weights import weight
from ..ops import DOMAIN
from ._match import constant_ints

RULE = "UnfusedMoe"

# a pattern that matched fewer nodes than this into a block did not come close enough to name it
_CLOSE_MATCH_NODES = 3
# how far back from a selection its router linear may be (Softmax, Sigmoid, bias Add, masking, Casts)
_ROUTER_DEPTH = 8


def _expert_weight_gather(node: ir.Node, experts: int) -> bool:
    """A GatherND of a constant [E, ...] tensor: one expert's weights per slot."""
    w = weight(node.inputs[0]) if standard(node, "GatherND") else None
    return w is not None and len(w.shape) >= 2 and w.shape[0] == experts


def _sort(node: ir.Node, experts: int) -> bool:
    """A TopK over a 1-D tensor: a sort (of the slots by expert)."""
    scores = node.inputs[0] if standard(node, "TopK") else None
    return scores is not None and scores.shape is not None and len(scores.shape) == 1


# what a block's nodes resemble: (a test of one node given E, the description); the first that fits
_RESEMBLANCES = (
    (lambda node, experts: standard(node, "NonZero"),
     "a per-expert loop (an expert mask, NonZero of each expert's row)"),
    (lambda node, experts: standard(node, "Tile"), "the tiled form (the tokens tiled over all experts)"),
    (_expert_weight_gather, "the batched_mm form (a GatherND of each slot's expert weights)"),
    (_sort, "sorted expert chunks (the slots sorted by expert, each chunk through its expert)"),
)


@dataclasses.dataclass(frozen=True)
class PartialMatch:
    """A rule's pattern that matched ``nodes`` from ``root`` and then failed with ``reason``."""

    rule: str
    root: ir.Node
    nodes: tuple[ir.Node, ...]
    reason: str


@dataclasses.dataclass
class _Router:
    """One MoE block: its router linear, the selections over its E experts and what the block owns."""

    linear: ir.Node
    experts: int
    selections: list[ir.Node]
    fused: bool = False
    reported: bool = False


def _last_axis_width(node: ir.Node) -> int | None:
    """E when ``node`` selects over the static last axis of [T, E] scores (TopK k < E, or ArgMax)."""
    scores = node.inputs[0]
    shape = scores.shape if scores is not None else None
    if shape is None or len(shape) != 2 or not isinstance(shape[1], int):
        return None
    axis = node.attributes.get_int("axis", -1 if node.op_type == "TopK" else 0)
    if axis not in (-1, 1):
        return None
    if node.op_type == "TopK":
        k = constant_ints(node.inputs[1])
        if k is None or len(k) != 1 or not 0 < k[0] < shape[1]:
            return None
    return shape[1]


def _router_linear(scores: ir.Value, experts: int) -> ir.Node | None:
    """The MatMul/Gemm with a constant weight that has an E dimension, at most a few ops before ``scores``."""
    frontier, seen = [scores], set()
    for _ in range(_ROUTER_DEPTH):
        producers = []
        for value in frontier:
            node = value.producer() if value is not None else None
            if node is None or node in seen:
                continue
            seen.add(node)
            if (standard(node, "MatMul") or standard(node, "Gemm")) and len(node.inputs) > 1:
                w = weight(node.inputs[1])
                if w is not None and len(w.shape) == 2 and experts in w.shape:
                    width = w.shape[1] if w.shape[0] == experts else w.shape[0]
                    return node if _shared_input(node.inputs[0], narrow=experts < width) else None
            producers.append(node)
        frontier = [value for node in producers for value in node.inputs]
    return None


def _shared_input(tokens: ir.Value, narrow: bool) -> bool:
    """Whether ``tokens``, or what they are reshaped from, feed more than one node; for a ``narrow``
    router (E below the token width: never an LM head) also what they are computed from by a chain
    of single-use ops (a router with its own normalization: Gemma 4)."""
    while len(tokens.consumers()) == 1 and (node := tokens.producer()) is not None \
            and node.op_type in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast"):
        tokens = node.inputs[0]
    for _ in range(_ROUTER_DEPTH if narrow else 0):
        node = tokens.producer()
        if len(tokens.consumers()) > 1 or node is None or node.domain not in ("", "ai.onnx"):
            break
        computed = [value for value in node.inputs if value is not None and value.const_value is None]
        if not computed:
            break
        tokens = computed[0]
    return len(tokens.consumers()) > 1


def _routers(graph: ir.Graph) -> tuple[list[_Router], dict[ir.Node, _Router]]:
    """The main graph's routers, and the router of each selection node."""
    by_linear: dict[ir.Node, _Router] = {}
    of_selection: dict[ir.Node, _Router] = {}
    for node in graph:
        if not (standard(node, "TopK") or standard(node, "ArgMax")):
            continue
        experts = _last_axis_width(node)
        linear = None if experts is None else _router_linear(node.inputs[0], experts)
        if linear is None:
            continue
        router = by_linear.setdefault(linear, _Router(linear, experts, []))
        router.selections.append(node)
        of_selection[node] = router
    return list(by_linear.values()), of_selection


def _owners(graph: ir.Graph, of_selection: dict[ir.Node, _Router]) -> dict[ir.Node, _Router]:
    """The router of the latest selection each node depends on (nodes that depend on none are left out)."""
    position = {node: i for i, node in enumerate(graph)}
    latest: dict[ir.Value, ir.Node] = {}  # value -> the latest selection it depends on
    owner: dict[ir.Node, _Router] = {}
    for node in graph:
        found = [latest[v] for v in node.inputs if v is not None and v in latest]
        selection = max(found, key=position.__getitem__) if found else None
        if selection is not None:
            owner[node] = of_selection[selection]
        if node in of_selection:
            selection = node
        if selection is not None:
            for value in node.outputs:
                latest[value] = selection
    return owner


def _scores_reach_a_moe_onnx_node(linear: ir.Node) -> bool:
    """Whether the router's scores reach a moe_onnx node within a few ops (a fused router: MoeGatingTopK
    takes them, while the exporter's own selection may stay alive for another output)."""
    frontier = list(linear.outputs)
    for _ in range(_ROUTER_DEPTH):
        consumers = [node for value in frontier for node in value.consumers()]
        if any(node.domain == DOMAIN for node in consumers):
            return True
        frontier = [value for node in consumers for value in node.outputs]
    return False


def _resemblance(nodes: Sequence[ir.Node], experts: int) -> str | None:
    return next((what for fits, what in _RESEMBLANCES if any(fits(node, experts) for node in nodes)), None)


def _reason(router: _Router, owner: dict[ir.Node, _Router], partial: Sequence[PartialMatch]) -> str:
    selection = router.selections[0]
    what = (f"the router '{router.linear.name}' selects among {router.experts} experts "
            f"({', '.join(f'{node.op_type} {node.name!r}' for node in router.selections)}) and nothing was fused")
    inside = [match for match in partial if len(match.nodes) >= _CLOSE_MATCH_NODES
              and any(owner.get(node) is router for node in match.nodes)]
    closest = max(inside, key=lambda match: len(match.nodes), default=None)
    if closest is not None:
        return (f"{what}; closest rule {closest.rule} matched {len(closest.nodes)} nodes from "
                f"'{closest.root.name}', then: {closest.reason}")
    block = [node for node, of in owner.items() if of is router]
    resembles = _resemblance(block, router.experts)
    form = f"its experts look like {resembles}, but " if resembles else ""
    return f"{what}; {form}no fusion rule recognises the experts that {selection.op_type} '{selection.name}' feeds"


def unfused_blocks(model: ir.Model, missed_roots: Iterable[ir.Node],
                   partial: Sequence[PartialMatch]) -> list[dict[str, str]]:
    """Near-misses for the MoE blocks of ``model`` that neither fused nor got a near-miss of their own.

    ``missed_roots`` are the root nodes of the rules' near-misses; ``partial`` the furthest pattern
    matches that did not match (from the tracer).
    """
    graph = model.graph
    routers, of_selection = _routers(graph)
    if not routers:
        return []
    owner = _owners(graph, of_selection)
    reported = set(missed_roots)
    for node, router in owner.items():
        if node.domain == DOMAIN:
            router.fused = True
        elif node in reported:
            router.reported = True
    for router in routers:
        router.fused = router.fused or _scores_reach_a_moe_onnx_node(router.linear)
    return [{"rule": RULE, "node": router.selections[0].name or "", "reason": _reason(router, owner, partial)}
            for router in routers if not (router.fused or router.reported)]
