"""moe-onnx shard and run: the sharded models' outputs equal the unsharded model's on 2 and 4 ranks, the
session-start checks, and faults that end the whole job in bounded time.

The multi-rank runs need mpirun (Open MPI) and mpi4py: without them these tests FAIL, saying so. Every
world size runs all its configurations in ONE mpirun launch (tests/distributed_driver.py), not one per case.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from backends import cached_session
from distributed_models import drop_pad_model, grouped_model, moe_model, routing_feeds, with_bfloat16_blocks
from fixture_models import FIXTURES, WHOLE_FIXTURES, WHOLE_MANIFEST, as_float16, random_feeds, whole_reference_data
from moe_export.fixtures import whole_feeds
from world_simulation import run_world

from moe_onnx import quantize, session
from moe_onnx._ir import model_files
from moe_onnx.check import check_model
from moe_onnx.cli import main as cli_main
from moe_onnx.distributed.manifest import MANIFEST_NAME, Manifest, mismatches, rank_record
from moe_onnx.distributed.run import LaunchError, mpirun_command, package_environment, run_session
from moe_onnx.distributed.shard import ShardError, shard
from moe_onnx.ops.moe import GEMM2_ACT, GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU
from moe_onnx.pipeline import optimize_file, shard_file
from moe_onnx.rewrite import optimize
from moe_onnx.verify import PRECISION_TOLERANCE

DRIVER = Path(__file__).with_name("distributed_driver.py")
TOLERANCE = 1e-5  # the largest absolute difference (docs/distributed.md, `moe-onnx run --check`), per unit of |y|
EXPERTS = 8  # 2 local experts at ep = 4
# (tp, ep) per world size
CONFIGS = {2: [(2, 1), (1, 2)], 4: [(4, 1), (1, 4), (2, 2)]}
# The whole LMs' (tp, ep): at four ranks the one that combines TP and EP; their other ops run the same at every
# layout, and the routing-input and fixture models take every layout
WHOLE_CONFIGS = {2: CONFIGS[2], 4: [(2, 2)]}
BACKENDS = ("cpp", "python")
FIXTURE_MODELS = ("mixtral_batched_mm_tiny", "gpt_oss_batched_mm_tiny")
# tiny LMs: input_ids -> logits; aria_text folds a shared expert into its 4 routed ones
WHOLE_MODELS = ("mixtral__tf5__torchscript", "gpt_oss__tf457__torchscript", "aria_text__tf5__dynamo")
# Mixtral in half precision: float16 throughout (the export converted), or its MOE blocks in bfloat16
# (onnxruntime's CPU provider runs few other ops in bfloat16: not the rotary embedding's Sin)
HALF_MODELS = {"mixtral_fp16": "float16", "mixtral_bf16_blocks": "bfloat16"}
HALF_SOURCE = "mixtral__tf5__torchscript"
QMOE_HIDDEN = 32  # the QMOE models' H and I = 64: 4 blocks of 16, one per TP rank at tp = 4


def _quantized(expert_type: str, seed: int, **settings) -> onnx.ModelProto:
    model = moe_model(expert_type, experts=EXPERTS, hidden=QMOE_HIDDEN, inter=64, seed=seed)
    return quantize(model, measure=False, **settings)[0]


# routing-input models: GPT-OSS-like GEMM2 (biases, clamp), Mixtral/Qwen-like GEMM3 and Nemotron-like GEMM2_ACT, as
# MOE nodes and grouped chains, and a drop/pad chain with capacity 2 (most rows dropped at 13 tokens)
MODELS = {
    "gemm2_moe": lambda: moe_model(GEMM2_BIAS_SWIGLU_CLAMP, experts=EXPERTS),
    "gemm3_moe": lambda: moe_model(GEMM3_SWIGLU, experts=EXPERTS, rank3=True),
    "gemm2_act_moe": lambda: moe_model(GEMM2_ACT, experts=EXPERTS, seed=3),
    "gemm2_grouped": lambda: grouped_model(GEMM2_BIAS_SWIGLU_CLAMP, experts=EXPERTS, seed=1),
    "gemm3_grouped": lambda: grouped_model(GEMM3_SWIGLU, experts=EXPERTS, seed=2),
    "drop_pad": lambda: drop_pad_model(capacity=2, experts=EXPERTS),
    # QMOE: int4 blocks of 16 with zero points (their nibbles repacked at tp = 4), and int8 per column
    "qmoe_gemm3_int4": lambda: _quantized(GEMM3_SWIGLU, 4, bits=4, block_size=16, zero_points=True),
    "qmoe_gemm2_int8": lambda: _quantized(GEMM2_BIAS_SWIGLU_CLAMP, 5, bits=8),
}
# T = 0 and 1 (fewer tokens than ranks), 13 (uneven split, random loads), every slot on the first or the last
# EP rank's experts (the other EP ranks receive no rows)
ROUTINGS = {"t0": dict(tokens=0), "t1": dict(tokens=1), "t13": dict(tokens=13),
            "first_experts": dict(tokens=9, only=(0, 1)), "last_experts": dict(tokens=7, only=(6, 7))}


def require_mpirun() -> str:
    program = shutil.which("mpirun")
    if program is None:
        pytest.fail("mpirun was not found: the multi-rank tests need Open MPI (apt-get install openmpi-bin "
                    "libopenmpi-dev) and mpi4py")
    return program


def launch(ranks: int, command: list[str], timeout: float = 300, **env: str) -> tuple[subprocess.CompletedProcess,
                                                                                      float]:
    """Run ``command`` on ``ranks`` processes; returns the finished process and the seconds it took."""
    require_mpirun()
    start = time.monotonic()
    done = subprocess.run(mpirun_command(ranks, command), env={**package_environment(), "OMP_NUM_THREADS": "1", **env},
                          capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - start


def expected_outputs(model_path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return run_session(cached_session(onnx.load(model_path)), inputs)


def _cases(world: int) -> list[tuple[int, int, str, str]]:
    whole = [*WHOLE_MODELS, *HALF_MODELS]  # the whole LMs' other ops: slow on the python host
    return [(tp, ep, model, backend) for tp, ep in CONFIGS[world]
            for model in [*MODELS, *FIXTURE_MODELS, *whole] for backend in BACKENDS
            if model not in whole or (backend == "cpp" and (tp, ep) in WHOLE_CONFIGS[world])]


def _inputs(model: str) -> dict[str, dict[str, np.ndarray]]:
    if model in WHOLE_MODELS or model in HALF_MODELS:
        source = HALF_SOURCE if model in HALF_MODELS else model
        names = [i.name for i in onnx.load(WHOLE_FIXTURES / WHOLE_MANIFEST[source]["file"]).graph.input]
        data = whole_reference_data(source)
        return {key: whole_feeds(names, data[key]) for key in data if key.startswith("input_ids")}
    if model in FIXTURE_MODELS:
        return {"b1s1": random_feeds(model, 1, 1), "b2s3": random_feeds(model, 2, 3)}
    rank3 = model == "gemm3_moe"
    hidden = QMOE_HIDDEN if model.startswith("qmoe") else 8
    return {name: routing_feeds(experts=EXPERTS, hidden=hidden, rank3=rank3, seed=i, **spec)
            for i, (name, spec) in enumerate(ROUTINGS.items())}


def _half_model(precision: str) -> onnx.ModelProto:
    """:data:`HALF_SOURCE` in ``precision`` (:data:`HALF_MODELS`): float16 as exported, bfloat16 blocks fused."""
    model = onnx.load(WHOLE_FIXTURES / WHOLE_MANIFEST[HALF_SOURCE]["file"])
    return as_float16(model) if precision == "float16" else with_bfloat16_blocks(optimize(model)[0])


def assert_close(got: np.ndarray, expected: np.ndarray, model: str, where: str) -> None:
    """Within :data:`TOLERANCE` per unit of the largest |y| (at least 1); a half-precision model within its
    precision's rounding (verify's PRECISION_TOLERANCE, relative and absolute)."""
    if model in HALF_MODELS:
        tolerance = PRECISION_TOLERANCE[HALF_MODELS[model]]
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance, err_msg=where)
    else:
        scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
        np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE * scale, err_msg=where)


def world_results(world: int, root: str) -> dict:
    """Shard every model for every configuration of ``world``, run them all in one mpirun launch, and return
    {(tp, ep, model, backend): [(input name, got, expected)]}; the launch's failure fails the test."""
    root = Path(root)
    sources, runs, table = {}, [], {}
    for name, build in MODELS.items():
        sources[name] = root / f"{name}.onnx"
        onnx.save(build(), sources[name])
    for name in FIXTURE_MODELS:
        sources[name] = FIXTURES / f"{name}.onnx"
    for name in WHOLE_MODELS:
        sources[name] = WHOLE_FIXTURES / WHOLE_MANIFEST[name]["file"]
    for name, precision in HALF_MODELS.items():
        sources[name] = root / f"{name}.onnx"
        if not sources[name].exists():
            onnx.save(_half_model(precision), sources[name])
    fused = dict(sources)
    exports = [*FIXTURE_MODELS, *WHOLE_MODELS, *(name for name, p in HALF_MODELS.items() if p == "float16")]
    for name in exports:  # fused once here, not by every shard_file
        fused[name] = root / f"{name}.fused.onnx"
        if not fused[name].exists():
            optimize_file(sources[name], fused[name])
    inputs = {model: _inputs(model) for model in sources}
    expected = {model: {name: expected_outputs(sources[model], feeds) for name, feeds in inputs[model].items()}
                for model in sources}
    for tp, ep, model, backend in _cases(world):
        directory = root / f"{model}_tp{tp}_ep{ep}"
        if not directory.exists():
            shard_file(fused[model], directory, tp, ep)
        entries = []
        run = {"dir": str(directory), "backend": backend, "inputs": [], "outputs": []}
        for input_name, feeds in inputs[model].items():
            in_path = root / f"{model}_{input_name}.npz"
            np.savez(in_path, **feeds)
            out_path = directory / f"{backend}_{input_name}.out.npz"
            run["inputs"].append(str(in_path))
            run["outputs"].append(str(out_path))
            entries.append((input_name, out_path, expected[model][input_name]))
        runs.append(run)
        table[(tp, ep, model, backend)] = entries
    plan = root / "plan.json"
    plan.write_text(json.dumps({"runs": runs}))
    done, seconds = launch(world, [sys.executable, str(DRIVER), str(plan)], timeout=900)
    assert done.returncode == 0, f"the {world}-rank launch failed ({seconds:.0f} s):\n{done.stdout}\n{done.stderr}"
    print(f"{world} ranks: {sum(len(r['inputs']) for r in runs)} runs of {len(runs)} shards in one launch, "
          f"{seconds:.1f} s")
    return {key: [(name, dict(np.load(path)), expected) for name, path, expected in entries]
            for key, entries in table.items()}


