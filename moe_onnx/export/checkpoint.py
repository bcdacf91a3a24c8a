"""A Hugging Face checkpoint folder read tensor by tensor, as it ships (no torch here).

The safetensors files are read with ``pread``-style reads of the byte ranges a caller asks for (never mapped, so
the page cache holds what was read, not this process), and each tensor is offered as a :class:`Source`: its
shape, its numpy type and any range of its first axis (:meth:`Source.rows`). The checkpoint's format
(``quantization_config.quant_method`` of config.json) says how its tensors become the model's:

* unquantized (float32, bfloat16, float16): each tensor is a source as stored;
* ``mxfp4`` (GPT-OSS as openai ships it): the experts' ``X_blocks`` uint8 [E, N, K/32, 16] (two E2M1 codes a
  byte, the even one in the low nibble) and ``X_scales`` uint8 [E, N, K/32] (E8M0: 2^(s - 127)) are one source
  ``X`` [E, K, N] in float32, transformers' layout of the dequantized parameter; :meth:`Mxfp4Source.mxfp4_expert`
  gives an expert's codes and scales as stored, for QMOE, without widening them;
* ``fp8`` (DeepSeek-V3, Qwen3-*-FP8): each ``X.weight`` float8_e4m3fn [..., N, K] with its ``X.weight_scale_inv``
  float32 [..., ceil(N/bn), ceil(K/bk)] is one source ``X.weight`` in float32, ``w * scale_inv`` of its block
  (bn x bk, the config's ``weight_block_size``, as transformers dequantizes them on a CPU).

Any other ``quant_method`` is refused in one line naming it (:class:`CheckpointError`).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .._ir import model_files
from .._ir.weights import write_array
from ..ops.qmoe import E8M0_NAN, MXFP4_BLOCK, QUANT_MXFP4, dequantize

#: safetensors' element types as numpy reads them (E8M0 scales as their uint8 codes)
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": np.uint8,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32,
          "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
#: the formats read: quantization_config.quant_method -> what it is (None: no quantization_config)
FORMATS = {None: "unquantized (float32, bfloat16 or float16 tensors)",
           "mxfp4": "MXFP4 experts (GPT-OSS: *_blocks and *_scales)",
           "fp8": "block-scaled float8_e4m3fn linears (weight and weight_scale_inv)"}
_FP8_SCALE = "_scale_inv"
#: the floating-point types a checkpoint tensor may hold where the model reads floats
FLOATS = {np.dtype(t) for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)}


class CheckpointError(model_files.ModelFileError):
    """A checkpoint ``moe-onnx export`` cannot read: a format it does not know, files or tensors missing or not
    what the format says (the message names the file or tensor, and what was expected)."""


# ----------------------------------------------------------------------------- safetensors files

@dataclass(frozen=True)
class _Stored:
    """One tensor of a safetensors file: its type, shape and bytes [begin, end) in the file."""

    file: _SafetensorsFile
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class _SafetensorsFile:
    """A safetensors file's header, and reads of byte ranges of it (the file opened on first read)."""

    def __init__(self, path: Path):
        self.path = path
        self._handle = None
        if path.exists() and not path.is_file():  # a FIFO or a device is never opened
            raise CheckpointError(f"{path}: not a regular file")
        try:
            file_size = os.path.getsize(path)
            with open(path, "rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                if size > file_size - 8:
                    raise CheckpointError(f"{path}: not a safetensors file (its header length {size} is past "
                                          f"its end)")
                header = json.loads(handle.read(size))
        except OSError as error:
            raise CheckpointError(f"{path}: cannot read it: {error.strerror or error}") from None
        except (ValueError, struct.error) as error:
            raise CheckpointError(f"{path}: not a safetensors file ({error})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: not a safetensors file (its header is JSON but not an object)")
        self.data_start = 8 + size
        self.tensors = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = np.dtype(DTYPES[entry["dtype"]])
                shape, offsets = entry["shape"], entry["data_offsets"]
            except (KeyError, TypeError) as error:
                raise CheckpointError(f"{path}: tensor {name!r}: element type or layout not readable "
                                      f"({type(error).__name__}: {error})") from None
            if not (_naturals(shape) and _naturals(offsets) and len(offsets) == 2):
                raise CheckpointError(f"{path}: tensor {name!r}: shape {shape!r}, data_offsets {offsets!r}; expected "
                                      "lists of integers >= 0 (the offsets: [begin, end])")
            shape, (begin, end) = tuple(shape), offsets
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise CheckpointError(f"{path}: tensor {name!r} holds {end - begin} bytes; its shape "
                                      f"{list(shape)} of {entry['dtype']} needs {math.prod(shape) * dtype.itemsize}")
            if self.data_start + end > file_size:
                raise CheckpointError(f"{path}: tensor {name!r} ends at byte {self.data_start + end}, past the "
                                      f"file's end ({file_size} bytes): the file is cut short")
            self.tensors[name] = _Stored(self, name, dtype, shape, begin, end)
        # as the safetensors library checks: the tensors lie end to end, from the data's first byte to the file's end
        position = 0
        for tensor in sorted(self.tensors.values(), key=lambda tensor: (tensor.begin, tensor.end)):
            if tensor.begin != position:
                raise CheckpointError(f"{path}: tensor {tensor.name!r} starts at byte {tensor.begin} of the data; "
                                      f"expected {position}, where the tensor before it ends (safetensors' tensors "
                                      "lie end to end: the header is damaged)")
            position = tensor.end
        if self.data_start + position != file_size:
            raise CheckpointError(f"{path}: its tensors end at byte {self.data_start + position}, the file at "
                                  f"{file_size}; expected the same (safetensors' tensors fill the file)")

    def read(self, tensor: _Stored, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of ``tensor``'s first axis (a scalar: all of it)."""
        row_shape = tensor.shape[1:]
        row_bytes = math.prod(row_shape) * tensor.dtype.itemsize
        count = stop - start if tensor.shape else 1
        out = np.empty((count, *row_shape) if tensor.shape else (), dtype=tensor.dtype)
        if self._handle is None:
            self._handle = open(self.path, "rb")  # noqa: SIM115 - kept open while the checkpoint is read
        self._handle.seek(self.data_start + tensor.begin + start * row_bytes)
        view = memoryview(out.reshape(-1).view(np.uint8))
        if self._handle.readinto(view) != len(view):
            raise CheckpointError(f"{self.path}: tensor {tensor.name!r} is cut short (the file ends early)")
        return out

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def _naturals(value: object) -> bool:
    """Whether ``value`` is a JSON list of integers >= 0 (not bools)."""
    return isinstance(value, list) and all(_is_count(v, 0) for v in value)


#: the safetensors name of each numpy type (the inverse of DTYPES; E8M0 codes are written as U8)
_NAMES = {np.dtype(dtype): name for name, dtype in DTYPES.items() if name != "F8_E8M0"}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its ``shape``, numpy ``dtype`` and ``rows(start, stop)`` giving rows of its first axis (a
    scalar: ``rows(0, 1)`` gives the value)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    rows: Callable[[int, int], np.ndarray]

    @classmethod
    def of(cls, array: np.ndarray) -> TensorSpec:
        return cls(tuple(array.shape), array.dtype, lambda start, stop: array[start:stop] if array.ndim else array)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, TensorSpec], rows_per_write: int = 1 << 14,
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to the safetensors file ``path``, in their order, each ``rows_per_write`` rows at a time
    (a checkpoint of any size, held a chunk at a time)."""
    header, offset = {}, 0
    for name, spec in tensors.items():
        size = math.prod(spec.shape) * np.dtype(spec.dtype).itemsize
        header[name] = {"dtype": _NAMES[np.dtype(spec.dtype)], "shape": list(spec.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, spec in tensors.items():
            count = spec.shape[0] if spec.shape else 1
            for start in range(0, count, rows_per_write):
                write_array(handle, np.ascontiguousarray(spec.rows(start, min(count, start + rows_per_write)),
                                                         dtype=spec.dtype))


# ----------------------------------------------------------------------------- sources

class Source:
    """A checkpoint tensor as the model reads it: ``name``, ``shape``, numpy ``dtype`` and :meth:`rows`."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the first axis (a scalar: the value itself)."""
        raise NotImplementedError

    def whole(self) -> np.ndarray:
        return self.rows(0, self.shape[0] if self.shape else 1)


class StoredSource(Source):
    """A tensor as stored."""

    def __init__(self, stored: _Stored, name: str | None = None):
        self.stored, self.name = stored, name or stored.name
        self.shape, self.dtype = stored.shape, stored.dtype

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.stored.file.read(self.stored, start, stop)


class Fp8Source(Source):
    """A float8_e4m3fn weight [..., N, K] and its inverse scales [..., ceil(N/bn), ceil(K/bk)] as float32:
    ``w * scale_inv`` of each bn x bk block (``block``: the config's weight_block_size; without one, the block
    that makes the scales' grid), as transformers' Fp8Dequantize computes it."""

    def __init__(self, weight: _Stored, scale: _Stored, block: tuple[int, int] | None):
        self.weight, self.scale = weight, scale
        self.name, self.shape, self.dtype = weight.name, weight.shape, np.dtype(np.float32)
        if weight.dtype != np.dtype(ml_dtypes.float8_e4m3fn) or scale.dtype not in FLOATS:
            raise CheckpointError(f"{weight.name} {weight.dtype} and {scale.name} {scale.dtype}: expected "
                                  "float8_e4m3fn and float32, bfloat16 or float16 (the fp8 format)")
        if len(weight.shape) < 2 or len(scale.shape) != len(weight.shape) or scale.shape[:-2] != weight.shape[:-2]:
            raise CheckpointError(f"{weight.name}: weight {list(weight.shape)} and {scale.name} "
                                  f"{list(scale.shape)}: expected [..., N, K] and [..., N/bn, K/bk]")
        (n, k), (sn, sk) = weight.shape[-2:], scale.shape[-2:]
        self.block = tuple(block) if block else (-(-n // sn), -(-k // sk))
        if (-(-n // self.block[0]), -(-k // self.block[1])) != (sn, sk):
            raise CheckpointError(f"{scale.name} {list(scale.shape)} is not the grid of {self.block[0]} x "
                                  f"{self.block[1]} blocks over {weight.name} {list(weight.shape)} (expected "
                                  f"{[-(-n // self.block[0]), -(-k // self.block[1])]})")

    def rows(self, start: int, stop: int) -> np.ndarray:
        bn, bk = self.block
        if len(self.shape) > 2:  # stacked experts: whole matrices
            weights = self.weight.file.read(self.weight, start, stop).astype(np.float32)
            return weights * _blocks(self._scales(start, stop), bn, bk, self.shape[-2:])
        first, last = start // bn, -(-stop // bn)
        weights = self.weight.file.read(self.weight, start, stop).astype(np.float32)
        scales = _blocks(self._scales(first, last), bn, bk, ((last - first) * bn, self.shape[1]))
        return weights * scales[start - first * bn:stop - first * bn]

    def _scales(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the scales; CheckpointError for one that is not finite."""
        scales = self.scale.file.read(self.scale, start, stop).astype(np.float32)
        if not np.isfinite(scales).all():
            raise CheckpointError(f"{self.scale.name}: holds {scales[~np.isfinite(scales)][0]} in rows [{start}, "
                                  f"{stop}); expected finite scales (the file is damaged)")
        return scales


def _blocks(scales: np.ndarray, bn: int, bk: int, shape: tuple[int, int]) -> np.ndarray:
    """Each scale repeated over its bn x bk block, cut to ``shape`` (the last two dims)."""
    grid = np.repeat(np.repeat(scales.astype(np.float32), bn, axis=-2), bk, axis=-1)
    return grid[..., :shape[0], :shape[1]]


class Mxfp4Source(Source):
    """GPT-OSS's MXFP4 experts ``X_blocks`` [E, N, K/32, 16] and ``X_scales`` [E, N, K/32] as the float32
    parameter ``X`` [E, K, N] (transformers' layout: each expert's matrix transposed), and as stored."""

    def __init__(self, name: str, blocks: _Stored, scales: _Stored):
        self.blocks_tensor, self.scales_tensor = blocks, scales
        if (len(blocks.shape) != 4 or blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:3] != scales.shape
                or blocks.dtype != np.uint8 or scales.dtype != np.uint8):
            raise CheckpointError(f"{blocks.name} {list(blocks.shape)} and {scales.name} {list(scales.shape)}: "
                                  f"expected uint8 [E, N, K/32, 16] and uint8 [E, N, K/32] (MXFP4)")
        experts, n, groups, _ = blocks.shape
        self.name, self.shape, self.dtype = name, (experts, groups * MXFP4_BLOCK, n), np.dtype(np.float32)

    def mxfp4_expert(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert ``e`` as stored, in QMOE's mxfp4 layout: codes [N, K/2] (two a byte, the even k in the low
        nibble) and E8M0 scales [N, K/32], the same bytes as the checkpoint's."""
        blocks = self.blocks_tensor.file.read(self.blocks_tensor, e, e + 1)[0]
        scales = self.scales_tensor.file.read(self.scales_tensor, e, e + 1)[0]
        if (scales == E8M0_NAN).any():
            raise CheckpointError(f"{self.scales_tensor.name}: expert {e} holds the E8M0 scale {E8M0_NAN} (NaN); "
                                  f"expected scales in [0, {E8M0_NAN}) (the file is damaged)")
        return blocks.reshape(blocks.shape[0], -1), scales

    def rows(self, start: int, stop: int) -> np.ndarray:
        out = np.empty((stop - start, *self.shape[1:]), np.float32)
        for e in range(start, stop):
            codes, scales = self.mxfp4_expert(e)
            out[e - start] = dequantize(codes, scales, bits=4, block_size=MXFP4_BLOCK, quant_type=QUANT_MXFP4,
                                        k_dim=self.shape[1]).T
        return out


# ----------------------------------------------------------------------------- the checkpoint

def quant_method(config: dict) -> str | None:
    """The checkpoint's format (:data:`FORMATS`' key); CheckpointError for one export does not read."""
    quantization = config.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if quantization is not None and method not in FORMATS:
        known = "; ".join(f"{key or 'no quantization_config'}: {what}" for key, what in FORMATS.items())
        raise CheckpointError(f"quantization_config.quant_method {method!r} is not a format moe-onnx export reads "
                              f"(it reads {known})")
    if method == "fp8" and quantization.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"quantization_config: fp8 fmt {quantization.get('fmt')!r} is not read (e4m3 is)")
    return method


#: config.json's keys (transformers' names, by family) for the experts a token takes and for a layer's experts
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k")
EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def check_routing(config: model_files.JsonObject) -> None:
    """ModelFileError, naming the key, for experts per token (:data:`TOP_K_KEYS`: an integer, or a list of them per
    layer) that are not in [1, the layer's experts] (:data:`EXPERTS_KEYS`, where config.json gives them as one
    integer; 0 experts, a dense model, takes any): transformers builds such a model, but its experts add nothing
    (0 per token) or its trace fails."""
    experts = next((key for key in EXPERTS_KEYS if _is_count(config.data.get(key), 0)), None)
    if experts is not None and config.data[experts] == 0:
        return
    bound = f"in [1, {config.data[experts]}] ({experts})" if experts else ">= 1"
    for key in TOP_K_KEYS:
        value = config.data.get(key)
        counts = value if isinstance(value, list) and value else [value]
        if value is not None and not all(_is_count(k, 1) and (experts is None or k <= config.data[experts])
                                         for k in counts):
            raise config.error(key, f"an integer {bound}, or a list of them per layer")


def _is_count(value: object, minimum: int) -> bool:
    """Whether ``value`` is an integer >= ``minimum`` (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


class Checkpoint:
    """The tensors of a checkpoint folder's safetensors files (``model.safetensors``, or those that
    ``model.safetensors.index.json`` names) as :class:`Source` objects by the names the model's loading
    takes (:meth:`sources`), read in the checkpoint's format (``config``: its config.json)."""

    def __init__(self, folder: str | os.PathLike, config: dict):
        self.folder, self.config = Path(folder), config
        self.format = quant_method(config)
        index = self.folder / "model.safetensors.index.json"
        placed: dict[str, str] = {}  # tensor -> the file the index puts it in
        if index.exists():
            try:
                weight_map = model_files.read_json(index).object("weight_map")
                placed = {name: weight_map.string(name) for name in weight_map.data}
            except model_files.ModelFileError as error:
                raise CheckpointError(f"{error} (safetensors' index: JSON with a weight_map)") from None
            if not placed:
                raise CheckpointError(f"{index}: weight_map is empty; expected the file of each tensor")
            outside = sorted({name for name in placed.values() if Path(name).name != name or name in ("", ".", "..")})
            if outside:
                raise CheckpointError(f"{index}: weight_map names {outside[0]!r}; expected the name of a file in "
                                      f"{self.folder} (only the checkpoint's own files are read)")
            names = sorted(set(placed.values()))
        elif (self.folder / "model.safetensors").exists():
            names = ["model.safetensors"]
        else:
            raise CheckpointError(f"{self.folder}: no model.safetensors or model.safetensors.index.json (moe-onnx "
                                  f"export reads safetensors checkpoints)")
        self.files = [_SafetensorsFile(self.folder / name) for name in names]
        self.stored = {}
        for file in self.files:
            for name, tensor in file.tensors.items():
                if name in self.stored:
                    raise CheckpointError(f"{name}: in both {self.stored[name].file.path} and {file.path}")
                if placed and placed.get(name) != file.path.name:
                    raise CheckpointError(f"{file.path}: holds {name}, which {index.name} "
                                          f"{'puts in ' + placed[name] if name in placed else 'does not list'}")
                self.stored[name] = tensor
        absent = [f"{name} (in {placed[name]})" for name in sorted(set(placed) - set(self.stored))]
        if absent:
            raise CheckpointError(f"{index}: the files it names do not hold {len(absent)} of the tensors it lists: "
                                  f"{', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''}")

    def sources(self) -> dict[str, Source]:
        """Every tensor the model loads, by its name in the checkpoint (a format's pair of tensors under the one
        name transformers loads it by), in natural order (layer 10 after layer 9)."""
        stored = dict(self.stored)
        sources: dict[str, Source] = {}
        if self.format == "mxfp4":
            for name in [name for name in stored if name.endswith("_blocks")]:
                base = name[:-len("_blocks")]
                scales = stored.pop(base + "_scales", None)
                if scales is None:
                    raise CheckpointError(f"{name}: no {base}_scales beside it (MXFP4 blocks need their scales)")
                sources[base] = Mxfp4Source(base, stored.pop(name), scales)
        if self.format == "fp8":
            for name in [name for name in stored if name.endswith(_FP8_SCALE)]:
                weight = stored.pop(name[:-len(_FP8_SCALE)], None)
                if weight is None:
                    raise CheckpointError(f"{name}: no {name[:-len(_FP8_SCALE)]} beside it")
                sources[weight.name] = Fp8Source(weight, stored.pop(name), self._fp8_block())
            # static activation scales (the fp8 compute's inputs) are not weights of the float model
            for name in [name for name in stored if name.endswith((".input_scale", ".activation_scale"))]:
                stored.pop(name)
        for name, tensor in stored.items():
            if tensor.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
                raise CheckpointError(f"{name}: a {tensor.dtype} tensor without {name}{_FP8_SCALE} (the fp8 "
                                      f"format's scales; quantization_config says {self.format or 'none'})")
            sources[name] = StoredSource(tensor)
        return dict(sorted(sources.items(), key=lambda item: _natural_key(item[0])))

    def _fp8_block(self) -> tuple[int, int] | None:
        block = self.config["quantization_config"].get("weight_block_size")
        if block is None:
            return None
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(f"quantization_config.weight_block_size {block!r}: expected [rows, columns]")
        return block[0], block[1]

    def close(self) -> None:
        for file in self.files:
            file.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def bytes(self) -> int:
        return sum(tensor.end - tensor.begin for tensor in self.stored.values())


def _natural_key(name: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]

