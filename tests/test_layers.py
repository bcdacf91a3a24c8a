"""Layers that import one way: every module of moe_onnx belongs to one layer of CONTRIBUTING.md's
"Layers" table and imports (at module level or inside a function) only modules of its own layer or
of the layers below; ``import moe_onnx`` loads neither the rewriter, onnxscript nor the MPI layer, and
a Python-backend session of one rank never imports ``moe_onnx.distributed``."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moe_onnx"


def layer_table() -> list[tuple[str, list[str]]]:
    """CONTRIBUTING.md's layers, top first: each layer's name and the paths its row names (a path
    ending in ``/`` is a package with everything under it)."""
    guide = (ROOT / "CONTRIBUTING.md").read_text()
    section = re.search(r"^## Layers\n(.*?)(?=^## )", guide, re.M | re.S)
    assert section, 'CONTRIBUTING.md has no "## Layers" section'
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")][2:]  # past header, rule
    table = []
    for row in rows:
        name, paths = (cell.strip() for cell in row.strip("|").split("|")[:2])
        table.append((name, re.findall(r"`(moe_onnx/[^`]*)`", paths)))
    assert table, "CONTRIBUTING.md's Layers section has no table rows"
    return table


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(path: Path, table: list[tuple[str, list[str]]]) -> tuple[int, str] | None:
    """(height, name) of the layer of the file at ``path``: the row whose path names it most closely
    (the bottom layer is 0); None when no row names it."""
    relative = path.relative_to(ROOT).as_posix()
    best = None
    for index, (name, entries) in enumerate(table):
        for entry in entries:
            if relative == entry or (entry.endswith("/") and relative.startswith(entry)):
                if best is None or len(entry) > best[0]:
                    best = (len(entry), (len(table) - 1 - index, name))
    return None if best is None else best[1]


def imported_modules(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) of every moe_onnx module that ``module`` imports, wherever the import statement is;
    ``from package import name`` imports the module ``package.name`` when there is one, else ``package``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            for alias in node.names:
                found.append((node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base))
    return [(line, name) for line, name in found if name == "moe_onnx" or name.startswith("moe_onnx.")]


def test_the_table_names_existing_paths():
    for name, entries in layer_table():
        for entry in entries:
            assert (ROOT / entry).exists(), f"CONTRIBUTING.md's layer {name!r} names {entry}, which does not exist"


def test_every_module_belongs_to_a_layer():
    table = layer_table()
    homeless = [path.relative_to(ROOT).as_posix() for path in MODULES.values() if layer_of(path, table) is None]
    assert not homeless, f"modules in no layer of CONTRIBUTING.md's Layers table: {homeless}"


def test_no_module_imports_a_higher_layer():
    table = layer_table()
    problems = []
    for module, path in MODULES.items():
        layer = layer_of(path, table)
        for line, target in imported_modules(module, path):
            assert target in MODULES, f"{path.relative_to(ROOT)}:{line} imports {target}, which is not a module"
            target_layer = layer_of(MODULES[target], table)
            if layer is not None and target_layer is not None and target_layer[0] > layer[0]:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {module} (layer {layer[1]}) imports {target} "
                                f"(layer {target_layer[1]}, higher)")
    assert not problems, "imports of a higher layer:\n" + "\n".join(problems)


#: what ``import moe_onnx`` must not load: they load when first used
LAZY = ("moe_onnx.distributed", "mpi4py", "onnxscript", "moe_onnx.rewrite")


def _loaded_after(code: str) -> list[str]:
    """The modules of LAZY that are in sys.modules after ``code`` runs in a fresh interpreter."""
    report = f"\nimport json, sys\nprint(json.dumps([m for m in {LAZY!r} if m in sys.modules]))\n"
    done = subprocess.run([sys.executable, "-c", code + report], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
def test_importing_the_package_loads_neither_the_rewriter_nor_the_mpi_layer():
    assert _loaded_after("import moe_onnx") == []


@pytest.mark.subprocess
def test_a_python_session_of_one_rank_does_not_import_the_distributed_layer():
    code = """
import sys
sys.path.insert(0, "tests")
import numpy as np
import moe_onnx
from distributed_models import moe_model, routing_feeds
from moe_onnx.ops.moe import GEMM3_SWIGLU
sess = moe_onnx.session(moe_model(GEMM3_SWIGLU), backend="python")
(y,) = sess.run(None, routing_feeds(5))
assert np.isfinite(y).all() and y.shape == (5, 8), y.shape
"""
    assert [m for m in _loaded_after(code) if m.startswith("moe_onnx.distributed")] == []