@pytest.fixture(scope="module")
def shard_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("shards"))


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_sharded_outputs_equal_the_unsharded_model(world, shard_root):
    """Every (tp, ep, model, backend) of ``world`` ranks (``_cases``) gives the unsharded model's outputs. One
    test per world size: its cases share one launch, which a test per case would repeat on each xdist worker
    that ran one of them."""
    results = world_results(world, shard_root)
    assert sorted(results) == sorted(_cases(world))
    problems = []
    for (tp, ep, model, backend), entries in results.items():
        for input_name, got, expected in entries:
            where = f"tp{tp}_ep{ep}_{model}_{backend} {input_name}"
            if got.keys() != expected.keys():
                problems.append(f"{where}: outputs {sorted(got)}, expected {sorted(expected)}")
                continue
            for name, value in expected.items():
                if got[name].shape != value.shape:
                    problems.append(f"{where}: {name} is {got[name].shape}, expected {value.shape}")
                    continue
                try:
                    assert_close(got[name], value, model, where)
                except AssertionError as error:
                    problems.append(str(error))
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- the graph transformation

@functools.cache
def _unsharded(model: str) -> onnx.ModelProto:
    return MODELS[model]()


@pytest.mark.slow
@pytest.mark.parametrize("tp, ep", [c for world in CONFIGS for c in CONFIGS[world]], ids=lambda v: str(v))
@pytest.mark.parametrize("model", list(MODELS))
def test_simulated_ranks_equal_the_unsharded_model(model, tp, ep):
    """Every rank in one process (threads, the ops' all-ranks references): the transformation, without MPI."""
    ranks = shard(_unsharded(model), tp=tp, ep=ep)
    sess = cached_session(_unsharded(model))
    for input_name, feeds in _inputs(model).items():
        expected = run_session(sess, feeds)["y"]
        for rank, (got,) in enumerate(run_world(ranks, feeds)):
            assert got.shape == expected.shape
            assert_close(got, expected, model, f"{input_name} rank {rank}")


