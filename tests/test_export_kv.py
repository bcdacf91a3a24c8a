"""`moe-onnx export`'s decoders with a KV cache: the committed exports of models/fixtures/kv (made by
models/export_kv_fixtures.py: a tiny random checkpoint per family, exported and fused) generate transformers'
greedy tokens step by step, feeding each step's presents back as the next step's pasts, with logits within 1e-4
of torch's at every step, on our kernels, after `--target ort` on plain onnxruntime, and in onnxruntime-genai; the
folder is what onnxruntime-genai reads; the command's refusals. Where torch and
transformers are installed, the export itself runs too (test_export_from_checkpoint)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import moe_onnx
from decoders import assert_generates_reference, genai_config, genai_tokens
from moe_onnx.cli import main as cli
from moe_onnx.export import FAMILIES as EXPORT_FAMILIES
from moe_onnx.genai_folder import GenaiFolder

FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "kv"
FAMILIES = sorted(folder.name for folder in FIXTURES.iterdir())
CHECKPOINTS = FIXTURES.parent / "checkpoints"  # qwen3_moe's tiny checkpoint, which the README's quick start exports


def _config(folder: Path) -> dict:
    return genai_config(folder)


def _assert_generates_torch_tokens(session: ort.InferenceSession, folder: Path) -> None:
    assert_generates_reference(session, folder, folder / "reference.npz")


#: our ops in a fixture: a MOE and a MoeGatingTopK per layer, but for Nemotron-H (one MoE layer, then an attention
#: layer) and the routers the router fusion does not match (ERNIE's and Kolibri's top-k of biased scores, PhiMoE's
#: sparsemixer), which stay as exported
FUSED_OPS = {"nemotron_h": ["MOE", "MoeGatingTopK"], "ernie4_5_moe": ["MOE", "MOE"], "kolibri1": ["MOE", "MOE"],
             "phimoe": ["MOE", "MOE"]}
#: the fixtures that `--target ort` turns into com.microsoft::MoE (the others keep our MOE: docs/cli.md says why)
TARGET_ORT = ["flex_olmo", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "jetmoe",
              "mellum", "minimax", "mixtral", "olmoe", "qwen3_moe"]
#: the fixtures onnxruntime-genai cannot run: latent attention caches keys wider than values, and genai sizes both
#: by the one head_size of genai_config.json
GENAI_CANNOT_RUN = ["axk1", "deepseek_v3", "glm4_moe_lite"]
#: the fixtures that also run 32 steps through moe_onnx.generate and onnxruntime-genai (the others: their cache
#: layout in moe_onnx.generate, GENAI_STEPS steps in genai): the first families, and caches of every kind
FULL_RUN = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "mimo_v2_flash", "nemotron_h"]
GENAI_STEPS = 4


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_generates_torch_tokens(family):
    """32 greedy tokens (a 7-token prefill, then 31 one-token steps) equal transformers' generate(do_sample=False)
    token for token, with every step's logits within 1e-4; every MoE layer is fused (FUSED_OPS)."""
    folder = FIXTURES / family
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    ops = [node.op_type for node in model.graph.node if node.domain == "moe_onnx"]
    assert sorted(ops) == FUSED_OPS.get(family, ["MOE", "MOE", "MoeGatingTopK", "MoeGatingTopK"])
    _assert_generates_torch_tokens(moe_onnx.session(folder / "model.onnx"), folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_onnx_generate_gives_torch_tokens(family):
    """`moe_onnx.generate` on the exported folder: torch's greedy tokens, up to the first eos token (which ends
    generation there, as in onnxruntime-genai); 2 tokens for the families outside FULL_RUN (the cache layout
    is what differs)."""
    folder = FIXTURES / family
    reference = np.load(folder / "reference.npz")
    eos = json.loads((folder / "genai_config.json").read_text())["model"]["eos_token_id"]
    eos = set(eos) if isinstance(eos, list) else {eos}
    expected = reference["tokens"].tolist()[:None if family in FULL_RUN else 2]
    stop = next((i for i, token in enumerate(expected) if token in eos), len(expected))
    generated = moe_onnx.generate(folder, prompt_ids=reference["prompt_ids"].ravel().tolist(), max_new_tokens=len(expected))
    assert generated.tokens == expected[:stop]
    assert generated.stop == ("eos" if stop < len(expected) else "max_new_tokens")


@pytest.mark.parametrize("family", TARGET_ORT)
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
    """genai_config.json names the decoder's inputs and outputs by layer (the layers with attention), with the
    dims genai sizes its buffers by where genai runs it; the presents grow (no shared buffer); the logits are every
    position's (these fixtures were exported so: `--all-logits` today; the default, the last position's, is checked on
    the shipped fixtures, test_export_shipped.py); the tokenizer is beside it."""
    folder = FIXTURES / family
    config = _config(folder)
    decoder = config["model"]["decoder"]
    model = onnx.load(folder / decoder["filename"], load_external_data=False)
    shapes = {value.name: [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
              for value in (*model.graph.input, *model.graph.output)}
    layers = sorted({int(value.name.split(".")[1]) for value in model.graph.input if "." in value.name})
    assert layers and layers[-1] < decoder["num_hidden_layers"]
    cache = [decoder["inputs"][key] % layer for layer in layers for key in ("past_key_names", "past_value_names")]
    present = [decoder["outputs"][key] % layer for layer in layers
               for key in ("present_key_names", "present_value_names")]
    assert [value.name for value in model.graph.input] == ["input_ids", "attention_mask", "position_ids", *cache]
    assert [value.name for value in model.graph.output] == ["logits", *present]
    assert all(shapes[name][::2] == ["batch_size", "past_sequence_length"] for name in cache)
    assert all(shapes[past][1::2] == shapes[now][1::2] and shapes[now][::2] == ["batch_size", "total_sequence_length"]
               for past, now in zip(cache, present, strict=True))
    first_key = shapes[cache[0]]
    assert [decoder["num_key_value_heads"], decoder["head_size"]] == first_key[1::2]
    assert shapes["logits"] == ["batch_size", "sequence_length", config["model"]["vocab_size"]]
    assert config["search"]["past_present_share_buffer"] is False
    assert (folder / "tokenizer.json").is_file()


def _genai_folder(family: str, tmp_path: Path) -> Path:
    """The fixture as `moe-onnx export` writes it: our library beside the decoder, named in genai_config.json."""
    folder = tmp_path / family
    folder.mkdir()
    for name in ("model.onnx", "model.onnx.data"):
        (folder / name).symlink_to(FIXTURES / family / name)
    GenaiFolder(FIXTURES / family).copy_to(folder, folder / "model.onnx", library=True)
    return folder


@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in GENAI_CANNOT_RUN])
def test_fixture_in_onnxruntime_genai(family, tmp_path):
    """onnxruntime-genai runs the folder and generates the torch tokens up to the first end token (32 for
    FULL_RUN, GENAI_STEPS for the others), whatever the kv heads of each layer (MiMo's) or a layer without a cache
    (Nemotron-H's)."""
    folder = _genai_folder(family, tmp_path)
    reference = np.load(FIXTURES / family / "reference.npz")
    expected = reference["tokens"].tolist()[:None if family in FULL_RUN else GENAI_STEPS]
    tokens = genai_tokens(folder, reference["prompt_ids"], len(expected))
    end = _config(folder)["model"]["eos_token_id"]
    assert tokens == expected[:expected.index(end) + 1] if end in expected else tokens == expected


