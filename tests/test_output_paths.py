"""Output paths that are not regular files (docs/cli.md, "What OUT may be"): every command that writes
refuses a device, a FIFO, a socket or a directory as its file (exit 2, one line, the thing untouched), and
writes through a symbolic link to its target; a write that fails midway leaves no partial file."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from fixture_models import FIXTURES

from moe_onnx._ir import model_files
from moe_onnx.check import check_model
from moe_onnx.cli import main

TINY = FIXTURES / "mixtral_batched_mm_tiny.onnx"
REPO = Path(__file__).resolve().parents[1]


def _fifo(folder: Path) -> Path:
    os.mkfifo(folder / "fifo")
    return folder / "fifo"


def _directory(folder: Path) -> Path:
    (folder / "dir.onnx").mkdir()
    return folder / "dir.onnx"


def _socket(folder: Path) -> Path:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(folder / "sock"))
    server.close()  # the socket file stays
    return folder / "sock"


NOT_FILES = {"fifo": (_fifo, "is a FIFO"), "directory": (_directory, "is a directory"),
             "socket": (_socket, "is a socket")}
DEVICES = ["/dev/null", "/dev/full"]


def _error_lines(stderr: str) -> list[str]:
    """stderr without the progress lines."""
    return [line for line in stderr.splitlines() if not line.startswith("[")]


def _kind(path) -> int:
    return stat.S_IFMT(os.lstat(path).st_mode)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("command", ["optimize", "quantize"])
@pytest.mark.parametrize("name", NOT_FILES)
def test_out_that_is_not_a_file_is_refused(command, name, tmp_path, capsys):
    make, message = NOT_FILES[name]
    out = make(tmp_path)
    kind = _kind(out)
    arguments = ["--bits", "8"] if command == "quantize" else []
    assert main([command, str(TINY), "-o", str(out), *arguments]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert line == f"moe-onnx {command}: {out}: {message}; expected a regular file or a new path"
    assert _kind(out) == kind and _listing(tmp_path) == [out.name]


@pytest.mark.parametrize("through_a_link", [False, True], ids=["named", "linked"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_device_is_never_replaced(device, through_a_link, tmp_path, capsys):
    before = os.stat(device)
    out, named = device, device
    if through_a_link:
        out = tmp_path / "link.onnx"
        out.symlink_to(device)
        named = f"{out} (a symbolic link to {device})"
    assert main(["optimize", str(TINY), "-o", str(out), "--report", str(tmp_path / "r.json")]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert line == f"moe-onnx optimize: {named}: is a character device; expected a regular file or a new path"
    after = os.stat(device)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert _listing(tmp_path) == (["link.onnx"] if through_a_link else [])


def test_the_data_file_that_is_not_a_file_is_refused(tmp_path, capsys):
    os.mkfifo(tmp_path / "o.onnx.data")
    assert main(["optimize", str(TINY), "-o", str(tmp_path / "o.onnx")]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert line.endswith("o.onnx.data: is a FIFO; expected a regular file or a new path")
    assert _listing(tmp_path) == ["o.onnx.data"] and stat.S_ISFIFO(os.lstat(tmp_path / "o.onnx.data").st_mode)


@pytest.mark.parametrize("name", ["fifo", "directory"])
def test_report_that_is_not_a_file_is_refused_before_any_work(name, tmp_path, capsys):
    make, message = NOT_FILES[name]
    report = make(tmp_path)
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(TINY), "-o", str(out), "--report", str(report)]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert line == f"moe-onnx optimize: {report}: {message}; expected a regular file or a new path"
    assert not out.exists()


GENAI = REPO / "models" / "fixtures" / "genai" / "gpt_oss_fp32"


def _job(kind: str, folder: Path) -> tuple[Path, Path]:
    """The input and output of an optimize job in ``folder``: a model file with external data (``in.onnx`` ->
    ``out.onnx``), or an onnxruntime-genai folder (``in`` -> ``out``)."""
    if kind == "genai":
        shutil.copytree(GENAI, folder / "in")
        return folder / "in", folder / "out"
    model = onnx.load(TINY)
    onnx.save(model, folder / "in.onnx", save_as_external_data=True, location="in.onnx.data", size_threshold=0)
    return folder / "in.onnx", folder / "out.onnx"


@pytest.mark.parametrize("kind, report, role", [
    ("file", "in.onnx", "the input model"),
    ("file", "in.onnx.data", "the input model's external data"),
    ("file", "out.onnx", "the output"),
    ("file", "out.onnx.data", "the output's data file"),
    ("file", "link.json", "the input model"),  # a symbolic link to in.onnx
    ("genai", "in/genai_config.json", "a file of the input folder"),
    ("genai", "in/tokenizer.json", "a file of the input folder"),
    ("genai", "out/genai_config.json", "a file the output folder gets"),
    ("genai", "out/tokenizer.json", "a file the output folder gets"),
    ("genai", "out/model.onnx.data", "a file the output folder gets"),
])
def test_a_report_over_a_file_of_the_job_is_refused_before_any_work(kind, report, role, tmp_path, capsys):
    """--report, written last, would replace a file the job reads (the input and its data; any file of an input
    folder) or writes (the output and its data; any file the output folder gets): refused in one line (exit 2),
    nothing read or written."""
    source, out = _job(kind, tmp_path)
    (tmp_path / "link.json").symlink_to("in.onnx")
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    assert main(["optimize", str(source), "-o", str(out), "--report", str(tmp_path / report)]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert line == (f"moe-onnx optimize: --report {tmp_path / report}: is {role}; expected a path the job neither "
                    "reads nor writes")
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before
    assert not out.exists()


def test_a_report_beside_the_files_of_an_output_folder_is_written(tmp_path):
    source, out = _job("genai", tmp_path)
    assert main(["optimize", str(source), "-o", str(out), "--report", str(out / "report.json")]) == 0
    assert json.loads((out / "report.json").read_text())["fused"] and (out / "genai_config.json").is_file()


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external_data"])
def test_out_and_report_write_through_symbolic_links(external, tmp_path, monkeypatch):
    if external:
        monkeypatch.setattr(model_files, "EXTERNAL_DATA_THRESHOLD", 0)
    target, report_target = tmp_path / "model.onnx", tmp_path / "report.json"
    target.write_bytes(b"old")
    report_target.write_text("old")
    (tmp_path / "link.onnx").symlink_to(target.name)
    (tmp_path / "link.json").symlink_to(report_target)
    assert main(["optimize", str(TINY), "-o", str(tmp_path / "link.onnx"),
                 "--report", str(tmp_path / "link.json")]) == 0
    assert os.readlink(tmp_path / "link.onnx") == target.name and (tmp_path / "link.json").is_symlink()
    assert check_model(target) == [] and json.loads(report_target.read_text())["fused"]["BatchedMmSwiglu"] == 1
    written = ["model.onnx", "report.json"] + (["model.onnx.data"] if external else [])
    assert _listing(tmp_path) == sorted(["link.json", "link.onnx", *written])


def test_a_dangling_link_writes_its_target(tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.onnx").symlink_to(tmp_path / "sub" / "model.onnx")
    assert main(["optimize", str(TINY), "-o", str(tmp_path / "link.onnx")]) == 0
    assert check_model(tmp_path / "sub" / "model.onnx") == [] and (tmp_path / "link.onnx").is_symlink()
    (tmp_path / "lost.onnx").symlink_to(tmp_path / "missing" / "model.onnx")
    assert main(["optimize", str(TINY), "-o", str(tmp_path / "lost.onnx")]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    missing = tmp_path / "missing" / "model.onnx"
    assert line == (f"moe-onnx optimize: {tmp_path / 'lost.onnx'} (a symbolic link to {missing}): "
                    "the folder of its target does not exist")
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("out", ["file", "/dev/null"])
def test_shard_out_that_is_not_a_directory_is_refused(out, tmp_path, capsys):
    kind = "a character device"
    if out == "file":
        out, kind = tmp_path / "file", "a file"
        out.write_text("a file")
    assert main(["shard", str(TINY), "-o", str(out)]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert line == f"moe-onnx shard: {out}: is {kind}; expected a directory or a new path"
    assert _listing(tmp_path) == (["file"] if out == tmp_path / "file" else [])


def test_shard_refuses_a_rank_file_that_is_not_a_file_before_writing_any(tmp_path, capsys):
    os.mkfifo(tmp_path / "rank1.onnx")
    assert main(["shard", str(TINY), "-o", str(tmp_path), "--tp", "2"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert line == f"moe-onnx shard: {tmp_path / 'rank1.onnx'}: is a FIFO; expected a regular file or a new path"
    assert _listing(tmp_path) == ["rank1.onnx"]


@pytest.mark.parametrize("name", ["fifo", "directory"])
def test_run_out_that_is_not_a_file_is_refused_before_mpirun(name, tmp_path, capsys):
    make, message = NOT_FILES[name]
    out = make(tmp_path)
    assert main(["run", str(tmp_path), "-n", "1", "--inputs", str(tmp_path / "in.npz"), "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"moe-onnx run: {out}: {message}; expected a regular file or a new path"


WRITE_UNDER_A_SIZE_LIMIT = """
import resource, signal, sys
from moe_onnx._ir import model_files
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
try:
    with model_files.replacing(sys.argv[1]) as staged:
        staged.write_text("x" * 5000)
