"""The one JSON reader (moe_onnx._ir.model_files.read_json) and the files read through it: genai_config.json,
shard.json, a checkpoint's config.json and safetensors index. Every error names the file, the key and what was
expected there."""

import json
import os
import shutil
from pathlib import Path

import pytest

from moe_onnx._ir.model_files import ModelFileError, read_json
from moe_onnx.distributed.manifest import MANIFEST_NAME, Manifest, ManifestError
from moe_onnx.export.checkpoint import Checkpoint, CheckpointError
from moe_onnx.genai_folder import GENAI_CONFIG, GenaiFolder

GENAI_FIXTURE = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "genai" / "gpt_oss_fp32"

DOCUMENT = {"model": {"decoder": {"layers": 4, "name": "model.onnx", "scale": 0.5, "flag": True,
                                  "ids": [1, 2], "text": "64", "nothing": None}},
            "ranks": [{"rank": 0}, {"rank": "one"}]}


@pytest.fixture
def document(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DOCUMENT))
    return read_json(path)


def test_look_ups_return_the_values(document):
    decoder = document.object("model").object("decoder")
    assert (decoder.integer("layers", minimum=1), decoder.string("name"), decoder.number("scale"),
            decoder.number("layers"), decoder.boolean("flag"), decoder.list("ids")) == (4, "model.onnx", 0.5, 4,
                                                                                         True, [1, 2])
    assert decoder.integer("missing", 7) == 7 and decoder.integer("nothing", 7) == 7  # null reads as missing
    assert decoder.object("absent", required=False).data == {} and "absent" not in decoder and "layers" in decoder
    assert document.objects("ranks")[0].integer("rank") == 0


@pytest.mark.parametrize("look_up, message", [
    (lambda d: d.object("model").object("decoder").integer("text"), 'model.decoder.text: expected an integer, got "64"'),
    (lambda d: d.object("model").object("decoder").integer("flag"), "model.decoder.flag: expected an integer, got true"),
    (lambda d: d.object("model").object("decoder").integer("scale"), "model.decoder.scale: expected an integer, got 0.5"),
    (lambda d: d.object("model").object("decoder").integer("layers", minimum=8),
     "model.decoder.layers: expected an integer >= 8, got 4"),
    (lambda d: d.object("model").object("decoder").string("layers"), "model.decoder.layers: expected a string, got 4"),
    (lambda d: d.object("model").object("decoder").boolean("name"),
     'model.decoder.name: expected true or false, got "model.onnx"'),
    (lambda d: d.object("model").object("decoder").object("ids"), "model.decoder.ids: expected an object, got a list"),
    (lambda d: d.object("model").list("decoder"), "model.decoder: expected a list, got an object"),
    (lambda d: d.object("model").object("decoder").string("nothing"), "model.decoder.nothing: missing; expected a string"),
    (lambda d: d.object("search"), "search: missing; expected an object"),
    (lambda d: d.objects("ranks")[1].integer("rank"), 'ranks[1].rank: expected an integer, got "one"'),
])
def test_errors_name_the_file_the_key_and_what_was_expected(document, look_up, message):
    with pytest.raises(ModelFileError) as raised:
        look_up(document)
    assert str(raised.value) == f"{document.path}: {message}"


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "expected an object, got a list"),
    ('"text"', 'expected an object, got "text"'),
    ("{1: 2}", "expected JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ("", "expected JSON: Expecting value: line 1 column 1 (char 0)"),
])
def test_a_file_that_is_not_a_json_object_is_refused(tmp_path, content, message):
    (tmp_path / "c.json").write_text(content)
    with pytest.raises(ModelFileError, match=f"^{tmp_path / 'c.json'}: {message}$".replace("(", r"\(").replace(
            ")", r"\)").replace("[", r"\[")):
        read_json(tmp_path / "c.json")


