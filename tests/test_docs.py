"""Each op's doc page agrees with its schema: inputs, outputs, attributes and types; the README's set-up
and test command are what CI runs; the README stays short; every command and option is in docs/cli.md;
every relative link in the docs leads somewhere."""

from __future__ import annotations

import argparse
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
            "Types", "Errors", "Departures from the vendor specification")
README_MAX_LINES = 200


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
    """The README's set-up commands (its Quick start's first lines) are exactly .ci/run's, in order, and its
    test command (the Quick start's last) is what CI runs after them (CI's last step, the aarch64 kernels under
    qemu, follows it)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## Quick start\n\n```bash\n(.*?)\n```", readme, re.S | re.M)
    assert block, "README's Quick start has no bash block"
    setup_lines, _, _ = block.group(1).partition("\n\n")
    setup = _commands(setup_lines.splitlines())
    ci = _commands((ROOT / ".ci" / "run").read_text().splitlines())
    start = ci.index(setup[0])
    assert ci[start:start + len(setup)] == setup
    assert "bash scripts/install_mpi.sh" in setup
    assert _commands(block.group(1).splitlines())[-1] in ci[start + len(setup):], "CI does not run README's test command"
    assert ci[-1] == "bash custom_ops/arm64.sh", "CI's last step is not the aarch64 kernels' (custom_ops/arm64.sh)"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; details go to docs/ (at most {README_MAX_LINES})"


def test_every_command_and_option_is_documented():
    """README names every `moe-onnx` command; docs/cli.md has a section per command naming each of its options."""
    from moe_onnx.cli import build_parser

    readme = (ROOT / "README.md").read_text()
    cli_doc = (ROOT / "docs" / "cli.md").read_text()
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in commands.choices.items():
        assert f"`moe-onnx {name}" in readme, f"README's command table lacks moe-onnx {name}"
        section = _section(cli_doc, f"moe-onnx {name}")
        for action in parser._actions:
            if action.option_strings and action.help != argparse.SUPPRESS and "-h" not in action.option_strings:
                option = max(action.option_strings, key=len)
                assert option in section, f"docs/cli.md's moe-onnx {name} does not document {option}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md", "models/README.md",
                                  *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))])
def test_relative_links_resolve(page):
    """Every relative link of the page names a file of the repository, and its #anchor one of that file's headings."""
    path = ROOT / page
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{page} links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", linked.read_text(), flags=re.S), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{page} links to {target}: no such heading"
