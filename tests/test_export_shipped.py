"""`moe-onnx export` of checkpoints as they ship: the committed tiny checkpoints of models/fixtures/shipped (GPT-OSS
with MXFP4 experts, Qwen3-MoE and DeepSeek-V3 with block-scaled FP8 linears, Mixtral in bfloat16; made by
models/export_shipped_fixtures.py) and their exports give transformers' greedy tokens (transformers dequantizes on
a CPU), the MXFP4 experts are the checkpoint's bytes, the checkpoint reader's formats and refusals; where torch is
installed, the export itself runs (streamed from the checkpoint: each weight computed as it is written) and its
quantized form equals `moe-onnx quantize` of the float one."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import moe_onnx
from decoders import assert_generates_reference, genai_config, genai_tokens
from moe_onnx.cli import main as cli
from moe_onnx.export import export_checkpoint
from moe_onnx._ir.weights import WRITE_CHUNK_BYTES
from moe_onnx.export.checkpoint import Checkpoint, CheckpointError, StoredSource, TensorSpec, write_safetensors
from moe_onnx.genai_folder import GenaiFolder
from moe_onnx.ops import signatures
from moe_onnx.ops.qmoe import E2M1_VALUES

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "shipped"
QUICK_START = SHIPPED.parent / "checkpoints" / "qwen3_moe"
NAMES = sorted(folder.name for folder in SHIPPED.iterdir())
#: each fixture's experts once exported (QMOE mxfp4: the checkpoint's codes and scales)
EXPERT_OPS = {"gpt_oss_mxfp4": ["MoeGatingTopK", "MoeGatingTopK", "QMOE", "QMOE"]}
_NEEDS_TORCH = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
    reason="the export needs torch and transformers (the export extra); the tests above check its committed "
           "results without them")


def _our_ops(path: Path) -> list[str]:
    return sorted(node.op_type for node in onnx.load(path, load_external_data=False).graph.node
                  if node.domain == "moe_onnx")


def test_every_format_has_a_fixture():
    formats = {json.loads((SHIPPED / name / "checkpoint" / "config.json").read_text()).get(
        "quantization_config", {}).get("quant_method") for name in NAMES}
    assert formats == {"mxfp4", "fp8", None}


@pytest.mark.parametrize("name", NAMES)
def test_export_gives_transformers_tokens(name):
    """The committed export of each shipped checkpoint (fp32, fused) generates transformers' 32 greedy tokens with
    the KV cache, every step's logits within 1e-4."""
    folder = SHIPPED / name / "export"
    assert _our_ops(folder / "model.onnx") == EXPERT_OPS.get(name, ["MOE", "MOE", "MoeGatingTopK", "MoeGatingTopK"])
    assert_generates_reference(moe_onnx.session(folder / "model.onnx"), folder, SHIPPED / name / "reference.npz")


def test_last_position_logits_run_in_onnxruntime_genai(tmp_path):
    """The export's decoder outputs the last position's logits only ([batch_size, 1, vocab]); onnxruntime-genai 0.18
    takes such a decoder (its "pruned" logits) and generates transformers' tokens with it."""
    export = SHIPPED / "mixtral_bf16" / "export"
    logits = onnx.load(export / "model.onnx", load_external_data=False).graph.output[0]
    assert [d.dim_param or d.dim_value for d in logits.type.tensor_type.shape.dim] == ["batch_size", 1, 96]
    folder = tmp_path / "genai"
    folder.mkdir()
    for name in ("model.onnx", "model.onnx.data"):
        (folder / name).symlink_to(export / name)
    GenaiFolder(export).copy_to(folder, folder / "model.onnx", library=True)
    reference = np.load(SHIPPED / "mixtral_bf16" / "reference.npz")
    expected = reference["tokens"].tolist()[:8]
    tokens = genai_tokens(folder, reference["prompt_ids"], len(expected))
    end = genai_config(folder)["model"]["eos_token_id"]
    assert tokens == (expected[:expected.index(end) + 1] if end in expected else expected)


