"""Packed-weights files (custom_ops/src/packing/packed_file.h; moe_onnx.runtime.packed_weights; ``moe-onnx pack``): a
session that maps a node's file gives the bits of one that packs, in every weight format and at 1 and 2 threads,
reads its panels from the file, and holds the weights as the file's pages; a file that does not match the node
(other weights or layout, weights edited where the fingerprint does not look, panels damaged, cut short, of an older
version) is never used, nor one written in place under a running session: the node packs and logs why."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from backends import options
from cases import Case
from cases.moe import GEMM2, GEMM3
from test_packing import _MEMORY_CHILD, CASES, _moe, _moe_file, _one_expert_feeds, _qmoe

import moe_onnx
from moe_onnx.cli import main
from moe_onnx.runtime import pack_weights, run
from moe_onnx.runtime.packed_weights import default_directory

# every weight format of test_packing's cases, and QMOE's level 4 (int8 activations) on int4 and int8 codes
FILE_CASES = CASES + [
    dataclasses.replace(case, name=case.name + "_level4", attrs={**case.attrs, "accuracy_level": 4})
    for case in (_qmoe("qmoe_int4_block32_gemm3", GEMM3, bits=4, block_size=32),
                 _qmoe("qmoe_int8_block32_gemm2", GEMM2, bits=8, block_size=32))]


def _write(case: Case, folder: Path) -> Path:
    path = folder / f"{case.name}.onnx"
    path.write_bytes(case.model().SerializeToString())
    return path


def _bits(outputs: list[np.ndarray]) -> list[bytes]:
    return [o.tobytes() for o in outputs]


def _packing(case: Case, path: Path, threads: int = 2) -> list[np.ndarray]:
    return run(moe_onnx.session(path, sess_options=options(threads), packed_weights=None), case.feeds())


@pytest.mark.parametrize("case", FILE_CASES, ids=lambda c: c.name)
def test_mapped_file_gives_the_bits_of_packing(tmp_path, capfd, case):
    """pack_weights writes one file per node into MODEL.packed; a session there maps it and gives, at 1 and 2
    threads, the bits of a session that packs, logging nothing."""
    path = _write(case, tmp_path)
    result = pack_weights(path)
    assert len(result.files) == 1 and result.files[0][0].parent == default_directory(path)
    assert result.files[0][1] == result.files[0][0].stat().st_size > 4096
    for threads in (1, 2):
        expected = _packing(case, path, threads)
        logged = options(threads)
        logged.log_severity_level = 2  # warnings (conftest silences the default logger)
        got = run(moe_onnx.session(path, sess_options=logged), case.feeds())
        assert _bits(got) == _bits(expected), threads
    assert "packs its weights itself" not in capfd.readouterr().err


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclasses.dataclass
class _Layout:
    """Where a file's parts lie (packed_file.h's PackedFileLayout), read from its header."""
    experts: int
    sources: int  # offset of the source files' stamps: their count (u64), then 4 stamps of 56 bytes
    checksums: int  # offset of the table: per expert its weights' checksum, then each matrix's slot checksum
    slots: list[tuple[int, int]]  # per matrix: (offset of its panels, bytes of a slot)
    biases: list[tuple[int, int]]  # per matrix: (offset of its biases, bytes of a slot's; 0: none)

    @classmethod
    def of(cls, data: bytes) -> _Layout:
        length = struct.unpack_from("<I", data, 12)[0]
        items = [item.split("=", 1) for item in data[24:24 + length].decode().split(";") if item]
        matrices = [dict(kv.split(":") for kv in value.split(",")) for key, value in items if key.startswith("matrix")]
        experts = next(int(value.split("[")[1].split(",")[0]) for key, value in items if "[" in value)
        sources = _round_up(24 + length, 8)
        checksums = sources + 8 + 4 * 56
        at = _round_up(checksums + experts * (1 + len(matrices)) * 8, 4096)
        slots, biases = [], []
        for m in matrices:
            slots.append((at, int(m["slot_bytes"])))
            at = _round_up(at + int(m["slot_bytes"]) * experts, 4096)
        for m in matrices:
            biases.append((at, int(m["bias"]) // experts))
            at = _round_up(at + int(m["bias"]), 64)
        return cls(experts, sources, checksums, slots, biases)

    def slot(self, matrix: int, expert: int) -> slice:
        offset, size = self.slots[matrix]
        return slice(offset + expert * size, offset + (expert + 1) * size)


def _slot_checksum(panels: bytes, bias: bytes) -> int:
    """packed_file_writer.h's slot_checksum, through the library's test hook of the checksum."""
    lib = ctypes.CDLL(moe_onnx.custom_ops_library())
    lib.MoeOnnxChecksum.restype = ctypes.c_uint64
    lib.MoeOnnxChecksum.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_uint64]
    checksum = lib.MoeOnnxChecksum(panels, len(panels), 0)
    return lib.MoeOnnxChecksum(bias, len(bias), checksum) if bias else checksum


def _used_expert(case: Case) -> int:
    return int(case.feeds()["router_topk_output_indices"].flat[0])


def test_the_panels_are_read_from_the_file(tmp_path, capfd):
    """An expert's panels zeroed in the file with their checksum made to match change the outputs, with no
    warning: the session uses the file's bytes, and the checksums the library writes are the hook's."""
    case = CASES[0]
    path = _write(case, tmp_path)
    [(file, _)] = pack_weights(path).files
    expected = _packing(case, path)
    data = bytearray(file.read_bytes())
    layout, expert = _Layout.of(bytes(data)), _used_expert(case)
    (bias_offset, bias_bytes) = layout.biases[0]
    bias = bytes(data[bias_offset + expert * bias_bytes:bias_offset + (expert + 1) * bias_bytes])
    entry = layout.checksums + 8 * (expert * (1 + len(layout.slots)) + 1)
    assert struct.unpack_from("<Q", data, entry)[0] == _slot_checksum(bytes(data[layout.slot(0, expert)]), bias)
    data[layout.slot(0, expert)] = bytes(layout.slots[0][1])
    struct.pack_into("<Q", data, entry, _slot_checksum(bytes(layout.slots[0][1]), bias))
    file.write_bytes(bytes(data))
    capfd.readouterr()
    logged = options(2)
    logged.log_severity_level = 2
    assert _bits(run(moe_onnx.session(path, sess_options=logged), case.feeds())) != _bits(expected)
    assert "packs its weights itself" not in capfd.readouterr().err


def _other_weights(case: Case) -> Case:
    """The case with weights of the same names and shapes but other values."""
    inputs = [np.ascontiguousarray(a[::-1]) if i in case.constant and a is not None and a.ndim == 3 else a
              for i, a in enumerate(case.padded_inputs())]
    return Case(case.op, case.name, inputs, case.attrs, constant=case.constant)


def _edited_weights(case: Case) -> Case:
    """The case with the last element of the used expert's first weight edited (outside the fingerprint's windows:
    an expert's first 64 bytes and 64 bytes in its first 3/4)."""
    inputs = [None if a is None else a.copy() for a in case.padded_inputs()]
    weight = inputs[case.constant[0]]
    weight[_used_expert(case)].flat[-1] += 1
    return Case(case.op, case.name, inputs, case.attrs, constant=case.constant)


