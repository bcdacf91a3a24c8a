"""`moe-onnx check`: valid models pass, corrupted ones fail naming the node and the input or attribute."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from cases import finalize_routing as finalize_cases
from cases import row_parallel_linear as linear_cases
from cases import qmoe as qmoe_cases
from cases.moe import CASES

from moe_onnx import check
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
        "MOE node 'MOE_node': attribute 'expert_gamma' is not an attribute of MOE; expected one of 'expert_type'"),
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


# ----------------------------------------------------------------------------- models onnxruntime cannot load

def _external(path, edit=None) -> str:
    """The base model saved with every initializer in external data beside ``path``; ``edit(data_file, proto)``
    may then corrupt the data file or the proto's external-data entries."""
    _save(_model(), path, save_as_external_data=True, location=f"{path.name}.data", size_threshold=0)
    if edit is not None:
        proto = onnx.load(str(path), load_external_data=False)
        edit(path.parent / f"{path.name}.data", proto)
        onnx.save(proto, str(path))
    return str(path)


def _truncate_data(data, proto):
    with open(data, "r+b") as handle:
        handle.truncate(data.stat().st_size - 4)


def _set_external(key, value):
    def edit(data, proto):
        for entry in proto.graph.initializer[0].external_data:
            if entry.key == key:
                entry.value = value
    return edit


def _routing_model(n=4, k=2, **attributes) -> onnx.ModelProto:
    """A single MoeInitRouting node over x [n, 8] and expert_idx [n, k]."""
    make = onnx.helper.make_tensor_value_info
    node = onnx.helper.make_node("MoeInitRouting", ["x", "idx"], ["expanded_x", "row_idx", "counts"],
                                 domain="moe_onnx", name="routing", expert_tokens_num_flag=1, **attributes)
    graph = onnx.helper.make_graph(
        [node], "g", [make("x", onnx.TensorProto.FLOAT, [n, 8]), make("idx", onnx.TensorProto.INT32, [n, k])],
        [make("expanded_x", onnx.TensorProto.FLOAT, ["a", "b", "c"]), make("row_idx", onnx.TensorProto.INT32, ["r"]),
         make("counts", onnx.TensorProto.INT64, ["e"])])
    return onnx.helper.make_model(graph, ir_version=10, opset_imports=[onnx.helper.make_opsetid("", 18),
                                                                       onnx.helper.make_opsetid("moe_onnx", 1)])


UNLOADABLE = {
    "external_data_shorter_than_declared": (
        lambda folder: _external(folder / "m.onnx", _truncate_data),
        "external data at offset"),
    "external_offset_past_the_end": (
        lambda folder: _external(folder / "m.onnx", _set_external("offset", str(10**9))),
        "at offset 1000000000"),
    "external_length_wrong": (
        lambda folder: _external(folder / "m.onnx", _set_external("length", "4")),
        "length is 4 bytes; expected"),
    "drop_pad_rows_overflow": (
        lambda folder: _save(_routing_model(expert_num=2**40, expert_capacity=2**40, drop_pad_mode=1),
                             folder / "m.onnx"),
        "MoeInitRouting node 'routing': attribute 'expert_capacity' is 1099511627776; expected expert_num * "
        "expert_capacity (the rows of expanded_x) <= 9223372036854775807"),
    "declared_dims_2_40": (  # N * k = 2**80 rows: once a traceback from shape inference
        lambda folder: _save(_routing_model(n=2**40, k=2**40, expert_num=8), folder / "m.onnx"),
        "value 'idx' has shape [1099511627776, 1099511627776]"),
    "unused_moe_onnx_opset_2": (
        lambda folder: _save(onnx.helper.make_model(
            onnx.helper.make_graph([], "g", [], []), ir_version=10,
            opset_imports=[onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid("moe_onnx", 2)]),
            folder / "m.onnx"),
        "opset_import for domain 'moe_onnx' is 2; expected 1"),
}


@pytest.mark.parametrize("name", UNLOADABLE)
def test_models_onnxruntime_cannot_load_fail(name, tmp_path, capsys):
    make, message = UNLOADABLE[name]
    path = make(tmp_path)
    assert main(["check", path]) == 1
    out = capsys.readouterr().out
    assert f"{path}: INVALID" in out and message in out, out


def test_empty_file_cannot_be_read(tmp_path, capsys):
    (tmp_path / "empty.onnx").write_bytes(b"")
    assert main(["check", str(tmp_path / "empty.onnx")]) == 1
    assert "cannot read the model" in capsys.readouterr().out


