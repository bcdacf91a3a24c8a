"""`moe-onnx optimize`: report, verification, JSON, external data, refusal to overwrite its input's files,
no partial output, one-line errors, --verify on trace-bound exports; the Python API's files: the inputs the
command line refuses, a result that saves anywhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from cases.moe import CASES
from fixture_models import FIXTURES, TARGETS

import moe_onnx
from moe_onnx._ir import model_files
from moe_onnx.check import check_model
from moe_onnx.cli import main
from moe_onnx.verify import verify

REPO = Path(__file__).resolve().parents[1]
BASE_CASE = next(c for c in CASES if c.name == "gemm2_fp32")


@pytest.mark.parametrize("target", TARGETS)
def test_optimize_verify_and_report(target, tmp_path, capsys):
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    status = main(["optimize", str(FIXTURES / "qwen3_moe_batched_mm_tiny.onnx"), "-o", str(out), "--target", target,
                   "--verify", "--backend", "python", "--sizes", "1x1,2x3", "--report", str(report)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "BatchedMmSwiglu: 1 block fused" in printed and "OK" in printed and "speed-up" in printed
    document = json.loads(report.read_text())
    assert document["target"] == target and document["fused"]["BatchedMmSwiglu"] == 1
    assert document["verify"]["ok"] and len(document["verify"]["sizes"]) == 2
    assert document["nodes_before"].get("GatherND") == 2 and "GatherND" not in document["nodes_after"]
    assert check_model(out) == []


def test_verify_holds_one_session_at_a_time(tmp_path, sessions_alive_at_creation, capsys):
    """--verify runs the original at every size and frees it before the optimized model loads: the peak is the
    larger model's, not both (docs/cli.md); the verdict and the timings are still given."""
    out = tmp_path / "out.onnx"
    status = main(["optimize", str(FIXTURES / "qwen3_moe_batched_mm_tiny.onnx"), "-o", str(out), "--verify",
                   "--sizes", "1x1,2x3"])
    printed = capsys.readouterr().out
    assert status == 0 and printed.count(" OK") == 2 and "speed-up" in printed, printed
    assert sessions_alive_at_creation == [0, 0]  # the original's, then the optimized model's, the first freed


def test_external_data_is_written_slice_by_slice(tmp_path, monkeypatch):
    """Lazy (transposed) weights streamed into external data give the same numbers."""
    monkeypatch.setattr(model_files, "EXTERNAL_DATA_THRESHOLD", 0)
    original = FIXTURES / "gpt_oss_tiled_tiny.onnx"
    out = tmp_path / "grouped.onnx"
    assert main(["optimize", str(original), "-o", str(out), "--target", "grouped"]) == 0
    assert (tmp_path / "grouped.onnx.data").stat().st_size > 0
    assert any(t.data_location == onnx.TensorProto.EXTERNAL
               for t in onnx.load(out, load_external_data=False).graph.initializer)
    assert check_model(out) == []
    assert verify(original, out, backend="python", sizes=[(2, 3)], time_it=False).ok


def test_refuses_to_overwrite_its_input(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    model.write_bytes((FIXTURES / "mixtral_batched_mm_tiny.onnx").read_bytes())
    assert main(["optimize", str(model), "-o", str(model)]) == 2
    assert "same file" in capsys.readouterr().err


def test_unknown_target_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["optimize", str(FIXTURES / "mixtral_batched_mm_tiny.onnx"), "-o", str(tmp_path / "o.onnx"),
              "--target", "dense"])
    assert exit_info.value.code == 2


# ----------------------------------------------------------------------------- never lose a file

TINY = FIXTURES / "mixtral_batched_mm_tiny.onnx"


def _external_copy(folder, name: str = "a.onnx", data: str = "a.onnx.data"):
    """TINY saved in ``folder`` as ``name`` with its weights in ``data``; returns (model path, data path)."""
    model = onnx.load(TINY)
    onnx.save(model, str(folder / name), save_as_external_data=True, location=data, size_threshold=100)
    return folder / name, folder / data


def _snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_refuses_to_overwrite_the_data_file_of_its_input(tmp_path, capsys):
    """(a) IN keeps its weights in b.onnx.data: `-o b.onnx` would write its own data there."""
    source, _ = _external_copy(tmp_path, data="b.onnx.data")
    before = _snapshot(tmp_path)
    assert main(["optimize", str(source), "-o", str(tmp_path / "b.onnx")]) == 2
    err = capsys.readouterr().err
    assert "same file" in err and "b.onnx.data" in err
    assert _snapshot(tmp_path) == before