except model_files.ModelFileError as error:
    print(error)
    sys.exit(1)
"""


@pytest.mark.slow  # a fresh process or a measurement: seconds, outside the fast lane
@pytest.mark.subprocess
def test_a_write_that_fills_the_disk_leaves_the_old_file(tmp_path):
    """The writer every output goes through (reports, manifests, run's outputs, models) under a file-size limit."""
    (tmp_path / "report.json").write_text("old")
    (tmp_path / "link.json").symlink_to("report.json")
    child = subprocess.run([sys.executable, "-c", WRITE_UNDER_A_SIZE_LIMIT, str(tmp_path / "link.json")],
                           capture_output=True, text=True,
                           env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
                                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert child.returncode == 1, child.stderr
    assert child.stdout.strip() == f"{tmp_path / 'link.json'}: cannot write it: File too large"
    assert (tmp_path / "report.json").read_text() == "old" and _listing(tmp_path) == ["link.json", "report.json"]


def _write_folder(folder: Path, text: str) -> None:
    for name in ("model.onnx.data", "model.onnx", "genai_config.json"):
        (folder / name).write_text(f"{name} {text}")


def test_a_folder_is_replaced_only_when_complete(tmp_path):
    """replacing_folder (export's OUT): a failed write leaves a new path absent and an existing folder as it was;
    a completed one makes a new folder or replaces the files it wrote, keeping the folder's other files."""
    new, old = tmp_path / "new" / "out", tmp_path / "old"
    old.mkdir()
    _write_folder(old, "old")
    (old / "notes.txt").write_text("mine")
    for path in (new, old):
        with pytest.raises(RuntimeError), model_files.replacing_folder(path) as staged:
            _write_folder(staged, "new")
            raise RuntimeError("the export failed")
    assert not new.exists() and sorted(os.listdir(tmp_path / "new")) == []
    assert {p.name: p.read_text() for p in old.iterdir()} == {
        "model.onnx.data": "model.onnx.data old", "model.onnx": "model.onnx old",
        "genai_config.json": "genai_config.json old", "notes.txt": "mine"}
    for path in (new, old):
        with model_files.replacing_folder(path) as staged:
            _write_folder(staged, "new")
        assert all((path / name).read_text() == f"{name} new" for name in ("model.onnx", "genai_config.json"))
    assert (old / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["new", "old"]  # no temporary folder left
    (tmp_path / "file").write_text("x")
    with pytest.raises(model_files.OutputPathError, match="is a file; expected a directory or a new path"):
        with model_files.replacing_folder(tmp_path / "file"):
            pass


@pytest.mark.slow
@pytest.mark.xdist_group("export")  # the worker that has imported torch
def test_a_failed_export_leaves_out_as_it_was(tmp_path, monkeypatch, capsys):
    """An export that fails once OUT is taken (here its trace) leaves an existing OUT as it was and makes no new one."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from moe_onnx.export import _torch

    def fail(*args):
        raise RuntimeError("the trace failed")

    monkeypatch.setattr(_torch, "trace_decoder", fail)
    checkpoint = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "checkpoints" / "qwen3_moe"
    old = tmp_path / "old"
    old.mkdir()
    _write_folder(old, "old")
    for out in (old, tmp_path / "new"):
        assert main(["export", str(checkpoint), "-o", str(out)]) == 1
        assert capsys.readouterr().err.strip().endswith("RuntimeError: the trace failed")
    assert not (tmp_path / "new").exists() and sorted(os.listdir(tmp_path)) == ["old"]
    assert all((old / name).read_text() == f"{name} old" for name in ("model.onnx", "genai_config.json"))
