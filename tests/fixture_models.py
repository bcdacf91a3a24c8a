"""The committed export fixtures (models/fixtures) as the rewrite tests load, run, compare and mutate them.

Shared by test_rewrite_{tiled,batched_mm,loop,fixtures}.py and test_cli_optimize.py; what only one
export form needs stays in its own test module.
"""

from __future__ import annotations

import functools
import json
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from moe_onnx import TARGETS  # noqa: F401  (the test modules take it from here)
from moe_onnx.ops import REFERENCE_OPS
from moe_onnx.rewrite import optimize
from moe_onnx.testing import random_hidden_states
from moe_onnx.testing import attributes, initializer, moe_node  # noqa: F401 (for the test modules)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from moe_export.fixtures import whole_feeds, whole_logits_match  # noqa: E402, F401 (no torch in there)

FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]
# whole tiny causal LMs (input_ids -> logits), with the fusion state the rewriter is expected to reach
WHOLE_FIXTURES = FIXTURES / "whole"
WHOLE_MANIFEST = json.loads((WHOLE_FIXTURES / "manifest.json").read_text())["fixtures"]
# (batch, seq): one token, a small shape, and one unlike the exports' traced (2, 5) or (2, 8)
SHAPES = [(1, 1), (2, 3), (3, 7)]
TOL = dict(rtol=1e-4, atol=1e-4)


def fixture_names(*styles: str) -> list[str]:
    """The fixtures exported in one of these styles (the manifest's "style"), sorted."""
    return sorted(name for name, entry in MANIFEST.items() if entry["style"] in styles)


# ----------------------------------------------------------------------------- loading

@functools.cache
def original(name: str) -> onnx.ModelProto:
    """The fixture as committed; shared between tests, so never mutate it (see ``mutable_copy``)."""
    return onnx.load(FIXTURES / MANIFEST[name]["file"])


def mutable_copy(name: str) -> onnx.ModelProto:
    """A private copy of the fixture, for a test to mutate."""
    model = onnx.ModelProto()
    model.CopyFrom(original(name))
    return model


@functools.cache
def optimized(name: str, target: str):
    """``optimize(original(name), target=target)``: the optimized model and its report."""
    return optimize(original(name), target=target)


@functools.cache
def optimized_whole(name: str, target: str):
    """``optimize`` of the whole-model fixture ``name``: the optimized model and its report."""
    return optimize(onnx.load(WHOLE_FIXTURES / WHOLE_MANIFEST[name]["file"]), target=target)


def whole_reference_data(name: str) -> dict[str, np.ndarray]:
    """The whole-model fixture's .npz: ``input_ids[_alt]`` and torch's logits ``expected[_alt]``."""
    return dict(np.load(WHOLE_FIXTURES / WHOLE_MANIFEST[name]["reference"]))


@functools.cache
def reference_data(name: str) -> dict[str, np.ndarray]:
    """The fixture's .npz: inputs ``hidden_states[_alt]`` and torch's outputs ``expected[_<output>][_alt]``."""
    return dict(np.load(FIXTURES / MANIFEST[name]["reference"]))


def random_hidden(name: str, batch: int, seq: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Standard normal (times ``scale``) float32 hidden states [batch, seq, H] for fixture ``name``."""
    return random_hidden_states(MANIFEST[name]["hidden_size"], batch, seq, seed, scale)


def random_feeds(name: str, batch: int, seq: int, seed: int = 0, scale: float = 1.0) -> dict[str, np.ndarray]:
    """``random_hidden`` as the fixture's input ``hidden_states``."""
    return {"hidden_states": random_hidden(name, batch, seq, seed, scale)}


# ----------------------------------------------------------------------------- running

def run_ort(model: onnx.ModelProto, feeds: dict, outputs: Sequence[str] | None = None) -> list[np.ndarray]:
    """The outputs (all, or those named) of onnxruntime on the CPU."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # mutated copies keep constants nothing reads: no warnings about them
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None if outputs is None else list(outputs), feeds)


def run_reference(model: onnx.ModelProto, feeds: dict, outputs: Sequence[str] | None = None) -> list[np.ndarray]:
    """The outputs (all, or those named) of onnx's ReferenceEvaluator with the moe_onnx reference ops."""
    return ReferenceEvaluator(model, new_ops=REFERENCE_OPS).run(None if outputs is None else list(outputs), feeds)


def ort_output(model: onnx.ModelProto, feeds: dict, name: str = "output") -> np.ndarray:
    return run_ort(model, feeds, [name])[0]


def reference_output(model: onnx.ModelProto, feeds: dict, name: str = "output") -> np.ndarray:
    return run_reference(model, feeds, [name])[0]


# ----------------------------------------------------------------------------- reading graphs

def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


def nodes(model: onnx.ModelProto, op_type: str,
          where: Callable[[onnx.NodeProto], bool] = lambda n: True) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op_type and where(n)]


def producer(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    """The one node that computes ``name``."""
    (node,) = [n for n in model.graph.node if name in n.output]
    return node


# ----------------------------------------------------------------------------- mutating graphs

def set_input(model: onnx.ModelProto, node: onnx.NodeProto, index: int, array) -> None:
    """Give input ``index`` of ``node`` a new initializer of its own (shared constants stay as they are)."""
    name = f"mutated_{len(model.graph.initializer)}"
    model.graph.initializer.append(numpy_helper.from_array(np.asarray(array), name))
    while len(node.input) <= index:
        node.input.append("")
    node.input[index] = name
