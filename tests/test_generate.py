"""`moe-onnx generate` and moe_onnx.generate on onnxruntime-genai folders (models/fixtures/genai: the model builder's
GPT-OSS, whose layer 0 has a sliding window of 8, and LFM2-MoE, whose layer 0 is a convolution): greedy tokens equal
onnxruntime-genai's own for the builder's folders and for the optimized ones (our ops), sampling is reproducible,
the command prints the text and the tokens/s, and its errors are one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime_genai as og
import pytest
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.cli import main as cli
from moe_onnx._ir.model_files import ModelFileError
from moe_onnx.genai_folder import CacheShape, new_config
from moe_onnx.generation import GenerateError

FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "genai"
#: the folders onnxruntime-genai runs on CPU (the builder's fp16 models do not)
NAMES = ["gpt_oss_fp32", "gpt_oss_int4", "lfm2_moe_fp32", "lfm2_moe_int4"]
PROMPT = [7, 19, 33, 4, 61, 12, 70, 8, 41, 23, 50, 88]  # longer than GPT-OSS's window of 8; no fixture's eos follows
NEW_TOKENS = 20  # the sequence passes the window again and again


def _genai_tokens(folder: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """onnxruntime-genai's greedy tokens after ``prompt``."""
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(token) for token in generator.get_sequence(0)][len(prompt):]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_genais(genai_optimized, name):
    """The builder's folder (onnxruntime's MoE/QMoE) and the optimized one (our MOE/QMOE) give onnxruntime-genai's
    tokens, one decode run per token after the prefill."""
    expected = _genai_tokens(FIXTURES / name, PROMPT, NEW_TOKENS)
    assert len(set(expected)) > 3, expected  # a real sequence, not one token repeated
    for folder in (FIXTURES / name, genai_optimized[name]):
        result = moe_onnx.generate(folder, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
        assert result.tokens == expected, (folder, result.tokens, expected)
        assert result.stop == "max_new_tokens" and result.decode_runs == NEW_TOKENS - 1
        assert result.prefill_seconds > 0 and result.decode_seconds > 0
    assert _genai_tokens(genai_optimized[name], PROMPT, NEW_TOKENS) == expected


def test_python_backend_gives_the_same_tokens(genai_optimized):
    folder = genai_optimized["lfm2_moe_int4"]
    cpp = moe_onnx.generate(folder, prompt_ids=PROMPT[:5], max_new_tokens=6)
    python = moe_onnx.generate(folder, prompt_ids=PROMPT[:5], max_new_tokens=6, backend="python")
    assert python.tokens == cpp.tokens


def _folder_with(tmp_path: Path, name: str, **model_settings) -> Path:
    """A copy of a fixture folder whose genai_config.json's model section takes ``model_settings``."""
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"].update(model_settings)
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def test_stops_at_eos_as_genai_does(tmp_path):
    """An eos token (one of a list) ends generation and is left out of the tokens, as onnxruntime-genai does."""
    greedy = moe_onnx.generate(FIXTURES / "gpt_oss_fp32", prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS).tokens
    eos = next(token for position, token in enumerate(greedy) if position >= 3 and token not in greedy[:position])
    folder = _folder_with(tmp_path, "gpt_oss_fp32", eos_token_id=[95, eos])
    result = moe_onnx.generate(folder, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    assert result.stop == "eos" and result.tokens == greedy[:greedy.index(eos)]
    assert result.decode_runs == len(result.tokens)  # the run that gave the eos token counts
    assert result.tokens == _genai_tokens(folder, PROMPT, NEW_TOKENS)


def test_without_an_eos_token_generation_runs_to_its_length_as_genai_does(tmp_path):
    """A checkpoint may have no eos token (eos_token_id null, as transformers allows): export leaves it out of the
    config (genai refuses a null), and both genai and generate then stop at the length asked for only."""
    config = new_config({"max_position_embeddings": 64, "hidden_size": 8, "num_attention_heads": 2,
                         "vocab_size": 96, "eos_token_id": None, "bos_token_id": 1, "pad_token_id": None}, {},
                        "gpt_oss", "model.onnx", [CacheShape(0, 2, 4)])
    assert config["model"]["bos_token_id"] == 1 and not {"eos_token_id", "pad_token_id"} & config["model"].keys()
    folder = _folder_with(tmp_path, "gpt_oss_fp32")
    settings = json.loads((folder / "genai_config.json").read_text())
    del settings["model"]["eos_token_id"]
    (folder / "genai_config.json").write_text(json.dumps(settings))
    result = moe_onnx.generate(folder, prompt_ids=PROMPT, max_new_tokens=6)
    assert result.stop == "max_new_tokens" and result.tokens == _genai_tokens(folder, PROMPT, 6)


def test_the_cache_layers_are_the_decoders_whatever_the_layer_count(tmp_path, capsys):
    """The caches are found among the decoder's inputs (a huge num_hidden_layers is not iterated); one beyond the
    config's count, or a name pattern without its one %d, is refused naming the config's key."""
    expected = moe_onnx.generate(FIXTURES / "gpt_oss_fp32", prompt_ids=PROMPT, max_new_tokens=4).tokens
    huge = _folder_with(tmp_path / "huge", "gpt_oss_fp32")
    settings = json.loads((huge / "genai_config.json").read_text())
    settings["model"]["decoder"]["num_hidden_layers"] = 10**12
    (huge / "genai_config.json").write_text(json.dumps(settings))
    assert moe_onnx.generate(huge, prompt_ids=PROMPT, max_new_tokens=4).tokens == expected
    for name, decoder, message in (
            ("one", {"num_hidden_layers": 1}, "{decoder}: cache input 'past_key_values.1.key' is beyond "
                                              "genai_config.json's num_hidden_layers 1"),
            ("pattern", {"inputs": {"past_key_names": "past_key_values.key"}},
             "genai_config.json's past_key_names 'past_key_values.key': expected a name with one %d (the layer)")):
        folder = _folder_with(tmp_path / name, "gpt_oss_fp32")
        settings = json.loads((folder / "genai_config.json").read_text())
        for key, value in decoder.items():
            settings["model"]["decoder"][key] = {**settings["model"]["decoder"].get(key, {}), **value} \
                if isinstance(value, dict) else value
        (folder / "genai_config.json").write_text(json.dumps(settings))
        assert cli(["generate", str(folder), "--prompt-ids", "5,9", "-n", "2"]) == 2
        assert capsys.readouterr().err == f"moe-onnx generate: {message.format(decoder=folder / 'model.onnx')}\n"


def test_a_decoder_file_that_is_not_a_model_and_a_prompt_that_is_not_utf8_are_one_line(tmp_path, capsys):
    folder = _folder_with(tmp_path, "gpt_oss_fp32")
    settings = json.loads((folder / "genai_config.json").read_text())
    settings["model"]["decoder"]["filename"] = "tokenizer.json"
    (folder / "genai_config.json").write_text(json.dumps(settings))
    assert cli(["generate", str(folder), "--prompt-ids", "5,9", "-n", "2"]) == 1
    assert capsys.readouterr().err.startswith(
        f"moe-onnx generate: {folder / 'tokenizer.json'} (genai_config.json's model.decoder.filename): not a decoder "
        "onnxruntime loads: ")
    assert cli(["generate", str(FIXTURES / "gpt_oss_fp32"), "--prompt", "w5 \udcff", "-n", "2"]) == 2
    assert capsys.readouterr().err == "moe-onnx generate: the prompt is not UTF-8 text (at character 3)\n"


@pytest.mark.parametrize("eos", [-1, 96, "2", [2, None], True])
def test_an_eos_token_outside_the_vocabulary_is_refused(tmp_path, eos):
    folder = _folder_with(tmp_path, "gpt_oss_fp32", eos_token_id=eos)
    with pytest.raises(ModelFileError) as raised:
        moe_onnx.generate(folder, prompt_ids=PROMPT, max_new_tokens=2)
    assert str(raised.value).startswith(f"{folder / 'genai_config.json'}: model.eos_token_id: expected a token id in "
                                        "[0, 96) or a list of them, got ")


@pytest.mark.parametrize("sample", [[], ["--sample"]], ids=["greedy", "sample"])
def test_logits_that_hold_nan_are_refused_not_read_as_a_token(tmp_path, capsys, sample):
    """A decoder whose logits hold NaN (damaged weights, or a type that overflows) stops generation in one line
    naming it (exit 1): greedy search would take the first NaN's token as the best, silently."""
    folder = _folder_with(tmp_path, "gpt_oss_fp32")
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    producer = next(node for node in model.graph.node if "logits" in node.output)
    producer.output[list(producer.output).index("logits")] = "logits_before_nan"
    model.graph.node.append(helper.make_node("Mul", ["logits_before_nan", "nan"], ["logits"]))
    model.graph.initializer.append(helper.make_tensor("nan", TensorProto.FLOAT, [], [float("nan")]))
    onnx.save(model, folder / "model.onnx")
    assert cli(["generate", str(folder), "--prompt-ids", "5,9", "-n", "2", *sample]) == 1
    assert capsys.readouterr().err == (f"moe-onnx generate: {folder / 'model.onnx'}: its logits at run 1 hold NaN; "
                                       "expected numbers (the decoder's weights are damaged, or its type overflows)\n")


@pytest.mark.parametrize("token", [-1, 96, 2.0, True])
def test_the_api_and_the_command_refuse_a_prompt_id_outside_the_vocabulary_alike(capsys, token):
    folder = FIXTURES / "gpt_oss_fp32"
    message = f"prompt token 1 is {token!r}: expected a token id in [0, 96) (genai_config.json's vocab_size)"
    with pytest.raises(GenerateError) as raised:
        moe_onnx.generate(folder, prompt_ids=[5, token], max_new_tokens=2)
    assert str(raised.value) == message
    if isinstance(token, int) and not isinstance(token, bool):
        assert cli(["generate", str(folder), "--prompt-ids", f"5,{token}", "-n", "2"]) == 2
        assert capsys.readouterr().err == f"moe-onnx generate: {message}\n"


def test_stops_at_the_context_length_and_refuses_a_prompt_that_fills_it(tmp_path, capsys):
    greedy = moe_onnx.generate(FIXTURES / "lfm2_moe_fp32", prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS).tokens
    folder = _folder_with(tmp_path, "lfm2_moe_fp32", context_length=len(PROMPT) + 5)
    result = moe_onnx.generate(folder, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    assert result.stop == "context" and result.tokens == greedy[:5]
    too_long = ",".join(map(str, PROMPT * 2))
    assert cli(["generate", str(folder), "--prompt-ids", too_long, "-n", "4"]) == 2
    assert capsys.readouterr().err == ("moe-onnx generate: the prompt's 24 tokens leave no room in the context of 17 "
                                       "tokens (genai_config.json's context_length)\n")


def test_sampling_is_reproducible():
    folder = FIXTURES / "gpt_oss_int4"

    def sampled(**settings):
        return moe_onnx.generate(folder, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, sample=True,
                                 **settings).tokens

    greedy = moe_onnx.generate(folder, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS).tokens
    first = sampled(seed=7)
    assert sampled(seed=7) == first
    assert sampled(seed=8) != first and first != greedy
    assert sampled(seed=7, top_k=1) == greedy  # one candidate: the largest logit
    assert sampled(seed=7, top_p=1e-6) == greedy  # the fewest tokens reaching p: the most likely one
    with pytest.raises(GenerateError, match="only apply with sample=True"):
        moe_onnx.generate(folder, prompt_ids=PROMPT, max_new_tokens=2, seed=7)
    with pytest.raises(GenerateError, match=r"top_p must be in \(0, 1\], got 2"):
        sampled(top_p=2.0)


def test_command_prints_the_text_and_the_tokens_per_second(capsys):
    folder = FIXTURES / "lfm2_moe_fp32"
    expected = _genai_tokens(folder, [5, 9, 17], 6)
    assert cli(["generate", str(folder), "--prompt", "w5 w9 w17", "-n", "6", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == " ".join(f"w{token}" for token in expected)  # the tokenizer's words, one per token
    assert lines[1] == f"tokens: {' '.join(map(str, expected))} (stopped: -n tokens)"
    assert lines[2].startswith("prefill: 3 tokens in ") and lines[2].endswith(" tokens/s")
    assert lines[3].startswith("decode: 5 tokens in ") and lines[3].endswith(" tokens/s")
    assert lines[4] == "(times: session.run only)"
    assert cli(["generate", str(folder), "--prompt-ids", "5,9,17", "-n", "6", "--sample", "--seed", "3"]) == 0
    sampled = capsys.readouterr().out.splitlines()[1]
    assert cli(["generate", str(folder), "--prompt-ids", "5 9 17", "-n", "6", "--sample", "--seed", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == sampled


@pytest.mark.parametrize("case", ["no config", "config value", "no tokenizer", "seed without sample"])
def test_command_errors_are_one_line(tmp_path, capsys, case):
    folder = tmp_path / "folder"
    shutil.copytree(FIXTURES / "gpt_oss_fp32", folder)
    (folder / "tokenizer.json").unlink()
    if case == "config value":
        config = json.loads((folder / "genai_config.json").read_text())
        config["model"]["context_length"] = "4096"
        (folder / "genai_config.json").write_text(json.dumps(config))
    target, args, status, message = {
        "no config": (tmp_path, ["--prompt-ids", "5"], 1,
                      f"{tmp_path}: no genai_config.json (a folder in onnxruntime-genai's format)"),
        "config value": (folder, ["--prompt-ids", "5"], 1,
                         f'{folder / "genai_config.json"}: model.context_length: expected an integer >= 2, got '
                         '"4096"'),
        "no tokenizer": (folder, ["--prompt", "w5"], 1,
                         f"{folder}: no tokenizer.json to read the prompt with (give --prompt-ids instead)"),
        "seed without sample": (folder, ["--prompt-ids", "5", "--seed", "1"], 2,
                                "seed only apply with sample=True (greedy otherwise)"),
    }[case]
    assert cli(["generate", str(target), *args, "-n", "2"]) == status
    assert capsys.readouterr().err == f"moe-onnx generate: {message}\n"


@pytest.mark.slow  # a fresh process or a measurement: seconds, outside the fast lane
@pytest.mark.subprocess  # onnxruntime's logger, which the tests' conftest silences, left as a user has it
def test_a_run_onnxruntime_fails_is_one_line():
    """The builder's fp16 LFM2-MoE fails in onnxruntime on CPU once it has a past (an fp16 Cast onnxruntime
    inserts): its message in one line, nothing logged besides."""
    done = subprocess.run([sys.executable, "-m", "moe_onnx.cli", "generate", str(FIXTURES / "lfm2_moe_fp16"),
                           "--prompt-ids", "5,9,17", "-n", "4"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("moe-onnx generate: Fail: [ONNXRuntimeError] : 1 : FAIL : Non-zero status code "
                                  "returned while running Cast node.") and done.stderr.count("\n") == 1, done.stderr


def test_without_the_tokenizers_package_ids_still_generate(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers raises ImportError
    folder = str(FIXTURES / "gpt_oss_fp32")
    assert cli(["generate", folder, "--prompt", "w5 w9", "-n", "2"]) == 2
    assert capsys.readouterr().err == ("moe-onnx generate: a text prompt needs the tokenizers package: pip install "
                                       "'moe-onnx[generate]' (or give the prompt's token ids)\n")
    assert cli(["generate", folder, "--prompt-ids", "5,9", "-n", "2"]) == 0
    assert capsys.readouterr().out.startswith("tokens: ")  # no text line


def test_command_refuses_ids_that_are_not_ids(capsys):
    with pytest.raises(SystemExit) as exited:
        cli(["generate", str(FIXTURES / "gpt_oss_fp32"), "--prompt-ids", "5,x", "-n", "2"])
    assert exited.value.code == 2
    assert "argument --prompt-ids: '5,x' is not token ids like 5,9,17" in capsys.readouterr().err


def test_reads_the_names_and_feeds_positions_from_the_config(tmp_path):
    """A decoder of other names, with position_ids: its logits pick token (sum of the cached positions + the mask's
    length) mod V, so each step's token checks that the positions continue, that the cache is fed back whole and
    that the mask covers the whole sequence."""
    vocab = 100
    _write_counting_decoder(tmp_path, vocab)
    prompt = [4, 8, 15]
    result = moe_onnx.generate(tmp_path, prompt_ids=prompt, max_new_tokens=6)
    lengths = range(len(prompt), len(prompt) + 6)  # the tokens each run has seen
    assert result.tokens == [(total * (total - 1) // 2 + total) % vocab for total in lengths]
    assert result.stop == "max_new_tokens" and result.decode_runs == 5


def test_command_refuses_a_decoder_input_the_config_does_not_name(tmp_path, capsys):
    _write_counting_decoder(tmp_path, 100)
    config = json.loads((tmp_path / "genai_config.json").read_text())
    del config["model"]["decoder"]["inputs"]["position_ids"]
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    assert cli(["generate", str(tmp_path), "--prompt-ids", "4", "-n", "2"]) == 2
    assert capsys.readouterr().err == (f"moe-onnx generate: {tmp_path / 'model.onnx'}: inputs ['pos'] are neither the "
                                       f"token inputs nor a cache that genai_config.json names\n")


def _write_counting_decoder(folder: Path, vocab: int) -> None:
    """genai_config.json and model.onnx of a decoder named ids/mask/pos -> scores, caches past.%d.k/v ->
    present.%d.k/v (one layer, head and head size 1) holding each token's position."""
    def tensor(name, elem_type, dims):
        return helper.make_tensor_value_info(name, elem_type, dims)

    nodes = [
        helper.make_node("Cast", ["pos"], ["pos_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["pos_f", "axes_1_3"], ["new"]),
        helper.make_node("Concat", ["past.0.k", "new"], ["present.0.k"], axis=2),
        helper.make_node("Concat", ["past.0.v", "new"], ["present.0.v"], axis=2),
        helper.make_node("ReduceSum", ["present.0.k"], ["positions"], keepdims=0),
        helper.make_node("Shape", ["mask"], ["total"], start=1),
        helper.make_node("Cast", ["total"], ["total_f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["positions", "total_f"], ["index_f"]),
        helper.make_node("Cast", ["index_f"], ["index"], to=TensorProto.INT64),
        helper.make_node("Mod", ["index", "vocab"], ["token"]),
        helper.make_node("OneHot", ["token", "vocab", "off_on"], ["one_hot"]),
        helper.make_node("Shape", ["ids"], ["ids_shape"]),
        helper.make_node("Concat", ["ids_shape", "vocab"], ["scores_shape"], axis=0),
        helper.make_node("Expand", ["one_hot", "scores_shape"], ["scores"]),
    ]
    constants = [helper.make_tensor("axes_1_3", TensorProto.INT64, [2], [1, 3]),
                 helper.make_tensor("vocab", TensorProto.INT64, [1], [vocab]),
                 helper.make_tensor("off_on", TensorProto.FLOAT, [2], [0, 1])]
    cache = ["batch", 1, "past", 1]
    graph = helper.make_graph(
        nodes, "counting", [tensor("ids", TensorProto.INT64, ["batch", "seq"]),
                            tensor("mask", TensorProto.INT64, ["batch", "total"]),
                            tensor("pos", TensorProto.INT64, ["batch", "seq"]),
                            tensor("past.0.k", TensorProto.FLOAT, cache), tensor("past.0.v", TensorProto.FLOAT, cache)],
        [tensor("scores", TensorProto.FLOAT, ["batch", "seq", vocab]),
         tensor("present.0.k", TensorProto.FLOAT, None), tensor("present.0.v", TensorProto.FLOAT, None)],
        constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)  # ORT 1.31 reads
    onnx.save(model, folder / "model.onnx")
    decoder = {"filename": "model.onnx", "head_size": 1, "num_hidden_layers": 1, "num_key_value_heads": 1,
               "inputs": {"input_ids": "ids", "attention_mask": "mask", "position_ids": "pos",
                          "past_key_names": "past.%d.k", "past_value_names": "past.%d.v"},
               "outputs": {"logits": "scores", "present_key_names": "present.%d.k",
                           "present_value_names": "present.%d.v"}}
    config = {"model": {"decoder": decoder, "context_length": 64, "eos_token_id": vocab - 1, "vocab_size": vocab}}
    (folder / "genai_config.json").write_text(json.dumps(config))