def test_check_never_raises(tmp_path, capsys, monkeypatch):
    """Whatever fails inside the checks is one problem line under the file's name, not a traceback."""
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(check, "_check_opset", broken)
    path = _save(_model(), tmp_path / "m.onnx")
    assert main(["check", path]) == 1
    assert capsys.readouterr().out.splitlines() == [f"{path}: INVALID (1 problem)",
                                                    "  cannot check the model: RuntimeError: a bug"]


def _case_model(cases, name: str) -> onnx.ModelProto:
    return next(c for c in cases if c.name == name).model()


def test_expert_offsets_decreasing_past_int64_max_are_reported(tmp_path, capsys):
    """Constant offsets [0, 2**63-1, -2, 5] decrease although their differences wrap to positive numbers."""
    model = _case_model(linear_cases.CASES, "offsets_decreasing_past_int64_max")
    assert main(["check", _save(model, tmp_path / "m.onnx")]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and ("MoeRowParallelLinear node 'MoeRowParallelLinear_node': input 'expert_offset'[2] = -2 "
                                 "is less than expert_offset[1] = 9223372036854775807") in out, out


def test_finalize_routing_expert_idx_without_bias_passes(tmp_path, capsys):
    """Ascend graphs wire expert_idx with no bias: accepted (and unused)."""
    model = _case_model(finalize_cases.CASES, "expert_idx_without_bias")
    assert main(["check", _save(model, tmp_path / "m.onnx")]) == 0
    assert "OK" in capsys.readouterr().out


WRONG_ATTRIBUTE_TYPES = {
    "string_for_float": ("expert_beta", "7", "attribute 'expert_beta' has type STRING; expected FLOAT"),
    "floats_for_float": ("expert_alpha", [1.0, 2.0], "attribute 'expert_alpha' has type FLOATS; expected FLOAT"),
    "tensor_for_float": ("expert_alpha", onnx.numpy_helper.from_array(np.array([1.0], np.float32)),
                         "attribute 'expert_alpha' has type TENSOR; expected FLOAT"),
    "float_for_int": ("gate_parity", 1.0, "attribute 'gate_parity' has type FLOAT; expected INT"),
    "misspelled": ("expert_alhpa", 1.0, "attribute 'expert_alhpa' is not an attribute of MOE; expected one of "
                   "'expert_type', 'expert_alpha', 'expert_beta', 'gate_parity', 'activation', 'tp_world_size', "
                   "'tp_rank_id', 'accuracy_level'"),
}


@pytest.mark.parametrize("name", WRONG_ATTRIBUTE_TYPES)
def test_wrong_attribute_type_is_a_problem(name, tmp_path, capsys):
    """An attribute of the wrong ONNX type (or name) is one problem line naming the node, not a traceback."""
    attribute, value, message = WRONG_ATTRIBUTE_TYPES[name]
    path = _save(_set_attr(_model(), attribute, v=value), tmp_path / f"{name}.onnx")
    assert main(["check", path]) == 1
    out = capsys.readouterr().out
    assert f"  MOE node 'MOE_node': {message}\n" in out, out


QMOE_BASE = next(c for c in qmoe_cases.CASES if c.name == "gemm3_int8_block32_zero_points")


def test_qmoe_model_passes_and_infers_its_output(tmp_path, capsys):
    model = QMOE_BASE.model(symbolic=True)
    assert main(["check", _save(model, tmp_path / "q.onnx")]) == 0
    assert "OK (1 nodes; moe_onnx ops: QMOE x1)" in capsys.readouterr().out
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph.output[0].type.tensor_type
    assert inferred.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_param for d in inferred.shape.dim] == ["hidden_states_d0", "hidden_states_d1"]


@pytest.mark.parametrize("name, corrupt, message", [
    ("packed_dim", lambda m: _replace_initializer(m, "weight_1", np.zeros((4, 32, 16), np.uint8)),
     "QMOE node 'QMOE_node': input 'weight_1' dim 2 is 16; expected H * bits / 8 = 32 (H = 32, bits = 8)"),
    ("block_size", lambda m: _set_attr(m, "block_size", v=64),
     "QMOE node 'QMOE_node': attribute 'block_size' is 64; expected a divisor of H = 32"),
    ("zero_points", lambda m: _replace_initializer(m, "zero_points_2", np.zeros((4, 32, 2), np.uint8)),
     "QMOE node 'QMOE_node': input 'zero_points_2' dim 2 is 2; expected ceil(I / block_size * bits / 8) = 1"),
])
def test_corrupted_qmoe_model_fails(name, corrupt, message, tmp_path, capsys):
    path = _save(corrupt(QMOE_BASE.model()), tmp_path / f"{name}.onnx")
    assert main(["check", path]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and message in out, out