def test_grouped_chain_keeps_an_empty_batch_empty():
    """Rank-3 hidden states with no tokens: the chain's last Reshape takes the 0 as a 0 (allowzero)."""
    feeds = routing_feeds(0, rank3=True)
    got = run_session(session(grouped_model(GEMM3_SWIGLU, rank3=True)), feeds)["y"]
    assert got.shape == (1, 0, 8)

def _ops(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]


def _weights(model: onnx.ModelProto) -> dict[str, list[int]]:
    return {t.name: list(t.dims) for t in model.graph.initializer}


def test_tensor_parallel_moe_holds_its_intermediate_slice():
    ranks = shard(moe_model(GEMM2_BIAS_SWIGLU_CLAMP, inter=7), tp=2)
    for rank, columns in zip(ranks, (3, 4)):  # I = 7: [0, 3) and [3, 7)
        (node,) = rank.graph.node
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["tp_world_size"], attrs["tp_rank_id"]) == (2, list(ranks).index(rank))
        shapes = [_weights(rank)[name] for name in node.input[3:7]]
        assert shapes == [[4, 8, 2 * columns], [4, 2 * columns], [4, columns, 8], [4, 8]]


def test_gate_up_pairs_stay_together_on_their_tp_rank():
    model = moe_model(GEMM2_BIAS_SWIGLU_CLAMP, inter=5)
    w0 = onnx.numpy_helper.to_array(model.graph.initializer[0])
    ranks = shard(model, tp=2)
    got = [onnx.numpy_helper.to_array(next(t for t in r.graph.initializer if list(t.dims) == [4, 8, n]))
           for r, n in zip(ranks, (4, 6))]
    np.testing.assert_array_equal(np.concatenate(got, axis=2), w0)  # rank 0: pairs 0-1, rank 1: pairs 2-4


def test_expert_parallel_moe_becomes_dispatch_experts_combine():
    """The MOE node runs on the dispatched rows (each its local expert, weight 1) with its 4 local experts' I-slice."""
    ranks = shard(moe_model(GEMM3_SWIGLU, experts=8), tp=2, ep=2)
    ops = _ops(ranks[3])
    assert ops.count("MoeDistributeDispatch") == ops.count("MoeDistributeCombine") == ops.count("MOE") == 1
    (moe,) = [n for n in ranks[3].graph.node if n.op_type == "MOE"]
    assert moe.input[0] == next(n for n in ranks[3].graph.node if n.op_type == "MoeDistributeDispatch").output[0]
    assert sorted(_weights(ranks[3]).values())[-3:] == [[4, 3, 8], [4, 3, 8], [4, 8, 3]]  # 4 local experts, I 6 / 2
    dispatch = next(n for n in ranks[3].graph.node if n.op_type == "MoeDistributeDispatch")
    attrs = {a.name: a.i for a in dispatch.attribute}
    assert attrs == dict(num_experts=8, expert_capacity=0, ep_world_size=2, ep_rank_id=1, tp_world_size=2,
                         tp_rank_id=1)


