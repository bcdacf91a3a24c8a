"""Writes the C++ kernels' op tables from moe_onnx/ops/signatures.py (run by CMake at build time).

    python gen_op_tables.py <moe_onnx/ops/signatures.py> <generated/op_signatures.h>

op_signatures.h: for each op, its input and output names in order, which are optional, and the
element types each may have; its attributes with their kind and default (a moe_onnx::OpSignature,
custom_ops/src/core/signature.h), as ``moe_onnx::signatures::<op name>``; and for each string attribute
with ``choices``, the StringChoices of its enum (the attribute's name, its values' spelling).
op_choices.h (written beside it): those enums, one per attribute name (``expert_type`` ->
``enum class ExpertType { kGemm2BiasSwigluClamp, ... }``, the values in the signature's order),
with no include, so that the SIMD kernels can use them.
signatures.py is loaded by path and needs only the standard library, so this runs in an isolated
PEP 517 build (no numpy, no onnx) and never imports the moe_onnx package.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

HEADER = """\
// Generated from moe_onnx/ops/signatures.py by custom_ops/cmake/gen_op_tables.py: do not edit.
#pragma once

#include "op_choices.h"
#include "signature.h"

namespace moe_onnx {
"""
FOOTER = """\
}  // namespace signatures
}  // namespace moe_onnx
"""
CHOICES_HEADER = """\
// Generated from moe_onnx/ops/signatures.py by custom_ops/cmake/gen_op_tables.py: do not edit.
// The allowed values of the ops' string attributes, value i of an attribute's choices being
// enumerator i (their spelling: StringChoices in op_signatures.h). No include: the SIMD kernels use them.
#pragma once

namespace moe_onnx {

"""
CHOICES_FOOTER = """\
}  // namespace moe_onnx
"""


def load_signatures(path: Path):
    """The SIGNATURES tuple of the signatures module at ``path``."""
    spec = importlib.util.spec_from_file_location("moe_onnx_signatures", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module.SIGNATURES


def elem_enum(type_str: str) -> str:
    """"tensor(float16)" -> "ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16"."""
    assert type_str.startswith("tensor(") and type_str.endswith(")"), type_str
    return "ONNX_TENSOR_ELEMENT_DATA_TYPE_" + type_str[len("tensor("):-1].upper()


def formal_params(signature, params) -> str:
    rows = []
    for p in params:
        types = ", ".join(elem_enum(t) for t in signature.allowed_types(p))
        rows.append(f'        {{"{p.name}", {str(p.optional).lower()}, {{{types}}}}},')
    return "\n".join(rows)


def default_literal(attr) -> str:
    """The C++ initializers of a default: a numeric one's double ("-1", "1.0", "HUGE_VAL" for inf); a
    string's is 0 and its text ("0, \"softmax\"")."""
    value = attr.default
    if attr.kind == "string" and isinstance(value, str):
        if not all(c.isalnum() or c in "_-." for c in value):
            raise ValueError(f"attribute '{attr.name}': the string default {value!r} needs escaping in C++")
        return f'0, "{value}"'
    if attr.kind not in ("int", "float") or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"attribute '{attr.name}': a default of kind {attr.kind} ({value!r}) has no C++ form here")
    if math.isnan(value):
        raise ValueError(f"attribute '{attr.name}': a NaN default has no C++ form here")
    if math.isinf(value):
        return "HUGE_VAL" if value > 0 else "-HUGE_VAL"
    return repr(value)


def formal_attrs(attributes) -> str:
    rows = []
    for a in attributes:
        has_default = a.default is not None and not a.required
        default = default_literal(a) if has_default else "0"
        rows.append(f'        {{"{a.name}", "{a.kind}", {str(a.required).lower()}, {str(has_default).lower()}, '
                    f"{default}}},")
    return "\n".join(rows)


def camel(text: str) -> str:
    """"gelu_tanh" -> "GeluTanh", "GEMM2_ACT" -> "Gemm2Act"."""
    if not text or not all(c.isalnum() or c == "_" for c in text):
        raise ValueError(f"{text!r} has no C++ name here")
    return "".join(part.capitalize() for part in text.split("_"))


def choice_attributes(signatures) -> dict:
    """{attribute name: (its choices, the ops that have it)} of every string attribute with choices;
    an attribute name is one enum, so every op must give it the same choices."""
    found = {}
    for s in signatures:
        for a in s.attributes:
            if not a.choices:
                continue
            if a.kind != "string":
                raise ValueError(f"{s.name} attribute '{a.name}': choices are for string attributes")
            choices, ops = found.setdefault(a.name, (a.choices, []))
            if choices != a.choices:
                raise ValueError(f"attribute '{a.name}' has the choices {choices} in {ops[0]}, but {a.choices} in "
                                 f"{s.name}: one attribute name is one C++ enum")
            ops.append(s.name)
    return found


def render_choices(signatures) -> str:
    """op_choices.h: an enum per string attribute with choices."""
    parts = [CHOICES_HEADER]
    for name, (choices, ops) in choice_attributes(signatures).items():
        values = ", ".join(f"k{camel(c)}" for c in choices)
        parts.append(f"// attribute '{name}' ({', '.join(ops)})\nenum class {camel(name)} : int {{ {values} }};\n\n")
    parts.append(CHOICES_FOOTER)
    return "".join(parts)


def string_choices(signatures) -> str:
    """The StringChoices specialization of each enum of op_choices.h."""
    parts = []
    for name, (choices, _) in choice_attributes(signatures).items():
        names = ", ".join(f'"{c}"' for c in choices)
        parts.append(f"template <>\nstruct StringChoices<{camel(name)}> {{\n"
                     f'  static constexpr const char* attribute = "{name}";\n'
                     f"  static constexpr const char* const names[] = {{{names}}};\n}};\n\n")
    return "".join(parts)


def render(signatures) -> str:
    parts = [HEADER, "\n", string_choices(signatures), "namespace signatures {\n"]
    for s in signatures:
        parts.append(f"inline const OpSignature {s.name} = {{\n"
                     f'    "{s.name}",\n'
                     f"    {{  // inputs\n{formal_params(s, s.inputs)}\n    }},\n"
                     f"    {{  // outputs\n{formal_params(s, s.outputs)}\n    }},\n"
                     f"    {{  // attributes: name, kind, required, has a default, the default\n"
                     f"{formal_attrs(s.attributes)}\n    }},\n"
                     "};\n\n")
    parts.append(FOOTER)
    return "".join(parts)


def main(argv: list[str]) -> int:
    source, target = Path(argv[1]), Path(argv[2])
    signatures = load_signatures(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    for path, text in ((target, render(signatures)), (target.with_name("op_choices.h"), render_choices(signatures))):
        if not path.is_file() or path.read_text() != text:  # unchanged: no rebuild of the kernels
            path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
