"""The router pass (moe_onnx/rewrite/gating.py): ``optimize`` (``fuse_routers=True``, the default) replaces each
fused block's router chain by one MoeGatingTopK and keeps the numbers, on both targets and backends.

Chains: the fixtures' softmax -> top-k (Qwen2-MoE, OLMoE), with the ReduceSum/Div renormalization
(Mixtral, Qwen3-MoE), and top-k -> softmax (GPT-OSS); transformers' DeepSeek-V3 router exported alone
(models/fixtures/routers, models/export_routers.py) by both transformers versions and exporters, with
an MOE node added. A near-miss table: mutations whose router must stay (the report's note names
why, the numbers are kept) and mutations that must still fuse.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import moe_onnx
import moe_onnx.runtime
from backends import cached_session
from fixture_models import (FIXTURES, MANIFEST, TARGETS, attributes, nodes, optimized, original, producer,
                            reference_data, run_ort)
from moe_onnx.check import check_model
from moe_onnx.rewrite import optimize
from moe_onnx.rewrite.gating import RULE

TOL = dict(rtol=1e-5, atol=1e-5)
ROUTERS = FIXTURES / "routers"
# one fixture per router chain and export form: softmax -> top-k, renormalized, top-k -> softmax
FIXTURE_NAMES = ["qwen2_moe_batched_mm_tiny", "olmoe_loop_tiny", "qwen2_moe_tiled3_small", "mixtral_batched_mm_tiny",
                 "qwen3_moe_loop_tiny", "qwen3_moe_tiled3_tiny", "gpt_oss_batched_mm_tiny", "gpt_oss_tiled_tiny",
                 "gpt_oss_tiled_dynamo_tiny"]
DEEPSEEK = sorted(p.name for p in ROUTERS.glob("deepseek_v3_*.onnx"))
BF16 = np.dtype(ml_dtypes.bfloat16)


def expected_attributes(name: str) -> dict:
    """The MoeGatingTopK attributes of a fixture's router (the manifest's description of it)."""
    entry = MANIFEST[name]
    topk_softmax = entry["family"] == "gpt_oss"
    return {"k": entry["top_k"], "score_func": b"softmax", "renormalize": int(topk_softmax or entry["renormalize"])}


def gating_node(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = nodes(model, "MoeGatingTopK")
    return node


def run(model: onnx.ModelProto, feeds: dict, backend: str) -> np.ndarray:
    """The first output on ``backend`` (bfloat16 feeds and outputs included)."""
    return moe_onnx.runtime.run(cached_session(model, backend), feeds)[0]


# ----------------------------------------------------------------------------- the fixtures' routers

def fused(name: str, target: str):
    """Fixture ``name`` optimized with its router fused (the one cache, fixture_models.optimized)."""
    return optimized(name, target, fuse_routers=True)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_router_fuses(name, target):
    model, report = fused(name, target)
    assert report.fused[RULE] == 1 and report.notes == [], report.summary()
    assert check_model(model) == []
    node = gating_node(model)
    assert attributes(node) == expected_attributes(name)
    assert len(node.input) == 1  # no bias
    if target == "moe":  # the MOE takes the node's indices, and its weights (or their Cast to the block's type)
        (moe,) = nodes(model, "MOE")
        assert routed_source(model, moe.input[2]) == node.output[1]
        weights = producer(model, routed_source(model, moe.input[1]))
        assert weights is node or (weights.op_type == "Cast" and weights.input[0] == node.output[0])
    else:  # MoeInitRouting takes them as [T, k] (a Reshape)
        (init,) = nodes(model, "MoeInitRouting")
        assert routed_source(model, init.input[1]) == node.output[1]


def routed_source(model: onnx.ModelProto, value: str) -> str:
    """``value`` seen through Reshapes and the shared-expert fold's Concat (the routed part: its first input)."""
    node = producer(model, value)
    while node is not None and node.op_type in ("Reshape", "Concat"):
        value = node.input[0]
        node = producer(model, value)
    return value


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_numbers(name, target):
    model, _ = fused(name, target)
    data = reference_data(name)
    for suffix in ("", "_alt"):
        feeds = {"hidden_states": data["hidden_states" + suffix]}
        expected = run_ort(original(name), feeds, ["output"])[0]
        for backend in ("cpp", "python"):
            got = cached_session(model, backend).run(["output"], feeds)[0]
            np.testing.assert_allclose(got, expected, **TOL)