def test_down_bias_only_on_tp_rank_zero_with_expert_parallelism():
    ranks = shard(moe_model(GEMM2_BIAS_SWIGLU_CLAMP, experts=8), tp=2, ep=2)
    moes = [next(n for n in r.graph.node if n.op_type == "MOE") for r in ranks]
    assert [len([i for i in m.input[3:] if i]) for m in moes] == [4, 3, 4, 3]


def test_drop_pad_capacity_goes_to_dispatch():
    (rank0, _) = shard(drop_pad_model(capacity=3, experts=EXPERTS), tp=1, ep=2)
    dispatch = next(n for n in rank0.graph.node if n.op_type == "MoeDistributeDispatch")
    assert {a.name: a.i for a in dispatch.attribute}["expert_capacity"] == 3
    combine = next(n for n in rank0.graph.node if n.op_type == "MoeDistributeCombine")
    assert len(combine.input) == 4  # the residual x1 travels to combine


def test_grouped_chain_with_tensor_parallelism_all_reduces_in_the_down_linear():
    ranks = shard(grouped_model(GEMM3_SWIGLU), tp=2)
    down = [n for n in ranks[1].graph.node if n.op_type == "MoeRowParallelLinear"][-1]
    attrs = {a.name: a.i for a in down.attribute}
    assert attrs["tp_world_size"] == 2 and attrs["tp_rank_id"] == 1 and attrs["input_is_parallel"] == 1
    assert "MoeInitRouting" in _ops(ranks[1]) and "MoeFinalizeRouting" in _ops(ranks[1])


@pytest.mark.parametrize("model, tp, ep, message", [
    (lambda: moe_model(GEMM3_SWIGLU, experts=6), 1, 4, "6 experts do not split over ep = 4"),
    (lambda: moe_model(GEMM3_SWIGLU, inter=3), 4, 1, "I = 3 is smaller than tp = 4"),
    (lambda: drop_pad_model(2, inter=2), 4, 2, "I = 2 is smaller than tp = 4"),
    (lambda: moe_model(GEMM3_SWIGLU), 0, 1, "both must be >= 1"),
    (lambda: shard(moe_model(GEMM3_SWIGLU), tp=2)[0], 2, 1, "already sharded"),
])
def test_refusals_name_the_reason(model, tp, ep, message):
    with pytest.raises(ShardError, match=message):
        shard(model(), tp=tp, ep=ep)


@pytest.mark.parametrize("settings, tp, message", [
    (dict(bits=8, block_size=32), 4, "QMOE node 'moe': I = 64 holds 2 quantization blocks of block_size 32, "
                                     "fewer than tp = 4 (a TP slice may not split a block)"),
    (dict(bits=4, accuracy_level=4), 2, "accuracy_level 4 with per-column scales (block_size 0) quantizes the down "
                                        "projection's activations over all of I = 64, which tp = 2 would split"),
])
def test_quantized_slices_that_would_split_a_block_are_refused(settings, tp, message):
    with pytest.raises(ShardError, match=re.escape(message)):
        shard(_quantized(GEMM3_SWIGLU, 0, **settings), tp=tp)


def test_quantized_experts_hold_their_blocks_and_experts():
    """tp 2 x ep 2 of int4 codes in blocks of 16 with zero points (I = 64: 2 blocks per TP rank): rank 3 (EP rank 1,
    TP rank 1) holds experts 4-7, the gate/up rows [32, 64) and the down codes' bytes [16, 32) with their blocks."""
    model = _quantized(GEMM3_SWIGLU, 0, bits=4, block_size=16, zero_points=True)
    whole = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    rank3 = shard(model, tp=2, ep=2)[3]
    (node,) = [n for n in rank3.graph.node if n.op_type == "QMOE"]
    held = {t.name: onnx.numpy_helper.to_array(t) for t in rank3.graph.initializer}
    (source,) = [n for n in model.graph.node if n.op_type == "QMOE"]
    gate, down, down_scales, down_zero_points = (3, 7, 10, 13)
    np.testing.assert_array_equal(held[node.input[gate]], whole[source.input[gate]][4:, 32:])
    np.testing.assert_array_equal(held[node.input[down]], whole[source.input[down]][4:, :, 16:])
    np.testing.assert_array_equal(held[node.input[down_scales]], whole[source.input[down_scales]][4:, :, 2:])
    np.testing.assert_array_equal(held[node.input[down_zero_points]], whole[source.input[down_zero_points]][4:, :, 1:])


def test_odd_blocks_of_4_bit_zero_points_are_repacked():
    """tp 4: TP rank 1 takes block 1 of 4 (the high nibble of the first zero-point byte) as its low nibble."""
    model = _quantized(GEMM3_SWIGLU, 0, bits=4, block_size=16, zero_points=True)
    (source,) = [n for n in model.graph.node if n.op_type == "QMOE"]
    packed = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == source.input[13]))
    rank1 = shard(model, tp=4)[1]
    (node,) = [n for n in rank1.graph.node if n.op_type == "QMOE"]
    held = onnx.numpy_helper.to_array(next(t for t in rank1.graph.initializer if t.name == node.input[13]))
    np.testing.assert_array_equal(held, packed[:, :, :1] >> 4)