DAMAGES = {"other weights": "packed from other weights", "cut short": "truncated or damaged",
           "garbage": "not a packed-weights file", "empty": "not a packed-weights file",
           "another layout": "packed for another layout", "fifo": "is not a regular file",
           "older version": "has packing layout version 1; this library reads version 3",
           "weights edited outside the fingerprint": "'s weights differ from those the file was packed from",
           "flipped panel byte": "'s packed panels of matrix 0 differ from their checksum (the file is damaged)",
           "flipped checksum byte": "differ from their checksum (the file is damaged)"}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_file_that_does_not_match_is_not_used(tmp_path, capfd, damage):
    """A file packed from other weights, cut short, overwritten with garbage, empty, of another layout (float16
    weights of the same shapes), of an older layout version, or a FIFO in its place (never opened for reading: no
    hang) is not used; nor is a used expert's slot whose weights were edited where the fingerprint does not look,
    or whose panels or checksum have a flipped byte (checked on its first use). The outputs are those of packing,
    and the node logs why."""
    case = CASES[0]
    path = _write(case, tmp_path)
    [(file, size)] = pack_weights(path).files
    data = bytearray(file.read_bytes())
    if damage == "other weights":
        path = _write(_other_weights(case), tmp_path)
        case = _other_weights(case)
    elif damage == "weights edited outside the fingerprint":
        case = _edited_weights(case)
        path = _write(case, tmp_path)
    elif damage == "older version":
        file.write_bytes(data[:8] + struct.pack("<I", 1) + data[12:])
    elif damage in ("flipped panel byte", "flipped checksum byte"):
        layout = _Layout.of(bytes(data))
        expert = _used_expert(case)
        at = (layout.slot(0, expert).start + layout.slots[0][1] // 2 if damage == "flipped panel byte"
              else layout.checksums + 8 * (expert * (1 + len(layout.slots)) + 2) + 3)
        data[at] ^= 0x10
        file.write_bytes(bytes(data))
    elif damage == "cut short":
        file.write_bytes(file.read_bytes()[:size - 4096])
    elif damage == "garbage":
        file.write_bytes(np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes())
    elif damage == "empty":
        file.write_bytes(b"")
    elif damage == "fifo":
        file.unlink()
        os.mkfifo(file)
    else:
        case = _moe(case.name, GEMM3, np.float16)
        path = _write(case, tmp_path)
    capfd.readouterr()
    expected = _packing(case, path)
    logged = options(2)
    logged.log_severity_level = 2  # warnings (conftest silences the default logger)
    got = run(moe_onnx.session(path, sess_options=logged), case.feeds())
    assert _bits(got) == _bits(expected)
    err = capfd.readouterr().err
    assert f"packs its weights itself: {file}" in err and DAMAGES[damage] in err, err