def _qmoe_initializers(model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    """Each QMOE node's weights and scales by input name (weight_0, scales_0, ...)."""
    inits = {tensor.name: tensor for tensor in model.graph.initializer}
    names = [entry.name for entry in signatures.QMOE.inputs]
    return [{names[i]: numpy_helper.to_array(inits[name]) for i, name in enumerate(node.input)
             if name in inits and names[i].startswith(("weight", "scales"))}
            for node in model.graph.node if node.op_type == "QMOE"]


def _assert_mxfp4_experts_are_the_checkpoints(export: Path, checkpoint: Path) -> None:
    with Checkpoint(checkpoint, json.loads((checkpoint / "config.json").read_text())) as read:
        stored = {name: StoredSource(tensor).whole() for name, tensor in read.stored.items()}
    layers = _qmoe_initializers(onnx.load(export / "model.onnx"))
    assert len(layers) == 2
    for layer, inputs in enumerate(layers):
        for index, projection in enumerate(("gate_up_proj", "down_proj")):
            blocks = stored[f"model.layers.{layer}.mlp.experts.{projection}_blocks"]
            assert inputs[f"weight_{index}"].tobytes() == blocks.tobytes()
            assert inputs[f"weight_{index}"].shape == (*blocks.shape[:2], blocks.shape[2] * blocks.shape[3])
            assert inputs[f"scales_{index}"].tobytes() == stored[
                f"model.layers.{layer}.mlp.experts.{projection}_scales"].tobytes()


def test_mxfp4_experts_are_the_checkpoints_bytes():
    """GPT-OSS's MXFP4 experts become QMOE mxfp4 nodes whose weights and scales are the checkpoint's blocks and
    scales byte for byte (never dequantized and requantized)."""
    _assert_mxfp4_experts_are_the_checkpoints(SHIPPED / "gpt_oss_mxfp4" / "export",
                                              SHIPPED / "gpt_oss_mxfp4" / "checkpoint")


# ----------------------------------------------------------------------------- the reader (no torch)

def _write(folder: Path, tensors: dict[str, np.ndarray], quantization: dict | None = None,
           model_type: str = "qwen3_moe") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "model.safetensors", {name: TensorSpec.of(a) for name, a in tensors.items()},
                      rows_per_write=3)
    config = {"model_type": model_type}
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _sources(folder: Path) -> dict:
    return Checkpoint(folder, json.loads((folder / "config.json").read_text())).sources()


@pytest.mark.parametrize("shape, block", [((20, 12), (8, 8)), ((3, 16, 8), (4, 4)), ((9, 7), None)])
def test_fp8_weights_are_dequantized_by_block(tmp_path, shape, block):
    """A float8_e4m3fn weight and its weight_scale_inv are one float32 tensor, w * scale_inv of its block (blocks
    at the edges cut short: ceil(N/bn) x ceil(K/bk) scales), read a range of rows at a time; without
    weight_block_size the block is the one that makes the grid."""
    rng = np.random.default_rng(0)
    weight = rng.uniform(-400, 400, shape).astype(ml_dtypes.float8_e4m3fn)
    bn, bk = block or (3, 4)
    grid = (*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk))
    scales = rng.uniform(1e-3, 1e-2, grid).astype(np.float32)
    quantization = {"quant_method": "fp8", "fmt": "e4m3"} | ({"weight_block_size": list(block)} if block else {})
    folder = _write(tmp_path, {"w.weight": weight, "w.weight_scale_inv": scales, "norm.weight": np.ones(4, np.float32)},
                    quantization)
    sources = _sources(folder)
    assert sorted(sources) == ["norm.weight", "w.weight"]
    expanded = np.repeat(np.repeat(scales, bn, axis=-2), bk, axis=-1)[..., :shape[-2], :shape[-1]]
    expected = weight.astype(np.float32) * expanded
    source = sources["w.weight"]
    assert source.dtype == np.float32 and source.shape == shape
    np.testing.assert_array_equal(source.whole(), expected)
    np.testing.assert_array_equal(source.rows(1, shape[0] - 1), expected[1:shape[0] - 1])