def test_shared_experts_stay_replicated_under_expert_parallelism():
    """aria_text folds 1 shared expert into its 4 routed ones: at ep = 2 and 4 every rank holds E / ep routed experts
    and the whole shared expert, which it runs on its own tokens; the ranks give the unsharded logits."""
    name = "aria_text__tf5__dynamo"
    fused = optimize(onnx.load(WHOLE_FIXTURES / WHOLE_MANIFEST[name]["file"]))[0]
    feeds = next(iter(_inputs(name).values()))
    expected = run_session(cached_session(fused), feeds)
    for tp, ep in [(1, 2), (2, 2), (1, 4)]:
        ranks = shard(fused, tp=tp, ep=ep)
        for rank in ranks:
            dispatch = [n for n in rank.graph.node if n.op_type == "MoeDistributeDispatch"]
            assert [a.i for n in dispatch for a in n.attribute if a.name == "num_experts"] == [4, 4]
            rows = {n.output[0] for n in dispatch}
            held = sorted((n.input[0] in rows, _weights(rank)[n.input[3]][0]) for n in rank.graph.node
                          if n.op_type == "MOE")
            assert held == [(False, 1), (False, 1), (True, 4 // ep), (True, 4 // ep)]  # shared, local routed
        for rank, outputs in enumerate(run_world(ranks, feeds)):
            assert_close(outputs[0], expected["logits"], name, f"tp {tp} ep {ep} rank {rank}")


def _router_rows(ranks: list[onnx.ModelProto], feeds: dict[str, np.ndarray]) -> list[list[int]]:
    """The rows each rank's routers (MoeGatingTopK nodes) take, from a run with their outputs exposed."""
    exposed = []
    for rank in ranks:
        rank = onnx.ModelProto.FromString(rank.SerializeToString())
        gates = [n.output[0] for n in rank.graph.node if n.op_type == "MoeGatingTopK"]
        rank.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in gates)
        exposed.append(rank)
    return [[len(v) for v in outputs[1:]] for outputs in run_world(exposed, feeds)]


def _softmax_topk_model() -> onnx.ModelProto:
    """:func:`moe_model` (GEMM3, rank-3 hidden states [B, S, 8]) whose routing is its own router: MatMul ->
    Softmax(axis=2) -> TopK(2, axis=2), the unfused form of a rank-3 router."""
    model = moe_model(GEMM3_SWIGLU, experts=EXPERTS, rank3=True)
    router = onnx.numpy_helper.from_array(np.random.default_rng(7).standard_normal((8, EXPERTS)).astype(np.float32),
                                          "router")
    model.graph.initializer.extend([router, onnx.numpy_helper.from_array(np.array([2], np.int64), "k")])
    model.graph.node.insert(0, onnx.helper.make_node("MatMul", ["hidden", "router"], ["logits"]))
    model.graph.node.insert(1, onnx.helper.make_node("Softmax", ["logits"], ["probs"], axis=2))
    model.graph.node.insert(2, onnx.helper.make_node("TopK", ["probs", "k"], ["routing", "indices"], axis=2))
    del model.graph.input[1:]
    return model


def test_a_rank_3_router_is_rebuilt_on_the_ranks_rows():
    """Softmax and TopK on the last axis of [B, S, E] become the same ops on this rank's [T_local, E] rows."""
    model = _softmax_topk_model()
    feeds = {"hidden": np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)}
    expected = run_session(cached_session(model), feeds)["y"]
    ranks = shard(model, tp=1, ep=4)
    for got in run_world(ranks, feeds):
        np.testing.assert_allclose(got[0], expected, rtol=0, atol=TOLERANCE)
    for rank in ranks:
        exposed = onnx.ModelProto.FromString(rank.SerializeToString())
        exposed.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n.output[0])
                                    for n in exposed.graph.node if n.op_type == "Softmax")
        ranks[ranks.index(rank)] = exposed
    assert [outputs[1].shape for outputs in run_world(ranks, feeds)] == [(2, 8), (3, 8), (2, 8), (3, 8)]


@pytest.mark.parametrize("model", ["mixtral__tf5__torchscript", "qmoe"])
def test_each_rank_routes_only_its_tokens(model):
    """Slice first: under ep each rank's router runs on its own rows [T * g // W, T * (g + 1) // W) of the T = 10
    tokens (2 x 5), not on all of them; a QMOE model's too."""
    fused = optimize(onnx.load(WHOLE_FIXTURES / WHOLE_MANIFEST["mixtral__tf5__torchscript"]["file"]))[0]
    if model == "qmoe":
        fused = quantize(fused, bits=8, measure=False)[0]
    feeds = next(iter(_inputs("mixtral__tf5__torchscript").values()))
    tokens = feeds["input_ids"].size
    for tp, ep in [(1, 2), (2, 2)]:
        world = tp * ep
        shares = [tokens * (g + 1) // world - tokens * g // world for g in range(world)]
        assert _router_rows(shard(fused, tp=tp, ep=ep), feeds) == [[share, share] for share in shares]


def test_a_model_without_moe_blocks_is_refused(tmp_path):
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])]), ir_version=10)
    with pytest.raises(ShardError, match="no MoE block"):
        shard(model, tp=2)


