"""Packed-weights files: the expert ops' packed panels written once (:func:`pack_weights`, ``moe-onnx pack``) and
mapped by later sessions instead of packing (custom_ops/src/packing/packed_file.h; docs/building.md, "Packed-weights
files"). A session finds them through session config entries, read when the C++ library is registered; its
default directory is ``<model path>.packed`` (:func:`default_directory`) when that exists."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

#: session config entries (kPackedWeights*Key in custom_ops/src/packing/packed_file.h)
DIRECTORY_KEY = "moe_onnx.packed_weights"
WRITE_KEY = "moe_onnx.packed_weights_write"
THREADS_KEY = "moe_onnx.packed_weights_threads"
FILE_SUFFIX = ".moepack"


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


#: ``session(packed_weights=DEFAULT)``: ``<model path>.packed`` when the model is a path and that folder exists
DEFAULT = _Default()


def default_directory(model: str | os.PathLike) -> Path:
    """Where ``moe-onnx pack`` writes the files of ``model``, and where a session looks for them."""
    return Path(os.fspath(model) + ".packed")


def session_directory(model: object, packed_weights: object) -> str | None:
    """The folder a session on ``model`` reads the files from: ``packed_weights`` (a path; FileNotFoundError when
    it is not a folder), none for None or False, and for :data:`DEFAULT` the model's :func:`default_directory`
    when the model is a path and that folder exists."""
    if packed_weights is DEFAULT:
        if isinstance(model, (str, os.PathLike)) and default_directory(model).is_dir():
            return os.fspath(default_directory(model).resolve())
        return None
    if packed_weights is None or packed_weights is False:
        return None
    directory = Path(packed_weights)
    if not directory.is_dir():
        raise FileNotFoundError(f"packed_weights: {directory} is not a folder; expected the folder "
                                "`moe-onnx pack` wrote, or None")
    return os.fspath(directory.resolve())


def config_entries(directory: str | None) -> dict[str, str]:
    """The session config entries that point the C++ kernels at ``directory`` (none: no entries)."""
    return {DIRECTORY_KEY: directory} if directory else {}


@dataclass
class PackResult:
    """What :func:`pack_weights` wrote: each file with its bytes, and the seconds it took."""

    files: list[tuple[Path, int]]
    seconds: float

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.files)


def pack_weights(model: str | os.PathLike, directory: str | os.PathLike | None = None,
                 threads: int | None = None) -> PackResult:
    """Packs every expert of each MOE, QMOE and MoeRowParallelLinear node of ``model`` whose weights are
    initializers into one file per node in ``directory`` (default :func:`default_directory`, made if missing), on
    ``threads`` threads (default: the machine's), by creating a session that writes them. Files of the same nodes
    are replaced; others are left alone. Raises what :func:`moe_onnx.runtime.session` raises, and
    ``onnxruntime``'s error (naming the file) when one cannot be written."""
    from . import session  # the package imports this module

    folder = Path(directory) if directory is not None else default_directory(model)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    before = {path: path.stat().st_ino for path in folder.glob("*" + FILE_SUFFIX)}
    options = ort.SessionOptions()
    options.add_session_config_entry(WRITE_KEY, "1")
    if threads:
        options.add_session_config_entry(THREADS_KEY, str(threads))
    start = time.perf_counter()
    try:
        session(model, sess_options=options, packed_weights=folder)
    except BaseException:
        if made:
            with contextlib.suppress(OSError):  # only an empty folder goes
                folder.rmdir()
        raise
    seconds = time.perf_counter() - start
    written = [path for path in sorted(folder.glob("*" + FILE_SUFFIX)) if before.get(path) != path.stat().st_ino]
    if made and not written:  # nothing to pack: no empty folder left for sessions to look in
        folder.rmdir()
    return PackResult([(path, path.stat().st_size) for path in written], seconds)
