"""The router: where a fused MOE's routing inputs come from, checked once for every export form.

MOE takes the router's result, not the router: per token, k expert indices (distinct, in [0, E))
and the k weights the experts' outputs are multiplied by. The router itself stays in the graph, so
any weights chain is valid (the forms fuse softmax -> TopK, TopK -> softmax, and softmax -> TopK
-> ReduceSum/Div renormalization alike: MOE multiplies by whatever tensor the block multiplied by).
What must hold is that the indices are a top-k selection over the E experts, k per token. Every
form hands :func:`route` the indices and weights it found at the block boundary:

- batched_mm: the TopK indices and the weights the slots are multiplied by, directly;
- tiled: the ``ScatterElements(zeros [T, E], indices, weights, axis=1)`` dense matrix (:func:`dense_route`);
- loop: the ``Transpose(OneHot(indices, E, [0, 1]), [2, 1, 0])`` expert mask (:func:`one_hot_route`),
  with the dense matrix above where the branches read their weights from it (:func:`one_hot_dense_route`);
  the dynamo exporter writes the one-hot as ``Cast(Equal(Unsqueeze(indices, -1), arange(E)))``.

A new router (sigmoid scores with a selection bias, group-limited top-k) produces its indices
differently: it is one more entry of ``_INDEX_SOURCES`` (as PhiMoE's sparsemixer, successive ArgMaxes
each over the scores with the earlier picks masked out, is), a function that checks the
indices' producer and returns E and k (raising MatchFailure with the reason otherwise).

Abbreviations: T tokens, E experts, k experts per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import onnx_ir as ir

from .._ir.nodes import standard
from ._match import constant, constant_ints, fill_value, is_zeros, require, shape_dims


@dataclasses.dataclass(frozen=True)
class Route:
    """A fused MOE's routing inputs: ``indices`` [T, k] and ``weights`` [T, k], with E and k."""

    indices: ir.Value
    weights: ir.Value
    experts: int
    k: int


def _top_k(indices: ir.Value) -> tuple[int, int]:
    """(E, k) when ``indices`` are the indices output of a TopK along the last axis of [T, E] scores."""
    topk = indices.producer()
    require(indices.index() == 1, "the expert indices are not the indices output of a TopK")
    scores = topk.inputs[0]
    shape = scores.shape
    experts = None if shape is None or len(shape) != 2 else shape[1]
    axis = topk.attributes.get_int("axis", -1)
    require(isinstance(experts, int) and axis in (-1, 1),
            f"TopK over axis {axis} of router scores of shape {shape}; expected the last axis of [T, E] "
            "with a static E")
    k = constant_ints(topk.inputs[1])
    require(k is not None and len(k) == 1, "TopK k is not a constant")
    return experts, k[0]


def _successive_argmax(indices: ir.Value) -> tuple[int, int]:
    """(E, k) when ``indices = Concat(ArgMax(s), ArgMax(ScatterElements(s, pick 0, -inf)), ...)`` over [T, E]
    scores s, each pick masking the previous one out of the scores it chose from (PhiMoE's sparsemixer):
    k distinct experts per token, one per pick."""
    concat = indices.producer()
    require(concat.attributes.get_int("axis", 0) in (-1, 1),
            "the expert indices are a Concat that is not along the slots (sparsemixer: axis -1)")
    chosen_from = None
    for j, pick in enumerate(concat.inputs):
        argmax = pick.producer()
        require(standard(argmax, "ArgMax") and argmax.attributes.get_int("axis", 0) in (-1, 1)
                and argmax.attributes.get_int("keepdims", 1) == 1,
                f"the expert indices are a Concat whose input {j} is not an ArgMax over the experts (keepdims)")
        scores = argmax.inputs[0]
        if j:
            masked = scores.producer()
            require(standard(masked, "ScatterElements") and masked.attributes.get_int("axis", 0) in (-1, 1)
                    and masked.attributes.get_string("reduction", "none") == "none"
                    and masked.inputs[0] is chosen_from and masked.inputs[1] is concat.inputs[j - 1]
                    and fill_value(masked.inputs[2]) == float("-inf"),
                    f"sparsemixer pick {j} does not choose among the scores with pick {j - 1} set to -inf "
                    "(ScatterElements(scores, previous pick, -inf)): two picks could name the same expert")
        chosen_from = scores
    shape = concat.inputs[0].producer().inputs[0].shape
    experts = None if shape is None or len(shape) != 2 else shape[1]
    require(isinstance(experts, int), f"the sparsemixer scores have shape {shape}; expected [T, E] with a static E")
    return experts, len(concat.inputs)


# op type of the indices' producer -> (E, k) of that router; one entry per kind of router
_INDEX_SOURCES: dict[str, Callable[[ir.Value], tuple[int, int]]] = {"TopK": _top_k, "Concat": _successive_argmax}


