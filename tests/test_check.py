"""`moe-onnx check`: valid models pass, corrupted ones fail naming the node and the input or attribute."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from cases.moe import CASES

from moe_onnx.cli import main

BASE = next(c for c in CASES if c.name == "gemm2_fp32")


def _save(model: onnx.ModelProto, path, **kwargs) -> str:
    onnx.save(model, str(path), **kwargs)
    return str(path)


def _model() -> onnx.ModelProto:
    return BASE.model(symbolic=True)


def _set_attr(model, name, **value):
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept + ([onnx.helper.make_attribute(name, value["v"])] if "v" in value else []))
    return model


def _replace_initializer(model, name, array):
    for tensor in model.graph.initializer:
        if tensor.name == name:
            tensor.CopyFrom(onnx.numpy_helper.from_array(array, name))
    return model


def _set_input_type(model, name, elem_type):
    for info in model.graph.input:
        if info.name == name:
            info.type.tensor_type.elem_type = elem_type
    return model


def test_valid_model_passes(tmp_path, capsys):
    assert main(["check", _save(_model(), tmp_path / "m.onnx")]) == 0
    assert "OK (1 nodes; moe_onnx ops: MOE x1)" in capsys.readouterr().out


def test_external_data_model_passes(tmp_path, capsys):
    path = _save(_model(), tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    assert main(["check", path]) == 0
    (tmp_path / "m.data").unlink()
    assert main(["check", path]) == 1
    assert "m.data" in capsys.readouterr().out


CORRUPTIONS = {
    "wrong_weight_rank": (
        lambda m: _replace_initializer(m, "weight_1", np.zeros((4, 6), np.float32)),
        "MOE node 'MOE_node': input 'weight_1' has rank 2 (shape [4, 6]); expected rank 3"),
    "unknown_expert_type": (
        lambda m: _set_attr(m, "expert_type", v="GEMM2_SWIGLU"),
        "MOE node 'MOE_node': attribute 'expert_type' is 'GEMM2_SWIGLU'; expected one of"),
    "index_dtype_float": (
        lambda m: _set_input_type(m, "router_topk_output_indices", onnx.TensorProto.FLOAT),
        "MOE node 'MOE_node': input 'router_topk_output_indices' has type float32; expected int32, int64"),
    "weights_disagree": (
        lambda m: _replace_initializer(m, "weight_1", np.zeros((4, 5, 8), np.float32)),
        "MOE node 'MOE_node': input 'weight_1' dim 1 is 5; expected I = 6"),
    "clamp_bound_zero": (
        lambda m: _set_attr(m, "expert_beta", v=0.0),
        "MOE node 'MOE_node': attribute 'expert_beta' is 0.0; expected a value > 0"),
    "missing_expert_type": (
        lambda m: _set_attr(m, "expert_type"),
        "attribute 'expert_type'"),
    "unknown_attribute": (
        lambda m: _set_attr(m, "expert_gamma", v=1.0),
        "MOE node 'MOE_node': unknown attribute(s) ['expert_gamma']"),
    "unknown_op": (
        lambda m: setattr(m.graph.node[0], "op_type", "MoeUnknown") or m,
        "unknown op 'MoeUnknown' in domain 'moe_onnx'"),
    "wrong_opset_version": (
        lambda m: [o for o in m.opset_import if o.domain == "moe_onnx"][0].__setattr__("version", 2) or m,
        "opset_import for domain 'moe_onnx' is 2; expected 1"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_corrupted_model_fails(name, tmp_path, capsys):
    corrupt, message = CORRUPTIONS[name]
    path = _save(corrupt(_model()), tmp_path / f"{name}.onnx")
    assert main(["check", path]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and message in out, out


def test_standard_op_errors_are_reported(tmp_path, capsys):
    model = _model()
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(3, np.float32), "three"))
    model.graph.node.append(onnx.helper.make_node("Add", ["y", "three"], ["z"], name="bad_add"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, ["T", 8]))
    assert main(["check", _save(model, tmp_path / "m.onnx")]) == 1
    out = capsys.readouterr().out
    assert "shape inference" in out and "bad_add" in out, out


def test_unreadable_file(tmp_path, capsys):
    path = tmp_path / "junk.onnx"
    path.write_bytes(b"\xff\x00not a model")
    assert main(["check", str(path)]) == 1
    assert "cannot read the model" in capsys.readouterr().out


WRONG_ATTRIBUTE_TYPES = {
    "string_for_float": ("expert_beta", "7", "attribute 'expert_beta' has type STRING; expected FLOAT"),
    "floats_for_float": ("expert_alpha", [1.0, 2.0], "attribute 'expert_alpha' has type FLOATS; expected FLOAT"),
    "tensor_for_float": ("expert_alpha", onnx.numpy_helper.from_array(np.array([1.0], np.float32)),
                         "attribute 'expert_alpha' has type TENSOR; expected FLOAT"),
    "float_for_int": ("gate_parity", 1.0, "attribute 'gate_parity' has type FLOAT; expected INT"),
    "misspelled": ("expert_alhpa", 1.0, "attribute 'expert_alhpa' is not an attribute of MOE; expected one of "
                   "'expert_type', 'expert_alpha', 'expert_beta', 'gate_parity'"),
}


@pytest.mark.parametrize("name", WRONG_ATTRIBUTE_TYPES)
def test_wrong_attribute_type_is_a_problem(name, tmp_path, capsys):
    """An attribute of the wrong ONNX type (or name) is one problem line naming the node, not a traceback."""
    attribute, value, message = WRONG_ATTRIBUTE_TYPES[name]
    path = _save(_set_attr(_model(), attribute, v=value), tmp_path / f"{name}.onnx")
    assert main(["check", path]) == 1
    out = capsys.readouterr().out
    assert f"  MOE node 'MOE_node': {message}\n" in out, out
