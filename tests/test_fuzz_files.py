"""Fuzzing the files the commands read besides models: a packed-weights file (`moe-onnx pack`) with bytes flipped,
cut or added anywhere, and an onnxruntime-genai folder's genai_config.json (`moe-onnx generate`) with any field
changed to a value of another type or range, or removed.

A packed file never changes a result: whatever was done to it, the session's outputs are the bits of a session
that packs its weights itself. generate either generates or exits with one line naming the command, never a
traceback or a hang. The examples are derandomized (the same on every run); MOE_ONNX_FUZZ_EXAMPLES sets how many.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
from backends import options
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_packing import CASES

import moe_onnx
from moe_onnx.cli import main as cli
from moe_onnx.runtime import pack_weights, run

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]

EXAMPLES = int(os.environ.get("MOE_ONNX_FUZZ_EXAMPLES", "150")) // 3
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# ----------------------------------------------------------------------------- packed-weights files

#: one fp32 MOE and one QMOE (int4 blocks) of test_packing's cases: the float and the quantized panels
PACK_CASES = [CASES[0], next(case for case in CASES if case.op == "QMOE")]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> dict[str, tuple[Path, Path, bytes, list[bytes]]]:
    """Per case: its model, its packed file, the file's bytes, and the outputs of a session that packs."""
    folder = tmp_path_factory.mktemp("packed")
    made = {}
    for case in PACK_CASES:
        model = folder / f"{case.name}.onnx"
        model.write_bytes(case.model().SerializeToString())
        [(file, _)] = pack_weights(model).files
        expected = run(moe_onnx.session(model, sess_options=options(1), packed_weights=None), case.feeds())
        made[case.name] = (model, file, file.read_bytes(), [o.tobytes() for o in expected])
    return made


@st.composite
def damaged(draw, data: bytes) -> bytes:
    """``data`` with a few bytes flipped (anywhere: header, stamps, checksum table, panels, biases, padding),
    cut short, or with bytes appended."""
    kind = draw(st.sampled_from(["flip", "flip", "flip", "cut", "append"]))
    if kind == "cut":
        return data[:draw(st.integers(0, len(data) - 1))]
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=64))
    damaged = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        damaged[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    return bytes(damaged)


@pytest.mark.parametrize("case", PACK_CASES, ids=lambda c: c.name)
@FUZZ
@given(data=st.data())
def test_a_damaged_packed_file_never_changes_a_result(packed, capfd, case, data):
    model, file, original, expected = packed[case.name]
    damage = data.draw(damaged(original))
    staged = file.with_name(file.name + ".new")
    staged.write_bytes(damage)
    staged.replace(file)  # as pack replaces a file: a new inode, which no earlier session has mapped
    logged = options(1)
    logged.log_severity_level = 2  # warnings (conftest silences the default logger)
    capfd.readouterr()
    got = run(moe_onnx.session(model, sess_options=logged), case.feeds())
    event("packs itself" if "packs its weights itself" in capfd.readouterr().err else "maps the file")
    assert [o.tobytes() for o in got] == expected


# ----------------------------------------------------------------------------- genai_config.json

GENAI = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "genai" / "gpt_oss_fp32"
#: what a field may become: other types, out-of-range numbers, or nothing
VALUES = [None, True, 0, -1, 1, 3, 2**31, 2**63, 1.5, float("nan"), "", "model.onnx", "x" * 300, "%d", [], [0], [-1],
          {}, {"a": 1}]


def _fields(node: object, path: tuple = ()) -> list[tuple]:
    """Every key path of a JSON document, containers included."""
    paths = [path] if path else []
    if isinstance(node, dict):
        for key, value in node.items():
            paths += _fields(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            paths += _fields(value, (*path, index))
    return paths


def _holds(container: object, key: object) -> bool:
    """Whether ``container[key]`` exists (a dict's key, or a list's index)."""
    if isinstance(container, dict):
        return key in container
    return isinstance(container, list) and isinstance(key, int) and key < len(container)


def _changed(document: dict, changes: list[tuple[tuple, object]]) -> dict:
    """A copy of ``document`` with each (key path, value) change made where the path still leads ("remove": the
    key or item removed)."""
    document = json.loads(json.dumps(document))
    for path, value in changes:
        parent = document
        for key in path[:-1]:
            parent = parent[key] if _holds(parent, key) else None
        if not _holds(parent, path[-1]):
            continue
        if value == "remove":
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
    return document

CONFIG = json.loads((GENAI / "genai_config.json").read_text())
FIELDS = _fields(CONFIG)


@pytest.fixture(scope="module")
def genai_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("genai") / "folder"
    shutil.copytree(GENAI, folder)
    (folder / "tokenizer.json").unlink()  # ids in and out: the config's fields are what is fuzzed
    return folder


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(FIELDS), st.sampled_from([*VALUES, "remove"])), min_size=1,
                        max_size=3))
def test_generate_under_a_changed_genai_config_generates_or_says_why_in_one_line(genai_folder, capsys, changes):
    (genai_folder / "genai_config.json").write_text(json.dumps(_changed(CONFIG, changes)))
    capsys.readouterr()
    status = cli(["generate", str(genai_folder), "--prompt-ids", "5,9,17", "-n", "2"])
    out, err = capsys.readouterr()
    event(f"exit {status}")
    if status == 0:
        assert out.startswith("tokens: ") and err == "", (changes, out, err)
    else:
        assert status in (1, 2) and err.startswith("moe-onnx generate: ") and err.count("\n") == 1, (changes, err)
        assert "Traceback" not in err


# ----------------------------------------------------------------------------- a checkpoint's config.json

QUICK_START = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "checkpoints" / "qwen3_moe"
CHECKPOINT_CONFIG = json.loads((QUICK_START / "config.json").read_text())
CHECKPOINT_FIELDS = _fields(CHECKPOINT_CONFIG)


class _ReachedTheTrace(BaseException):
    """Raised in place of the trace (seconds per example): passes through the command's error handling."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("checkpoint") / "qwen3_moe"
    shutil.copytree(QUICK_START, folder)
    return folder


@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
                    reason="export needs torch and transformers")
@pytest.mark.xdist_group("export")  # the worker that has imported torch and transformers
@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(CHECKPOINT_FIELDS), st.sampled_from([*VALUES, "remove"])),
                        min_size=1, max_size=3))
def test_export_of_a_changed_config_reaches_the_trace_or_says_why_in_one_line(checkpoint, capsys, monkeypatch,
                                                                           changes):
    """Up to the trace (replaced here: it is seconds per example), export reads a config.json changed anywhere
    (the config, transformers' model built from it, the checkpoint's tensors mapped onto that model) and either
    goes on or exits with one line, writing nothing."""
    from moe_onnx.export import _torch

    def reached(*args):
        raise _ReachedTheTrace

    monkeypatch.setattr(_torch, "trace_decoder", reached)
    (checkpoint / "config.json").write_text(json.dumps(_changed(CHECKPOINT_CONFIG, changes)))
    out = checkpoint.parent / "out"
    capsys.readouterr()
    try:
        status = cli(["export", str(checkpoint), "-o", str(out)])
    except _ReachedTheTrace:
        status = "trace"
    err = capsys.readouterr().err
    event(f"exit {status}")
    assert not out.exists()
    if status != "trace":
        line = err.strip().splitlines()[-1]  # after transformers' own warnings
        assert status in (1, 2) and line.startswith("moe-onnx export: "), (changes, err)
        assert "Traceback" not in err
