"""The onnxruntime-genai model folder: its one reader (:class:`GenaiFolder`) and writer (:func:`new_config`,
:func:`write_config`, :meth:`GenaiFolder.copy_to`), for export, optimize, quantize and generate.

A folder holds ``genai_config.json``, the decoder it names (``model.decoder.filename``, with its external data),
the tokenizer files and, when the decoder keeps moe_onnx ops, our C++ library, named in the config as the
decoder's ``session_options.custom_ops_library`` (onnxruntime-genai loads a library only from inside the model
folder). The config is written as onnxruntime-genai 0.18's model builder writes it (models/fixtures/genai/): the
decoder's input and output names, the attention shape, the special token ids and the search defaults.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._ir import model_files
from ._ir.model_files import ModelFileError
from .runtime import custom_ops_library

GENAI_CONFIG = "genai_config.json"
TOKENIZER_FILE = "tokenizer.json"
#: the checkpoint's files onnxruntime-genai and ``moe-onnx generate`` read, copied by export when present
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
#: the decoder's input and output names as export writes them; ``%d`` is the layer
INPUT_NAMES = {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
               "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
OUTPUT_NAMES = {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}

#: search settings that generation_config.json may set, with the builder's defaults
_SEARCH_DEFAULTS = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0,
                    "length_penalty": 1.0, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0, "temperature": 1.0,
                    "top_k": 50, "top_p": 1.0}


@dataclass(frozen=True)
class CacheShape:
    """The KV cache of one decoder layer: its index, kv heads and the head size of its keys (its values' may be
    narrower, under multi-head latent attention)."""

    layer: int
    kv_heads: int
    head_size: int


def new_config(config: dict, generation: dict, genai_type: str, decoder: str, cache: list[CacheShape]) -> dict:
    """The genai_config.json of a decoder file named ``decoder`` exported from a checkpoint whose config.json is
    ``config`` (and generation_config.json ``generation``, or {}); ``genai_type`` is ``model.type``; ``cache`` the
    decoder's cache layers. The attention shape is the first cache layer's and the layer count runs to the last
    one (genai 0.18 reads each past's kv heads from the decoder and skips a layer without one, but sizes keys and
    values alike by head_size: latent attention, whose values are narrower than its keys, runs in
    ``moe-onnx generate``, which reads every dim from the decoder, not in genai).

    The presents are the pasts with the new tokens appended (they grow each step), so the past and present
    buffers are not shared."""
    context_length = config["max_position_embeddings"]
    search = {}
    for key, default in _SEARCH_DEFAULTS.items():
        source = _search_source(config, generation, key)
        search[key] = default if source is None else source[key]
    search.update(early_stopping=True, max_length=context_length, min_length=0, past_present_share_buffer=False)
    # a special token the checkpoint leaves null (transformers allows it) is left out: genai refuses a null and runs
    # without one (no eos: generation stops at its length only)
    tokens = {key: _token_source(config, generation, key).get(key) for key in ("bos_token_id", "eos_token_id",
                                                                                 "pad_token_id")}
    return {
        "model": {
            **{key: value for key, value in tokens.items() if value is not None},
            "context_length": context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": decoder,
                "head_size": cache[0].head_size,
                "hidden_size": config["hidden_size"],
                "inputs": dict(INPUT_NAMES),
                "outputs": dict(OUTPUT_NAMES),
                "num_attention_heads": config["num_attention_heads"],
                "num_hidden_layers": cache[-1].layer + 1,
                "num_key_value_heads": cache[0].kv_heads,
            },
            "type": genai_type,
            "vocab_size": config["vocab_size"],
        },
        "search": dict(sorted(search.items())),
    }


def check_checkpoint_config(config: model_files.JsonObject, generation: model_files.JsonObject) -> None:
    """What :func:`new_config` takes from a checkpoint's config.json (``config``) and generation_config.json
    (``generation``, empty where the checkpoint has none), checked before anything is exported, so that the folder
    written is one that onnxruntime-genai and ``moe-onnx generate`` read: ModelFileError, naming the file, the key
    and what was expected, for a hidden size, head count or vocabulary size that is not an integer >= 1, a context
    length (max_position_embeddings) below 2, an eos_token_id that is not a token id of the vocabulary or a list of
    them, or a search setting of another type than the builder's default."""
    for key in ("hidden_size", "num_attention_heads", "vocab_size"):
        config.integer(key, minimum=1)
    config.integer("max_position_embeddings", minimum=2)
    vocab_size = config.integer("vocab_size")
    tokens = generation if _token_source(config.data, generation.data, "eos_token_id") is generation.data else config
    if "eos_token_id" in tokens and stop_tokens(tokens.data["eos_token_id"], vocab_size) is None:
        raise tokens.error("eos_token_id", f"a token id in [0, {vocab_size}) or a list of them")
    for key, default in _SEARCH_DEFAULTS.items():
        source = _search_source(config.data, generation.data, key)
        if source is not None:
            document = generation if source is generation.data else config
            look_up = {bool: document.boolean, int: document.integer, float: document.number}[type(default)]
            look_up(key)