def test_mxfp4_experts_read_as_transformers_parameter(tmp_path):
    """GPT-OSS's X_blocks [E, N, K/32, 16] and X_scales [E, N, K/32] are one source X [E, K, N] (the dequantized
    parameter's layout: each expert transposed), code c of scale s being e2m1(c) * 2^(s - 127), the even k in the
    low nibble; and each expert's bytes as stored."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (2, 3, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 130, (2, 3, 2), dtype=np.uint8)
    folder = _write(tmp_path, {"experts.down_proj_blocks": blocks, "experts.down_proj_scales": scales},
                    {"quant_method": "mxfp4"}, "gpt_oss")
    source = _sources(folder)["experts.down_proj"]
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(2, 3, 2, 32)
    values = E2M1_VALUES[codes] * np.exp2(scales.astype(np.float32) - 127)[..., None]
    expected = values.reshape(2, 3, 64).transpose(0, 2, 1)
    assert source.shape == (2, 64, 3)
    np.testing.assert_array_equal(source.whole(), expected)
    np.testing.assert_array_equal(source.rows(1, 2), expected[1:])
    codes_1, scales_1 = source.mxfp4_expert(1)
    assert codes_1.tobytes() == blocks[1].tobytes() and codes_1.shape == (3, 32)
    assert scales_1.tobytes() == scales[1].tobytes()


@pytest.mark.parametrize("tensors, quantization, message", [
    ({"w.weight": np.zeros((2, 2), ml_dtypes.float8_e4m3fn)}, {"quant_method": "fp8"},
     "w.weight: a float8_e4m3fn tensor without w.weight_scale_inv"),
    ({"w.weight": np.zeros((16, 16), ml_dtypes.float8_e4m3fn), "w.weight_scale_inv": np.ones((1, 1), np.float32)},
     {"quant_method": "fp8", "weight_block_size": [8, 8]},
     "w.weight_scale_inv [1, 1] is not the grid of 8 x 8 blocks over w.weight [16, 16] (expected [2, 2])"),
    ({"x_blocks": np.zeros((1, 2, 1, 16), np.uint8)}, {"quant_method": "mxfp4"},
     "x_blocks: no x_scales beside it (MXFP4 blocks need their scales)"),
    ({"x_blocks": np.zeros((1, 2, 1, 8), np.uint8), "x_scales": np.zeros((1, 2, 1), np.uint8)},
     {"quant_method": "mxfp4"}, "x_blocks [1, 2, 1, 8] and x_scales [1, 2, 1]: expected uint8 [E, N, K/32, 16]"),
])
def test_reader_refuses_tensors_the_format_does_not_explain(tmp_path, tensors, quantization, message):
    folder = _write(tmp_path, tensors, quantization)
    with pytest.raises(CheckpointError) as caught:
        _sources(folder)
    assert str(caught.value).startswith(message)


def test_reader_refuses_a_cut_file(tmp_path):
    folder = _write(tmp_path, {"a": np.arange(64, dtype=np.float32).reshape(8, 8)})
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="tensor 'a' ends at byte .*, past the file's end .*: the file is cut "
                                              "short"):
        _sources(folder)


def _raw_safetensors(folder: Path, header: object, data: bytes) -> Path:
    """A checkpoint folder whose model.safetensors holds ``header`` (as JSON) and ``data`` as they are given."""
    folder.mkdir(parents=True, exist_ok=True)
    encoded = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    return folder


def _entry(shape: object, offsets: object) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": offsets}


@pytest.mark.parametrize("header, data, message", [
    ([1, 2], b"", "not a safetensors file (its header is JSON but not an object)"),
    ({"a": _entry([-1, -2], [0, 8])}, bytes(8),
     "tensor 'a': shape [-1, -2], data_offsets [0, 8]; expected lists of integers >= 0 (the offsets: [begin, end])"),
    ({"a": _entry("12", [0, 8])}, bytes(8), "tensor 'a': shape '12', data_offsets [0, 8]; expected lists"),
    ({"a": _entry([2], [0, 4, 8])}, bytes(8), "tensor 'a': shape [2], data_offsets [0, 4, 8]; expected lists"),
    ({"a": _entry([2], [-8, 0])}, bytes(8), "tensor 'a': shape [2], data_offsets [-8, 0]; expected lists"),
    ({"a": _entry([2], [0, 8]), "b": _entry([2], [0, 8])}, bytes(8),
     "tensor 'b' starts at byte 0 of the data; expected 8, where the tensor before it ends (safetensors' tensors lie "
     "end to end: the header is damaged)"),
    ({"a": _entry([2], [4, 12])}, bytes(12), "tensor 'a' starts at byte 4 of the data; expected 0"),
    ({"a": _entry([2], [0, 8])}, bytes(12), "its tensors end at byte {end}, the file at {size}; expected the same "
                                           "(safetensors' tensors fill the file)"),
])
def test_reader_refuses_a_damaged_header(tmp_path, header, data, message):
    """A header that does not lay its tensors end to end over the data, as the safetensors library requires
    (overlapping tensors, a gap, a negative offset reading the header itself, bytes after the last tensor), or whose
    shapes and offsets are not lists of naturals, is refused naming the file and the tensor, never read."""
    folder = _raw_safetensors(tmp_path, header, data)
    file = folder / "model.safetensors"
    size = file.stat().st_size
    with pytest.raises(CheckpointError) as caught:
        _sources(folder)
    assert str(caught.value).startswith(f"{file}: " + message.format(end=size - 4, size=size))


def _fp8(folder: Path, weight: np.ndarray, scales: np.ndarray) -> dict:
    return _sources(_write(folder, {"w.weight": weight, "w.weight_scale_inv": scales}, {"quant_method": "fp8"}))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_reader_refuses_scales_that_are_not_finite(tmp_path, value):
    """An fp8 weight_scale_inv holding NaN or an infinity, or an MXFP4 scale of E8M0 code 255 (NaN), would make
    every weight of its block NaN or infinite: the tensor is refused when it is read (the export then writes
    nothing), naming it and the rows or expert."""
    scales = np.ones((2, 2), np.float32)
    scales[1, 0] = value
    source = _fp8(tmp_path / "fp8", np.ones((16, 16), ml_dtypes.float8_e4m3fn), scales)["w.weight"]
    np.testing.assert_array_equal(source.rows(0, 8), np.ones((8, 16), np.float32))  # the first block row is fine
    with pytest.raises(CheckpointError) as caught:
        source.whole()
    assert str(caught.value) == (f"w.weight_scale_inv: holds {np.float32(value)} in rows [0, 2); expected finite "
                                 "scales (the file is damaged)")
    blocks, codes = np.zeros((2, 3, 1, 16), np.uint8), np.full((2, 3, 1), 127, np.uint8)
    codes[1, 2, 0] = 255
    mxfp4 = _sources(_write(tmp_path / "mxfp4", {"x_blocks": blocks, "x_scales": codes}, {"quant_method": "mxfp4"},
                            "gpt_oss"))["x"]
    assert mxfp4.mxfp4_expert(0)[1].tobytes() == codes[0].tobytes()
    for read in (lambda: mxfp4.mxfp4_expert(1), mxfp4.whole):
        with pytest.raises(CheckpointError) as caught:
            read()
        assert str(caught.value) == ("x_scales: expert 1 holds the E8M0 scale 255 (NaN); expected scales in [0, 255) "
                                     "(the file is damaged)")


def test_a_damaged_scale_met_by_a_pass_is_the_readers_error(tmp_path):
    """A tensor read while the export folds its graph (onnx_ir's initializer dedup reads the small ones) raises the
    reader's error as itself, not inside onnx_ir's PassError: one line on the command line (exit 1), where it was a
    traceback."""
    import onnx_ir as ir
    from onnx_ir.passes import PassError

    from moe_onnx.export import _checkpoint_errors_as_they_are, _fold
    from moe_onnx.export.initializers import CheckpointTensor

    scales = np.ones((2, 2), np.float32)
    scales[1, 1] = np.nan
    source = _fp8(tmp_path, np.ones((16, 16), ml_dtypes.float8_e4m3fn), scales)["w.weight"]

    def model() -> ir.Model:
        x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 16]))
        w = ir.Value(name="w", const_value=CheckpointTensor(source, ir.DataType.FLOAT, "w"))
        node = ir.node("MatMul", [x, w], outputs=[ir.Value(name="y")])
        graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 18})
        return ir.Model(graph, ir_version=10)

    with pytest.raises(PassError):  # what the pass raises
        _fold(model())
    with pytest.raises(CheckpointError) as caught, _checkpoint_errors_as_they_are():
        _fold(model())
    assert str(caught.value).startswith("w.weight_scale_inv: holds nan in rows [")


@pytest.mark.parametrize("weight, scales", [
    (np.ones((16, 16), ml_dtypes.bfloat16), np.ones((2, 2), np.float32)),
    (np.ones((16, 16), ml_dtypes.float8_e4m3fn), np.ones((2, 2), np.int32)),
])
def test_reader_refuses_fp8_tensors_of_other_types(tmp_path, weight, scales):
    with pytest.raises(CheckpointError) as caught:
        _fp8(tmp_path, weight, scales)
    assert str(caught.value) == (f"w.weight {weight.dtype} and w.weight_scale_inv {scales.dtype}: expected "
                                 "float8_e4m3fn and float32, bfloat16 or float16 (the fp8 format)")


def _indexed(folder: Path, weight_map: dict) -> Path:
    """``folder`` with its tensors a and b in two shards and an index holding ``weight_map`` (the shards' by
    default: {"a": "a.safetensors", "b": "b.safetensors"})."""
    folder.mkdir(parents=True)
    for name in "ab":
        write_safetensors(folder / f"{name}.safetensors", {name: TensorSpec.of(np.ones((2, 2), np.float32))})
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("weight_map, message", [
    ({}, "{index}: weight_map is empty; expected the file of each tensor"),
    ({"a": "a.safetensors", "b": "../outside/b.safetensors"},
     "{index}: weight_map names '../outside/b.safetensors'; expected the name of a file in {folder} (only the "
     "checkpoint's own files are read)"),
    ({"a": "a.safetensors", "b": "/abs/b.safetensors"}, "{index}: weight_map names '/abs/b.safetensors'"),
    ({"a": "a.safetensors", "b": "a.safetensors"},
     "{index}: the files it names do not hold 1 of the tensors it lists: b (in a.safetensors)"),
    ({"a": "a.safetensors", "b": "b.safetensors", "c": "b.safetensors"},
     "{index}: the files it names do not hold 1 of the tensors it lists: c (in b.safetensors)"),
    ({"a": "a.safetensors", "b": 3}, "{index}: weight_map.b: expected a string, got 3"),
])
def test_reader_reads_exactly_the_files_the_index_names(tmp_path, weight_map, message):
    """Only files inside the checkpoint folder are opened, and the index and its files agree tensor by tensor."""
    folder = _indexed(tmp_path / "checkpoint", weight_map)
    with pytest.raises(CheckpointError) as caught:
        _sources(folder)
    assert str(caught.value).startswith(message.format(index=folder / "model.safetensors.index.json", folder=folder))


def test_reader_refuses_a_tensor_the_index_places_elsewhere_or_not_at_all(tmp_path):
    folder = _indexed(tmp_path / "checkpoint", {"a": "a.safetensors", "b": "b.safetensors"})
    write_safetensors(folder / "b.safetensors", {name: TensorSpec.of(np.ones(2, np.float32)) for name in "bc"})
    with pytest.raises(CheckpointError) as caught:
        _sources(folder)
    assert str(caught.value) == f"{folder / 'b.safetensors'}: holds c, which model.safetensors.index.json does not list"
    write_safetensors(folder / "b.safetensors", {name: TensorSpec.of(np.ones(2, np.float32)) for name in "ab"})
    with pytest.raises(CheckpointError) as caught:
        _sources(folder)
    assert str(caught.value) == f"a: in both {folder / 'a.safetensors'} and {folder / 'b.safetensors'}"


def test_reader_never_opens_a_fifo(tmp_path):
    folder = _write(tmp_path, {"a": np.ones(2, np.float32)})
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors: not a regular file"):
        _sources(folder)


def _export(tmp_path, config: dict) -> tuple[int, str]:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir(exist_ok=True)
    (checkpoint / "config.json").write_text(json.dumps(config))
    return cli(["export", str(checkpoint), "-o", str(tmp_path / "out")]), str(checkpoint)


def test_export_refuses_a_format_it_does_not_read(tmp_path, capsys):
    """A quantization_config it does not read is refused in one line naming it and what it reads (exit 2, before
    torch is imported, nothing written)."""
    status, checkpoint = _export(tmp_path, {"model_type": "mixtral", "quantization_config": {"quant_method": "awq"}})
    assert status == 2
    assert capsys.readouterr().err.strip() == (
        f"moe-onnx export: {checkpoint}/config.json: quantization_config.quant_method 'awq' is not a format moe-onnx "
        "export reads (it reads no quantization_config: unquantized (float32, bfloat16 or float16 tensors); mxfp4: "
        "MXFP4 experts (GPT-OSS: *_blocks and *_scales); fp8: block-scaled float8_e4m3fn linears (weight and "
        "weight_scale_inv))")
    assert not (tmp_path / "out").exists()


def test_export_refuses_mxfp4_beside_another_family(tmp_path, capsys):
    status, checkpoint = _export(tmp_path, {"model_type": "mixtral", "quantization_config": {"quant_method": "mxfp4"}})
    assert status == 2
    assert capsys.readouterr().err.strip() == (
        f"moe-onnx export: {checkpoint}: quantization_config mxfp4 is read for gpt_oss (its experts' blocks and "
        "scales), not for model_type 'mixtral'")


def test_export_refuses_fp8_of_another_encoding(tmp_path, capsys):
    status, _ = _export(tmp_path, {"model_type": "qwen3_moe", "quantization_config": {"quant_method": "fp8",
                                                                                      "fmt": "e5m2"}})
    assert status == 2
    assert capsys.readouterr().err.strip().endswith("quantization_config: fp8 fmt 'e5m2' is not read (e4m3 is)")


# ----------------------------------------------------------------------------- the export (torch)

@pytest.mark.slow
@_NEEDS_TORCH
@pytest.mark.xdist_group("export")
@pytest.mark.parametrize("name", ["gpt_oss_mxfp4", "qwen3_moe_fp8"])
def test_export_of_the_shipped_checkpoint(name, exported):
    """`moe-onnx export` of a committed checkpoint as shipped writes a folder fused as the committed one that
    generates transformers' tokens (GPT-OSS's experts the checkpoint's MXFP4 bytes). One checkpoint per format read
    here: bfloat16 is exported by the next test (mixtral_bf16, quantized), and every committed export is checked
    against transformers above without torch."""
    out = exported(SHIPPED / name / "checkpoint")
    assert _our_ops(out / "model.onnx") == _our_ops(SHIPPED / name / "export" / "model.onnx")
    assert_generates_reference(moe_onnx.session(out / "model.onnx"), out, SHIPPED / name / "reference.npz")
    if name == "gpt_oss_mxfp4":
        _assert_mxfp4_experts_are_the_checkpoints(out, SHIPPED / name / "checkpoint")


@pytest.mark.slow
@_NEEDS_TORCH
@pytest.mark.xdist_group("export")
def test_quantized_export_is_quantize_of_the_float_export(exported, tmp_path):
    """`moe-onnx export --bits 4 --block-size 16 --linears --embedding` quantizes each weight from the checkpoint as
    it is written, into the same bytes as `moe-onnx quantize` with those options of the float export
    (the experts QMOE, the attention projections and lm_head MatMulNBits, the token embedding
    GatherBlockQuantized; the routers float)."""
    name = "mixtral_bf16"
    options = ["--bits", "4", "--block-size", "16", "--linears", "--embedding"]
    out = exported(SHIPPED / name / "checkpoint", *options)
    quantized = tmp_path / "quantized.onnx"
    assert cli(["quantize", str(SHIPPED / name / "export" / "model.onnx"), "-o", str(quantized), *options,
                "--no-measure"]) == 0
    streamed, filed = onnx.load(out / "model.onnx"), onnx.load(quantized)
    assert sorted(node.op_type for node in streamed.graph.node if node.domain) == sorted(
        node.op_type for node in filed.graph.node if node.domain)
    ops = [node.op_type for node in streamed.graph.node if node.domain]
    assert ops.count("QMOE") == 2 and ops.count("GatherBlockQuantized") == 1 and ops.count("MatMulNBits") == 9
    by_name = {tensor.name: numpy_helper.to_array(tensor) for tensor in filed.graph.initializer}
    mine = {tensor.name: numpy_helper.to_array(tensor) for tensor in streamed.graph.initializer}
    assert mine.keys() == by_name.keys()
    for tensor_name, array in by_name.items():
        np.testing.assert_array_equal(mine[tensor_name], array, err_msg=tensor_name)


@pytest.mark.slow
@_NEEDS_TORCH
@pytest.mark.xdist_group("export")
@pytest.mark.parametrize("layers, message", [
    (1, "no parameter of the model reads 21 of the checkpoint's tensors: model.layers.1.input_layernorm.weight, "
        "model.layers.1.mlp.experts.0.down_proj.weight, model.layers.1.mlp.experts.0.gate_proj.weight ... (does "
        "config.json describe these weights?)"),
    (3, "the checkpoint has no tensor for 11 of the model's parameters: model.layers.2.input_layernorm.weight, "
        "model.layers.2.mlp.experts.down_proj, model.layers.2.mlp.experts.gate_up_proj ... (does config.json "
        "describe these weights?)"),
])
def test_export_reads_the_checkpoint_exactly(tmp_path, capsys, layers, message):
    """A config.json of more or fewer layers than the weights hold is refused in one line naming the tensors
    (before the trace), not exported with parameters left at random or tensors dropped."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(QUICK_START, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    assert cli(["export", str(checkpoint), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"moe-onnx export: {message}"
    assert not (tmp_path / "out").exists()


def _changed_checkpoint(folder: Path, checkpoint: Path, change: Callable[[dict[str, np.ndarray]], None]) -> Path:
    """A copy of ``checkpoint`` in ``folder`` whose tensors (by name) ``change`` has changed."""
    shutil.copytree(checkpoint, folder)
    with Checkpoint(checkpoint, json.loads((checkpoint / "config.json").read_text())) as read:
        tensors = {name: StoredSource(tensor).whole() for name, tensor in read.stored.items()}
    change(tensors)
    write_safetensors(folder / "model.safetensors", {name: TensorSpec.of(array) for name, array in tensors.items()})
    return folder


def _transposed(tensors: dict[str, np.ndarray], experts: range) -> None:
    """The gate_proj of ``experts`` in layer 0 transposed."""
    for expert in experts:
        tensors[EXPERT.format(expert)] = np.ascontiguousarray(tensors[EXPERT.format(expert)].T)


EXPERT = "model.layers.0.mlp.experts.{}.gate_proj.weight"


@pytest.mark.slow
@_NEEDS_TORCH
@pytest.mark.xdist_group("export")
@pytest.mark.parametrize("change, message", [
    (lambda tensors: tensors.update({"model.embed_tokens.weight": np.ones((96, 32), np.int32)}),
     "checkpoint tensor model.embed_tokens.weight is int32; the model's parameter model.embed_tokens.weight is "
     "float32: expected a floating-point tensor"),
    (lambda tensors: _transposed(tensors, range(1)),
     f"parameter model.layers.0.mlp.experts.gate_up_proj: WeightConverter of the checkpoint tensors {EXPERT.format(0)} "
     f"[32, 24], {EXPERT.format(1)} [24, 32], {EXPERT.format(2)} [24, 32] ... fails: stack expects each tensor to be "
     "equal size, but got torch.Size([32, 24]) at entry 0"),
    (lambda tensors: _transposed(tensors, range(4)),
     f"parameter model.layers.0.mlp.experts.gate_up_proj: WeightConverter of the checkpoint tensors {EXPERT.format(0)} "
     f"[32, 24], {EXPERT.format(1)} [32, 24], {EXPERT.format(2)} [32, 24] ... fails: Sizes of tensors must match "
     "except in dimension 1."),
], ids=["int32", "one expert transposed", "every expert transposed"])
def test_export_refuses_tensors_its_parameters_cannot_be_made_from(tmp_path, capsys, change, message):
    """A tensor that is not floating-point where the parameter is (it would be cast silently) and expert tensors that
    transformers' weight mapping cannot stack into the parameter (run on their shapes first) are refused in one line,
    before the trace and before OUT is made; not a traceback while the weights are written."""
    checkpoint = _changed_checkpoint(tmp_path / "checkpoint", QUICK_START, change)
    assert cli(["export", str(checkpoint), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"moe-onnx export: {message}")
    assert not (tmp_path / "out").exists()


#: glibc's mallopt parameter: allocations from this size up are mapped and unmapped on their own (not kept in the
#: heap once freed), so that the resident peak measures what is held
_M_MMAP_THRESHOLD = -3


def _peak_growth_mib(work: Callable[[], object]) -> float:
    """How far this process's peak resident memory (VmHWM, anonymous + file-backed) rises above its resident
    memory while ``work()`` runs, in MiB."""
    def status_mib(key: str) -> float:
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key + ":"))
        return int(line.split()[1]) / 1024

    libc = ctypes.CDLL(None)
    libc.mallopt(_M_MMAP_THRESHOLD, 64 << 10)
    try:
        resident = status_mib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
        work()
        return status_mib("VmHWM") - resident
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, 128 << 10)  # glibc's initial threshold


