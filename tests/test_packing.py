"""Initializer weights packed on first use (packed_weights.h, ConstantExperts): each expert is packed by
the first run that routes rows to it, in every weight format, with the bits of per-run packing whatever
experts earlier runs packed and whatever the thread count; creating a session packs nothing, and the
weights of an external-data model are resident once (the pages onnxruntime mapped are reclaimed as
their experts are packed)."""

from __future__ import annotations

import ctypes
import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import isa_levels
import numpy as np
import onnx
import pytest
from backends import options
from cases import Case
from cases import moe as moe_cases
from cases import qmoe as qmoe_cases
from cases import row_parallel_linear as linear_cases
from cases.moe import BF16, GEMM2, GEMM2_ACT, GEMM3
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.runtime import kernel_report, run


def _moe(name, expert_type, dtype, **attrs):
    inputs = moe_cases.make_inputs(tokens=9, hidden=40, inter=24, experts=5, k=2, expert_type=expert_type, dtype=dtype,
                                   seed=len(name))
    attrs = {"expert_type": expert_type, **attrs}
    if expert_type == GEMM2:
        attrs.setdefault("expert_beta", 7.0)
    if expert_type == GEMM2_ACT:
        attrs["activation"] = "silu"
    return Case("MOE", name, inputs, attrs, constant=moe_cases.WEIGHTS)


def _qmoe(name, expert_type, **kw):
    quant = {key: kw[key] for key in ("bits", "block_size", "quant_type") if key in kw}
    inputs = qmoe_cases.make_inputs(tokens=9, hidden=64, inter=32, experts=5, k=2, expert_type=expert_type,
                                    seed=len(name), **kw)
    attrs = {"expert_type": expert_type, **quant}
    if expert_type == GEMM2:
        attrs["expert_beta"] = 7.0
    if expert_type == GEMM2_ACT:
        attrs["activation"] = "silu"
    return Case("QMOE", name, inputs, attrs, constant=qmoe_cases.CONSTANT)


def _linear(name, dtype, **attrs):
    inputs = linear_cases.make_inputs(offsets=(0, 3, 3, 8, 11), lead=(11,), k=37, n=21, dtype=dtype, seed=len(name))
    return Case("MoeRowParallelLinear", name, inputs, attrs, constant=(linear_cases.W, linear_cases.B))


# One case per weight format (packed_weights.h's WeightFormat) and way of filling its panels: float
# panels (gate/up from two sources, interleaved gate/up columns, plain [K, N] columns), bf16 pair panels
# (accuracy_level 3: where the CPU has no bf16 GEMM, level 0's panels), int8 pairs or quads, quantized
# panels (int4/int8, per column or block-wise, zero points, E2M1).
CASES = [
    _moe("moe_f32_gemm3", GEMM3, np.float32),
    _moe("moe_f16_gemm2_parity1", GEMM2, np.float16, gate_parity=1),
    _moe("moe_bf16_gemm2_act", GEMM2_ACT, BF16),
    _moe("moe_f32_gemm2_level3", GEMM2, np.float32, accuracy_level=3),
    _moe("moe_f16_gemm3_level3", GEMM3, np.float16, accuracy_level=3),
    _qmoe("qmoe_int4_block16_zp_gemm3", GEMM3, bits=4, block_size=16, zero_points=True),
    _qmoe("qmoe_int8_per_column_zp_gemm2", GEMM2, bits=8, zero_points=True),
    _qmoe("qmoe_mxfp4_gemm2_act", GEMM2_ACT, bits=4, block_size=32, quant_type="mxfp4"),
    _linear("linear_int8", np.int8),
    _linear("linear_bf16", BF16),
    _linear("linear_f32_level3", np.float32, accuracy_level=3),
]