def _token_source(config: dict, generation: dict, key: str) -> dict:
    """The document a special token is taken from: generation_config.json where it has the key (null there: no such
    token, as transformers' generate reads it), else config.json."""
    return generation if key in generation else config


def _search_source(config: dict, generation: dict, key: str) -> dict | None:
    """The document a search setting is taken from: the first of generation_config.json and config.json that gives
    it a value; None where neither does (the builder's default, then)."""
    return next((document for document in (generation, config) if document.get(key) is not None), None)


def stop_tokens(value: object, vocab_size: int) -> set[int] | None:
    """An eos_token_id as a config holds it (a token id or a list of them) as a set of token ids; None when any of
    them is not a token id of a vocabulary of ``vocab_size``."""
    tokens = value if isinstance(value, list) else [value]
    return {int(token) for token in tokens} if all(_is_index(token, vocab_size) for token in tokens) else None


def _is_index(value: object, stop: int) -> bool:
    """Whether ``value`` is an integer (Python's or numpy's, not a bool) in [0, ``stop``)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value < stop


def is_genai_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a genai_config.json (read it with :class:`GenaiFolder`, which says what is
    wrong with one that is not a regular JSON file)."""
    return os.path.isdir(path) and os.path.lexists(Path(path) / GENAI_CONFIG)


