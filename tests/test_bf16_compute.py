"""bf16 compute (accuracy_level 3): `moe-onnx optimize --compute bf16` records it on every expert node of each
target, `--verify` judges the result with bf16's tolerance (here also on simulated bf16 kernels: the Python
backend's MOE with both GEMM operands rounded), quantize and shard keep it, check takes 3 and refuses other
values in the op's words. The op rules and the kernels' numbers at level 3 are the case tables' (tests/cases,
bf16_tolerance); here, simulated bf16 kernels of MOE, QMOE and MoeRowParallelLinear meet those bounds."""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from cases import ALL_CASES
from fixture_models import FIXTURES

import moe_onnx
from moe_onnx.check import check_model
from moe_onnx.cli import main
from moe_onnx.distributed.shard import shard
from moe_onnx.ops import DOMAIN, OPS, moe, qmoe
from moe_onnx.ops._common import BF16_OPERANDS, ArrayView
from moe_onnx.pipeline import optimize_file
from moe_onnx.rewrite.compute import ApplyCompute
from moe_onnx.verify import BF16_COMPUTE_TOLERANCE, BF16_ROUNDING, verify

GEMM3_BLOCK = FIXTURES / "qwen3_moe_batched_mm_small.onnx"  # E = 8, H = 64, I = 32
GEMM2_BLOCK = FIXTURES / "gpt_oss_tiled_small.onnx"
SIZES = [(1, 1), (3, 17)]