def test_only_regular_files_are_opened(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # opening it would hang
    for name, message in (("fifo", "is not a regular file; expected a JSON file"), (".", "is not a regular file; "
                          "expected a JSON file"), ("absent", "cannot read it: No such file or directory")):
        with pytest.raises(ModelFileError) as raised:
            read_json(tmp_path / name)
        assert str(raised.value) == f"{tmp_path / name}: {message}"


def _genai_folder(tmp_path: Path, decoder_settings: dict) -> Path:
    folder = tmp_path / "folder"
    shutil.copytree(GENAI_FIXTURE, folder)
    config = json.loads((folder / GENAI_CONFIG).read_text())
    config["model"]["decoder"].update(decoder_settings)
    (folder / GENAI_CONFIG).write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("settings, message", [
    ({"num_hidden_layers": "2"}, 'model.decoder.num_hidden_layers: expected an integer >= 1, got "2"'),
    ({"num_hidden_layers": 0}, "model.decoder.num_hidden_layers: expected an integer >= 1, got 0"),
    ({"filename": 3}, "model.decoder.filename: expected a string, got 3"),
    ({"filename": "../model.onnx"}, 'model.decoder.filename: expected the decoder\'s path inside the folder, got '
                                    '"../model.onnx"'),
    ({"filename": "genai_config.json"}, "model.decoder.filename: expected the decoder's path inside the folder, got "
                                        '"genai_config.json"'),
    ({"sliding_window": {"layers": [0]}},
     "model.decoder.sliding_window.window_size: missing; expected an integer >= 1"),
    ({"sliding_window": {"window_size": -8}}, "model.decoder.sliding_window.window_size: expected an integer >= 1, "
                                              "got -8"),
    ({"sliding_window": {"window_size": 8, "layers": [0, 2]}},
     "model.decoder.sliding_window.layers: expected a list of layers in [0, 2), got a list"),
    ({"inputs": {"input_ids": 5}}, "model.decoder.inputs.input_ids: expected a string, got 5"),
])
def test_genai_config_errors_name_the_key(tmp_path, settings, message):
    folder = _genai_folder(tmp_path, settings)
    with pytest.raises(ModelFileError) as raised:
        GenaiFolder(folder).name("input_ids", "input_ids")
    assert str(raised.value) == f"{folder / GENAI_CONFIG}: {message}"


def test_genai_config_eos_must_be_token_ids(tmp_path):
    folder = _genai_folder(tmp_path, {})
    config = json.loads((folder / GENAI_CONFIG).read_text())
    config["model"]["eos_token_id"] = [1, "2"]
    (folder / GENAI_CONFIG).write_text(json.dumps(config))
    with pytest.raises(ModelFileError) as raised:
        GenaiFolder(folder)
    assert str(raised.value) == f"{folder / GENAI_CONFIG}: model.eos_token_id: expected a token id in [0, 96) or a " \
                                "list of them, got a list"


def _manifest(tmp_path: Path, **changes) -> Path:
    document = {**Manifest("m.onnx", "f", 1, 2, ["rank0.onnx", "rank1.onnx"], ["a", "b"]).document(), **changes}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(document))
    return tmp_path


@pytest.mark.parametrize("changes, message", [
    ({"tp": "1"}, 'tp: expected an integer, got "1"'),
    ({"ranks": [{"rank": 0, "file": "rank0.onnx"}]}, "ranks[0].fingerprint: missing; expected a string"),
    ({"ranks": {}}, "ranks: expected a list, got an object"),
    ({"format": 99}, "format 99; this moe-onnx reads format 1 (shard the model again)"),
])
def test_manifest_errors_name_the_key(tmp_path, changes, message):
    with pytest.raises(ManifestError) as raised:
        Manifest.read(_manifest(tmp_path, **changes))
    assert str(raised.value) == f"{tmp_path / MANIFEST_NAME}: {message}"


def test_manifest_round_trips(tmp_path):
    assert Manifest.read(_manifest(tmp_path)) == Manifest("m.onnx", "f", 1, 2, ["rank0.onnx", "rank1.onnx"],
                                                          ["a", "b"])


@pytest.mark.parametrize("index, message", [
    ({"metadata": {}}, "weight_map: missing; expected an object"),
    ({"weight_map": {"a.weight": 3}}, "weight_map.a.weight: expected a string, got 3"),
])
def test_safetensors_index_errors_name_the_key(tmp_path, index, message):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as raised:
        Checkpoint(tmp_path, {})
    assert str(raised.value) == (f"{tmp_path / 'model.safetensors.index.json'}: {message} (safetensors' index: JSON "
                                 "with a weight_map)")