class GenaiFolder:
    """A folder in onnxruntime-genai's format, read and checked: the config as read (``config``), the decoder's
    path, its input and output names, the attention shape (layers, kv heads, head size, sliding window), the stop
    tokens, the context length and the search section. Raises ModelFileError, naming the file and what is wrong,
    for a folder without a readable config or whose decoder is not a file."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        config_path = self.folder / GENAI_CONFIG
        if not config_path.exists():  # one that is not a regular file: read_json says so
            raise ModelFileError(f"{self.folder}: no {GENAI_CONFIG} (a folder in onnxruntime-genai's format)")
        document = model_files.read_json(config_path)
        self.config = document.data
        model = document.object("model")
        decoder = model.object("decoder")
        filename = decoder.string("filename")
        self.decoder_path = self.folder / filename
        if Path(filename).is_absolute() or ".." in Path(filename).parts or filename in (GENAI_CONFIG, ""):
            raise decoder.error("filename", "the decoder's path inside the folder")
        self.inputs, self.outputs = decoder.object("inputs", required=False), decoder.object("outputs", required=False)
        self.layers = decoder.integer("num_hidden_layers", minimum=1)
        self.kv_heads = decoder.integer("num_key_value_heads", minimum=1)
        self.head_size = decoder.integer("head_size", minimum=1)
        self.context_length = model.integer("context_length", minimum=2)
        self.vocab_size = model.integer("vocab_size", minimum=1)
        eos = stop_tokens(model.value("eos_token_id", []), self.vocab_size)  # none: it stops at its length, as genai
        if eos is None:
            raise model.error("eos_token_id", f"a token id in [0, {self.vocab_size}) or a list of them")
        self.eos = eos
        window = decoder.object("sliding_window", required=False)
        self.window_size = window.integer("window_size", minimum=1) if window.data else None
        listed = window.list("layers", []) if window.data else []
        if not all(_is_index(layer, self.layers) for layer in listed):
            raise window.error("layers", f"a list of layers in [0, {self.layers})")
        self._window_layers = set(listed) if "layers" in window else None  # None: every layer
        self.search = document.object("search", required=False)
        if not self.decoder_path.is_file():
            raise ModelFileError(f"{config_path}: its decoder {self.decoder_path} is not a file")

    def is_token(self, value: object) -> bool:
        """Whether ``value`` is a token id of the vocabulary (an integer in [0, vocab_size), not a bool)."""
        return _is_index(value, self.vocab_size)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (the layers the config lists, all when it lists none), or None."""
        if self.window_size is None or (self._window_layers is not None and layer not in self._window_layers):
            return None
        return self.window_size

    def name(self, key: str, default: str) -> str:
        """The decoder input's or output's name the config gives for ``key`` (``default`` where it gives none)."""
        return (self.inputs if key in self.inputs else self.outputs).string(key, default)

    def names_written(self, decoder: str | os.PathLike) -> set[str]:
        """The names of the files :meth:`copy_to` and the decoder ``decoder`` (with its data file) put in a folder."""
        decoder = Path(decoder)
        names = {file.name for file in self.folder.iterdir() if file.is_file()}
        names |= {decoder.name, model_files.data_file(decoder).name, GENAI_CONFIG}
        with contextlib.suppress(FileNotFoundError):  # no library built: a job that needs it says so itself
            names.add(Path(custom_ops_library()).name)
        return names

    def copy_to(self, destination: str | os.PathLike, decoder: str | os.PathLike, *, library: bool) -> None:
        """Complete the folder ``destination`` whose decoder ``decoder`` is written already: the other files of this
        folder (tokenizer, configs; not the decoder and its data) and the config naming ``decoder`` (and our library
        with ``library``: :func:`write_config`)."""
        destination = Path(destination)
        skipped = {GENAI_CONFIG, self.decoder_path.name, model_files.data_file(self.decoder_path).name} | {
            file.name for file in model_files.external_data_files(model_files.read_proto(self.decoder_path),
                                                                  self.folder)}
        try:
            for file in sorted(self.folder.iterdir()):
                if file.is_file() and file.name not in skipped:
                    with model_files.replacing(destination / file.name) as copy:
                        shutil.copyfile(file, copy)
        except OSError as error:
            raise ModelFileError(f"{destination}: cannot write the onnxruntime-genai folder: "
                                 f"{error.strerror or error}") from None
        config = json.loads(json.dumps(self.config))
        config["model"]["decoder"]["filename"] = Path(decoder).name
        write_config(destination, config, library=library)


def write_config(folder: str | os.PathLike, config: dict, *, library: bool) -> None:
    """Write ``config`` as ``folder``'s genai_config.json; with ``library`` copy our C++ library into the folder and
    name it as the decoder's ``session_options.custom_ops_library``, else name none. ModelFileError when the folder
    cannot be written."""
    folder = Path(folder)
    options = config["model"]["decoder"].setdefault("session_options", {})
    try:
        if library:
            path = Path(custom_ops_library())
            with model_files.replacing(folder / path.name) as copy:
                shutil.copyfile(path, copy)
            options["custom_ops_library"] = path.name
        else:
            options.pop("custom_ops_library", None)
        with model_files.replacing(folder / GENAI_CONFIG) as written:
            written.write_text(json.dumps(config, indent=4) + "\n")
    except OSError as error:
        raise ModelFileError(f"{folder}: cannot write the onnxruntime-genai folder: "
                             f"{error.strerror or error}") from None


def copy_tokenizer(checkpoint: str | os.PathLike, folder: str | os.PathLike) -> None:
    """The checkpoint's tokenizer files (:data:`TOKENIZER_FILES`, those it has) into ``folder``."""
    try:
        for name in TOKENIZER_FILES:
            if (Path(checkpoint) / name).is_file():
                with model_files.replacing(Path(folder) / name) as copy:
                    shutil.copyfile(Path(checkpoint) / name, copy)
    except OSError as error:
        raise ModelFileError(f"{folder}: cannot write it: {error.strerror or error}") from None
