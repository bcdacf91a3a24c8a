"""The one protocol of the passes over a model: onnx_ir's in-place pass (``ir.passes.InPlacePass``), whose
result, a :class:`RewriteResult` (an ``ir.passes.PassResult``), also says what the pass rewrote per rule,
where a rule came close and did not apply (near-misses, with the reason) and what the report should note.
``optimize`` is a list of such passes (``moe_onnx.rewrite._driver.optimize_passes``); a report adds their
results up in order.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Mapping

import onnx_ir as ir

__all__ = ["RewritePass", "RewriteResult", "rewritten"]


@dataclasses.dataclass
class RewriteResult(ir.passes.PassResult):
    """What a pass did: onnx_ir's ``model`` and ``modified``; the nodes (or blocks) it rewrote per rule, none
    at 0; near-misses (``{"rule", "node", "reason"}``); notes for the report."""

    fused: dict[str, int] = dataclasses.field(default_factory=dict)
    near_misses: list[dict[str, str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def rewritten(model: ir.Model, fused: Mapping[str, int] | None = None, *, near_misses: Iterable[dict[str, str]] = (),
              notes: Iterable[str] = (), modified: bool | None = None) -> RewriteResult:
    """A pass's result; ``modified`` (None: some rule rewrote something) as onnx_ir's passes report it."""
    counts = {rule: count for rule, count in (fused or {}).items() if count}
    return RewriteResult(model, bool(counts) if modified is None else modified, counts, list(near_misses),
                         list(notes))


class RewritePass(ir.passes.InPlacePass):
    """A pass that changes its model in place and returns a :class:`RewriteResult`; ``stage`` is what the
    progress messages say while it runs ("": nothing)."""

    stage = ""

    @abc.abstractmethod
    def call(self, model: ir.Model) -> RewriteResult:
        ...