def test_quantize_of_a_folder_writes_a_complete_folder(tmp_path):
    """`moe-onnx quantize FOLDER -o OUT_DIR` takes an onnxruntime-genai folder and writes a complete one, as optimize
    does: the decoder quantized (QMOE), the tokenizer and config beside it, our library named in genai_config.json;
    onnxruntime-genai and moe_onnx.generate run it."""
    out = tmp_path / "int8"
    assert cli(["quantize", str(FIXTURES / "qwen3_moe"), "-o", str(out), "--bits", "8", "--no-measure"]) == 0
    config = _config(out)
    assert config["model"]["decoder"]["filename"] == "model.onnx"
    assert (out / config["model"]["decoder"]["session_options"]["custom_ops_library"]).is_file()
    assert (out / "tokenizer.json").read_bytes() == (FIXTURES / "qwen3_moe" / "tokenizer.json").read_bytes()
    assert _moe_ops(out / "model.onnx") == ["MoeGatingTopK", "MoeGatingTopK", "QMOE", "QMOE"]
    prompt = np.load(FIXTURES / "qwen3_moe" / "reference.npz")["prompt_ids"]
    ours = moe_onnx.generate(out, prompt_ids=prompt.ravel().tolist(), max_new_tokens=4).tokens
    genai = genai_tokens(out, prompt, 4)
    assert genai[:len(ours)] == ours and len(ours) == 4