def test_refuses_to_write_over_its_inputs_external_data(tmp_path, capsys):
    """(b) OUT names IN's external data file."""
    source, data = _external_copy(tmp_path)
    before = _snapshot(tmp_path)
    assert main(["optimize", str(source), "-o", str(data)]) == 2
    err = capsys.readouterr().err
    assert "same file" in err and str(data) in err
    assert _snapshot(tmp_path) == before


def test_refuses_a_hard_link_to_its_input(tmp_path, capsys):
    """(c) OUT is another name of IN."""
    source = tmp_path / "m.onnx"
    source.write_bytes(TINY.read_bytes())
    os.link(source, tmp_path / "link.onnx")
    assert main(["optimize", str(source), "-o", str(tmp_path / "link.onnx")]) == 2
    assert "same file" in capsys.readouterr().err
    assert source.read_bytes() == TINY.read_bytes()


WRITE_UNDER_A_SIZE_LIMIT = """
import resource, signal, sys
from moe_onnx._ir import model_files
from moe_onnx.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
model_files.EXTERNAL_DATA_THRESHOLD = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
sys.exit(main(["optimize", *sys.argv[3:]]))
"""


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("threshold", [1 << 30, 0], ids=["inline", "external_data"])
def test_a_failed_write_leaves_no_partial_output(threshold, tmp_path):
    """(d) the file-size limit stops the write midway: OUT keeps its old content, nothing else is left."""
    out = tmp_path / "out.onnx"
    out.write_bytes(b"old")
    limit = TINY.stat().st_size // 3
    child = subprocess.run([sys.executable, "-c", WRITE_UNDER_A_SIZE_LIMIT, str(threshold), str(limit), str(TINY),
                            "-o", str(out)], capture_output=True, text=True,
                           env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
                                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert child.returncode == 1, child.stderr
    assert _error_lines(child.stderr) == [f"moe-onnx optimize: {out}: cannot write it: File too large"]
    assert _snapshot(tmp_path) == {"out.onnx": b"old"} and list(tmp_path.iterdir()) == [out]


# ----------------------------------------------------------------------------- one line, nothing written

def _error_lines(stderr: str) -> list[str]:
    """stderr without the progress lines."""
    return [line for line in stderr.splitlines() if not line.startswith("[")]


def _truncated(folder):
    path = folder / "truncated.onnx"
    path.write_bytes(TINY.read_bytes()[:3000])
    return path


def _random_bytes(folder):
    path = folder / "random.onnx"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8).tobytes())
    return path


def _empty(folder):
    path = folder / "empty.onnx"
    path.write_bytes(b"")
    return path


def _directory(folder):
    (folder / "dir.onnx").mkdir()
    return folder / "dir.onnx"


def _missing_data(folder):
    source, data = _external_copy(folder)
    data.unlink()
    return source


