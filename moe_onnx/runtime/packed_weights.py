"""Packed-weights files: the expert ops' packed panels written once (:func:`pack_weights`, ``moe-onnx pack``) and
mapped by later sessions instead of packing (custom_ops/src/packing/packed_file.h; docs/building.md, "Packed-weights
files"). A session finds them through session config entries, read when the C++ library is registered; its
default directory is ``<model path>.packed`` (:func:`default_directory`) when that exists."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnxruntime as ort

from .._ir.progress import counter

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
                 threads: int | None = None, progress: Callable[[str], None] | None = None) -> PackResult:
    """Packs every expert of each MOE, QMOE and MoeRowParallelLinear node of ``model`` whose weights are
    initializers into one file per node in ``directory`` (default :func:`default_directory`, made if missing), on
    ``threads`` threads (default: the machine's), by creating a session that writes them; ``progress`` counts the
    files as they appear (:func:`moe_onnx._ir.progress.counter`). Files of the same nodes are replaced; others are
    left alone. Raises what :func:`moe_onnx.runtime.session` raises, and ``onnxruntime``'s error (naming the file)
    when one cannot be written."""
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
        with _counting_files(folder, before, _packed_nodes(model) if progress is not None else 0, progress):
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


_PACKED_OPS = ("MOE", "QMOE", "MoeRowParallelLinear")


def _packed_nodes(model: object) -> int:
    """How many nodes of ``model`` (a path; other models, and a path that cannot be read: 0, uncounted: the
    session then says what is wrong with it) pack their weights into a file."""
    if not isinstance(model, (str, os.PathLike)):
        return 0
    try:
        proto = onnx.load(model, load_external_data=False)
    except Exception:  # noqa: BLE001 - any unreadable model: the session reports it in its own words
        return 0
    return sum(node.op_type in _PACKED_OPS and node.domain == "moe_onnx" for node in proto.graph.node)


@contextlib.contextmanager
def _counting_files(folder: Path, before: dict[Path, int], expected: int,
                    progress: Callable[[str], None] | None) -> Iterator[None]:
    """While the block runs, count the files written into ``folder`` (new, or replacing those of ``before``) for
    ``progress``, twice a second, on a thread of its own."""
    if progress is None or not expected:
        yield
        return
    advance = counter(progress, "packing", expected, "nodes")
    done = threading.Event()

    def count() -> int:
        return sum(1 for path in folder.glob("*" + FILE_SUFFIX) if before.get(path) != _inode(path))

    def watch() -> None:
        while not done.wait(0.5):
            advance(min(count(), expected - 1))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
    advance(expected)


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:  # replaced while looked at
        return None