def test_an_exported_model_is_optimized_then_sharded(tmp_path):
    manifest = shard_file(FIXTURES / "qwen3_moe_batched_mm_tiny.onnx", tmp_path, tp=1, ep=2)
    assert (manifest.world, manifest.files) == (2, ["rank0.onnx", "rank1.onnx"])
    assert Manifest.read(tmp_path) == manifest
    rank1 = onnx.load(tmp_path / "rank1.onnx")
    assert "MoeDistributeDispatch" in _ops(rank1) and "MoeGatingTopK" in _ops(rank1)


def test_shard_cli(tmp_path, capsys):
    source = tmp_path / "m.onnx"
    onnx.save(moe_model(GEMM3_SWIGLU, experts=6), source)
    assert cli_main(["shard", str(source), "--tp", "2", "-o", str(tmp_path / "out")]) == 0
    document = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert (document["format"], document["world"], document["tp"], document["ep"]) == (1, 2, 2, 1)
    assert [r["file"] for r in document["ranks"]] == ["rank0.onnx", "rank1.onnx"]
    assert cli_main(["shard", str(source), "--ep", "4", "-o", str(tmp_path / "bad")]) == 2
    assert "6 experts do not split over ep = 4" in capsys.readouterr().err


def test_rank_records_detect_another_shard_and_another_rank():
    ranks_a = shard(moe_model(GEMM3_SWIGLU, experts=8), tp=1, ep=2)
    ranks_b = shard(moe_model(GEMM3_SWIGLU, experts=8, inter=4), tp=1, ep=2)
    assert mismatches([rank_record(m, g) for g, m in enumerate(ranks_a)], tp=1) == []
    (problem,) = mismatches([rank_record(ranks_a[0], 0), rank_record(ranks_b[1], 1)], tp=1)
    assert "ranks 0 and 1 hold models of different shards" in problem
    problems = mismatches([rank_record(ranks_a[0], 0), rank_record(ranks_a[0], 1)], tp=1)
    assert "rank 1's model holds the layout (ep_rank_id, tp_rank_id) = (0, 0); rank 1 needs (1, 0)" in problems[0]


def _sized_drop_pad_model(inter: int) -> onnx.ModelProto:
    """:func:`drop_pad_model` whose linears name their sizes (out_features of gate/up, in_features of down)."""
    model = drop_pad_model(capacity=2, inter=inter)
    sizes = {"gate": ("out_features", inter), "up": ("out_features", inter), "down": ("in_features", inter)}
    for node in model.graph.node:
        if node.op_type == "MoeRowParallelLinear":
            node.attribute.append(onnx.helper.make_attribute(*sizes[node.input[2]]))
    return model


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2)])
def test_linears_that_name_their_sizes_shard_and_run(tp, ep):
    """A TP down linear (input_is_parallel) keeps in_features = the full I (docs/ops/MoeRowParallelLinear.md);
    the others name their slice: I = 7 gives TP ranks 3 and 4 columns."""
    ranks = shard(_sized_drop_pad_model(7), tp=tp, ep=ep)
    widths = [{(n.input[2], a.name): a.i for n in rank.graph.node if n.op_type == "MoeRowParallelLinear"
               for a in n.attribute if a.name.endswith("_features")} for rank in ranks[:2]]
    down = 7 if ep == 1 else None  # ep > 1: the down linear has tp_world_size 1 and its X is the slice
    for widths_q, own in zip(widths, (3, 4)):
        assert [v for (_, name), v in widths_q.items() if name == "out_features"] == [own, own]
        assert [v for (_, name), v in widths_q.items() if name == "in_features"] == [down or own]
    feeds = routing_feeds(13, experts=4)
    expected = run_session(session(_sized_drop_pad_model(7)), feeds)["y"]
    for (got,) in run_world(ranks, feeds):
        np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2)])
def test_rank_records_of_an_uneven_intermediate_split_fit_together(tp, ep):
    """I = 7 over tp = 2 gives the TP ranks 3 and 4 columns: linears that name their slice's width differ
    there by design, and the session-start check must not call that different models."""
    ranks = shard(_sized_drop_pad_model(7), tp=tp, ep=ep)
    assert mismatches([rank_record(m, g) for g, m in enumerate(ranks)], tp=tp) == []
    if ep == 1:
        return
    last = ranks[-1]  # EP rank 1, TP rank 1: a width of TP rank 0's slice is a mismatch in its EP group
    next(a for n in last.graph.node for a in n.attribute if a.name == "in_features").i = 3
    (problem,) = mismatches([rank_record(m, g) for g, m in enumerate(ranks)], tp=tp)
    assert f"ranks 1 and {len(ranks) - 1} hold different models: node 'd'" in problem and "'in_features': 4" in problem


