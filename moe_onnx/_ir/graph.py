"""Walking an ONNX graph together with its subgraphs (If branches, Loop and Scan bodies)."""

from __future__ import annotations

from collections.abc import Iterator

import onnx

Scope = tuple[onnx.GraphProto, ...]  # the graphs a node sees, outermost first, its own graph last


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs held by ``node``'s attributes, in attribute order."""
    found = []
    for attr in node.attribute:
        if attr.HasField("g"):
            found.append(attr.g)
        found.extend(attr.graphs)
    return found


def walk(graph: onnx.GraphProto, parents: Scope = ()) -> Iterator[tuple[onnx.NodeProto, Scope]]:
    """Every node of ``graph`` and of its subgraphs, depth first (a node before its subgraphs'
    nodes), with the chain of graphs it is visible from."""
    scope = parents + (graph,)
    for node in graph.node:
        yield node, scope
        for sub in subgraphs(node):
            yield from walk(sub, scope)


def graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph in it, an outer graph before the graphs it holds."""
    yield graph
    for node, _ in walk(graph):
        yield from subgraphs(node)