def test_onnxruntime_genai_cannot_run_latent_attention(tmp_path):
    """genai sizes the values' empty pasts by head_size, the keys' width: DeepSeek's narrower values are refused."""
    import onnxruntime_genai as og

    model = og.Model(str(_genai_folder("deepseek_v3", tmp_path)))
    generator = og.Generator(model, og.GeneratorParams(model))
    with pytest.raises(RuntimeError, match="past_key_values.0.value .*\n index: 3 Got: 16 Expected: 8"):
        generator.append_tokens(np.load(FIXTURES / "deepseek_v3" / "reference.npz")["prompt_ids"])


def test_every_export_family_has_a_fixture():
    assert FAMILIES == sorted(EXPORT_FAMILIES)


QUICK_START_CONFIG = json.loads((CHECKPOINTS / "qwen3_moe" / "config.json").read_text())


def _checkpoint(tmp_path: Path, config: dict) -> Path:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(config))
    return checkpoint


@pytest.mark.parametrize("files, message", [
    ({"config.json": "[1, 2]"}, "{checkpoint}/config.json: expected an object, got a list"),
    ({"config.json": '{"model_type": ["qwen3_moe"]}'}, "{checkpoint}/config.json: model_type: expected a string, "
                                                         "got a list"),
    ({"config.json": "{not json"}, "{checkpoint}/config.json: expected JSON: "),
    ({"generation_config.json": "3"}, "{checkpoint}/generation_config.json: expected an object, got 3"),
    ({"model.safetensors.index.json": "{"}, "{checkpoint}/model.safetensors.index.json: expected JSON: "),
    ({"config.json": json.dumps({**QUICK_START_CONFIG, "max_position_embeddings": None})},
     "{checkpoint}/config.json: max_position_embeddings: missing; expected an integer >= 2"),
    ({"config.json": json.dumps({**QUICK_START_CONFIG, "max_position_embeddings": 1})},
     "{checkpoint}/config.json: max_position_embeddings: expected an integer >= 2, got 1"),
    ({"config.json": json.dumps({**QUICK_START_CONFIG, "vocab_size": "96"})},
     '{checkpoint}/config.json: vocab_size: expected an integer >= 1, got "96"'),
    *[({"config.json": json.dumps({**QUICK_START_CONFIG, "num_experts_per_tok": k})},
       "{checkpoint}/config.json: num_experts_per_tok: expected an integer in [1, 4] (num_local_experts), or a list "
       f"of them per layer, got {'a list' if isinstance(k, list) else json.dumps(k)}")
      for k in (0, 5, -1, [2, 0], True)],
    ({"generation_config.json": '{"eos_token_id": [2, 96]}'},
     "{checkpoint}/generation_config.json: eos_token_id: expected a token id in [0, 96) or a list of them, got a "
     "list"),
    ({"config.json": json.dumps({**QUICK_START_CONFIG, "eos_token_id": -1}), "generation_config.json": "{}"},
     "{checkpoint}/config.json: eos_token_id: expected a token id in [0, 96) or a list of them, got -1"),
    ({"generation_config.json": '{"temperature": "hot"}'},
     '{checkpoint}/generation_config.json: temperature: expected a number, got "hot"'),
    ({"generation_config.json": '{"do_sample": 1}'},
     "{checkpoint}/generation_config.json: do_sample: expected true or false, got 1"),
])
def test_export_names_the_file_and_key_of_a_malformed_input(tmp_path, capsys, files, message):
    """A config, generation config or index that is not the JSON expected is refused in one line naming the file
    and the key (exit 1), before torch is imported and before OUT is made: among them the values a genai_config.json
    written from them would hold and onnxruntime-genai or `moe-onnx generate` refuse (an eos token outside the
    vocabulary, a context of one token, a search setting of another type), and experts per token outside [1, the
    experts], which transformers builds (at 0, experts that add nothing)."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINTS / "qwen3_moe", checkpoint)
    for name, text in files.items():
        (checkpoint / name).write_text(text)
    assert cli(["export", str(checkpoint), "-o", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip().startswith(f"moe-onnx export: {message.format(checkpoint=checkpoint)}")
    assert not (tmp_path / "out").exists()


def test_export_refuses_unknown_family(tmp_path, capsys):
    checkpoint = _checkpoint(tmp_path, {"model_type": "llama"})
    assert cli(["export", str(checkpoint), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"moe-onnx export: {checkpoint}: model_type 'llama' is not a family moe-onnx export knows "
        f"(it knows {', '.join(sorted(EXPORT_FAMILIES))})")
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_family_whose_cache_is_not_keys_and_values(tmp_path, capsys):
    """A family whose whole model fuses but whose cache holds more (DeepSeek-V3.2's indexer keys) is refused with
    the reason, before torch is imported."""
    checkpoint = _checkpoint(tmp_path, {"model_type": "deepseek_v32"})
    assert cli(["export", str(checkpoint), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"moe-onnx export: {checkpoint}: model_type 'deepseek_v32' is not exported with a KV cache: its sparse "
        f"(indexed) attention caches the indexer's keys beside the keys and values")
    assert not (tmp_path / "out").exists()


def test_export_refuses_unknown_dtype(tmp_path, capsys):
    checkpoint = _checkpoint(tmp_path, {"model_type": "qwen3_moe"})
    assert cli(["export", str(checkpoint), "-o", str(tmp_path / "out"), "--dtype", "int8"]) == 2
    assert capsys.readouterr().err.strip() == "moe-onnx export: --dtype 'int8': expected one of fp32, fp16, bf16"


def test_export_of_a_folder_without_config(tmp_path, capsys):
    assert cli(["export", str(tmp_path), "-o", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"moe-onnx export: {tmp_path / 'config.json'}: cannot read it: No such file or directory")


_NEEDS_TORCH = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
    reason="the export needs torch and transformers (the export extra); the fixture tests above check its committed "
           "results without them")


def _moe_ops(path: Path) -> list[str]:
    return sorted(node.op_type for node in onnx.load(path, load_external_data=False).graph.node if node.domain)


def test_committed_checkpoint_is_the_fixtures():
    """The quick start's checkpoint is the one the qwen3_moe fixture was exported from: its config and tokenizer
    are the fixture's (the slow export test below checks its weights give the fixture's tokens)."""
    checkpoint = CHECKPOINTS / "qwen3_moe"
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert (checkpoint / "tokenizer.json").read_bytes() == (FIXTURES / "qwen3_moe" / "tokenizer.json").read_bytes()
    assert (checkpoint / "model.safetensors").stat().st_size < 200_000


@pytest.mark.slow
@_NEEDS_TORCH
@pytest.mark.xdist_group("export")
def test_export_from_checkpoint(exported, tmp_path):
    """Where torch is installed: `moe-onnx export --no-optimize` of the README's quick start checkpoint (qwen3_moe's,
    committed), then `moe-onnx optimize` of its folder, write a folder fused as the committed one that generates the
    committed torch tokens. (Every family's committed fixture is this exporter's output, checked against
    transformers above without torch; export's own fusing runs on every other export here: one per format and dtype,
    test_export_shipped.py and the fp16 test below. The unfused export is the one the benchmark smoke times:
    test_bench_real_size.py, one trace for both.)"""
    family = "qwen3_moe"
    checkpoint = CHECKPOINTS / family
    out = tmp_path / "fused"
    assert cli(["optimize", str(exported(checkpoint, "--no-optimize")), "-o", str(out)]) == 0
    config = _config(out)
    assert (out / config["model"]["decoder"]["session_options"]["custom_ops_library"]).is_file()
    assert (out / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
    assert _moe_ops(out / "model.onnx") == _moe_ops(FIXTURES / family / "model.onnx")
    _assert_generates_torch_tokens(moe_onnx.session(out / "model.onnx"), FIXTURES / family)


@pytest.mark.slow
@_NEEDS_TORCH
@pytest.mark.xdist_group("export")  # the worker that has imported torch and transformers
def test_export_refuses_a_cache_of_other_state(tmp_path, capsys):
    """A checkpoint of a known family whose layers keep a Mamba state (GraniteMoeHybrid's mamba layer) is refused
    when it loads, naming the cache layer type (exit 2), before anything is exported."""
    import export_kv_fixtures
    import torch
    import transformers
    from moe_export import whole

    config = whole.tiny_config("granitemoehybrid", dict(vocab_size=export_kv_fixtures.VOCAB_SIZE))
    assert config.layer_types == ["linear_attention", "full_attention"]  # transformers' names of mamba, attention
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "checkpoint")
    assert cli(["export", str(tmp_path / "checkpoint"), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (  # after transformers' progress bars
        "moe-onnx export: granitemoehybrid: its cache holds LinearAttentionLayer layers (state other than keys and "
        "values, layer_types ['linear_attention', 'full_attention']); moe-onnx export writes a decoder with a KV cache only")
    assert not (tmp_path / "out" / "model.onnx").exists()


#: GPT-OSS's checkpoint as shipped (MXFP4 experts, the rest bfloat16)
GPT_OSS_SHIPPED = FIXTURES.parent / "shipped" / "gpt_oss_mxfp4" / "checkpoint"


@pytest.mark.slow
@_NEEDS_TORCH
@pytest.mark.xdist_group("export")
def test_export_fp16_fuses(exported):
    """Where torch is installed: `moe-onnx export --dtype fp16` of GPT-OSS as shipped fuses every MoE layer (the
    float32 sum and routing casts of the fp16 export; its MXFP4 experts become QMOE nodes with float16 activations)
    and its first step's logits are the fp32 reference's within float16's rounding (the logits reach about 5: one
    float16 step there is 0.004)."""
    out = exported(GPT_OSS_SHIPPED, "--dtype", "fp16")
    model = onnx.load(out / "model.onnx", load_external_data=False)
    assert sorted(node.op_type for node in model.graph.node if node.domain == "moe_onnx") == [
        "MoeGatingTopK", "MoeGatingTopK", "QMOE", "QMOE"]
    reference = np.load(GPT_OSS_SHIPPED.parent / "reference.npz")
    config = _config(out)
    session = moe_onnx.session(out / "model.onnx")
    past = {value.name: np.zeros((1, value.shape[1], 0, value.shape[3]), np.float16)
            for value in session.get_inputs() if value.name.startswith("past_key_values.")}
    prompt = reference["prompt_ids"]
    logits = session.run([config["model"]["decoder"]["outputs"]["logits"]], {
        "input_ids": prompt, "attention_mask": np.ones_like(prompt),
        "position_ids": np.arange(prompt.shape[1], dtype=np.int64)[None], **past})[0]
    assert logits.dtype == np.float16 and logits.shape == (1, 1, config["model"]["vocab_size"])
    np.testing.assert_allclose(logits[0, -1].astype(np.float32), reference["logits"][0], atol=1.5e-2)


def test_export_of_a_checkpoint_without_safetensors(tmp_path, capsys):
    """A folder without safetensors is refused before torch is imported and before anything is written."""
    checkpoint = _checkpoint(tmp_path, {"model_type": "qwen3_moe"})
    assert cli(["export", str(checkpoint), "-o", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"moe-onnx export: {checkpoint}: no model.safetensors or model.safetensors.index.json (moe-onnx export reads "
        f"safetensors checkpoints)")
    assert not (tmp_path / "out").exists()
