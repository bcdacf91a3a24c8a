"""Models as onnxruntime-genai 0.18's model builder writes them (models/fixtures/genai, made by
models/export_genai_fixtures.py: GPT-OSS and LFM2-MoE at fp32, fp16 and int4) through the command line: check,
optimize (target moe and ort), quantize, the numbers of the optimized model against the builder's, and the
optimized folder in onnxruntime-genai itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import onnxruntime_genai as og
import pytest

import moe_onnx
from moe_onnx.cli import main as cli

FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "genai"
NAMES = sorted(folder.name for folder in FIXTURES.iterdir())
#: max |ours - builder's| / max |builder's| of every output, per precision: fp32 and int4 as float32 rounding gives
#: (int4: both sides dequantize the same codes), fp16 as its rounding of the activations between ops gives
RELATIVE_TOLERANCE = {"fp32": 1e-5, "int4": 1e-5, "fp16": 5e-3}
VOCAB_SIZE = json.loads((FIXTURES / "gpt_oss_fp32" / "genai_config.json").read_text())["model"]["vocab_size"]
PAST, NEW = 0, 6  # tokens in the past KV cache (the builder's fp16 models fail on onnxruntime with a past), of the step


def _ops(path: Path) -> set[str]:
    model = onnx.load(path, load_external_data=False)
    return {f"{node.domain}::{node.op_type}" for node in model.graph.node}


def test_check_takes_builder_models(capsys):
    """Contrib ops (SimplifiedLayerNormalization in the default domain, com.microsoft's GroupQueryAttention, ...)
    are onnxruntime's, not errors; the builder's constant declared as a scalar holding [1] is a note."""
    assert cli(["check", *(str(FIXTURES / name / "model.onnx") for name in NAMES)]) == 0
    out = capsys.readouterr().out
    assert out.count(": OK (") == len(NAMES)
    assert "note: a declared shape differs from the inferred one, which onnxruntime tolerates" in out


def test_check_still_refuses_unregistered_ops(tmp_path, capsys):
    model = onnx.load(FIXTURES / "gpt_oss_fp32" / "model.onnx", load_external_data=False)
    moe = next(node for node in model.graph.node if node.op_type == "MoE")
    moe.op_type = "NoSuchMoE"
    onnx.save(model, tmp_path / "model.onnx")
    (tmp_path / "model.onnx.data").symlink_to(FIXTURES / "gpt_oss_fp32" / "model.onnx.data")
    assert cli(["check", str(tmp_path / "model.onnx")]) == 1
    assert (f"node '{moe.name}': op 'NoSuchMoE' of domain 'com.microsoft' (version 1) is not defined by onnx or "
            f"onnxruntime {ort.__version__}") in capsys.readouterr().out


def test_optimize_fuses_every_block_and_passes_check(genai_optimized, capsys):
    for name, folder in genai_optimized.items():
        ops = _ops(folder / "model.onnx")
        quantized = name.endswith("int4")
        assert "com.microsoft::MoE" not in ops and "com.microsoft::QMoE" not in ops, name
        assert f"moe_onnx::{'QMOE' if quantized else 'MOE'}" in ops, name
        assert cli(["check", str(folder / "model.onnx")]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("name", NAMES)
def test_optimized_logits_match_the_builders(genai_optimized, name):
    """One step: the builder's model on onnxruntime, ours on our kernels, every output (the logits see both MoE
    layers, layer 1's present keys and values layer 0's)."""
    config = json.loads((FIXTURES / name / "genai_config.json").read_text())["model"]["decoder"]
    builder = ort.InferenceSession(FIXTURES / name / "model.onnx", providers=["CPUExecutionProvider"])
    gqa = "com.microsoft::GroupQueryAttention" in _ops(FIXTURES / name / "model.onnx")
    feeds = _step_inputs(builder, config, gqa)
    names = [output.name for output in builder.get_outputs()]
    expected = dict(zip(names, builder.run(names, feeds), strict=True))
    ours = dict(zip(names, moe_onnx.session(genai_optimized[name] / "model.onnx").run(names, feeds), strict=True))
    relative = max(_relative_error(ours[output], expected[output], output) for output in names)
    print(f"{name}: max |ours - builder's| / max |builder's| = {relative:.3g}")
    assert relative <= RELATIVE_TOLERANCE[name.rsplit("_", 1)[1]], (name, relative)


def _relative_error(ours: np.ndarray, expected: np.ndarray, output: str) -> float:
    if output.startswith("present"):  # a sliding window's buffer: the slots past the step's tokens are not written
        ours, expected = ours[:, :, :PAST + NEW], expected[:, :, :PAST + NEW]
    ours, expected = ours.astype(np.float32), expected.astype(np.float32)
    return float(np.abs(ours - expected).max() / np.abs(expected).max())


def _step_inputs(session: ort.InferenceSession, config: dict, gqa: bool) -> dict[str, np.ndarray]:
    """The first step's inputs: NEW tokens, an empty past (GroupQueryAttention's sliding-window layers take a
    cache buffer of the window's size, as onnxruntime-genai gives them: its values are masked)."""
    rng = np.random.default_rng(0)
    sizes = {"batch_size": 1, "sequence_length": NEW, "total_sequence_length": PAST + NEW,
             "kv_cache_dim": config["head_size"], "past_sliding_length": config.get("sliding_window", {}).get(
                 "window_size", PAST) if gqa else PAST}
    feeds = {}
    for value in session.get_inputs():
        shape = [sizes.get(d, PAST if "past" in str(d) else d) for d in value.shape]
        if value.name == "input_ids":
            feeds[value.name] = rng.integers(4, VOCAB_SIZE, shape).astype(np.int64)
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones(shape, np.int64)
        elif value.name == "position_ids":
            feeds[value.name] = np.arange(PAST, PAST + NEW, dtype=np.int64)[None]
        else:  # the past keys, values and convolution states
            dtype = np.float16 if value.type == "tensor(float16)" else np.float32
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def test_target_ort_gives_the_contrib_ops_back(genai_optimized, tmp_path):
    for name in ("gpt_oss_fp32", "lfm2_moe_int4"):
        out = tmp_path / f"{name}.onnx"
        assert cli(["optimize", str(genai_optimized[name] / "model.onnx"), "-o", str(out), "--target", "ort"]) == 0
        ops = _ops(out)
        assert f"com.microsoft::{'QMoE' if name.endswith('int4') else 'MoE'}" in ops, name
        assert not any(op.startswith("moe_onnx::") for op in ops), name