def _short_data(folder):
    source, data = _external_copy(folder)
    with open(data, "r+b") as handle:
        handle.truncate(data.stat().st_size // 2)
    return source


def _other_opset(folder):
    model = onnx.load(TINY)
    model.opset_import.append(onnx.helper.make_opsetid("moe_onnx", 2))
    onnx.save(model, str(folder / "opset2.onnx"))
    return folder / "opset2.onnx"


def _invalid_moe_node(folder):
    """A model that fails `moe-onnx check` already: refused, not blamed on the optimization."""
    model = BASE_CASE.model(symbolic=True)
    for attr in model.graph.node[0].attribute:
        if attr.name == "expert_beta":
            attr.f = 0.0
    onnx.save(model, str(folder / "bad.onnx"))
    return folder / "bad.onnx"


BAD_INPUTS = {
    "random_bytes": (_random_bytes, "is not an ONNX model"),
    "truncated_protobuf": (_truncated, "is not an ONNX model"),
    "empty_file": (_empty, "is empty (0 bytes)"),
    "directory": (_directory, "is not a regular file"),
    "missing_path": (lambda folder: folder / "nothere.onnx", "no such file"),
    "missing_external_data": (_missing_data, "external data file 'a.onnx.data' does not exist"),
    "short_external_data": (_short_data, "is past the end of 'a.onnx.data'"),
    "other_moe_onnx_opset": (_other_opset, "opset_import for domain 'moe_onnx' is 2; expected 1"),
    "invalid_moe_node": (_invalid_moe_node, "the input model is invalid: MOE node"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_one_line(name, tmp_path, capsys):
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    make, message = BAD_INPUTS[name]
    source = make(inputs)
    assert main(["optimize", str(source), "-o", str(outputs / "o.onnx"), "--verify"]) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    assert line.startswith(f"moe-onnx optimize: {source}: ") and message in line, line
    assert not outputs.exists()


def test_unwritable_output_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("a file, not a folder")
    out = tmp_path / "file" / "o.onnx"
    assert main(["optimize", str(TINY), "-o", str(out)]) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    assert line.startswith(f"moe-onnx optimize: {out}: cannot write it: "), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("option", [["--sizes", "abc"], ["--sizes=0x2"], ["--sizes", "1x"], ["--threads", "0"]])
def test_bad_option_is_a_usage_error(option, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["optimize", str(TINY), "-o", str(tmp_path / "o.onnx"), "--verify", *option])
    assert exit_info.value.code == 2
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- the API reads files as the CLI does

#: the inputs that cannot be read as a model (the others of BAD_INPUTS are read, then found invalid)
UNREADABLE = [name for name in BAD_INPUTS if name not in ("other_moe_onnx_opset", "invalid_moe_node")]


@pytest.mark.parametrize("command", ["optimize", "quantize"])
@pytest.mark.parametrize("name", BAD_INPUTS)
def test_the_api_refuses_what_the_command_line_refuses(name, command, tmp_path, capsys):
    source = BAD_INPUTS[name][0](tmp_path)
    settings = ["--bits", "8"] if command == "quantize" else []
    assert main([command, str(source), "-o", str(tmp_path / "out.onnx"), *settings]) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    with pytest.raises(model_files.ModelFileError) as raised:
        getattr(moe_onnx, command)(source)
    assert line == f"moe-onnx {command}: {raised.value}"


@pytest.mark.parametrize("name", UNREADABLE)
def test_a_session_refuses_an_unreadable_file_as_the_command_line_does(name, tmp_path, capsys):
    source = BAD_INPUTS[name][0](tmp_path)
    assert main(["optimize", str(source), "-o", str(tmp_path / "out.onnx")]) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    with pytest.raises(model_files.ModelFileError) as raised:
        moe_onnx.session(source)
    assert line == f"moe-onnx optimize: {raised.value}"


@pytest.mark.parametrize("name", UNREADABLE)
def test_check_model_lists_an_unreadable_file_as_moe_onnx_check_prints_it(name, tmp_path, capsys):
    make, message = BAD_INPUTS[name]
    source = make(tmp_path)
    problems = check_model(source)
    assert problems and message in problems[0], problems
    assert main(["check", str(source)]) == 1
    assert capsys.readouterr().out.splitlines()[1:] == [f"  {problem}" for problem in problems]


def test_the_optimized_model_saves_anywhere(tmp_path):
    """moe_onnx.optimize of a file with external data gives a ModelProto that holds every weight: saved in
    another folder, inline or with external data of its own, it runs there with the input's folder gone."""
    inputs, elsewhere = tmp_path / "in", tmp_path / "elsewhere"
    inputs.mkdir()
    elsewhere.mkdir()
    source, _ = _external_copy(inputs)
    model, report = moe_onnx.optimize(source)
    assert report.fused_blocks == 1
    onnx.save(model, str(elsewhere / "inline.onnx"))
    onnx.save_model(model, str(elsewhere / "external.onnx"), save_as_external_data=True,
                    location="external.onnx.data")  # tensors of 1 KiB or more
    hidden = np.random.default_rng(0).standard_normal((2, 5, 32), dtype=np.float32)
    (expected,) = moe_onnx.session(source).run(None, {"hidden_states": hidden})
    shutil.rmtree(inputs)
    assert (elsewhere / "external.onnx.data").stat().st_size > 0
    for name in ("inline.onnx", "external.onnx"):
        (got,) = moe_onnx.session(elsewhere / name).run(None, {"hidden_states": hidden})
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=name)


# ----------------------------------------------------------------------------- --verify on trace-bound exports

def test_verify_skips_sizes_a_loop_export_cannot_run(tmp_path, capsys):
    """A TorchScript loop export runs only inputs that reach all its traced experts: never one token."""
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    status = main(["optimize", str(FIXTURES / "mixtral_loop_small.onnx"), "-o", str(out), "--verify",
                   "--sizes", "1x1,2x5,3x17", "--report", str(report)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "batch=1, seq=1: not compared: the original model cannot run at this size" in printed
    assert "batch=3, seq=17: max abs diff" in printed and "speed-up" in printed
    sizes = json.loads(report.read_text())["verify"]["sizes"]
    assert [s["compared"] for s in sizes] == [False, True, True] and all(s["ok"] for s in sizes)


def test_verify_says_when_nothing_could_be_compared(tmp_path, capsys):
    """The export missing expert 3 runs only on inputs routed to exactly experts 0, 1, 2."""
    report = tmp_path / "report.json"
    status = main(["optimize", str(FIXTURES / "mixtral_loop_missing_tiny.onnx"), "-o", str(tmp_path / "o.onnx"),
                   "--verify", "--sizes", "1x1,3x17", "--report", str(report)])
    assert status == 1
    assert "nothing compared: the original model runs at none of these sizes" in capsys.readouterr().out
    assert json.loads(report.read_text())["verify"]["ok"] is False


def _embedding_model(table: np.ndarray) -> onnx.ModelProto:
    ids = onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "seq"])
    out = onnx.helper.make_tensor_value_info("embedded", onnx.TensorProto.FLOAT, ["batch", "seq", table.shape[1]])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Gather", ["table", "input_ids"], ["embedded"])], "g",
                                   [ids], [out], [onnx.numpy_helper.from_array(table, "table")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)


def test_verify_draws_token_ids_from_the_vocabulary():
    """Rows past 1 of an embedding table are read too: a difference there is a mismatch."""
    table = np.arange(50 * 4, dtype=np.float32).reshape(50, 4)
    changed = table.copy()
    changed[2:] += 1
    assert not verify(_embedding_model(table), _embedding_model(changed), backend="python", time_it=False).ok
    assert verify(_embedding_model(table), _embedding_model(table), backend="python", time_it=False).ok


def test_verify_reports_an_input_it_cannot_generate():
    text = onnx.helper.make_tensor_value_info("text", onnx.TensorProto.STRING, ["n"])
    same = onnx.helper.make_tensor_value_info("same", onnx.TensorProto.STRING, ["n"])
    model = onnx.helper.make_model(
        onnx.helper.make_graph([onnx.helper.make_node("Identity", ["text"], ["same"])], "g", [text], [same]),
        opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)
    result = verify(model, model, backend="python", time_it=False)
    assert not result.ok and result.error == "verify: input 'text' has type tensor(string), which verify cannot generate"


def _elementwise_model(*ops: str) -> onnx.ModelProto:
    """y = op_n(...op_1(x)) for x [batch, seq] (Concat: along the last axis with itself)."""
    nodes, value = [], "x"
    for index, op in enumerate(ops):
        output = "y" if index == len(ops) - 1 else f"v{index}"
        inputs = [value, value] if op == "Concat" else [value]
        nodes.append(onnx.helper.make_node(op, inputs, [output], **({"axis": -1} if op == "Concat" else {})))
        value = output
    graph = onnx.helper.make_graph(nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                                    ["batch", "seq"])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)


def test_verify_counts_nan_as_infinite_unless_both_models_give_it():
    """moe_onnx.compare's rule: a NaN only the optimized model gives is an infinite difference; NaN where the
    original gives NaN too is equal."""
    nan_everywhere = _elementwise_model("Abs", "Neg", "Sqrt")  # sqrt(-|x|): NaN for x != 0
    result = verify(_elementwise_model("Identity"), nan_everywhere, backend="python", sizes=[(2, 3)], time_it=False)
    assert not result.ok and result.results[0].max_abs_diff == np.inf
    assert "max abs diff inf, max rel diff inf MISMATCH" in result.summary()
    same = verify(nan_everywhere, nan_everywhere, backend="python", sizes=[(2, 3)], time_it=False)
    assert same.ok and (same.results[0].max_abs_diff, same.results[0].max_rel_diff) == (0.0, 0.0)


def test_verify_names_an_output_whose_shape_differs():
    result = verify(_elementwise_model("Identity"), _elementwise_model("Concat"), backend="python", sizes=[(2, 3)],
                    time_it=False)
    assert not result.ok and not result.results[0].compared
    assert result.summary() == ("  batch=2, seq=3: FAILED: the optimized model's outputs differ from the original's: "
                                "output 'y' has shape [2, 6]; expected [2, 3]")


@pytest.mark.parametrize("name", UNREADABLE)
def test_run_refuses_an_unreadable_reference_before_starting_the_ranks(name, tmp_path, capsys):
    source = BAD_INPUTS[name][0](tmp_path)
    status = main(["run", str(tmp_path / "no_shard"), "-n", "2", "--inputs", str(tmp_path / "in.npz"),
                   "-o", str(tmp_path / "out.npz"), "--check", "--reference", str(source)])
    assert status == 1
    (line,) = _error_lines(capsys.readouterr().err)
    with pytest.raises(model_files.ModelFileError) as raised:
        model_files.read_complete(source)
    assert line == f"moe-onnx run: --reference: {raised.value}"
    assert not (tmp_path / "out.npz").exists()


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_shard_refuses_what_optimize_refuses(name, tmp_path, capsys):
    source = BAD_INPUTS[name][0](tmp_path)
    assert main(["optimize", str(source), "-o", str(tmp_path / "out.onnx")]) == 1
    (optimize_line,) = _error_lines(capsys.readouterr().err)
    assert main(["shard", str(source), "--tp", "2", "-o", str(tmp_path / "shard")]) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    assert line == optimize_line.replace("moe-onnx optimize:", "moe-onnx shard:", 1)
    assert not list((tmp_path / "shard").glob("rank*.onnx"))