def test_routers_fused_by_default_and_kept_on_request():
    """``optimize`` fuses the router by default; ``fuse_routers=False`` leaves the chain as exported (the
    MOE takes TopK's indices)."""
    model, report = optimize(original("qwen3_moe_batched_mm_tiny"))
    assert report.fused[RULE] == 1 and len(nodes(model, "MoeGatingTopK")) == 1
    model, report = optimize(original("qwen3_moe_batched_mm_tiny"), fuse_routers=False)
    assert RULE not in report.fused and not nodes(model, "MoeGatingTopK")
    (moe,) = nodes(model, "MOE")
    assert producer(model, moe.input[2]).op_type == "TopK"


# ----------------------------------------------------------------------------- DeepSeek-V3 routers

def with_moe(router: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """The router model with a GEMM3 MOE (random experts) on its weights and indices: output ``y``."""
    model = onnx.ModelProto()
    model.CopyFrom(router)
    outputs = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    (indices,) = [n for n, t in outputs.items() if t == TensorProto.INT64]
    (weights,) = [n for n in outputs if n != indices]
    rng = np.random.default_rng(seed)
    experts, hidden, inter = 8, 16, 12
    for name, shape in (("w0", (experts, inter, hidden)), ("w1", (experts, inter, hidden)),
                        ("w2", (experts, hidden, inter))):
        model.graph.initializer.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.3)
                                                               .astype(np.float32), name))
    model.graph.node.append(helper.make_node("MOE", ["hidden_states", weights, indices, "w0", "", "w1", "", "w2"],
                                             ["y"], domain="moe_onnx", name="moe", expert_type="GEMM3_SWIGLU"))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", hidden]))
    model.opset_import.append(helper.make_opsetid("moe_onnx", 1))
    return model


@functools.cache
def deepseek(file: str) -> onnx.ModelProto:
    return with_moe(onnx.load(ROUTERS / file))


def hidden_states(seed: int = 1, scale: float = 1.0) -> dict[str, np.ndarray]:
    """[2, 5, 16]: the shape the routers were traced with (the dynamo exports keep it)."""
    return {"hidden_states": (np.random.default_rng(seed).standard_normal((2, 5, 16)) * scale).astype(np.float32)}