def _one_expert_feeds(case: Case) -> dict[str, np.ndarray]:
    """The case's runtime inputs with every row routed to expert 1 (a run that packs only it)."""
    feeds = case.feeds()
    if case.op == "MoeRowParallelLinear":
        offsets = feeds["expert_offset"]
        feeds["expert_offset"] = np.array([0, 0] + [offsets[-1]] * (len(offsets) - 2), np.int64)
    else:
        feeds["router_topk_output_indices"] = np.ones_like(feeds["router_topk_output_indices"])
    return feeds


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_first_use_packing_gives_per_run_bits(case):
    """Whatever experts earlier runs packed (none, or only expert 1) and on 1, 2 or 3 threads, a run on
    initializer weights gives the bits of the same node packing its weights per run."""
    per_run = dataclasses.replace(case, constant=())
    expected = run(moe_onnx.session(per_run.model().SerializeToString(), sess_options=options(2)), per_run.feeds())
    model = case.model().SerializeToString()
    for threads in (1, 2, 3):
        for first in ("all", "one expert"):
            sess = moe_onnx.session(model, sess_options=options(threads))
            if first == "one expert":
                run(sess, _one_expert_feeds(case))
            for _ in range(2):  # packing, then packed
                got = run(sess, case.feeds())
                for g, e in zip(got, expected):
                    np.testing.assert_array_equal(g.view(np.uint8), e.view(np.uint8), err_msg=f"{threads} {first}")


# Resident memory of a child process, in MB (/proc/self/status): before and after creating a session on
# an external-data MOE model, after a run that routes rows to one expert and after one that routes
# rows to every expert.
_MEMORY_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import moe_onnx
    from moe_onnx._ir import model_files

    def status():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "RssAnon", "RssFile")}

    path, E, H = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    x = np.random.default_rng(0).standard_normal((4 * E, H), dtype=np.float32)
    routing = np.full((4 * E, 2), 0.5, np.float32)
    out = {"start": status()}
    sess = moe_onnx.session(path)
    out["created"] = status()
    sess.run(None, {"x": x, "routing": routing, "indices": np.ones((4 * E, 2), np.int64)})
    out["one expert"] = status()
    sess.run(None, {"x": x, "routing": routing, "indices": (np.arange(8 * E) % E).reshape(4 * E, 2)})
    out["every expert"] = status()
    print(json.dumps(out))
