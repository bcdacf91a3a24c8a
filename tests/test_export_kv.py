"""`moe-onnx export`'s decoders with a KV cache: the committed exports of models/fixtures/kv (made by
models/export_kv_fixtures.py: a tiny random checkpoint per family, exported and fused) generate transformers'
greedy tokens step by step, feeding each step's presents back as the next step's pasts, with logits within 1e-4
of torch's at every step, on our kernels, after `--target ort` on plain onnxruntime, and in onnxruntime-genai; the
folder is what onnxruntime-genai reads; the command's refusals. Where torch and
transformers are installed, the export itself runs too (test_export_from_checkpoint)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import moe_onnx
from moe_onnx.cli import main as cli
from moe_onnx.export import FAMILIES as EXPORT_FAMILIES

FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "kv"
FAMILIES = sorted(folder.name for folder in FIXTURES.iterdir())
TOLERANCE = 1e-4  # max |logits - torch's| at every step (fp32)


def _config(folder: Path) -> dict:
    return json.loads((folder / "genai_config.json").read_text())


def greedy(session: ort.InferenceSession, config: dict, prompt_ids: np.ndarray, steps: int):
    """``steps`` greedy tokens from ``session``: the prompt with an empty cache, then one token a step with the
    presents fed back as the pasts. Returns the tokens and each step's last-position logits."""
    decoder = config["model"]["decoder"]
    layers, heads, head_size = decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]
    names = decoder["inputs"]
    past = {}
    for layer in range(layers):
        for key in ("past_key_names", "past_value_names"):
            past[names[key] % layer] = np.zeros((prompt_ids.shape[0], heads, 0, head_size), np.float32)
    outputs = [output.name for output in session.get_outputs()]
    presents = {decoder["outputs"][key] % layer: names[key.replace("present", "past")] % layer
                for layer in range(layers) for key in ("present_key_names", "present_value_names")}
    tokens, logits, step_ids, seen = [], [], prompt_ids, 0
    for _ in range(steps):
        length = step_ids.shape[1]
        results = dict(zip(outputs, session.run(None, {
            names["input_ids"]: step_ids,
            names["attention_mask"]: np.ones((step_ids.shape[0], seen + length), np.int64),
            names["position_ids"]: np.arange(seen, seen + length, dtype=np.int64)[None].repeat(step_ids.shape[0], 0),
            **past}), strict=True))
        last = results[decoder["outputs"]["logits"]][:, -1]
        logits.append(last[0])
        tokens.append(int(last[0].argmax()))
        past = {presents[name]: value for name, value in results.items() if name in presents}
        seen += length
        step_ids = np.array([[tokens[-1]]], np.int64)
    return tokens, np.stack(logits)


