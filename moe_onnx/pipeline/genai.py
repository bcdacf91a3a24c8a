"""The onnxruntime-genai folder as a job's input: optimize and quantize take a folder holding genai_config.json
and write a complete one, its decoder optimized (or quantized) and the folder's other files copied
(:meth:`moe_onnx.genai_folder.GenaiFolder.copy_to`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..genai_folder import GenaiFolder, is_genai_folder


@dataclasses.dataclass(frozen=True)
class JobPaths:
    """The model file a job reads (``source``) and the one it writes (``destination``); for a genai folder, the
    folder read (``genai``) and the folder written (``folder``), the decoders inside them."""

    source: str | os.PathLike
    destination: str | os.PathLike
    genai: GenaiFolder | None = None
    folder: Path | None = None


def job_paths(source: str | os.PathLike, destination: str | os.PathLike) -> JobPaths:
    """The paths of a job from ``source`` to ``destination``: model files, or genai folders whose decoders the job
    reads and writes (raises :class:`moe_onnx._ir.model_files.ModelFileError` for a folder whose genai_config.json
    cannot be read)."""
    if not is_genai_folder(source):
        return JobPaths(source, destination)  # as given: the messages name them so
    genai, folder = GenaiFolder(source), Path(destination)
    return JobPaths(genai.decoder_path, folder / genai.decoder_path.name, genai, folder)