def test_quantize_the_optimized_fp32_model(genai_optimized, tmp_path, capsys):
    """With the error measured on inputs a decoder takes (a prompt, then the next token after it)."""
    for name in ("gpt_oss_fp32", "lfm2_moe_fp32"):
        out, report = tmp_path / f"{name}.onnx", tmp_path / f"{name}.json"
        assert cli(["quantize", str(genai_optimized[name] / "model.onnx"), "-o", str(out), "--bits", "4",
                    "--sizes", "1x6", "--report", str(report)]) == 0, capsys.readouterr()
        assert "moe_onnx::QMOE" in _ops(out), name
        assert cli(["check", str(out)]) == 0, capsys.readouterr().out
        error = json.loads(report.read_text())["error"]
        logits = next(output for output in error["outputs"] if output["name"] == "logits")
        if name.startswith("gpt_oss"):  # the checkpoint's experts are MXFP4: repacked as they are, exact
            assert logits["max_abs"] == 0, (name, logits)
        else:  # int4 codes of K = 32 or 64 inputs per column move the logits
            assert 0 < logits["relative"] < 1, (name, logits)


def test_quantize_says_the_builders_int4_experts_are_quantized_already(tmp_path, capsys):
    """The model builder's int4 folder (onnxruntime's QMoE) has nothing left to quantize: said so, not "run optimize
    first" (which would only make its QMoE our QMOE)."""
    assert cli(["quantize", str(FIXTURES / "gpt_oss_int4"), "-o", str(tmp_path / "out"), "--bits", "4"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (  # after the progress lines
        "moe-onnx quantize: the model's 2 expert blocks are quantized already (com.microsoft::QMoE, 4-bit): nothing "
        "is left to quantize (--linears and --embedding quantize the other layers)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["optimize", "quantize"])
@pytest.mark.parametrize("case", ["plain folder", "config is a folder", "OUT is a file", "OUT is the decoder"])
def test_folder_jobs_name_what_is_wrong_in_one_line(tmp_path, capsys, command, case):
    """A folder without genai_config.json (read as a model file, as shard reads it), a config that is not a file,
    an OUT_DIR that is a file (the input's decoder too): one line naming it, nothing written."""
    folder, out = tmp_path / "in", tmp_path / "out"
    shutil.copytree(FIXTURES / "gpt_oss_fp32", folder)
    if case == "plain folder":
        (folder / "genai_config.json").unlink()
    elif case == "config is a folder":
        (folder / "genai_config.json").unlink()
        (folder / "genai_config.json").mkdir()
    elif case == "OUT is a file":
        out.write_text("mine")
    else:
        out = folder / "model.onnx"
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    status, message = {
        "plain folder": (1, f"{folder}: is not a regular file"),  # as a model file: a folder needs a genai config
        "config is a folder": (1, f"{folder / 'genai_config.json'}: is not a regular file; expected a JSON file"),
        "OUT is a file": (2, f"{out}: is a file; expected a directory or a new path"),
        "OUT is the decoder": (2, f"{out}: is a file; expected a directory or a new path"),
    }[case]
    assert cli([command, str(folder), "-o", str(out), *(["--bits", "4"] if command == "quantize" else [])]) == status
    assert [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[")] == [
        f"moe-onnx {command}: {message}"]  # after the progress lines
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("name", NAMES)
def test_verify_runs_the_builders_models_with_their_cache(name, tmp_path):
    """`--verify` draws what the builder's decoders take: ones for the mask, the GroupQueryAttention head size
    and sliding window capacity, a prompt and a next token after it. The builder's own fp16 models fail on
    onnxruntime with a past cache (an fp16 Cast onnxruntime inserts), so only their prompts are compared."""
    report = tmp_path / "report.json"
    assert cli(["optimize", str(FIXTURES / name), "-o", str(tmp_path / "out"), "--verify", "--sizes", "1x1,2x5",
                "--report", str(report)]) == 0
    verified = json.loads(report.read_text())["verify"]
    compared = [size["sizes"] for size in verified["sizes"] if size["compared"]]
    prompts = [size for size in compared if not any(v for d, v in size.items() if d.startswith("past_sequence"))]
    assert verified["ok"] and len(prompts) == 2, verified
    assert len(compared) == (2 if name.endswith("fp16") else 4), verified
    assert verified["precision"] == ("float16" if name.endswith("fp16") else "float32")


@pytest.mark.parametrize("name", [name for name in NAMES if not name.endswith("fp16")])
def test_genai_generates_the_builders_tokens(genai_optimized, name):
    """The optimized folder runs in onnxruntime-genai (our library copied in, named by genai_config.json) and
    greedy generation gives the builder's tokens. (The builder's fp16 models do not run in onnxruntime-genai on
    CPU, which the builder does not list as an fp16 target.)"""
    config = json.loads((genai_optimized[name] / "genai_config.json").read_text())
    library = config["model"]["decoder"]["session_options"]["custom_ops_library"]
    assert (genai_optimized[name] / library).is_file()
    assert _generate(FIXTURES / name) == _generate(genai_optimized[name])


def _generate(folder: Path) -> list[int]:
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=16, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([[5, 9, 17, 33, 4]], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(token) for token in generator.get_sequence(0)]


def test_a_decoder_in_a_subfolder_is_written_where_the_config_names_it(tmp_path):
    """A folder whose genai_config.json names its decoder in a subfolder: optimize writes OUT's decoder beside its
    config, which names it there, and OUT generates the input folder's tokens."""
    source = tmp_path / "in"
    (source / "sub").mkdir(parents=True)
    for file in (FIXTURES / "gpt_oss_fp32").iterdir():
        (source / ("sub" if file.name.startswith("model.onnx") else "") / file.name).write_bytes(file.read_bytes())
    config = json.loads((source / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "sub/model.onnx"
    (source / "genai_config.json").write_text(json.dumps(config))
    assert cli(["optimize", str(source), "-o", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "genai_config.json").read_text())["model"]["decoder"]["filename"]
    assert (tmp_path / "out" / written).is_file()
    prompt = [5, 9, 17]
    expected = moe_onnx.generate(source, prompt_ids=prompt, max_new_tokens=4).tokens
    assert moe_onnx.generate(tmp_path / "out", prompt_ids=prompt, max_new_tokens=4).tokens == expected


def test_a_failed_folder_job_leaves_out_as_it_was(tmp_path, monkeypatch, capsys):
    """optimize FOLDER -o OUT writes OUT only once complete: a job that fails after the decoder is written (here the
    copy of the folder's other files) leaves an existing OUT as it was and makes no new one."""
    from moe_onnx.genai_folder import GenaiFolder

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    old = tmp_path / "old"
    old.mkdir()
    (old / "model.onnx").write_text("old")
    monkeypatch.setattr(GenaiFolder, "copy_to", fail)
    for out in (old, tmp_path / "new"):
        assert cli(["optimize", str(FIXTURES / "gpt_oss_fp32"), "-o", str(out)]) != 0
        capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert [p.name for p in old.iterdir()] == ["model.onnx"] and (old / "model.onnx").read_text() == "old"
