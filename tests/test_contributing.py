"""CONTRIBUTING.md stays true: the paths it names exist, and every op and export form has each piece
its checklists list."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_onnx.ops import OPS
from moe_onnx.rewrite import _driver

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "CONTRIBUTING.md").read_text()
CMAKE = (ROOT / "custom_ops" / "CMakeLists.txt").read_text()
REGISTRATION = (ROOT / "custom_ops" / "src" / "host" / "ops_library.cc").read_text()
README = (ROOT / "README.md").read_text()


def _module(op_name: str) -> str:
    """The module name the op's files share (``moe``, ``init_routing``, ...)."""
    return OPS[op_name].reference.__module__.rsplit(".", 1)[1]


def test_named_paths_exist():
    paths = {p for p in re.findall(r"`((?:moe_onnx|custom_ops|tests|docs|models|benchmarks)/[^`<>* ]+)`", GUIDE)}
    assert paths, "CONTRIBUTING.md names no paths"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"CONTRIBUTING.md names paths that do not exist: {missing}"


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_each_piece(name):
    module = _module(name)
    assert (ROOT / "moe_onnx" / "ops" / f"{module}.py").is_file()
    assert (ROOT / "docs" / "ops" / f"{name}.md").is_file()
    assert f"`{name}`" in README, f"README's op table lacks {name}"
    table = (ROOT / "tests" / "cases" / f"{module}.py").read_text()
    assert re.search(rf'^OP = "{name}"', table, re.M), f"tests/cases/{module}.py is not {name}'s case table"
    for suffix in (".h", ".cc"):
        assert (ROOT / "custom_ops" / "src" / "ops" / f"{module}{suffix}").is_file()
    assert f"src/ops/{module}.cc" in CMAKE, f"ops/{module}.cc is not in custom_ops/CMakeLists.txt"
    assert f'#include "{module}.h"' in REGISTRATION, \
        f"custom_ops/src/host/ops_library.cc does not include {module}.h"
    assert (OPS[name].body is not None) != bool(OPS[name].no_body), \
        f"moe_onnx/ops/{module}.py gives {name} no function body (body=) nor a reason why not (no_body=)"


def test_every_export_form_has_each_piece():
    forms = [family.__name__.rsplit(".", 1)[1] for family in _driver.FAMILIES]
    modules = {p.stem for p in (ROOT / "moe_onnx" / "rewrite").glob("*.py") if not p.stem.startswith("_")}
    passes_over_fused_graph = {"compute", "gating", "grouped", "grouped_query", "ort_export", "portable",
                               "quantize", "shared_expert"}
    passes_before_the_fusions = {"ort_import"}  # onnxruntime's MoE/QMoE nodes into ours
    not_passes = {"targets"}  # the names of the targets, read without importing the rewriter
    assert modules - passes_over_fused_graph - passes_before_the_fusions - not_passes == set(forms), \
        "every export-form module runs in the driver"
    assert all((ROOT / "tests" / f"test_{name}.py").is_file() for name in passes_before_the_fusions)
    for form in forms:
        assert (ROOT / "tests" / f"test_rewrite_{form}.py").is_file(), f"no tests/test_rewrite_{form}.py"