def route(indices: ir.Value, weights: ir.Value) -> Route:
    """Checks that ``indices`` come from a known router and ``weights`` are [T, k] alike."""
    node = indices.producer()
    source = _INDEX_SOURCES.get(node.op_type) if node is not None and node.domain in ("", "ai.onnx") else None
    require(source is not None, "the expert indices are not the indices output of a TopK")
    experts, k = source(indices)
    shape = weights.shape
    require(shape is not None and len(shape) >= 1 and shape[-1] == k,
            f"the routing weights have shape {shape}; expected [T, k={k}] (k from TopK)")
    return Route(indices, weights, experts, k)


def dense_route(dense_TE: ir.Value) -> Route:
    """The route that ``dense_TE = ScatterElements(zeros [T, E], indices, weights, axis=1)`` spreads out."""
    scatter = dense_TE.producer()
    require(standard(scatter, "ScatterElements"), "the dense routing weights are not a ScatterElements output")
    axis = scatter.attributes.get_int("axis", 0)
    require(axis in (1, -1), f"ScatterElements axis {axis}; expected 1 (experts)")
    reduction = scatter.attributes.get_string("reduction", "none")
    require(reduction == "none", f"ScatterElements reduction {reduction}; expected none")
    require(is_zeros(scatter.inputs[0]), "ScatterElements does not write into zeros")
    # the scatter keeps each of the distinct top-k indices, as MOE sums each
    found = route(scatter.inputs[1], scatter.inputs[2])
    shape = dense_TE.shape
    require(shape is not None and len(shape) == 2 and shape[1] == found.experts,
            f"dense routing weights of shape {shape}; expected [T, {found.experts}]")
    return found


def _one_hot(one_hot_TKE: ir.Value) -> tuple[ir.Value, int]:
    """``(indices, depth)`` of ``OneHot(indices, depth, [0, 1])`` or ``Cast(Equal(Unsqueeze(indices, -1),
    arange(depth)))`` (the dynamo exporter's one_hot)."""
    node = one_hot_TKE.producer()
    if standard(node, "Cast"):
        equal = node.inputs[0].producer()
        require(standard(equal, "Equal"), "the expert mask is neither OneHot nor Cast(Equal(indices, arange(E)))")
        unsqueezed, arange = equal.inputs
        steps = constant_ints(arange)
        require(steps is not None and steps == list(range(len(steps))),
                "the expert mask compares the indices with something other than arange(E)")
        unsqueeze = unsqueezed.producer()
        axes = None if not standard(unsqueeze, "Unsqueeze") else constant_ints(unsqueeze.inputs[1])
        require(axes in ([-1], [2]), "the expert mask does not compare Unsqueeze(indices, -1) with arange(E)")
        return unsqueeze.inputs[0], len(steps)
    require(standard(node, "OneHot"), "the expert mask is not OneHot permuted [2, 1, 0] or [2, 0, 1]")
    require(node.attributes.get_int("axis", -1) in (-1, 2), "the expert mask OneHot axis is not the last")
    values = constant(node.inputs[2])
    require(values is not None and values.reshape(-1).tolist() == [0, 1],
            "the expert mask OneHot values are not [0, 1]")
    depth = shape_dims(node.inputs[1])
    require(depth is not None and len(depth) == 1 and isinstance(depth[0], int),
            "the expert mask OneHot depth is not a constant")
    return node.inputs[0], depth[0]


def _expert_mask(mask: ir.Value) -> tuple[ir.Value, int]:
    """``(indices, depth)`` of ``mask = Transpose(one_hot(indices [T, k], depth), perm)`` with the experts
    first: perm [2, 1, 0] ([E, k, T], most loops) or [2, 0, 1] ([E, T, k], DeepSeek-V3's)."""
    transpose = mask.producer()
    require(standard(transpose, "Transpose")
            and list(transpose.attributes.get_ints("perm", [])) in ([2, 1, 0], [2, 0, 1]),
            "the expert mask is not OneHot permuted [2, 1, 0] or [2, 0, 1]")
    return _one_hot(transpose.inputs[0])


def _check_depth(depth: int, found: Route, widths: tuple[int, ...]) -> None:
    require(depth in widths, f"the expert mask OneHot depth {depth} differs from the router's width {found.experts}"
            + ("" if len(widths) == 1 else f" (or {widths[1]}, with GPT-OSS's masking class)"))


def one_hot_route(mask: ir.Value, weights: ir.Value) -> Route:
    """The route of the expert mask ``mask`` (see :func:`_expert_mask`) and the top-k ``weights``."""
    indices, depth = _expert_mask(mask)
    found = route(indices, weights)
    _check_depth(depth, found, (found.experts,))
    return found


def one_hot_dense_route(mask: ir.Value, dense_TE: ir.Value) -> Route:
    """The route of the expert mask ``mask`` (see :func:`_expert_mask`) when the block reads its weights from
    the dense [T, E] matrix ``dense_TE`` (:func:`dense_route`), scattered from the indices the mask encodes.
    GPT-OSS's mask has E + 1 rows ("masking is also a class"); no top-k index reaches the last."""
    indices, depth = _expert_mask(mask)
    found = dense_route(dense_TE)
    require(indices is found.indices, "the expert mask does not encode the indices of the dense routing weights")
    _check_depth(depth, found, (found.experts, found.experts + 1))
    return found