@pytest.mark.parametrize("replaced", ["renamed over", "written in place"])
def test_a_file_replaced_under_a_running_session_changes_nothing(tmp_path, capfd, replaced):
    """Another model's file of the same node put in the file's place while a session runs leaves the session's
    outputs as they were: renamed over it (as ``pack`` does), the session keeps its own; written in place (as ``cp``
    does), the session sees it on its next run and packs its weights itself, saying so."""
    case, other = CASES[0], _other_weights(CASES[0])
    path = _write(case, tmp_path)
    [(file, _)] = pack_weights(path).files
    (tmp_path / "other").mkdir()
    [(other_file, _)] = pack_weights(_write(other, tmp_path / "other")).files
    assert other_file.name == file.name and other_file.read_bytes() != file.read_bytes()
    expected = _packing(case, path)
    logged = options(2)
    logged.log_severity_level = 2
    sess = moe_onnx.session(path, sess_options=logged)
    one_expert = _one_expert_feeds(case)
    expected_one = run(moe_onnx.session(path, sess_options=options(2), packed_weights=None), one_expert)
    assert _bits(run(sess, one_expert)) == _bits(expected_one)  # expert 1 checked and used
    capfd.readouterr()
    if replaced == "renamed over":
        os.replace(other_file, file)
    else:
        file.write_bytes(other_file.read_bytes())
    assert _bits(run(sess, case.feeds())) == _bits(expected)
    assert _bits(run(sess, one_expert)) == _bits(expected_one)
    err = capfd.readouterr().err
    assert (f"packs its weights itself: {file} was written while the session ran" in err) == (
        replaced == "written in place"), err


