"""Each op's doc page agrees with its schema: inputs, outputs, attributes and types; the README's set-up
is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from onnx import defs

from moe_onnx.ops import DOMAIN, OPS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "ops"
TYPE_NAMES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
              "tensor(int8)": "int8", "tensor(int32)": "int32", "tensor(int64)": "int64", "tensor(uint8)": "uint8"}
SECTIONS = ("Short description", "Detailed description", "Pseudocode", "Inputs", "Outputs", "Attributes",
            "Types", "Errors", "Departures from the seed")


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"missing section '## {title}'"
    return match.group(1)


def _params(section: str) -> list[tuple[int, str, str, bool]]:
    found = re.findall(r"^- \*\*(\d+)\*\* `(\w+)` \(`([^`]+)`(, optional)?\)", section, re.M)
    return [(int(i), name, type_str, bool(opt)) for i, name, type_str, opt in found]


@pytest.mark.parametrize("name", sorted(OPS))
def test_doc_page_matches_schema(name):
    op = OPS[name]
    text = (DOCS / f"{name}.md").read_text()
    assert text.startswith(f"# {name}\n")
    for title in SECTIONS:
        _section(text, title)

    schema = defs.get_schema(name, 1, DOMAIN)
    expected_inputs = [(i, p.name, p.type_str, p.optional) for i, p in enumerate(op.inputs)]
    assert _params(_section(text, "Inputs")) == expected_inputs
    assert [p.name for p in schema.inputs] == [p.name for p in op.inputs]
    expected_outputs = [(i, p.name, p.type_str, p.optional) for i, p in enumerate(op.outputs)]
    assert _params(_section(text, "Outputs")) == expected_outputs

    documented = re.findall(r"^- `(\w+)` \((int|float|string|ints), (required|optional|default `([^`]*)`)\)",
                            _section(text, "Attributes"), re.M)
    assert [d[0] for d in documented] == [a.name for a in op.attributes]
    for (attr_name, kind, how, default), attr in zip(documented, op.attributes):
        assert kind == attr.kind, attr_name
        if attr.required:
            assert how == "required", attr_name
        elif attr.default is None:
            assert how == "optional", attr_name
        else:
            assert default == str(attr.default), attr_name
            assert schema.attributes[attr_name].default_value.name == attr_name

    types = dict(re.findall(r"^- `(\w+)`: (.+)$", _section(text, "Types"), re.M))
    constraints = {n: ", ".join(TYPE_NAMES[t] for t in allowed) for n, allowed, _ in op.type_constraints}
    assert types == constraints


def test_every_doc_page_has_an_op():
    assert sorted(p.stem for p in DOCS.glob("*.md")) == sorted(OPS)


def _commands(lines: list[str]) -> list[str]:
    """Shell commands of `lines`: comments and blank lines dropped, `a && b` split."""
    commands = []
    for line in lines:
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            commands += [c.strip() for c in line.split("&&")]
    return commands


def test_readme_setup_is_what_ci_runs():
    """The README's set-up commands (its Quick start's first lines) are exactly .ci/run's, in order."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## Quick start\n\n```bash\n(.*?)\n\n", readme, re.S | re.M)
    assert block, "README's Quick start has no bash block"
    setup = _commands(block.group(1).splitlines())
    ci = _commands((ROOT / ".ci" / "run").read_text().splitlines())
    start = ci.index(setup[0])
    assert ci[start:start + len(setup)] == setup
    assert "bash scripts/install_mpi.sh" in setup
