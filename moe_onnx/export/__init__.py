"""``moe-onnx export``: a local Hugging Face checkpoint folder (config.json, safetensors, tokenizer files)
becomes an onnxruntime-genai model folder: a decoder with a KV cache (inputs ``input_ids``, ``attention_mask``,
``position_ids``, ``past_key_values.%d.key/.value``; outputs ``logits``, ``present.%d.key/.value``; dynamic batch,
sequence and past lengths), fused by the optimize pass unless asked not to, with ``genai_config.json`` and the
tokenizer files beside it.

torch and transformers are needed only here (the ``export`` extra); they are imported when an export starts.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from .._ir import model_files
from ..pipeline import GENAI_CONFIG, OptimizeResult, optimize_file
from .families import FAMILIES, REFUSED, ExportFamily
from .genai_config import genai_config

__all__ = ["DTYPES", "FAMILIES", "DECODER", "ExportError", "ExportFailure", "ExportResult", "export_checkpoint"]

DTYPES = ("fp32", "fp16", "bf16")
DECODER = "model.onnx"
#: the checkpoint's files onnxruntime-genai and ``moe-onnx generate`` read, copied when present
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class ExportError(ValueError):
    """A checkpoint or setting ``moe-onnx export`` refuses (exit 2): a family it does not know or does not export
    with a KV cache, a cache of other state than keys and values, an unknown dtype, torch or transformers missing."""


class ExportFailure(RuntimeError):
    """transformers could not load the checkpoint, or torch.onnx could not export it (exit 1)."""


@dataclasses.dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote: the folder, the family and the optimize result (None with
    ``optimize=False``)."""

    out_dir: Path
    family: ExportFamily
    optimized: OptimizeResult | None

    @property
    def ok(self) -> bool:
        return self.optimized is None or self.optimized.ok

    def summary(self) -> str:
        lines = [f"exported {self.family.model_type} (dynamo exporter, experts {self.family.experts_implementation}) "
                 f"to {self.out_dir}"]
        if self.optimized is not None:
            lines.append(self.optimized.summary())
            if not self.optimized.report.fused_blocks:
                lines.append("no MoE block was fused (the near-misses above say why): the model runs as exported")
        return "\n".join(lines)


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "fp32", *,
                      optimize: bool = True, progress: Callable[[str], None] | None = None) -> ExportResult:
    """Export the checkpoint folder ``checkpoint`` at ``dtype`` into the folder ``out_dir`` (created when
    missing): ``model.onnx`` and its external data, ``genai_config.json`` and the tokenizer files. Unless ``optimize``
    is false the decoder is fused by :func:`moe_onnx.pipeline.optimize_file`, which also copies our C++ library
    into the folder and names it in genai_config.json (onnxruntime-genai loads it from there).

    Raises ExportError for a family :data:`FAMILIES` lacks (with the reason for those :data:`REFUSED` names), a
    checkpoint whose layers cache other state than keys and values, an unknown dtype or torch/transformers missing;
    ModelFileError when the checkpoint's config cannot be read or ``out_dir`` cannot be written;
    OutputPathError when ``out_dir`` is not a folder.
    """
    say = progress or (lambda message: None)
    checkpoint = Path(checkpoint)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    config = _read_json(checkpoint / "config.json")
    family = FAMILIES.get(config.get("model_type"))
    if config.get("model_type") in REFUSED:
        raise ExportError(f"{checkpoint}: model_type {config['model_type']!r} is not exported with a KV cache: "
                          f"{REFUSED[config['model_type']]}")
    if family is None:
        raise ExportError(f"{checkpoint}: model_type {config.get('model_type')!r} is not a family moe-onnx export "
                          f"knows (it knows {', '.join(sorted(FAMILIES))})")
    try:
        from . import _torch
    except ImportError as error:
        raise ExportError(f"needs torch and transformers ({error}): pip install 'moe-onnx[export]'") from None
    out = model_files.output_directory(out_dir)
    with tempfile.TemporaryDirectory(dir=out, prefix=".export-") as staging:
        stage = Path(staging) if optimize else out
        say(f"loading {checkpoint} ({dtype})")
        model = _attempt(f"transformers cannot load {checkpoint}", _torch.load_model, checkpoint, family, dtype)
        _torch.refuse_states(model)
        say("exporting the decoder with its KV cache (dynamo exporter)")
        cache = _attempt(f"torch.onnx cannot export {checkpoint}", _torch.export_decoder, model, stage / DECODER)
        del model
        gc.collect()
        generation = _read_json(checkpoint / "generation_config.json") if (
            checkpoint / "generation_config.json").is_file() else {}
        config_json = genai_config(config, generation, family.genai_type, DECODER, cache)
        _write_folder_files(checkpoint, stage, config_json)
        optimized = None
        if optimize:
            say("optimizing")
            optimized = optimize_file(stage, out, progress=progress)
    return ExportResult(out, family, optimized)


def _attempt(what: str, function: Callable, *args):
    """``function(*args)``; ExportFailure naming ``what`` and the root cause's type and first line when it fails."""
    try:
        return function(*args)
    except Exception as error:  # noqa: BLE001 - torch and transformers raise anything; the user gets one line
        cause = error
        while cause.__cause__ is not None:
            cause = cause.__cause__
        first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
        raise ExportFailure(f"{what}: {type(cause).__name__}: {first}") from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise model_files.ModelFileError(f"{path}: cannot read it: {error.strerror or error}") from None
    except ValueError as error:
        raise model_files.ModelFileError(f"{path}: expected JSON: {error}") from None


def _write_folder_files(checkpoint: Path, folder: Path, config: dict) -> None:
    """genai_config.json and the checkpoint's tokenizer files in ``folder``."""
    try:
        (folder / GENAI_CONFIG).write_text(json.dumps(config, indent=4) + "\n")
        for name in TOKENIZER_FILES:
            if (checkpoint / name).is_file():
                shutil.copyfile(checkpoint / name, folder / name)
    except OSError as error:
        raise model_files.ModelFileError(f"{folder}: cannot write it: {error.strerror or error}") from None