""")


def _moe_file(tmp_path, E: int, H: int, I: int, inline: bool,
              written: Sequence[int] | None = None) -> tuple[str, float]:
    """A GEMM3_SWIGLU MOE model with float32 weights in an external data file (or inside the .onnx); its path and
    weight MB. With `written`, only those experts' weights are written (external data): the others are a hole of
    the file (zeros, no disk)."""
    rng = np.random.default_rng(0)
    inits = []
    with open(tmp_path / "moe.data", "wb") as data:
        for name, shape in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I))):
            offset = data.seek(0, io.SEEK_END)
            offset += -offset % 4096
            length = E * shape[1] * shape[2] * 4
            if written is not None:
                for e in written:
                    data.seek(offset + e * length // E)
                    data.write((rng.standard_normal(shape[1:], dtype=np.float32) * 0.05).tobytes())
                data.truncate(offset + length)
            else:
                weights = rng.standard_normal(shape, dtype=np.float32) * 0.05
                if inline:
                    inits.append(onnx.numpy_helper.from_array(weights, name))
                    continue
                data.seek(offset)
                data.write(weights.tobytes())
            t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape, data_location=TensorProto.EXTERNAL)
            for key, value in (("location", "moe.data"), ("offset", str(offset)), ("length", str(length))):
                t.external_data.add(key=key, value=value)
            inits.append(t)
    node = helper.make_node("MOE", ["x", "routing", "indices", "gate", "", "up", "", "down"], ["y"],
                            domain=moe_onnx.DOMAIN, expert_type=GEMM3)
    graph = helper.make_graph(
        [node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H]),
                        helper.make_tensor_value_info("routing", TensorProto.FLOAT, ["T", 2]),
                        helper.make_tensor_value_info("indices", TensorProto.INT64, ["T", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", H])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(moe_onnx.DOMAIN, moe_onnx.OPSET_VERSION)],
                              ir_version=10)
    (tmp_path / "moe.onnx").write_bytes(model.SerializeToString())
    return str(tmp_path / "moe.onnx"), 3 * E * I * H * 4 / 2**20


def _memory_and_swap_bytes() -> int:
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(meminfo[key].split()[0]) * 1024 for key in ("MemTotal", "SwapTotal"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MAP_NORESERVE and /proc/meminfo: Linux")
def test_a_model_larger_than_memory_starts(tmp_path):
    """A model whose weights are twice memory plus swap (a sparse external data file: only the two experts the
    run uses hold data) starts and runs: the packed copy's address space is reserved without committing memory
    (MAP_NORESERVE) and a run packs only the experts it routes to. Its outputs are the bits of a model of those
    two experts alone."""
    H = I = 512
    E = -(-2 * _memory_and_swap_bytes() // (3 * H * I * 4))
    last = E - 1
    path, _ = _moe_file(tmp_path, E, H, I, inline=False, written=[0, last])
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((3, H), dtype=np.float32), "routing": rng.random((3, 2), dtype=np.float32),
             "indices": np.array([[0, last], [last, 0], [0, last]], np.int64)}
    got = run(moe_onnx.session(path, sess_options=options(2), packed_weights=None), feeds)

    pair = onnx.load(path, load_external_data=False)  # the two experts' weights, read from the file's data
    for i, init in enumerate(pair.graph.initializer):
        offset = int({e.key: e.value for e in init.external_data}["offset"])
        weights = np.memmap(tmp_path / "moe.data", np.float32, "r", offset, tuple(init.dims))[[0, last]]
        pair.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(np.array(weights), init.name))
    expected = run(moe_onnx.session(pair, sess_options=options(2)),
                   {**feeds, "indices": np.where(feeds["indices"] == last, 1, 0)})
    assert got[0].tobytes() == expected[0].tobytes()
    assert np.abs(got[0]).max() > 0


@pytest.mark.slow
@pytest.mark.parametrize("inline", [False, True], ids=["external data", "inline"])
def test_weights_are_resident_once(tmp_path, inline):
    """Creating the session packs nothing; a run packs the experts it uses; after every expert is packed,
    the process holds the weights once (packed, anonymous; onnxruntime's file pages released): within
    1.15x the weights plus the run's buffers. Inline weights likewise: the session maps them from a
    temporary file (moe_onnx.runtime.weights_file) rather than onnxruntime copying them."""
    E, H, I = 8, 1024, 1024
    path, weight_mb = _moe_file(tmp_path, E, H, I, inline)
    child = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, path, str(E), str(H)], capture_output=True,
                           text=True, check=True)
    rss = json.loads(child.stdout)
    grown = {stage: {key: value - rss["start"][key] for key, value in figures.items()}
             for stage, figures in rss.items()}
    code = 16  # MB: onnxruntime's and our libraries' pages first touched by a session and a run
    assert grown["created"]["RssAnon"] < 0.05 * weight_mb, grown
    assert grown["created"]["VmRSS"] < 0.05 * weight_mb + code, grown
    one_expert = weight_mb / E
    assert 0.9 * one_expert < grown["one expert"]["RssAnon"] < 1.15 * one_expert + code, grown
    activations = 4 * E * 2 * (H + 2 * I) * 4 / 2**20  # the run's rows, activations and outputs
    assert grown["every expert"]["VmRSS"] < 1.15 * weight_mb + activations + code, grown
    assert grown["every expert"]["RssFile"] < 0.05 * weight_mb + code, grown


# ----------------------------------------------------------------------------- the panels' bytes

LEVELS = isa_levels.LEVELS  # isa.h's levels of this architecture, in order
#: the fast lane packs at the level this process's kernels run (this CPU's best: its tile copies where it has them);
#: the other levels are slow
LEVEL_LANES = [level if level == kernel_report()["level"] else pytest.param(level, marks=pytest.mark.slow)
               for level in LEVELS]
# packed_weights.h's WeightFormat, as ints
F32, F16, BF16_PANELS, INT8_PAIRS, INT8_QUADS, BF16_PAIRS, INT8_OCTETS = 0, 1, 2, 3, 4, 6, 7
_ONNX_TYPE = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
              np.dtype(BF16): TensorProto.BFLOAT16, np.dtype(np.int8): TensorProto.INT8}
# (format, source type, N, K): whole 16-column panels and a part one; K of whole tiles, with a tail, below one tile
PANEL_CASES = [(fmt, dtype, n, k) for fmt, dtypes in ((F32, [np.float32]), (F16, [np.float16]), (BF16_PANELS, [BF16]),
                                                      (INT8_PAIRS, [np.int8]), (INT8_QUADS, [np.int8]),
                                                      (INT8_OCTETS, [np.int8]),
                                                      (BF16_PAIRS, [np.float32, np.float16, BF16]))
               for dtype in dtypes for n, k in ((37, 128), (32, 100), (16, 13))]


def _expected_panels(fmt: int, w: np.ndarray) -> bytes:
    """The panels of W [N, K] (x @ W^T) in `fmt`, as packed_weights.h lays them out."""
    n, k = w.shape
    panels = -(-n // 16)
    rows = {INT8_PAIRS: -(-k // 2) * 2, INT8_QUADS: -(-k // 4) * 4, INT8_OCTETS: -(-k // 8) * 8,
            BF16_PAIRS: -(-k // 32) * 32}.get(fmt, k)
    if fmt == BF16_PAIRS:
        w = w.astype(np.float32).astype(BF16)
    dtype = np.int16 if fmt == INT8_PAIRS else w.dtype
    columns = np.zeros((panels * 16, rows), dtype)
    columns[:n, :k] = w
    per_element = {INT8_PAIRS: 2, INT8_QUADS: 4, INT8_OCTETS: 8, BF16_PAIRS: 2}.get(fmt, 1)  # k side by side in a lane
    body = columns.reshape(panels, 16, rows // per_element, per_element).transpose(0, 2, 1, 3)
    if fmt == BF16_PANELS:  # lanes interleaved: column c at 2c (c < 8), 2(c - 8) + 1
        body = body[:, :, [c // 2 + 8 * (c % 2) for c in range(16)]]
    if fmt != INT8_QUADS:
        return np.ascontiguousarray(body).tobytes()
    sums = columns.reshape(panels, 16, rows).astype(np.int64).sum(-1)
    corrections = (-128 * sums % 2**32).astype(np.uint32)  # wrapping like the GEMM's int32 sums
    return b"".join(c.tobytes() + np.ascontiguousarray(b).tobytes() for c, b in zip(corrections, body))


def packing_mismatches() -> list[str]:
    """The PANEL_CASES whose packed bytes differ from _expected_panels, from nn.Linear [N, K] weights (the tile
    copy where it serves) or from [K, N] ones (element by element)."""
    lib = ctypes.CDLL(moe_onnx.custom_ops_library())
    lib.MoeOnnxPackExpert.restype = ctypes.c_int64
    lib.MoeOnnxPackExpert.argtypes = [ctypes.c_int] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [
        ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64]
    rng = np.random.default_rng(0)
    mismatches = []
    for fmt, dtype, n, k in PANEL_CASES:
        w = (rng.integers(-128, 128, (n, k)) if dtype == np.int8 else rng.standard_normal((n, k))).astype(dtype)
        expected = _expected_panels(fmt, w)
        for plain, source in ((0, w), (1, np.ascontiguousarray(w.T))):
            mismatches += _mismatch(f"format {fmt} {np.dtype(dtype).name} N={n} K={k} plain={plain}", expected,
                                    lambda *out, source=source, plain=plain: lib.MoeOnnxPackExpert(
                                        fmt, _ONNX_TYPE[np.dtype(dtype)], plain, n, k, source.ctypes.data, *out))
    return mismatches


def _mismatch(label: str, expected: bytes, pack) -> list[str]:
    """[label, with what was packed] when pack(out, out_bytes, error, error_size), a test hook that returns the
    bytes it packed (copying at most out_bytes), does not write `expected`; else []."""
    out = np.zeros(len(expected) + 64, np.uint8)
    error = ctypes.create_string_buffer(256)
    size = pack(out.ctypes.data, out.size, error, 256)
    if size == len(expected) and out[:size].tobytes() == expected:
        return []
    return [f"{label}: {size} bytes, {len(expected)} expected {error.value.decode()}"]


@pytest.mark.subprocess
@pytest.mark.parametrize("level", LEVEL_LANES)
def test_panels_are_the_layouts_bytes(level):
    """Every weight format's panels, at each ISA level this machine has, are the bytes of the layout
    packed_weights.h describes, whether the tile copy (transpose_tile.h) or the element-by-element path writes
    them; the AVX-512 tile copy runs from the avx512 level up."""
    kernel, mismatches = _at_level(level, "transpose_tile", "packing_mismatches")
    assert kernel == ("avx512" if "avx512" in LEVELS and LEVELS.index(level) >= LEVELS.index("avx512") else "portable")
    assert mismatches == []


def _at_level(level: str, slot: str, mismatches: str) -> tuple[str, list[str]]:
    """In a process capped at ISA level `level` (skipped above this machine's): the table's kernel in `slot` and
    what this module's function `mismatches` returns."""
    available = kernel_report()["level"]
    if LEVELS.index(level) > LEVELS.index(available):
        pytest.skip(f"ISA level {level} needs a CPU that has it: this machine's highest level is {available}")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_packing as t\n"
            f"print(json.dumps([t.kernel_report()[{slot!r}], t.{mismatches}()]))")
    env = {**{k: v for k, v in os.environ.items() if k != "MOE_ONNX_AMX"}, "MOE_ONNX_GEMM": level}
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return tuple(json.loads(out.stdout))


# ----------------------------------------------------------------------------- quantized panels' bytes

INT4, INT8, E2M1 = 0, 1, 2  # qgemm.h's QuantCode, as ints
_SCALE_TYPE = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(BF16): TensorProto.BFLOAT16, np.dtype(np.uint8): TensorProto.UINT8}


