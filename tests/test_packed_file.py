"""Packed-weights files (custom_ops/src/packing/packed_file.h; moe_onnx.runtime.packed_weights; ``moe-onnx pack``): a
session that maps a node's file gives the bits of one that packs, in every weight format and at 1 and 2 threads,
reads its panels from the file, and holds the weights as the file's pages; a file that does not match the node
(other weights or layout, damaged, cut short) is never used: the node packs and logs why."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from backends import options
from cases import Case
from cases.moe import GEMM2, GEMM3
from test_packing import _MEMORY_CHILD, CASES, _moe, _moe_file, _qmoe

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


def test_the_panels_are_read_from_the_file(tmp_path):
    """Changing the panels in the file (not its header) changes the outputs: the session uses the file's bytes."""
    case = CASES[0]
    path = _write(case, tmp_path)
    [(file, size)] = pack_weights(path).files
    expected = _packing(case, path)
    data = bytearray(file.read_bytes())
    data[4096:size // 2] = bytes(size // 2 - 4096)  # the first panels zeroed
    file.write_bytes(bytes(data))
    assert _bits(run(moe_onnx.session(path), case.feeds())) != _bits(expected)


def _other_weights(case: Case) -> Case:
    """The case with weights of the same names and shapes but other values."""
    inputs = [np.ascontiguousarray(a[::-1]) if i in case.constant and a is not None and a.ndim == 3 else a
              for i, a in enumerate(case.padded_inputs())]
    return Case(case.op, case.name, inputs, case.attrs, constant=case.constant)


@pytest.mark.parametrize("damage", ["other weights", "cut short", "garbage", "empty", "another layout", "fifo"])
def test_a_file_that_does_not_match_is_not_used(tmp_path, capfd, damage):
    """A file packed from other weights, cut short, overwritten with garbage, empty, of another layout (float16
    weights of the same shapes) or a FIFO in its place (never opened for reading: no hang) is not used: the outputs
    are those of packing, and the node logs why."""
    case = CASES[0]
    path = _write(case, tmp_path)
    [(file, size)] = pack_weights(path).files
    if damage == "other weights":
        path = _write(_other_weights(case), tmp_path)
        case = _other_weights(case)
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
    reason = {"other weights": "packed from other weights", "cut short": "truncated or damaged",
              "garbage": "not a packed-weights file", "empty": "not a packed-weights file",
              "another layout": "packed for another layout", "fifo": "is not a regular file"}[damage]
    err = capfd.readouterr().err
    assert "packs its weights itself" in err and reason in err, err


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