def _one_layer_qwen3_moe(folder: Path, hidden: int, inter: int, experts: int) -> None:
    """A Qwen3-MoE checkpoint of one layer (the trace's cost grows with the layers, the data with the experts) with
    bfloat16 weights of magnitudes in [2^-9, 2^-5), written tensor by tensor (no torch)."""
    folder.mkdir()
    heads, kv_heads, head_dim, vocab = 4, 2, 32, 96
    config = dict(model_type="qwen3_moe", hidden_size=hidden, moe_intermediate_size=inter, intermediate_size=64,
                  num_experts=experts, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, max_position_embeddings=256,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    (folder / "config.json").write_text(json.dumps(config))

    def random(shape):
        generator = np.random.default_rng(sum(shape))
        return TensorSpec(shape, np.dtype(ml_dtypes.bfloat16), lambda start, stop: generator.integers(
            0x3B00, 0x3D00, (stop - start, *shape[1:]), dtype=np.uint16).view(ml_dtypes.bfloat16))

    tensors = {"model.embed_tokens.weight": random((vocab, hidden)), "lm_head.weight": random((vocab, hidden)),
               "model.norm.weight": random((hidden,))}
    for name, shape in (("self_attn.q_proj.weight", (heads * head_dim, hidden)),
                        ("self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                        ("self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                        ("self_attn.o_proj.weight", (hidden, heads * head_dim)),
                        ("self_attn.q_norm.weight", (head_dim,)), ("self_attn.k_norm.weight", (head_dim,)),
                        ("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,)),
                        ("mlp.gate.weight", (experts, hidden))):
        tensors[f"model.layers.0.{name}"] = random(shape)
    for expert in range(experts):
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):
            tensors[f"model.layers.0.mlp.experts.{expert}.{name}.weight"] = random(shape)
    write_safetensors(folder / "model.safetensors", tensors)


@pytest.mark.slow
@_NEEDS_TORCH
@pytest.mark.xdist_group("export")
def test_export_holds_a_few_tensors_not_the_model(exported, tmp_path):
    """The export streams: exporting a checkpoint of 194 MiB (1 layer of 64 bfloat16 experts of 512 x 1024) at fp32
    (twice its size written) grows the peak resident memory by the graph and a few chunks of the writer
    (WRITE_CHUNK_BYTES: 16 MiB), whatever the checkpoint's size: here under half of it, where loading the model
    would hold it twice. Measured in this process after a first export of the same family (the quick start's,
    shared with the other export tests), which loads torch's exporter."""
    exported(QUICK_START, "--no-optimize")
    checkpoint = tmp_path / "checkpoint"
    _one_layer_qwen3_moe(checkpoint, hidden=512, inter=1024, experts=64)
    checkpoint_mib = (checkpoint / "model.safetensors").stat().st_size / 2**20
    grown = _peak_growth_mib(lambda: export_checkpoint(checkpoint, tmp_path / "out"))
    assert (tmp_path / "out" / "model.onnx.data").stat().st_size > 1.9 * checkpoint_mib * 2**20
    # the traced graph (~2 chunks here), and a chunk being written with the tensors it is made from
    bound = 6 * WRITE_CHUNK_BYTES / 2**20
    assert grown < bound < 0.5 * checkpoint_mib, f"the export's peak grew by {grown:.0f} MiB ({checkpoint_mib:.0f} " \
                                                 "MiB checkpoint)"