@pytest.mark.slow  # a fresh process or a measurement: seconds, outside the fast lane
def test_the_weights_are_held_as_the_files_pages(tmp_path):
    """A session on a packed model (external data) holds almost no anonymous memory for the weights after a run
    on every expert: they are the file's pages (RssFile grows by about the packed bytes)."""
    E, H, I = 8, 512, 1024
    path, weight_mb = _moe_file(tmp_path, E, H, I, inline=False)
    packed_mb = pack_weights(path).bytes / 2**20
    child = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, path, str(E), str(H)], capture_output=True,
                           text=True, check=True)
    rss = json.loads(child.stdout)
    grown = {key: rss["every expert"][key] - rss["start"][key] for key in ("RssAnon", "RssFile")}
    code = 16  # MB: onnxruntime's and our libraries' pages first touched by a session and a run
    activations = 4 * E * 2 * (H + 2 * I) * 4 / 2**20
    assert grown["RssAnon"] < 0.05 * weight_mb + activations + code, grown
    assert 0.95 * packed_mb < grown["RssFile"] < 1.05 * packed_mb + code, grown


def test_the_identity_of_the_weights_file_spares_their_checksums(tmp_path, capfd):
    """A model whose weights are mapped from an external data file last changed 2 s or more before ``pack`` has
    the file's identity (device, inode, size, times) recorded: its sessions check only the panels. A weight edited
    in place changes the identity (its change time): the node checks each expert's weights again, finds the
    edited one and packs itself."""
    E, H, I = 4, 64, 128
    path, _ = _moe_file(tmp_path, E, H, I, inline=False)
    time.sleep(2.1)  # settled: a later write gets another change time
    [(file, _)] = pack_weights(path).files
    data = file.read_bytes()
    assert struct.unpack_from("<Q", data, _Layout.of(data).sources)[0] == 1
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((E, H), dtype=np.float32), "routing": np.full((E, 2), 0.5, np.float32),
             "indices": np.array([[e, (e + 1) % E] for e in range(E)], np.int64)}
    logged = options(2)
    logged.log_severity_level = 2
    capfd.readouterr()
    for edited in (False, True):
        if edited:  # the last float of expert 0's gate weights: outside the fingerprint's windows
            with open(tmp_path / "moe.data", "r+b") as weights:
                weights.seek(I * H * 4 - 4)
                weights.write(np.float32(1.0).tobytes())
        expected = run(moe_onnx.session(path, sess_options=options(2), packed_weights=None), feeds)
        assert _bits(run(moe_onnx.session(path, sess_options=logged), feeds)) == _bits(expected)
        err = capfd.readouterr().err
        assert ("expert 0's weights differ from those the file was packed from" in err) == edited, err


def test_session_options_keep_one_folder(tmp_path):
    """SessionOptions registered with one packed-weights folder refuse a session on another."""
    case = CASES[0]
    path = _write(case, tmp_path)
    pack_weights(path)
    opts = options(1)
    moe_onnx.session(path, sess_options=opts)
    moe_onnx.session(path, sess_options=opts)
    with pytest.raises(ValueError, match="registered with packed_weights="):
        moe_onnx.session(path, sess_options=opts, packed_weights=None)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        moe_onnx.session(path, packed_weights=tmp_path / "missing")


def test_pack_command(tmp_path, capsys):
    """``moe-onnx pack``: 0 with the files and the rate; 1 for a missing model, a model with nothing to pack or a
    folder that cannot be written; 2 for bad settings."""
    path = _write(CASES[0], tmp_path)
    assert main(["pack", str(path), "--dir", str(tmp_path / "out"), "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "out") in out and "GB/s" in out and len(list((tmp_path / "out").iterdir())) == 1
    assert main(["pack", str(tmp_path / "missing.onnx")]) == 1
    assert "no such file" in capsys.readouterr().err and not (tmp_path / "missing.onnx.packed").exists()
    runtime_weights = Case(CASES[0].op, "runtime", CASES[0].inputs, CASES[0].attrs)
    runtime_path = _write(runtime_weights, tmp_path)
    assert main(["pack", str(runtime_path)]) == 1
    assert "nothing to pack" in capsys.readouterr().err and not default_directory(runtime_path).exists()
    (tmp_path / "file").write_text("")
    assert main(["pack", str(path), "--dir", str(tmp_path / "file")]) == 1
    assert "moe-onnx pack:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["pack", str(path), "--threads", "0"])
    assert exit_.value.code == 2