@dataclasses.dataclass(frozen=True)
class QuantCase:
    """One expert matrix of QMOE's quantized panels (qgemm.h's QuantPanels), from sources laid out as QMOE's
    inputs: `sources` "plain" (one [N, K] linear), "halves" (MOE's gate/up panels: two linears of N columns, lanes
    0-7 and 8-15; only the first with zero points when zero_points is "first") or "parity" (one [2N, K] linear,
    rows 2c and 2c + 1 into the two halves). block 0: per-column scales; nibble_offset: the codes start a nibble
    into their tensor (4-bit codes not at a byte)."""
    name: str
    code: int
    K: int
    block: int
    N: int
    scale_dtype: np.dtype = np.dtype(np.float32)
    zero_points: str = "none"  # "none", "all", "first"
    sources: str = "plain"
    level4: bool = False
    nibble_offset: int = 0

    @property
    def bits(self) -> int:
        return 8 if self.code == INT8 else 4


# Every layout variant: int4 (blocks of 16/32/64, per column), int8 (blocks, per column), E2M1 with E8M0 scales;
# with and without zero points (and a pair of linears of which only one has them); fp32/fp16/bf16 scales;
# accuracy levels 0 and 4; N not a multiple of 16 (a part panel), K of 16 or more blocks (the header tiles) and
# a tail, per-column K not a multiple of the codes' group.
QUANT_CASES = [
    QuantCase("int4_b32", INT4, 512, 32, 37),
    QuantCase("int4_b64_zp", INT4, 64 * 17, 64, 32, zero_points="all"),
    QuantCase("int4_b16_zp_first_halves_f16", INT4, 16 * 17, 16, 13, np.dtype(np.float16), "first", "halves"),
    QuantCase("int8_b16_zp_parity_bf16", INT8, 16 * 17, 16, 11, np.dtype(BF16), "all", "parity"),
    QuantCase("int8_per_column_zp", INT8, 37, 0, 21, zero_points="all"),
    QuantCase("int4_per_column_zp_f16", INT4, 38, 0, 19, np.dtype(np.float16), "all"),
    QuantCase("e2m1_b32", E2M1, 32 * 17, 32, 37, np.dtype(np.uint8)),
    QuantCase("int4_b32_zp_level4", INT4, 256, 32, 16, zero_points="all", level4=True),
    QuantCase("int8_b32_level4_bf16", INT8, 512, 32, 37, np.dtype(BF16), level4=True),
    QuantCase("int4_b16_mid_byte", INT4, 256, 16, 17, zero_points="all", nibble_offset=1),
]
QUANT_SLOTS = 3