def test_run_without_mpirun_says_so(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(LaunchError, match="mpirun was not found"):
        mpirun_command(2, ["python"])
    assert cli_main(["run", "dir", "-n", "2", "--inputs", "in.npz", "-o", "out.npz"]) == 2


@pytest.mark.parametrize("expert_type", [GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU])
def test_tensor_parallel_slices_sum_to_the_whole_moe(expert_type):
    """The ranks' MOE nodes, given to the TP reference (all ranks in one process), give the unsharded y."""
    from moe_onnx.ops.moe import moe, moe_tensor_parallel

    model = moe_model(expert_type, inter=7)
    feeds = routing_feeds(6)

    def inputs(m: onnx.ModelProto) -> tuple[list, dict]:
        (node,) = m.graph.node
        values = {**feeds, **{t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}}
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        return [values[name] if name else None for name in node.input] + [None] * (8 - len(node.input)), attrs

    whole, attrs = inputs(model)
    expected = moe(*whole, **attrs)[0]
    ranks = [inputs(m) for m in shard(model, tp=3)]
    rank_attrs = {k: v for k, v in ranks[0][1].items() if k not in ("tp_world_size", "tp_rank_id")}
    got = moe_tensor_parallel([arrays for arrays, _ in ranks], **rank_attrs)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the runner and its faults

FAULT_BOUND_S = 60  # every failing job must end well within this (the hanging rank sleeps 60 s)


@pytest.fixture(scope="module")
def fault_root(tmp_path_factory) -> Path:
    """A 2-rank expert-parallel shard (shard/), its source (model.onnx) and inputs (in.npz)."""
    root = tmp_path_factory.mktemp("faults")
    onnx.save(moe_model(GEMM3_SWIGLU, experts=EXPERTS), root / "model.onnx")
    shard_file(root / "model.onnx", root / "shard", tp=1, ep=2)
    np.savez(root / "in.npz", **routing_feeds(13, experts=EXPERTS))
    return root


def run_module(ranks: int, directory: Path, inputs: Path, output: Path, **env: str):
    return launch(ranks, [sys.executable, "-m", "moe_onnx.distributed.run", str(directory), "--inputs", str(inputs),
                          "-o", str(output)], timeout=FAULT_BOUND_S + 60, **env)


def run_with_fault(root: Path, kind: str, **env: str):
    plan = root / f"plan_{kind}.json"
    run = {"dir": str(root / "shard"), "backend": "cpp", "inputs": [str(root / "in.npz")],
           "outputs": [str(root / f"out_{kind}.npz")]}
    plan.write_text(json.dumps({"runs": [run], "fault": {"kind": kind, "rank": 1}}))
    return launch(2, [sys.executable, str(DRIVER), str(plan)], timeout=FAULT_BOUND_S + 60, **env)


def assert_failed(done: subprocess.CompletedProcess, seconds: float, *messages: str) -> None:
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert seconds < FAULT_BOUND_S, f"the job took {seconds:.0f} s to end"
    for message in messages:
        assert message in output, f"{message!r} not in:\n{output}"


@pytest.mark.slow
@pytest.mark.mpi
def test_the_runner_writes_rank_0s_outputs(fault_root):
    """Through a symbolic link, to its target (docs/cli.md: what OUT may be)."""
    (fault_root / "out_link.npz").symlink_to("out.npz")
    done, _ = run_module(2, fault_root / "shard", fault_root / "in.npz", fault_root / "out_link.npz")
    assert done.returncode == 0, done.stderr
    expected = expected_outputs(fault_root / "model.onnx", dict(np.load(fault_root / "in.npz")))
    assert (fault_root / "out_link.npz").is_symlink()
    np.testing.assert_allclose(np.load(fault_root / "out.npz")["y"], expected["y"], rtol=0, atol=TOLERANCE)


@pytest.mark.slow
@pytest.mark.mpi
def test_moe_onnx_run_checks_against_the_unsharded_model(fault_root, capsys):
    require_mpirun()
    status = cli_main(["run", str(fault_root / "shard"), "-n", "2", "--inputs", str(fault_root / "in.npz"), "-o",
                       str(fault_root / "cli_out.npz"), "--check", "--reference", str(fault_root / "model.onnx")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "max error" in out and "(ok, tolerance 1e-05)" in out


@pytest.mark.slow
@pytest.mark.mpi
def test_a_rank_that_raises_ends_the_job(fault_root):
    done, seconds = run_with_fault(fault_root, "raise")
    assert_failed(done, seconds, "moe_onnx.distributed.run: rank 1:", "hidden")


@pytest.mark.slow
@pytest.mark.mpi
def test_a_killed_rank_ends_the_job(fault_root):
    done, seconds = run_with_fault(fault_root, "kill")
    assert_failed(done, seconds, "signal 9")


@pytest.mark.slow
@pytest.mark.mpi
def test_a_hanging_rank_makes_the_others_time_out(fault_root):
    done, seconds = run_with_fault(fault_root, "hang", MOE_ONNX_COMM_TIMEOUT_S="3")
    assert_failed(done, seconds, "moe_onnx.distributed.run: rank 0:", "did not complete within 3 s")


@pytest.mark.slow
@pytest.mark.mpi
def test_a_rank_that_hangs_before_its_session_makes_the_others_time_out(fault_root):
    done, seconds = run_with_fault(fault_root, "hang_at_start", MOE_ONNX_COMM_TIMEOUT_S="3")
    assert_failed(done, seconds, "moe_onnx.distributed.run: rank 0:", "session start", "did not complete within 3 s")


@pytest.mark.slow
@pytest.mark.mpi
def test_a_wrong_rank_count_is_refused_on_every_rank(fault_root):
    done, seconds = run_module(3, fault_root / "shard", fault_root / "in.npz", fault_root / "out3.npz")
    assert_failed(done, seconds, "the MPI world has 3 ranks", "run it with -n 2")


@pytest.mark.slow
@pytest.mark.mpi
def test_a_rank_file_of_another_shard_is_detected(fault_root, tmp_path):
    onnx.save(moe_model(GEMM3_SWIGLU, experts=EXPERTS, inter=4), tmp_path / "other.onnx")
    shard_file(tmp_path / "other.onnx", tmp_path / "other", tp=1, ep=2)
    mixed = tmp_path / "mixed"
    shutil.copytree(fault_root / "shard", mixed)
    shutil.copy(tmp_path / "other" / "rank1.onnx", mixed / "rank1.onnx")
    done, seconds = run_module(2, mixed, fault_root / "in.npz", tmp_path / "out.npz")
    assert_failed(done, seconds, "rank 1: ", "does not match", "ranks 0 and 1 hold models of different shards")


@pytest.mark.slow
@pytest.mark.mpi
def test_a_corrupt_rank_file_is_reported_by_its_rank(fault_root, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(fault_root / "shard", broken)
    (broken / "rank1.onnx").write_bytes((broken / "rank1.onnx").read_bytes()[:100])
    done, seconds = run_module(2, broken, fault_root / "in.npz", tmp_path / "out.npz")
    assert_failed(done, seconds, "moe_onnx.distributed.run: rank 1:", "is not an ONNX model")


@pytest.mark.slow
@pytest.mark.mpi
def test_unreadable_inputs_are_reported(fault_root, tmp_path):
    (tmp_path / "in.npz").write_bytes(b"not an npz")
    done, seconds = run_module(2, fault_root / "shard", tmp_path / "in.npz", tmp_path / "out.npz")
    assert_failed(done, seconds, "cannot read the inputs")


def test_large_weights_are_streamed_into_each_ranks_data_file(tmp_path, monkeypatch):
    """A source with external data, ranks over the external-data threshold (lowered to 0 here)."""
    monkeypatch.setattr(model_files, "EXTERNAL_DATA_THRESHOLD", 0)
    source = tmp_path / "model.onnx"
    onnx.save(moe_model(GEMM3_SWIGLU, experts=EXPERTS), source, save_as_external_data=True,
              all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=0)
    shard_file(source, tmp_path / "shard", tp=2, ep=2)
    ranks = [onnx.load(tmp_path / "shard" / f"rank{g}.onnx") for g in range(4)]
    assert all((tmp_path / "shard" / f"rank{g}.onnx.data").is_file() for g in range(4))
    assert [check_model(tmp_path / "shard" / f"rank{g}.onnx") for g in range(4)] == [[]] * 4
    feeds = routing_feeds(11, experts=EXPERTS)
    expected = run_session(session(str(source)), feeds)["y"]
    for (got,) in run_world(ranks, feeds):
        np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE)


@pytest.mark.slow
@pytest.mark.subprocess
def test_sharding_and_its_runner_do_not_load_mpi_on_one_process():
    code = ("import sys, moe_onnx.cli, moe_onnx.distributed.run, moe_onnx.distributed.shard, moe_onnx.pipeline; "
            "assert 'mpi4py' not in sys.modules, 'mpi4py was imported'")
    done = subprocess.run([sys.executable, "-c", code], env=package_environment(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.subprocess
def test_sharding_a_model_without_external_data_holds_about_its_size_in_memory(tmp_path):
    """Weights inside the .onnx file are read expert by expert without converting the whole tensor for each
    expert: the rank models are written in a few times the model's size (the source, the rank's proto and
    its bytes), not a whole copy per expert (22x the model's size here, 1.1 GB, was measured)."""
    source = tmp_path / "model.onnx"
    onnx.save(moe_model(GEMM3_SWIGLU, experts=64, hidden=512, inter=128), source)  # 48 MiB of weights
    code = """
import resource, sys
from moe_onnx.pipeline import shard_file
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
shard_file(sys.argv[1], sys.argv[2], tp=2)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    done = subprocess.run([sys.executable, "-c", code, str(source), str(tmp_path / "shard")],
                          env=package_environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    grown_kib, model_kib = int(done.stdout), source.stat().st_size / 1024
    assert grown_kib < 5 * model_kib, (grown_kib, model_kib)
    assert [check_model(tmp_path / "shard" / f"rank{g}.onnx") for g in range(2)] == [[]] * 2


def test_check_counts_a_nan_in_any_output_as_a_mismatch(tmp_path):
    """`moe-onnx run --check` (run.compare): a NaN where the unsharded model has a number is an infinite error,
    whichever output holds it (max() over [0.0, nan] is 0.0); NaN where both have NaN is equal."""
    from moe_onnx.distributed.run import compare

    a, b = (onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2]) for n in ("a", "b"))
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["a"]),
                                    onnx.helper.make_node("Identity", ["x"], ["b"])], "two_outputs",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])], [a, b])
    reference = tmp_path / "reference.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8), reference)
    np.savez(tmp_path / "in.npz", x=np.array([1.0, np.nan], np.float32))
    np.savez(tmp_path / "out.npz", a=np.array([1.0, np.nan], np.float32), b=np.array([np.nan, np.nan], np.float32))
    errors = compare(reference, tmp_path / "in.npz", tmp_path / "out.npz")
    assert errors == {"a": 0.0, "b": float("inf")}