def levels(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Each op type of ours -> the accuracy_level of its nodes, in graph order."""
    found: dict[str, list[int]] = {}
    for node in model.graph.node:
        if node.domain == DOMAIN:
            level = next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
            found.setdefault(node.op_type, []).append(level)
    return found


@pytest.mark.parametrize("target, expected", [
    ("moe", {"MOE": [3]}),
    ("grouped", {"MoeRowParallelLinear": [3, 3, 3]}),
])
def test_optimize_compute_bf16_verifies(target, expected, tmp_path, capsys):
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    assert main(["optimize", str(GEMM3_BLOCK), "-o", str(out), "--target", target, "--compute", "bf16", "--verify",
                 "--sizes", "1x1,3x17", "--report", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "compute: bf16 (1 block at accuracy_level 3" in printed
    assert "of the output's peak) OK" in printed and f"within {BF16_COMPUTE_TOLERANCE:.2e} of its peak" in printed
    written = onnx.load(out)
    assert {op: lv for op, lv in levels(written).items() if op in expected} == expected
    assert check_model(out) == []
    document = json.loads(report.read_text())
    assert (document["compute"], document["bf16_blocks"]) == ("bf16", 1)
    assert document["verify"]["ok"] and document["verify"]["bf16_tolerance"] == BF16_COMPUTE_TOLERANCE


def test_target_ort_computes_moe_in_float32_with_a_note():
    model, report = moe_onnx.optimize(str(GEMM2_BLOCK), "ort", compute="bf16")
    assert [n.op_type for n in model.graph.node if n.domain == "com.microsoft"] == ["MoE"]
    assert report.bf16_blocks == 0 and not report.needs_our_library
    assert any("com.microsoft::MoE has no accuracy_level: 1 MoE node compute in float32" in n for n in report.notes)


def test_compute_fp32_resets_level_3_and_unknown_compute_is_refused():
    bf16, _ = moe_onnx.optimize(str(GEMM2_BLOCK), compute="bf16")
    again, report = moe_onnx.optimize(bf16)  # the default: fp32
    assert levels(again)["MOE"] == [0] and report.bf16_blocks == 0
    assert any("reset to 0 on 1 MOE" in note for note in report.notes)
    with pytest.raises(ValueError, match="compute is 'fp16'; expected one of fp32, bf16"):
        moe_onnx.optimize(str(GEMM2_BLOCK), compute="fp16")


def test_exact_nodes_keep_their_level():
    """An int8 MoeRowParallelLinear keeps 0 (exact int32) and a QMOE at 4 keeps its int8 activations."""
    kept = [next(c for c in ALL_CASES if c.id == case).model() for case in
            ("MoeRowParallelLinear-int8", "QMOE-gemm2_int4_block32_int8_activations")]
    for proto in kept:
        model = ir.serde.deserialize_model(proto)
        result = ApplyCompute("bf16")(model)
        assert not result.modified and len(result.notes) == 1 and "keeps accuracy_level" in result.notes[0]
        assert levels(ir.serde.serialize_model(model)) == levels(proto)


# ----------------------------------------------------------------------------- the tolerance, on simulated kernels

def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _moe_weight(view, arrays, i: int, e: int) -> np.ndarray:
    """MOE's expert ``e`` of weight input ``i`` as [N, K]."""
    w = arrays[i][e]
    return w.T if view.attr("expert_type") == moe.GEMM2_BIAS_SWIGLU_CLAMP else w  # GEMM2 stores [K, N]


def _qmoe_weight(view, arrays, i: int, e: int) -> np.ndarray:
    """QMOE's expert ``e`` of weight input ``i``, dequantized, [N, K]."""
    zero_points, expert_type = arrays[qmoe.ZERO_POINTS[i]], view.attr("expert_type")
    inter = arrays[moe.W0].shape[1] // (2 if expert_type == moe.GEMM2_BIAS_SWIGLU_CLAMP else 1)
    k_dim = next(arrays[moe.HIDDEN].shape[-1] if k == "H" else inter
                 for weight, _, _, k in moe.LINEARS[expert_type] if weight == i)
    return qmoe.dequantize(arrays[i][e], arrays[qmoe.SCALES[i]][e], None if zero_points is None else zero_points[e],
                           bits=view.attr("bits"), block_size=view.attr("block_size"),
                           quant_type=view.attr("quant_type"), k_dim=k_dim)


def simulated(op: str, scale: float = 1.0):
    """The reference of MOE or QMOE computing as bf16 kernels do (both operands of every GEMM rounded to
    bfloat16, float32 accumulation), its output times ``scale`` (a kernel off by more than bf16 allows)."""
    definition = OPS[op]
    weight = _moe_weight if op == "MOE" else _qmoe_weight

    def reference(*arrays, _node_name="", _named_outputs=None, **attrs):
        arrays = list(arrays) + [None] * (len(definition.inputs) - len(arrays))
        view = ArrayView(definition, arrays, attrs, node_name=_node_name, named_outputs=_named_outputs)
        definition.validate(view)

        def linear(i, e, a):
            return _bf16(a) @ _bf16(weight(view, arrays, i, e)).T

        y = moe.expert_sum(view, arrays[moe.HIDDEN], arrays[moe.ROUTING], arrays[moe.INDICES], arrays[moe.W0].shape[0],
                           linear, arrays[moe.B0], arrays[moe.B1])
        return (moe.round_like(y * np.float32(scale), arrays[moe.HIDDEN]),)

    return dataclasses.replace(definition, reference=reference)


def simulated_row_parallel_linear(X, expert_offset, W, B=None, **attrs):
    """MoeRowParallelLinear's reference on X and W rounded to bfloat16 (float32), rounded back to X's type."""
    (y,) = OPS["MoeRowParallelLinear"].reference(_bf16(X), expert_offset, _bf16(W), B if B is None else
                                                  B.astype(np.float32), **attrs)
    return (y.astype(X.dtype),)


LEVEL_3_CASES = [c for c in ALL_CASES if c.error is None and c.attrs.get("accuracy_level") == BF16_OPERANDS]


@pytest.mark.parametrize("case", LEVEL_3_CASES, ids=lambda c: c.id)
def test_simulated_bf16_kernels_meet_the_level_3_cases(case):
    """The case tables hold accuracy_level 3 to the exact result within a bf16 bound (tests/cases:
    bf16_tolerance); a kernel that rounds both GEMM operands, as the bf16 kernels do, is within it."""
    if case.op == "MoeRowParallelLinear":
        got = simulated_row_parallel_linear(*case.padded_inputs(), **case.attrs)
    else:
        got = simulated(case.op).reference(*case.inputs, **case.attrs)
    (expected,) = case.run_reference()
    np.testing.assert_allclose(got[0].astype(np.float64), expected.astype(np.float64), rtol=case.rtol, atol=case.atol)


@pytest.mark.parametrize("fixture", [GEMM2_BLOCK, GEMM3_BLOCK], ids=["gemm2", "gemm3"])
def test_verify_tolerance_on_simulated_bf16_kernels(fixture, tmp_path, monkeypatch):
    """bf16 operands differ from fp32 by more than fp32's tolerance and less than bf16's (measured on the
    fixtures: 2 to 3.5 x 2^-9 of the peak); 3% more fails."""
    out = tmp_path / "bf16.onnx"
    monkeypatch.setitem(OPS, "MOE", simulated("MOE"))
    result = optimize_file(fixture, out, compute="bf16", verify_backend="python", sizes=SIZES)
    assert result.ok, result.summary()
    peak_errors = [r.peak_rel_diff for r in result.verified.results]
    assert all(BF16_ROUNDING < error < BF16_COMPUTE_TOLERANCE for error in peak_errors), peak_errors
    assert not verify(fixture, out, backend="python", sizes=SIZES, time_it=False).ok  # fp32's tolerance
    monkeypatch.setitem(OPS, "MOE", simulated("MOE", scale=1.03))
    off = verify(fixture, out, backend="python", sizes=SIZES, time_it=False, bf16_blocks=1)
    assert not off.ok and "MISMATCH" in off.summary()
    assert verify(fixture, out, backend="python", sizes=SIZES, time_it=False, bf16_blocks=4).ok  # 4 blocks' worth


# ----------------------------------------------------------------------------- quantize, shard, check

@pytest.fixture(scope="module")
def bf16_block() -> onnx.ModelProto:
    return moe_onnx.optimize(str(GEMM3_BLOCK), compute="bf16")[0]


@pytest.mark.parametrize("asked, expected", [(None, 3), (0, 0), (4, 4)])
def test_quantize_keeps_level_3_unless_told(bf16_block, asked, expected):
    quantized, report = moe_onnx.quantize(bf16_block, bits=4, block_size=32, accuracy_level=asked, measure=False)
    assert levels(quantized)["QMOE"] == [expected] and [layer.accuracy_level for layer in report.layers] == [expected]


def test_quantize_cli_sets_level_3(tmp_path, capsys):
    fp32, out = tmp_path / "fp32.onnx", tmp_path / "q.onnx"
    assert main(["optimize", str(GEMM2_BLOCK), "-o", str(fp32)]) == 0
    assert main(["quantize", str(fp32), "-o", str(out), "--bits", "8", "--accuracy-level", "3",
                 "--backend", "python", "--sizes", "2x5"]) == 0
    assert "accuracy_level 3" in capsys.readouterr().out
    assert levels(onnx.load(out))["QMOE"] == [3] and check_model(out) == []


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_shard_keeps_the_level_on_every_rank(bf16_block, tp, ep):
    ranks = shard(bf16_block, tp, ep)
    assert len(ranks) == tp * ep
    for rank in ranks:
        assert set(levels(rank)["MOE"]) == {3}


def test_check_takes_level_3_and_refuses_others(bf16_block, tmp_path):
    path = tmp_path / "bad.onnx"
    bad = onnx.ModelProto.FromString(bf16_block.SerializeToString())
    (node,) = [n for n in bad.graph.node if n.op_type == "MOE"]
    assert check_model(bf16_block) == []
    next(a for a in node.attribute if a.name == "accuracy_level").i = 4
    onnx.save(bad, path)
    (problem,) = check_model(path)
    assert "attribute 'accuracy_level' is 4; expected one of 0, 3" in problem