def _elements(data: np.ndarray, bits: int) -> np.ndarray:
    """A uint8 tensor's elements of `bits` bits, flat (4: the low nibble of a byte first)."""
    flat = data.reshape(-1)
    return flat if bits == 8 else np.stack([flat & 15, flat >> 4], -1).reshape(-1)


def _quant_sources(case: QuantCase, rng) -> list[list[dict]]:
    """Per slot, its sources as packed_weights.h's QuantizedColumns (dicts; numpy arrays for the pointers), from
    random QMOE inputs of QUANT_SLOTS experts (every byte random; E8M0 scales 0 and 255 among them)."""
    blocks = case.K // case.block if case.block else 1
    rows = 2 * case.N if case.sources == "parity" else case.N

    def linear(with_zero_points: bool) -> dict:
        codes = rng.integers(0, 256, (QUANT_SLOTS, rows * case.K * case.bits // 8 + 1), dtype=np.uint8)
        if case.code == E2M1:
            scales = rng.integers(0, 256, (QUANT_SLOTS, rows, blocks), dtype=np.uint8)
        else:
            scales = rng.standard_normal((QUANT_SLOTS, rows, blocks)).astype(np.float32).astype(case.scale_dtype)
        zp_bytes = -(-(blocks if case.block else rows) * case.bits // 8)
        zp_shape = (QUANT_SLOTS, rows, zp_bytes) if case.block else (QUANT_SLOTS, zp_bytes)
        zero_points = rng.integers(0, 256, zp_shape, dtype=np.uint8) if with_zero_points else None
        return {"codes": codes, "scales": scales, "zero_points": zero_points}

    def columns(t: dict, e: int, row0: int, step: int, width: int, lane0: int) -> dict:
        per_byte = 8 // case.bits
        zp = t["zero_points"]
        if zp is None:
            zp_first = zp_stride = zp_block_stride = 0
        elif case.block:
            zp_row = zp.shape[-1] * per_byte
            zp_first, zp_stride, zp_block_stride = (e * rows + row0) * zp_row, step * zp_row, 1
        else:
            zp_first, zp_stride, zp_block_stride = e * zp.shape[-1] * per_byte + row0, step, 0
        codes_first = e * t["codes"].shape[1] * per_byte + case.nibble_offset + row0 * case.K
        return {"codes": t["codes"], "codes_first": codes_first, "codes_stride": step * case.K, "scales": t["scales"],
                "scales_first": (e * rows + row0) * blocks, "scales_stride": step * blocks, "zero_points": zp, "zero_points_first": zp_first,
                "zero_points_stride": zp_stride, "zero_points_block_stride": zp_block_stride, "columns": case.N,
                "width": width, "lane0": lane0}

    first = linear(case.zero_points != "none")
    if case.sources == "plain":
        return [[columns(first, e, 0, 1, 16, 0)] for e in range(QUANT_SLOTS)]
    if case.sources == "parity":
        return [[columns(first, e, 0, 2, 8, 0), columns(first, e, 1, 2, 8, 8)] for e in range(QUANT_SLOTS)]
    second = linear(case.zero_points == "all")
    return [[columns(first, e, 0, 1, 8, 0), columns(second, e, 0, 1, 8, 8)] for e in range(QUANT_SLOTS)]


def _expected_quant_panels(case: QuantCase, sources: list[dict]) -> bytes:
    """One slot's quantized panels as qgemm.h lays them out, each lane's codes, scales and zero points read at
    the elements packed_weights.h's QuantizedColumns names."""
    K, bits = case.K, case.bits
    block = case.block or K
    blocks, group = K // block, 8 if bits == 4 else 4
    groups = -(-block // group)
    panels = max(-(-src["columns"] // src["width"]) for src in sources)
    scales = np.zeros((panels * 16, blocks), np.uint8 if case.code == E2M1 else np.float32)  # E2M1: E8M0 bytes
    zero_points = np.zeros((panels * 16, blocks), np.uint8)
    codes = np.zeros((panels * 16, blocks, groups * group), np.uint8)
    for src in sources:
        all_codes = _elements(src["codes"], bits)
        all_scales = src["scales"].astype(scales.dtype).reshape(-1)
        for c in range(src["columns"]):
            lane = (c // src["width"]) * 16 + src["lane0"] + c % src["width"]
            first = src["codes_first"] + c * src["codes_stride"]
            codes[lane, :, :block] = all_codes[first:first + K].reshape(blocks, block)
            first = src["scales_first"] + c * src["scales_stride"]
            scales[lane] = all_scales[first:first + blocks]
            if src["zero_points"] is not None:
                first = src["zero_points_first"] + c * src["zero_points_stride"]
                zero_points[lane] = _elements(src["zero_points"], bits)[
                    first + np.arange(blocks) * src["zero_points_block_stride"]]
            else:
                zero_points[lane] = 1 << (bits - 1)
    # [panel, block, group, lane, row]
    codes = codes.reshape(panels, 16, blocks, groups, group).transpose(0, 2, 3, 1, 4)
    if bits == 4:  # byte i: row i low, 4 + i high
        codes = codes[..., :4] | codes[..., 4:] << 4
    out = []
    for p in range(panels):
        for b in range(blocks):
            out.append(scales[16 * p:16 * p + 16, b].tobytes())
            if case.zero_points != "none":
                out.append(zero_points[16 * p:16 * p + 16, b].tobytes())
            out.append(np.ascontiguousarray(codes[p, b]).tobytes())
    return b"".join(out)


def quant_packing_mismatches() -> list[str]:
    """The QUANT_CASES whose packed slots, on 1 and 2 threads, differ from _expected_quant_panels."""
    class QuantizedColumns(ctypes.Structure):  # packed_weights.h's
        _fields_ = [("codes", ctypes.c_void_p), ("codes_first", ctypes.c_int64), ("codes_stride", ctypes.c_int64),
                    ("scales", ctypes.c_void_p), ("scale_type", ctypes.c_int), ("scales_first", ctypes.c_int64),
                    ("scales_stride", ctypes.c_int64), ("zero_points", ctypes.c_void_p),
                    ("zero_points_first", ctypes.c_int64), ("zero_points_stride", ctypes.c_int64),
                    ("zero_points_block_stride", ctypes.c_int64), ("columns", ctypes.c_int64),
                    ("width", ctypes.c_int64), ("lane0", ctypes.c_int64)]

    lib = ctypes.CDLL(moe_onnx.custom_ops_library())
    lib.MoeOnnxPackQuantized.restype = ctypes.c_int64
    lib.MoeOnnxPackQuantized.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_int64, ctypes.POINTER(QuantizedColumns), ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_char_p, ctypes.c_int64]
    rng = np.random.default_rng(0)
    mismatches = []
    for case in QUANT_CASES:
        slots = _quant_sources(case, rng)
        expected = b"".join(_expected_quant_panels(case, sources) for sources in slots)
        flat = [src for sources in slots for src in sources]
        structs = (QuantizedColumns * len(flat))(*[QuantizedColumns(
            **{key: value.ctypes.data if isinstance(value, np.ndarray) else value for key, value in src.items()
               if value is not None},
            scale_type=_SCALE_TYPE[src["scales"].dtype]) for src in flat])
        for threads in (1, 2):
            mismatches += _mismatch(f"{case.name} on {threads} threads", expected,
                                    lambda *out, threads=threads: lib.MoeOnnxPackQuantized(
                                        case.code, case.K, case.block or case.K, case.zero_points != "none",
                                        case.level4, case.N * len(slots[0]), structs, len(slots[0]), len(slots),
                                        threads, *out))
    return mismatches


@pytest.mark.subprocess
@pytest.mark.parametrize("level", LEVEL_LANES)
def test_quantized_panels_are_the_layouts_bytes(level):
    """QMOE's quantized panels, every layout variant (QUANT_CASES), at each ISA level this machine has and on 1
    and 2 threads, are the bytes of the layout qgemm.h describes, whether the table's quant_code_groups kernel
    (transpose_tile.h: AVX2 from the avx2 level, AVX-512 from avx512) or the element-by-element path writes
    them."""
    kernel, mismatches = _at_level(level, "quant_code_groups", "quant_packing_mismatches")
    assert kernel == {"portable": "portable", "avx2": "avx2", **{arm: "portable" for arm in isa_levels.ARM64_LEVELS}}.get(
        level, "avx512")
    assert mismatches == []


def test_inline_weights_are_mapped_from_a_deleted_file(tmp_path):
    """A session on a model whose large initializers are inline gets them from a temporary external data file
    (moe_onnx.runtime.weights_file), gone once the session exists while its mapping lasts; the caller's model is
    left as it was, and the outputs are those of the same weights as external data."""
    E, H, I = 4, 256, 256  # 1 MiB per weight: the smallest moved
    (tmp_path / "inline").mkdir()
    (tmp_path / "external").mkdir()
    model = onnx.load(_moe_file(tmp_path / "inline", E, H, I, inline=True)[0])
    x = np.random.default_rng(1).standard_normal((8, H), dtype=np.float32)
    feeds = {"x": x, "routing": np.full((8, 2), 0.5, np.float32), "indices": (np.arange(16) % E).reshape(8, 2)}
    sess = moe_onnx.session(model)
    maps = [line.split()[-2:] for line in open("/proc/self/maps") if "moe-onnx-weights-" in line]
    assert maps and all(path.endswith("weights.data") and state == "(deleted)" for path, state in maps), maps
    assert not any(Path(path).parent.exists() for path, _ in maps)
    assert all(t.HasField("raw_data") for t in model.graph.initializer)
    external = moe_onnx.session(_moe_file(tmp_path / "external", E, H, I, inline=False)[0])
    np.testing.assert_array_equal(run(sess, feeds)[0], run(external, feeds)[0])