def assert_same_numbers(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    for seed in (1, 2, 3):
        feeds = hidden_states(seed, scale=3.0)
        expected = run(before, feeds, "cpp")
        for backend in ("cpp", "python"):
            np.testing.assert_allclose(run(after, feeds, backend), expected, **TOL)


def bias_initializer(model: onnx.ModelProto) -> onnx.TensorProto:
    (bias,) = [t for t in model.graph.initializer if list(t.dims) in ([8], [1, 8])]
    return bias


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("file", DEEPSEEK)
def test_deepseek_router_fuses(file, target):
    model, report = optimize(deepseek(file), target=target, fuse_routers=True)
    assert report.fused[RULE] == 1 and report.notes == [], report.summary()
    assert check_model(model) == []
    node = gating_node(model)
    torchscript = "torchscript" in file  # the dynamo exporter folds "+ 1e-20" away
    eps = {"eps": pytest.approx(1e-20)} if torchscript else {}
    assert attributes(node) == {"k": 2, "score_func": b"sigmoid", "n_group": 4, "topk_group": 2,
                                "group_select": b"sum_top2", "renormalize": 1, **eps, "routed_scaling_factor": 2.5}
    bias = numpy_helper.to_array(bias_initializer(deepseek(file)))
    got = [numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node if n.output[0] == node.input[1]]
    got = got or [numpy_helper.to_array(t) for t in model.graph.initializer if t.name == node.input[1]]
    np.testing.assert_array_equal(got[0], bias.reshape(8))
    for op in ("Where", "GatherElements", "ScatterElements", "ReduceSum", "Not"):  # the chain is gone
        assert not nodes(model, op), op
    assert_same_numbers(deepseek(file), model)


# ----------------------------------------------------------------------------- near-misses

def mutated(file: str, mutate: Callable[[onnx.ModelProto], None]) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(deepseek(file))
    mutate(model)
    return model


def set_initializer(model: onnx.ModelProto, name: str, array: np.ndarray) -> None:
    (tensor,) = [t for t in model.graph.initializer if t.name == name]
    tensor.CopyFrom(numpy_helper.from_array(array.astype(numpy_helper.to_array(tensor).dtype), name))


def set_constant(model: onnx.ModelProto, output: str, array: np.ndarray) -> None:
    """The Constant node or initializer ``output`` gets the value ``array`` (its dtype kept)."""
    node = [n for n in model.graph.node if n.op_type == "Constant" and n.output[0] == output]
    if not node:
        return set_initializer(model, output, array)
    old = numpy_helper.to_array(node[0].attribute[0].t)
    node[0].attribute[0].t.CopyFrom(numpy_helper.from_array(np.asarray(array, dtype=old.dtype)))


def op_node(model: onnx.ModelProto, op_type: str, index: int = 0) -> onnx.NodeProto:
    return nodes(model, op_type)[index]


def negative_bias(model):
    """A bias that makes some allowed experts' selection scores negative (and changes the choice)."""
    bias = bias_initializer(model)
    set_initializer(model, bias.name, np.linspace(-1.5, 0.5, 8).reshape(numpy_helper.to_array(bias).shape))


def scale_by_tensor(model):
    mul = nodes(model, "Mul", lambda n: n.output[0] in [i for m in nodes(model, "MOE") for i in m.input])[0]
    model.graph.initializer.append(numpy_helper.from_array(np.full((1, 2), 2.5, np.float32), "scale_tensor"))
    mul.input[1] = "scale_tensor"


def scale_by_input(model):
    mul = nodes(model, "Mul", lambda n: n.output[0] in [i for m in nodes(model, "MOE") for i in m.input])[0]
    mul.input[1] = "hidden_states"  # [2, 5, 16] times [T, 2] fails to broadcast: the check only reads the graph


def gather_the_selection(model):
    """The weights gathered from s + bias instead of s."""
    gather = op_node(model, "GatherElements")
    gather.input[0] = op_node(model, "Where", -1).input[2]  # the last Where masks (the first computes a shape)


def keep_masked_groups(model):
    """The Where keeps the scores of the masked groups (its condition without the Not)."""
    not_ = op_node(model, "Not")
    for node in model.graph.node:
        node.input[:] = [not_.input[0] if name == not_.output[0] else name for name in node.input]


def keep_three_groups(model):
    set_constant(model, op_node(model, "TopK", 1).input[1], np.array([3]))


def group_max(model):
    """DeepSeek-V2's group score: ReduceMax of the group view instead of the sum of its top 2."""
    topk, total = op_node(model, "TopK", 0), op_node(model, "ReduceSum", 0)
    total.op_type = "ReduceMax"
    total.input[0] = topk.input[0]


def rename_uses(model, old: str, new: str) -> None:
    for node in model.graph.node:
        node.input[:] = [new if name == old else name for name in node.input]


def deepseek_v2_style(model):
    """DeepSeek-V2's group-limited greedy router: no bias, the weights the expert TopK's own values."""
    add = [n for n in nodes(model, "Add") if any(i.endswith("e_score_correction_bias") or i.startswith("onnx::Add")
                                                 for i in n.input)][0]
    rename_uses(model, add.output[0], add.input[0])
    rename_uses(model, op_node(model, "GatherElements").output[0], op_node(model, "TopK", 2).output[0])


def bias_behind_identity(model):
    """The bias shared as the TorchScript exporter shares equal initializers of two layers: an Identity."""
    bias = bias_initializer(model).name
    rename_uses(model, bias, "shared_bias")
    model.graph.node.insert(0, helper.make_node("Identity", [bias], ["shared_bias"]))


def topk_values_with_bias(model):
    """The weights are the expert TopK's values, which include the bias."""
    rename_uses(model, op_node(model, "GatherElements").output[0], op_node(model, "TopK", 2).output[0])


def divide_by_other_sum(model):
    """The weights divided by the sum of the selection scores' top values (not their own)."""
    total = op_node(model, "ReduceSum", 1)
    total.input[0] = op_node(model, "GatherElements").input[0]


def smallest_k(model):
    """The expert TopK takes the smallest selection scores."""
    topk = op_node(model, "TopK", 2)
    del topk.attribute[:]
    topk.attribute.extend([helper.make_attribute("axis", -1), helper.make_attribute("largest", 0)])


TS457, TS5 = "deepseek_v3_tf457_torchscript.onnx", "deepseek_v3_tf5_torchscript.onnx"
DYNAMO457 = "deepseek_v3_tf457_dynamo.onnx"
# (name, file, mutation, the note's reason, whether the mutated model runs); each leaves the router as exported
STAYS = [
    ("zero_fill_negative_bias", TS457, negative_bias, "filled with 0.0, not -inf, and the expert bias has values "
                                                      "down to -1.5", True),
    ("zero_fill_negative_bias_dynamo", DYNAMO457, negative_bias, "filled with 0.0, not -inf", True),
    ("scale_by_tensor", TS5, scale_by_tensor, "a Mul by a tensor that is not a scalar constant", True),
    ("scale_by_graph_input", TS5, scale_by_input, "a Mul by a tensor that is not a scalar constant", False),
    ("gather_the_selection", TS5, gather_the_selection, "ranks other scores than the weights are gathered from", True),
    ("keep_masked_groups", TS5, keep_masked_groups, "does not keep the selection scores where the group mask is set",
     True),
    ("divide_by_other_sum", TS5, divide_by_other_sum, "divided by a sum that is not theirs", True),
    ("smallest_k", TS5, smallest_k, "the TopK does not take the largest values", True),
    ("topk_values_with_bias", TS5, topk_values_with_bias, "the top values of the scores plus a bias", True),
]
# (name, file, mutation, attributes that change); each must still fuse and keep the numbers
FUSES = [
    ("minus_inf_fill_negative_bias", "deepseek_v3_tf5_dynamo.onnx", negative_bias, {}),
    ("minus_inf_fill_negative_bias_ts", TS5, negative_bias, {}),
    ("keep_three_groups", TS5, keep_three_groups, {"topk_group": 3}),
    ("group_max", TS5, group_max, {"group_select": b"max"}),
    ("group_max_zero_fill", TS457, group_max, {"group_select": b"max"}),
    ("deepseek_v2_style", TS5, deepseek_v2_style, {}),
    ("deepseek_v2_style_zero_fill", TS457, deepseek_v2_style, {}),
    ("bias_behind_identity", TS5, bias_behind_identity, {}),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, file, mutate, reason, runs", STAYS, ids=[c[0] for c in STAYS])
def test_near_miss_router_stays(name, file, mutate, reason, runs):
    before = mutated(file, mutate)
    model, report = optimize(before, fuse_routers=True)
    assert RULE not in report.fused and not nodes(model, "MoeGatingTopK")
    (note,) = report.notes
    assert note.startswith("MOE node 'moe': the router stays as exported (") and reason in note, note
    if runs:
        assert_same_numbers(before, model)


@pytest.mark.slow
@pytest.mark.parametrize("name, file, mutate, changed", FUSES, ids=[c[0] for c in FUSES])
def test_variant_still_fuses(name, file, mutate, changed):
    before = mutated(file, mutate)
    model, report = optimize(before, fuse_routers=True)
    assert report.fused[RULE] == 1 and report.notes == [], report.summary()
    got = attributes(gating_node(model))
    for key, value in changed.items():
        assert got[key] == value
    assert_same_numbers(before, model)


def test_negative_bias_changes_the_choice():
    """The negative-bias variant routes differently from the unbiased router: the bias reaches the op."""
    before = mutated("deepseek_v3_tf5_dynamo.onnx", negative_bias)
    feeds = hidden_states(1, scale=3.0)
    assert not np.allclose(run(before, feeds, "cpp"), run(deepseek("deepseek_v3_tf5_dynamo.onnx"), feeds, "cpp"))


def set_attribute(node: onnx.NodeProto, name: str, value) -> None:
    for attr in list(node.attribute):
        if attr.name == name:
            node.attribute.remove(attr)
    node.attribute.append(helper.make_attribute(name, value))


def sum_over_tokens(model):
    """The renormalization divides by the sum over the tokens (axis 0), not over k."""
    (total,) = nodes(model, "ReduceSum", lambda n: producer(model, n.input[0]).op_type == "TopK")
    model.graph.initializer.append(numpy_helper.from_array(np.array([0], np.int64), "axis_0"))
    total.input[1] = "axis_0"


def clamped_sum(model):
    """Ernie 4.5's renormalization: divided by Clip(sum, min=norm_min) instead of the sum."""
    (div,) = nodes(model, "Div", lambda n: producer(model, n.input[1]).op_type == "ReduceSum")
    model.graph.initializer.append(numpy_helper.from_array(np.array(1e-12, np.float32), "norm_min"))
    model.graph.node.append(helper.make_node("Clip", [div.input[1], "norm_min"], ["clamped_sum"]))
    div.input[1] = "clamped_sum"


# (fixture, mutation of its router, the note's reason); the block still fuses, its router stays
FIXTURE_STAYS = [
    ("qwen2_moe_batched_mm_tiny", lambda m: set_attribute(nodes(m, "Softmax")[0], "axis", 0),
     "the router Softmax is not over the experts"),
    ("gpt_oss_batched_mm_tiny", lambda m: set_attribute(nodes(m, "Softmax")[0], "axis", 0),
     "the top-k Softmax is not over k"),
    ("mixtral_batched_mm_tiny", sum_over_tokens, "divided by a sum that is not theirs over k"),
    ("qwen3_moe_batched_mm_tiny", clamped_sum, "divided by max(their sum, 1e-12) (Ernie 4.5's norm_min)"),
    ("olmoe_tiled3_tiny", lambda m: set_attribute(nodes(m, "TopK")[0], "largest", 0),
     "the TopK does not take the largest values"),
]


@pytest.mark.parametrize("name, mutate, reason", FIXTURE_STAYS, ids=[c[0] for c in FIXTURE_STAYS])
def test_fixture_near_miss_router_stays(name, mutate, reason):
    model = onnx.ModelProto()
    model.CopyFrom(original(name))
    mutate(model)
    new, report = optimize(model, fuse_routers=True)
    blocks = sum(count for rule, count in report.fused.items() if rule != "SharedExpertFold")
    assert blocks == 1 and not nodes(new, "MoeGatingTopK"), report.summary()
    (note,) = report.notes
    assert "the router stays as exported" in note and reason in note, note
    feeds = {"hidden_states": reference_data(name)["hidden_states"]}
    np.testing.assert_allclose(run(new, feeds, "cpp"), run_ort(model, feeds, ["output"])[0], **TOL)


@pytest.mark.parametrize("keep", [False, True], ids=["default", "--keep-routers"])
def test_cli_routers(tmp_path, capsys, keep):
    """`moe-onnx optimize` reports the router fused and verifies the numbers; `--keep-routers` keeps it."""
    from moe_onnx.cli import main

    out = tmp_path / "out.onnx"
    status = main(["optimize", str(FIXTURES / "mixtral_batched_mm_tiny.onnx"), "-o", str(out), "--verify",
                   "--sizes", "1x1,2x3"] + (["--keep-routers"] if keep else []))
    printed = capsys.readouterr().out
    assert status == 0 and "OK" in printed and (f"{RULE}: 1 block fused" in printed) != keep, printed
    if keep:
        assert not nodes(onnx.load(out), "MoeGatingTopK")
    else:
        assert attributes(gating_node(onnx.load(out))) == {"k": 2, "score_func": b"softmax", "renormalize": 1}


# ----------------------------------------------------------------------------- routers in fp16 / bf16

def built_router(dtype, softmax_in_float: bool) -> onnx.ModelProto:
    """hidden [T, 16] (``dtype``) -> MatMul -> (Cast float32 ->) Softmax -> TopK(2) -> Div(ReduceSum)
    (-> Cast back) -> a GEMM3 MOE in ``dtype``, as the loop exports of Qwen3/Mixtral write it. bf16
    blocks compute the router in float32 (onnxruntime has no bf16 MatMul or TopK), as DeepSeek-V3 does."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    router_dtype = np.float32 if np.dtype(dtype) == BF16 else dtype
    rng = np.random.default_rng(4)
    experts, hidden, inter = 8, 16, 12

    def tensor(name, shape, as_dtype=dtype, scale=0.3):
        values = (rng.standard_normal(shape) * scale).astype(np.float32).astype(as_dtype)
        return helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(np.dtype(as_dtype)), shape,
                                  values.tobytes(), raw=True)

    inits = [tensor("router_w", (hidden, experts), router_dtype, 1.0), tensor("w0", (experts, inter, hidden)),
             tensor("w1", (experts, inter, hidden)), tensor("w2", (experts, hidden, inter)),
             numpy_helper.from_array(np.array([2], np.int64), "k"),
             numpy_helper.from_array(np.array([-1], np.int64), "last")]
    chain = [helper.make_node("Cast", ["hidden_states"], ["router_in"],
                              to=helper.np_dtype_to_tensor_dtype(np.dtype(router_dtype))),
             helper.make_node("MatMul", ["router_in", "router_w"], ["logits"])]
    scores_in = "logits"
    if softmax_in_float:
        chain.append(helper.make_node("Cast", ["logits"], ["logits_f"], to=TensorProto.FLOAT))
        scores_in = "logits_f"
    chain += [helper.make_node("Softmax", [scores_in], ["scores"], axis=1),
              helper.make_node("TopK", ["scores", "k"], ["top", "idx"], axis=-1),
              helper.make_node("ReduceSum", ["top", "last"], ["total"], keepdims=1),
              helper.make_node("Div", ["top", "total"], ["w"]),
              helper.make_node("Cast", ["w"], ["w_t"], to=elem),
              helper.make_node("MOE", ["hidden_states", "w_t", "idx", "w0", "", "w1", "", "w2"], ["y"],
                               domain="moe_onnx", name="moe", expert_type="GEMM3_SWIGLU")]
    graph = helper.make_graph(chain, "router", [helper.make_tensor_value_info("hidden_states", elem, ["T", hidden])],
                              [helper.make_tensor_value_info("y", elem, ["T", hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("moe_onnx", 1)],
                             ir_version=10)


HALF = [(np.float16, True), (np.float16, False), (BF16, False)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, softmax_in_float", HALF, ids=["fp16_softmax_in_float32", "fp16", "bf16_fp32_router"])
def test_half_precision_router(dtype, softmax_in_float):
    """The logits' type decides MoeGatingTopK's weights' type; a Cast to the block's type follows when they differ."""
    before = built_router(dtype, softmax_in_float)
    model, report = optimize(before, fuse_routers=True)
    assert report.fused[RULE] == 1 and report.notes == [], report.summary()
    assert check_model(model) == []
    node = gating_node(model)
    assert attributes(node) == {"k": 2, "score_func": b"softmax", "renormalize": 1}
    (moe,) = nodes(model, "MOE")
    cast_back = softmax_in_float or np.dtype(dtype) == BF16
    assert producer(model, moe.input[1]).op_type == ("Cast" if cast_back else "MoeGatingTopK")
    feeds = {"hidden_states": np.random.default_rng(5).standard_normal((9, 16)).astype(np.float32).astype(dtype)}
    expected = run(before, feeds, "cpp").astype(np.float32)
    for backend in ("cpp", "python"):
        got = run(model, feeds, backend)
        assert got.dtype == np.dtype(dtype)
        # fp16 softmax in the original vs float32 inside MoeGatingTopK: the weights differ by its rounding
        np.testing.assert_allclose(got.astype(np.float32), expected, rtol=1e-2, atol=1e-2)
