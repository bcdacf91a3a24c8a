"""The C++ layers include one way: every file of custom_ops/src lies in the folder of one layer of
CONTRIBUTING.md's "The C++ layers" table and includes only headers of its own layer or of the layers its row
lists; custom_ops/CMakeLists.txt builds each folder as an object library that uses exactly those layers (so
the build refuses what this test reports) and compiles every source file there is."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "custom_ops" / "src"
CMAKE = (ROOT / "custom_ops" / "CMakeLists.txt").read_text()
#: headers the build writes from moe_onnx/ops/signatures.py into the core layer's include path
GENERATED = {"op_signatures.h": "core", "op_choices.h": "core"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_table() -> dict[str, set[str]]:
    """CONTRIBUTING.md's C++ layers: each layer's folder name and the layers it may include."""
    guide = (ROOT / "CONTRIBUTING.md").read_text()
    section = re.search(r"^## The C\+\+ layers\n(.*?)(?=^## )", guide, re.M | re.S)
    assert section, 'CONTRIBUTING.md has no "## The C++ layers" section'
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")][2:]  # past header, rule
    table = {}
    for row in rows:
        name, folder, uses = (cell.strip() for cell in row.strip("|").split("|")[:3])
        assert folder == f"`custom_ops/src/{name}/`", f"the C++ layer {name!r}'s folder is {folder}"
        table[name] = {used.strip() for used in uses.split(",") if used.strip()}
    assert table, "CONTRIBUTING.md's C++ layers section has no table rows"
    return table


def layer_of(path: Path) -> str:
    return path.relative_to(SRC).parts[0]


def sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*") if p.suffix in (".h", ".cc"))


def resolve(path: Path, include: str, table: dict[str, set[str]]) -> str | None:
    """The layer of the file ``#include "include"`` in ``path`` names (its own folder first, as the
    compiler looks, then each layer's folder), None when it names no file of src/ or the build."""
    if (path.parent / include).is_file():
        return layer_of(path.parent / include)
    found = [name for name in table if (SRC / name / include).is_file()]
    assert len(found) <= 1, f"{include} is a file of several layers: {found}"
    return found[0] if found else GENERATED.get(include)


def test_the_table_is_the_folders_and_closed():
    table = layer_table()
    assert sorted(table) == sorted(p.name for p in SRC.iterdir() if p.is_dir()), \
        "the C++ layers table and the folders of custom_ops/src differ"
    for name, uses in table.items():
        assert uses <= set(table) - {name}, f"the C++ layer {name!r} may include unknown layers: {uses}"
        for used in uses:  # each object library links its layers' include paths, not theirs: list them all
            assert table[used] <= uses, f"{name!r} uses {used!r}, which uses {table[used] - uses} that {name!r} lacks"


def test_every_file_lies_in_a_layer():
    homeless = [p.relative_to(ROOT).as_posix() for p in sources() if len(p.relative_to(SRC).parts) < 2]
    assert not homeless, f"files of custom_ops/src in no layer's folder: {homeless}"


def test_no_file_includes_a_layer_it_may_not():
    table = layer_table()
    problems = []
    for path in sources():
        layer = layer_of(path)
        text = path.read_text()
        for match in INCLUDE.finditer(text):
            include, line = match.group(1), text.count("\n", 0, match.start()) + 1
            where = f"{path.relative_to(ROOT)}:{line}"
            target = resolve(path, include, table)
            if target is None:
                problems.append(f'{where}: #include "{include}" names no file of custom_ops/src')
            elif target != layer and target not in table[layer]:
                problems.append(f'{where}: #include "{include}" (layer {target}) from layer {layer}, '
                                f"which may include only {sorted(table[layer]) or 'its own files'}")
    assert not problems, "includes against the C++ layers:\n" + "\n".join(problems)


def test_the_build_uses_the_tables_layers():
    table = layer_table()
    built = {m.group(1): set((m.group(2) or "").split()) for m in
             re.finditer(r"moe_onnx_layer\((\w+)(?: USES ([\w ]+?))? SOURCES", CMAKE)}
    assert set(built) == set(table), f"CMake's layer libraries {sorted(built)} are not the table's"
    for name, uses in built.items():
        assert uses == table[name], f"CMake's layer_{name} uses {sorted(uses)}, CONTRIBUTING.md {sorted(table[name])}"


def test_the_build_compiles_every_source_file():
    missing = [p.relative_to(ROOT / "custom_ops").as_posix() for p in sources()
               if p.suffix == ".cc" and p.relative_to(ROOT / "custom_ops").as_posix() not in CMAKE]
    assert not missing, f"source files custom_ops/CMakeLists.txt does not build: {missing}"
