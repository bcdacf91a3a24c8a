"""Reading and writing model files of any size: weights stay on disk until they are written out.

Every failure is a :class:`ModelFileError` whose message names the file and what is wrong; a JSON file's
(:func:`read_json`) names the key too, and what was expected there. Every file the package writes goes through
:func:`replacing`: to temporary files beside the destination, renamed into place only once complete, and never onto
anything but a regular file (:func:`output_file`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
from google.protobuf.message import DecodeError

from .graph import graphs
from .progress import counter

if TYPE_CHECKING:
    import onnx_ir as ir  # imported where a model is loaded or saved: reading a file's proto needs only onnx

#: models whose weights exceed this are written with external data (protobuf's limit is 2 GB)
EXTERNAL_DATA_THRESHOLD = 1 << 30

_PACKED_4BIT = {getattr(onnx.TensorProto, name) for name in ("INT4", "UINT4", "FLOAT4E2M1")
                if hasattr(onnx.TensorProto, name)}


class ModelFileError(ValueError):
    """A model file that cannot be read, is not a valid model, or cannot be written; the message
    names the file and what is wrong."""


class OutputPathError(ModelFileError):
    """An output path that names something a write must not replace: a device (``/dev/null``), a FIFO, a
    socket or a directory, or a symbolic link to one (or into a missing folder). The command line exits 2."""


_NOT_A_FILE = {stat.S_ISDIR: "a directory", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
               stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"}


def output_file(path: str | os.PathLike) -> Path:
    """The regular file a write to ``path`` creates or replaces: ``path`` itself, or, where ``path`` is a
    symbolic link, the file it points to (a dangling link's target is created). Raises OutputPathError when
    that exists and is not a regular file, or when a link's target folder does not exist; ModelFileError when
    it cannot be looked at (a file where a folder should be, a loop of links)."""
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    link = f" (a symbolic link to {target})" if target != path else ""
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        if link and not target.parent.is_dir():
            raise OutputPathError(f"{path}{link}: the folder of its target does not exist") from None
        return target
    except OSError as error:  # a file where a folder is expected, a loop of links, a folder that cannot be searched
        raise ModelFileError(f"{path}{link}: cannot write it: {error.strerror or error}") from None
    kind = next((name for test, name in _NOT_A_FILE.items() if test(mode)), None)
    if kind is not None:
        raise OutputPathError(f"{path}{link}: is {kind}; expected a regular file or a new path")
    return target


def _staging_folder(target: Path, path: str | os.PathLike) -> Path:
    """A new temporary folder beside ``target`` (its parents made); ModelFileError naming ``path`` when it cannot be
    made."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    except OSError as error:
        raise ModelFileError(f"{path}: cannot write it: {error.strerror or error}") from None


def refuse_other_than_a_folder(path: Path) -> None:
    """OutputPathError when ``path`` exists and is not a folder (nor a link to one)."""
    if os.path.exists(path) and not os.path.isdir(path):
        kind = next((name for test, name in _NOT_A_FILE.items() if test(os.stat(path).st_mode)), "a file")
        raise OutputPathError(f"{path}: is {kind}; expected a directory or a new path")


def output_directory(path: str | os.PathLike) -> Path:
    """``path`` as a folder to write files into (a symbolic link to one is followed), created when missing.
    Raises OutputPathError when it exists and is not a folder, ModelFileError when it cannot be created."""
    path = Path(path)
    refuse_other_than_a_folder(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ModelFileError(f"{path}: cannot write it: {error.strerror or error}") from None
    return path


@contextlib.contextmanager
def replacing_folder(path: str | os.PathLike) -> Iterator[Path]:
    """A folder to write the files of the folder ``path`` into: a temporary folder beside it. When the block
    completes, a new ``path`` is that folder renamed; an existing one receives its files, each renamed onto its
    own (external data before the models that name them, JSON configs last; files of ``path`` the block did not
    write are left as they are). The temporary folder is removed in every case, so a failed write leaves ``path``
    as it was, and no folder where there was none. Raises OutputPathError (before the block runs) when ``path``
    exists and is not a folder, ModelFileError naming ``path`` for an OSError (a full disk, no permission)."""
    path = Path(path)
    refuse_other_than_a_folder(path)
    beside = path.resolve() if path.exists() else path  # a link's target: renames stay on its file system
    staging = _staging_folder(beside, path)
    try:
        yield staging
        if not path.exists():
            os.rename(staging, path)
        else:
            for name in sorted(os.listdir(staging), key=lambda name: (name.endswith(".json"), name.endswith(".onnx"))):
                os.replace(staging / name, path / name)
    except OSError as error:
        raise ModelFileError(f"{path}: cannot write it: {error.strerror or error}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def model_output_files(path: str | os.PathLike) -> tuple[Path, Path]:
    """The regular files a model written to ``path`` by :func:`save` creates or replaces: the model file and its
    :func:`data_file` (each through :func:`output_file`: OutputPathError for one that is not a regular file)."""
    target = output_file(path)
    return target, output_file(data_file(target))


@contextlib.contextmanager
def replacing(path: str | os.PathLike, *, with_data: bool = False) -> Iterator[Path]:
    """A path to write the file for ``path`` at: in a temporary folder beside :func:`output_file` (``path``),
    with its name; when the block completes, the file is renamed onto that target (with ``with_data``, the
    :func:`data_file` written beside it too, first, onto its own target). The temporary folder is removed in
    every case, so a failed write leaves nothing and an existing file unchanged. Raises OutputPathError (before
    the block runs) for a target that is not a regular file, ModelFileError naming ``path`` for an OSError
    (a full disk, no permission)."""
    files = model_output_files(path) if with_data else (output_file(path),)
    target = files[0]
    targets = dict(zip((target.name, data_file(target).name), files))
    staging = _staging_folder(target, path)
    try:
        yield staging / target.name
        # the data first: the model file names it
        for name in sorted(os.listdir(staging), key=lambda name: name == target.name):
            os.replace(staging / name, targets[name])
    except OSError as error:
        raise ModelFileError(f"{path}: cannot write it: {error.strerror or error}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_proto(path: str | os.PathLike) -> onnx.ModelProto:
    """The model at ``path`` without its external data. Raises ModelFileError when the path is
    missing, not a regular file, empty or not an ONNX protobuf."""
    if not os.path.exists(path):
        raise ModelFileError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise ModelFileError(f"{path}: is not a regular file")
    if os.path.getsize(path) == 0:
        raise ModelFileError(f"{path}: is empty (0 bytes); expected an ONNX model")
    try:
        return onnx.load(path, load_external_data=False)
    except DecodeError as error:
        raise ModelFileError(f"{path}: is not an ONNX model (protobuf: {error})") from None
    except OSError as error:
        raise ModelFileError(f"{path}: cannot read it: {error.strerror or error}") from None


#: what each JSON type is called in the errors of :class:`JsonObject`
_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "true or false", type(None): "null"}
_REQUIRED = object()


def read_json(path: str | os.PathLike) -> JsonObject:
    """The JSON object in the regular file ``path``, read whole, with look-ups whose errors name the file and the key
    (:class:`JsonObject`). Raises ModelFileError when the path is missing or not a regular file (a FIFO is never
    opened), cannot be read, is not JSON, or holds a JSON value other than an object."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: cannot read it: No such file or directory")
    if not path.is_file():
        raise ModelFileError(f"{path}: is not a regular file; expected a JSON file")
    try:
        document = json.loads(path.read_text())
    except OSError as error:
        raise ModelFileError(f"{path}: cannot read it: {error.strerror or error}") from None
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
        raise ModelFileError(f"{path}: expected JSON: {error}") from None
    return JsonObject(path, document, "")


class JsonObject:
    """A JSON object of the file ``path`` (the whole document, or the one at the dotted ``key`` inside it). Its
    look-ups take a key, check the value's type (and range) and raise ModelFileError naming the file, the dotted key
    and what was expected: ``genai_config.json: model.decoder.head_size: expected an integer >= 1, got "64"``.
    A look-up with a ``default`` returns it where the key is missing or null; without one, a missing key is an
    error (an :meth:`object` that is not ``required`` is empty where missing). ``data`` is the object itself, as
    JSON reads it."""

    def __init__(self, path: Path, data: Any, key: str):
        self.path, self.key = path, key
        if not isinstance(data, dict):
            raise self._error(key, "an object", data)
        self.data: dict = data

    def __contains__(self, key: str) -> bool:
        return self.data.get(key) is not None

    def error(self, key: str, expected: str) -> ModelFileError:
        """The error for the value at ``key`` of this object not being ``expected`` (a phrase: "a list of token
        ids"), naming the file, the dotted key and the value found."""
        return self._error(self._dotted(key), expected, self.data.get(key))

    def value(self, key: str, default: Any = _REQUIRED, expected: str = "a value") -> Any:
        """The value at ``key``, of any JSON type (``expected`` says what it should be, for the error)."""
        value = self.data.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ModelFileError(f"{self.path}: {self._dotted(key)}: missing; expected {expected}")
            return default
        return value

    def object(self, key: str, *, required: bool = True) -> JsonObject:
        """The object at ``key``; an empty one where it is missing or null and not ``required``."""
        return JsonObject(self.path, self.value(key, _REQUIRED if required else {}, "an object"), self._dotted(key))

    def objects(self, key: str) -> list[JsonObject]:
        """The list of objects at ``key``, each named ``key[i]`` in errors."""
        return [JsonObject(self.path, item, f"{self._dotted(key)}[{i}]") for i, item in enumerate(self.list(key))]

    def string(self, key: str, default: Any = _REQUIRED) -> str:
        return self._typed(key, default, (str,), "a string")

    def list(self, key: str, default: Any = _REQUIRED) -> list:
        return self._typed(key, default, (list,), "a list")

    def boolean(self, key: str, default: Any = _REQUIRED) -> bool:
        return self._typed(key, default, (bool,), "true or false")

    def integer(self, key: str, default: Any = _REQUIRED, *, minimum: int | None = None) -> int:
        """The integer at ``key`` (not a bool, not a float), at least ``minimum`` when given."""
        return self._ranged(key, default, (int,), "an integer", minimum)

    def number(self, key: str, default: Any = _REQUIRED, *, minimum: float | None = None) -> float:
        """The number (integer or float, not a bool) at ``key``, at least ``minimum`` when given."""
        return self._ranged(key, default, (int, float), "a number", minimum)

    def _ranged(self, key: str, default: Any, types: tuple, expected: str, minimum: float | None):
        if minimum is not None:
            expected = f"{expected} >= {minimum}"
        value = self._typed(key, default, types, expected)
        if minimum is not None and key in self and value < minimum:
            raise self.error(key, expected)
        return value

    def _typed(self, key: str, default: Any, types: tuple, expected: str) -> Any:
        value = self.value(key, default, expected)
        if key not in self:
            return value
        if isinstance(value, bool) != (bool in types) or not isinstance(value, types):
            raise self.error(key, expected)
        return value

    def _dotted(self, key: str) -> str:
        return f"{self.key}.{key}" if self.key else key

    def _error(self, key: str, expected: str, value: Any) -> ModelFileError:
        found = _JSON_TYPES.get(type(value), type(value).__name__)
        if not isinstance(value, (dict, list)):
            shown = json.dumps(value)
            found = shown if len(shown) <= 40 else f"{found} {shown[:37]}..."
        return ModelFileError(f"{self.path}: {f'{key}: ' if key else ''}expected {expected}, got {found}")


def read_complete(path: str | os.PathLike) -> onnx.ModelProto:
    """:func:`read_proto` of ``path`` once the external data it names is all there (:func:`external_data_problems`);
    raises ModelFileError as read_proto does, or :func:`invalid_input`'s error for data that is missing or short."""
    proto = read_proto(path)
    problems = external_data_problems(proto, os.path.dirname(path))
    if problems:
        raise invalid_input(path, problems)
    return proto


def invalid_input(path: str | os.PathLike, problems: Sequence[str]) -> ModelFileError:
    """The error for an input model with these problems (``moe-onnx check``'s lines): the first, and where the
    others are."""
    lines = [line for problem in problems for line in problem.splitlines()]
    more = f" (and more: see `moe-onnx check {path}`)" if len(lines) > 1 else ""
    return ModelFileError(f"{path}: the input model is invalid: {lines[0]}{more}")


def with_data(proto: onnx.ModelProto, path: str | os.PathLike) -> onnx.ModelProto:
    """``proto`` (read from the model file ``path``, its external data checked) with every external tensor's data
    read into it, in place: all of the model in memory, and a model that saves anywhere (an external location is
    relative to the model file's folder, the only kind onnx and onnxruntime take, so it breaks elsewhere)."""
    onnx.load_external_data_for_model(proto, os.path.dirname(path))
    return proto


def load(path: str | os.PathLike, proto: onnx.ModelProto | None = None) -> ir.Model:
    """The model at ``path`` (``proto``: its content already read by :func:`read_proto`); external
    tensors stay lazy (memory-mapped when read)."""
    import onnx_ir as ir

    model = ir.serde.deserialize_model(read_proto(path) if proto is None else proto)
    ir.external_data.set_base_dir(model.graph, os.path.dirname(path))
    return model


def external_tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """The tensors of ``proto`` (initializers and Constant values, subgraphs included) stored as external data."""
    for graph in graphs(proto.graph):
        tensors = list(graph.initializer)
        tensors += [attr.t for node in graph.node for attr in node.attribute if attr.HasField("t")]
        yield from (t for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL)


def external_data_files(proto: onnx.ModelProto, base_dir: str | os.PathLike) -> set[Path]:
    """The external data files the model loaded from ``base_dir`` reads."""
    return {Path(base_dir) / _external_info(t).get("location", "") for t in external_tensors(proto)}


def external_data_problems(proto: onnx.ModelProto, base_dir: str | os.PathLike) -> list[str]:
    """What keeps onnxruntime from reading the external tensors of the model loaded from ``base_dir``:
    a missing file, a location outside that directory, data shorter than the tensor or past the file's end."""
    problems = []
    for tensor in external_tensors(proto):
        info = _external_info(tensor)
        where = f"tensor '{tensor.name}': external data"
        location = info.get("location", "")
        if not location or os.path.isabs(location) or ".." in Path(location).parts:
            problems.append(f"{where} location '{location}'; expected a file name relative to the model's folder")
            continue
        file = Path(base_dir) / location
        if not file.is_file():
            problems.append(f"{where} file '{location}' does not exist (or is not a regular file)")
            continue
        try:
            offset, length = int(info.get("offset", 0)), info.get("length")
            length = None if length is None else int(length)
        except ValueError:
            problems.append(f"{where} offset/length {info.get('offset')!r}/{info.get('length')!r}; expected integers")
            continue
        needed = _data_bytes(tensor)
        size = file.stat().st_size
        if needed is not None and length is not None and length != needed:
            problems.append(f"{where} length is {length} bytes; expected {needed} (dims {list(tensor.dims)})")
        elif offset < 0 or offset + (length if length is not None else needed or 0) > size:
            problems.append(f"{where} at offset {offset}, {length if length is not None else needed} bytes, "
                            f"is past the end of '{location}' ({size} bytes)")
    return problems


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def _data_bytes(tensor: onnx.TensorProto) -> int | None:
    """Bytes of the tensor's raw data, None for strings."""
    if tensor.data_type == onnx.TensorProto.STRING:
        return None
    count = math.prod(tensor.dims)
    if tensor.data_type in _PACKED_4BIT:
        return (count + 1) // 2
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def data_file(path: str | os.PathLike) -> Path:
    """Where :func:`save` puts the external data of a model written to ``path``."""
    return Path(f"{path}.data")


def save(model: ir.Model, path: str | os.PathLike, progress: Callable[[str], None] | None = None, *,
         external_data: bool = False) -> None:
    """Write a model; with external data (:func:`data_file`) when asked, when its weights are large or when they
    are already external. Lazy tensors are computed one at a time as they are written (with external data: never
    held all at once). The files are written through :func:`replacing`: a failed write leaves no partial file; a
    symbolic link is written through. Raises OutputPathError for a path that is not a regular file,
    ModelFileError naming ``path`` when it cannot be written."""
    with replacing(path, with_data=True) as staged:
        _write(model, staged, progress, external_data)


def _write(model: ir.Model, path: Path, progress: Callable[[str], None] | None, external_data: bool) -> None:
    """Write the model to ``path`` (and its external data beside it)."""
    import onnx_ir as ir

    external = external_data or any(isinstance(v.const_value, ir.ExternalTensor)
                                    for v in model.graph.initializers.values())
    if not external and weight_bytes(model) < EXTERNAL_DATA_THRESHOLD:
        ir.save(model, path)
        return
    advance = counter(progress, "writing the weights", weight_bytes(model), "bytes")

    def report(tensor, info) -> None:  # called as each tensor starts: the bytes before it are written
        advance(info.offset)

    ir.save(model, path, external_data=data_file(path).name, callback=report, max_workers=1)
    advance(weight_bytes(model))