def _assert_generates_torch_tokens(session: ort.InferenceSession, folder: Path) -> None:
    reference = np.load(folder / "reference.npz")
    tokens, logits = greedy(session, _config(folder), reference["prompt_ids"], len(reference["tokens"]))
    assert tokens == reference["tokens"].tolist()
    error = np.abs(logits - reference["logits"]).max(axis=1)
    assert error.max() <= TOLERANCE, f"max |logits - torch| per step: {error}"


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_generates_torch_tokens(family):
    """32 greedy tokens (a 7-token prefill, then 31 one-token steps) equal transformers' generate(do_sample=False)
    token for token, with every step's logits within 1e-4; the MoE layers are fused (two MOE, two routers)."""
    folder = FIXTURES / family
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    ops = [node.op_type for node in model.graph.node if node.domain == "moe_onnx"]
    assert sorted(ops) == ["MOE", "MOE", "MoeGatingTopK", "MoeGatingTopK"]
    _assert_generates_torch_tokens(moe_onnx.session(folder / "model.onnx"), folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_onnx_generate_gives_torch_tokens(family):
    """`moe_onnx.generate` on the exported folder: torch's greedy tokens, up to the first eos token (which ends
    generation there, as in onnxruntime-genai)."""
    folder = FIXTURES / family
    reference = np.load(folder / "reference.npz")
    eos = json.loads((folder / "genai_config.json").read_text())["model"]["eos_token_id"]
    eos = set(eos) if isinstance(eos, list) else {eos}
    expected = reference["tokens"].tolist()
    stop = next((i for i, token in enumerate(expected) if token in eos), len(expected))
    generated = moe_onnx.generate(folder, prompt_ids=reference["prompt_ids"].ravel().tolist(), max_new_tokens=len(expected))
    assert generated.tokens == expected[:stop]
    assert generated.stop == ("eos" if stop < len(expected) else "max_new_tokens")


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_with_target_ort_generates_torch_tokens(family, tmp_path):
    """`moe-onnx optimize FOLDER --target ort`: every MoE layer becomes onnxruntime's com.microsoft::MoE, and plain
    onnxruntime (no library of ours) generates the same tokens with the cache, logits within 1e-4."""
    out = tmp_path / family
    assert cli(["optimize", str(FIXTURES / family), "-o", str(out), "--target", "ort"]) == 0
    model = onnx.load(out / "model.onnx", load_external_data=False)
    assert sorted(node.op_type for node in model.graph.node if node.domain) == ["MoE", "MoE"]
    _assert_generates_torch_tokens(ort.InferenceSession(out / "model.onnx", providers=["CPUExecutionProvider"]),
                                   FIXTURES / family)


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_folder_is_genai_format(family):
    """genai_config.json names the decoder's inputs and outputs layer by layer, with the dims genai sizes its
    buffers by; the presents grow (no shared buffer); the tokenizer is beside it."""
    folder = FIXTURES / family
    config = _config(folder)
    decoder = config["model"]["decoder"]
    model = onnx.load(folder / decoder["filename"], load_external_data=False)
    shapes = {value.name: [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
              for value in (*model.graph.input, *model.graph.output)}
    layers = decoder["num_hidden_layers"]
    cache = [decoder["inputs"][key] % layer for layer in range(layers) for key in ("past_key_names", "past_value_names")]
    present = [decoder["outputs"][key] % layer for layer in range(layers)
               for key in ("present_key_names", "present_value_names")]
    assert [value.name for value in model.graph.input] == ["input_ids", "attention_mask", "position_ids", *cache]
    assert [value.name for value in model.graph.output] == ["logits", *present]
    kv = [decoder["num_key_value_heads"], decoder["head_size"]]
    assert all(shapes[name] == ["batch_size", kv[0], "past_sequence_length", kv[1]] for name in cache)
    assert all(shapes[name] == ["batch_size", kv[0], "total_sequence_length", kv[1]] for name in present)
    assert shapes["logits"] == ["batch_size", "sequence_length", config["model"]["vocab_size"]]
    assert config["search"]["past_present_share_buffer"] is False
    assert (folder / "tokenizer.json").is_file()


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_in_onnxruntime_genai(family, tmp_path):
    """onnxruntime-genai runs the folder (our library added, as `moe-onnx export` writes it) and generates the
    torch tokens up to the first end token."""
    import onnxruntime_genai as og

    folder = tmp_path / family
    assert cli(["optimize", str(FIXTURES / family), "-o", str(folder)]) == 0  # the library beside, named
    reference = np.load(FIXTURES / family / "reference.npz")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=reference["prompt_ids"].shape[1] + len(reference["tokens"]), do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(reference["prompt_ids"])
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    expected = reference["tokens"].tolist()
    end = _config(folder)["model"]["eos_token_id"]
    assert tokens == expected[:expected.index(end) + 1] if end in expected else tokens == expected


def _checkpoint(tmp_path: Path, config: dict) -> Path:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(config))
    return checkpoint


def test_export_refuses_unknown_family(tmp_path, capsys):
    checkpoint = _checkpoint(tmp_path, {"model_type": "llama"})
    assert cli(["export", str(checkpoint), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"moe-onnx export: {checkpoint}: model_type 'llama' is not a family moe-onnx export knows "
        f"(it knows {', '.join(sorted(EXPORT_FAMILIES))})")
    assert not (tmp_path / "out").exists()


def test_export_refuses_unknown_dtype(tmp_path, capsys):
    checkpoint = _checkpoint(tmp_path, {"model_type": "qwen3_moe"})
    assert cli(["export", str(checkpoint), "-o", str(tmp_path / "out"), "--dtype", "int8"]) == 2
    assert capsys.readouterr().err.strip() == "moe-onnx export: --dtype 'int8': expected one of fp32, fp16, bf16"


def test_export_of_a_folder_without_config(tmp_path, capsys):
    assert cli(["export", str(tmp_path), "-o", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"moe-onnx export: {tmp_path / 'config.json'}: cannot read it: No such file or directory")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
                    reason="the export needs torch and transformers (the export extra); the fixture tests above "
                           "check its committed results without them")
@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_export_from_checkpoint(family, tmp_path, capsys):
    """Where torch is installed: `moe-onnx export` of the fixture's checkpoint (remade by the fixture script)
    writes a fused folder that generates the committed torch tokens."""
    import export_kv_fixtures

    checkpoint = tmp_path / "checkpoint"
    export_kv_fixtures.save_checkpoint(family, checkpoint)
    out = tmp_path / "out"
    assert cli(["export", str(checkpoint), "-o", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "BatchedMmSwiglu: 2 blocks fused" in summary and "RouterToMoeGatingTopK: 2 blocks fused" in summary
    config = _config(out)
    assert (out / config["model"]["decoder"]["session_options"]["custom_ops_library"]).is_file()
    assert (out / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
    reference = FIXTURES / family
    session = moe_onnx.session(out / "model.onnx")
    tokens, logits = greedy(session, config, np.load(reference / "reference.npz")["prompt_ids"], 32)
    saved = np.load(reference / "reference.npz")
    assert tokens == saved["tokens"].tolist()
    assert np.abs(logits - saved["logits"]).max() <= TOLERANCE


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
                    reason="the export needs torch and transformers (the export extra)")
@pytest.mark.parametrize("family", FAMILIES)
def test_export_fp16_fuses(family, tmp_path, capsys):
    """Where torch is installed: `moe-onnx export --dtype fp16` of the fixture's checkpoint fuses every MoE layer
    (the float32 sum and routing casts of the fp16 export) and its first step's logits are torch's float32 ones
    within float16's rounding (the logits reach about 5: one float16 step there is 0.004)."""
    import export_kv_fixtures

    checkpoint = tmp_path / "checkpoint"
    export_kv_fixtures.save_checkpoint(family, checkpoint)
    out = tmp_path / "out"
    assert cli(["export", str(checkpoint), "-o", str(out), "--dtype", "fp16"]) == 0
    summary = capsys.readouterr().out
    assert "Float32Sum: 2 blocks fused" in summary and "RouterToMoeGatingTopK: 2 blocks fused" in summary
    assert "near-miss" not in summary
    model = onnx.load(out / "model.onnx", load_external_data=False)
    assert sorted(node.op_type for node in model.graph.node if node.domain == "moe_onnx") == [
        "MOE", "MOE", "MoeGatingTopK", "MoeGatingTopK"]
    reference = np.load(FIXTURES / family / "reference.npz")
    config = _config(out)
    decoder = config["model"]["decoder"]
    past = {decoder["inputs"][key] % layer: np.zeros((1, decoder["num_key_value_heads"], 0, decoder["head_size"]),
                                                     np.float16)
            for layer in range(decoder["num_hidden_layers"]) for key in ("past_key_names", "past_value_names")}
    prompt = reference["prompt_ids"]
    logits = moe_onnx.session(out / "model.onnx").run([decoder["outputs"]["logits"]], {
        "input_ids": prompt, "attention_mask": np.ones_like(prompt),
        "position_ids": np.arange(prompt.shape[1], dtype=np.int64)[None], **past})[0]
    assert logits.dtype == np.float16
    np.testing.assert_allclose(logits[0, -1].astype(np.float32), reference["logits"][0], atol=1.5e-2)


def _resident_kib_of_mappings(path: Path) -> int:
    """The resident KiB of this process's memory maps of ``path`` (/proc/self/smaps)."""
    resident, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:  # a mapping's header: address range, perms, ..., path
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            resident += int(fields[1])
    return resident


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
                    reason="the export needs torch and transformers (the export extra)")
def test_load_hands_back_the_checkpoint_pages(tmp_path):
    """transformers keeps the checkpoint memory-mapped after the load and every page it read resident (the
    experts it stacked into new tensors: their size again); `moe-onnx export`'s load hands those pages back,
    and the weights still read the checkpoint's values."""
    import export_kv_fixtures
    import torch
    from safetensors.torch import load_file

    from moe_onnx.export import _torch

    checkpoint = tmp_path / "checkpoint"
    export_kv_fixtures.save_checkpoint("qwen3_moe", checkpoint)
    weights = checkpoint / "model.safetensors"
    with open(weights, "rb") as file:  # written back, so that its pages can be reclaimed at once
        os.fsync(file.fileno())
    model = _torch.load_model(checkpoint, EXPORT_FAMILIES["qwen3_moe"], "fp32")
    assert _resident_kib_of_mappings(weights.resolve()) == 0
    saved = load_file(weights)
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"])
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj[3], saved["model.layers.1.mlp.experts.3.down_proj.weight"])
