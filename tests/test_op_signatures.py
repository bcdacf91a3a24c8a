"""The C++ kernels' op tables (generated at build time by custom_ops/cmake/gen_op_tables.py) say
what the OpDefs say: input and output names in order, optional flags and element types, the
attributes with their kinds and defaults, and the allowed values of the string attributes (C++ enums
and their spelling; the Python tables keyed by them have the same values)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from onnx import TensorProto

from moe_onnx.ops import OPS, signatures
from moe_onnx.ops._common import elem_of_type_str

ROOT = Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "custom_ops" / "cmake" / "gen_op_tables.py"
SIGNATURES = ROOT / "moe_onnx" / "ops" / "signatures.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_op_tables", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """The headers as the build writes them: a bare interpreter (-I -S: no site-packages, so no numpy
    or onnx, as in an isolated PEP 517 build) runs the generator on the signatures file."""
    target = tmp_path_factory.mktemp("generated") / "op_signatures.h"
    subprocess.run([sys.executable, "-I", "-S", str(GENERATOR), str(SIGNATURES), str(target)], check=True)
    return target.parent


@pytest.fixture(scope="module")
def header(generated) -> str:
    return (generated / "op_signatures.h").read_text()


def _tables(header: str) -> dict[str, dict[str, list[tuple]]]:
    """{op: {"inputs": [(name, optional, [enum, ...])], "outputs": [...],
    "attributes": [(name, kind, required, default or None)]}} read back from the header (a string
    default is the text after the numeric field)."""
    tables = {}
    for variable, name, inputs, outputs, attributes in re.findall(
            r'inline const OpSignature (\w+) = \{\n    "(\w+)",\n    \{  // inputs\n(.*?)    \},\n'
            r'    \{  // outputs\n(.*?)    \},\n    \{  // attributes[^\n]*\n(.*?)    \},\n\};', header, re.S):
        assert variable == name
        tables[name] = {part: [(n, opt == "true", types.split(", "))
                               for n, opt, types in re.findall(r'\{"(\w+)", (true|false), \{([\w, ]+)\}\}', rows)]
                        for part, rows in (("inputs", inputs), ("outputs", outputs))}
        tables[name]["attributes"] = [
            (n, kind, required == "true",
             (text if kind == "string" else float(default.replace("HUGE_VAL", "inf"))) if has_default == "true" else None)
            for n, kind, required, has_default, default, text in re.findall(
                r'\{"(\w+)", "(\w+)", (true|false), (true|false), ([-\w.]+)(?:, "([-\w.]*)")?\}', attributes)]
    return tables


def _enum(elem: int) -> str:
    return "ONNX_TENSOR_ELEMENT_DATA_TYPE_" + TensorProto.DataType.Name(elem)


@pytest.mark.subprocess
def test_every_op_has_a_table(header):
    assert sorted(_tables(header)) == sorted(OPS)


@pytest.mark.subprocess
@pytest.mark.parametrize("name", sorted(OPS))
def test_table_matches_op(header, name):
    op, table = OPS[name], _tables(header)[name]
    for part in ("inputs", "outputs"):
        params = getattr(op, part)
        expected = [(p.name, p.optional, [_enum(elem_of_type_str(t)) for t in op.allowed_types(p)]) for p in params]
        assert table[part] == expected, part
    assert table["attributes"] == [(a.name, a.kind, a.required, None if a.required else a.default)
                                   for a in op.attributes]


@pytest.mark.subprocess
def test_generator_renders_what_it_writes(header):
    """The in-process rendering (the module the build runs) gives the same text."""
    assert _generator().render(signatures.SIGNATURES) == header


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_is_its_signature(name):
    """Each OpDef carries its signature's formal parts unchanged."""
    op = OPS[name]
    signature = next(s for s in signatures.SIGNATURES if s.name == name)
    assert (op.doc, op.inputs, op.outputs, op.type_constraints, op.attributes) == \
        (signature.doc, signature.inputs, signature.outputs, signature.type_constraints, signature.attributes)


def _declared_choices() -> dict[str, tuple[str, ...]]:
    """{attribute name: its choices} of every string attribute that declares them."""
    return {a.name: a.choices for s in signatures.SIGNATURES for a in s.attributes if a.choices}


def test_choices_are_enums(generated, header):
    """op_choices.h: one enum per string attribute with choices, an enumerator per value in the declared
    order; op_signatures.h spells them (StringChoices)."""
    camel = _generator().camel
    enums = dict(re.findall(r"enum class (\w+) : int \{ ([\w, ]+) \};", (generated / "op_choices.h").read_text()))
    spelled = dict(re.findall(r'struct StringChoices<(\w+)> \{\n  static constexpr const char\* attribute = "(\w+)";',
                              header))
    names = {enum: tuple(re.findall(r'"(\w+)"', text))
             for enum, text in re.findall(r"struct StringChoices<(\w+)> \{.*?names\[\] = \{([^}]*)\}", header, re.S)}
    declared = _declared_choices()
    assert enums == {camel(name): ", ".join(f"k{camel(c)}" for c in choices) for name, choices in declared.items()}
    assert spelled == {camel(name): name for name in declared}
    assert names == {camel(name): choices for name, choices in declared.items()}
    assert _generator().render_choices(signatures.SIGNATURES) == (generated / "op_choices.h").read_text()


def test_python_tables_have_the_declared_choices():
    """The Python tables keyed by an attribute's values (the activations of the reference and of the
    function bodies) have exactly the declared values, in their order."""
    from moe_onnx.ops import _expert_math
    from moe_onnx.ops import moe

    activations = signatures.MOE.attr_spec("activation").choices
    assert tuple(moe.ACTIVATIONS) == activations
    assert tuple(_expert_math.ACTIVATIONS) == activations
