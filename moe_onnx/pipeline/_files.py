"""What the file jobs share: the input read once it is known valid and not overwritten by the output, the output
written (and, for an onnxruntime-genai folder, the folder completed around it), a report written as JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from shutil import SameFileError

import onnx
import onnx_ir as ir

from .._ir import model_files
from ..check import require_valid
from .genai import JobPaths, job_paths


def load_input(paths: JobPaths, say: Callable[[str], None]) -> tuple[ir.Model, onnx.ModelProto | None]:
    """The valid model at ``paths.source``, its weights left on disk, once it is sure writing
    ``paths.destination`` does not overwrite a file it reads, and the model as the check's shape inference typed
    it (:func:`moe_onnx.check.require_valid`); OutputPathError when a genai job's output folder is not a folder."""
    say(f"loading {paths.source}")
    proto = model_files.read_proto(paths.source)
    if paths.genai is not None:  # before any work; the folder is written when the job completes (write_output)
        model_files.refuse_other_than_a_folder(paths.folder)
    _refuse_overwriting_input(paths.source, paths.destination, proto)
    say(f"checking {paths.source}")
    inferred = require_valid(paths.source, proto)
    return model_files.load(paths.source, proto), inferred


def write_output(model: ir.Model, paths: JobPaths, progress: Callable[[str], None] | None, *,
                 library: bool) -> Path:
    """Save ``model`` to ``paths.destination`` (:func:`moe_onnx._ir.model_files.save`) and, for a genai job, copy
    the rest of the folder beside it (our library too, named in its genai_config.json, with ``library``), the
    folder changed only once all of it is written (:func:`moe_onnx._ir.model_files.replacing_folder`); returns the
    file written (the target of a symbolic link: its external data, named after it, lies beside it)."""
    say = progress or (lambda message: None)
    say(f"saving {paths.destination}")
    if paths.genai is None:
        model_files.save(model, paths.destination, progress=progress)
    else:
        with model_files.replacing_folder(paths.folder) as staged:
            decoder = staged / Path(paths.destination).name
            model_files.save(model, decoder, progress=progress)
            say(f"copying the rest of the onnxruntime-genai folder {paths.genai.folder}")
            paths.genai.copy_to(staged, decoder, library=library)
    return model_files.output_file(paths.destination)


def write_json(document: dict, path: str | os.PathLike) -> None:
    """Write ``document`` to ``path`` through :func:`moe_onnx._ir.model_files.replacing`."""
    with model_files.replacing(path) as staged:
        staged.write_text(json.dumps(document, indent=2))


def check_report_path(report: str | os.PathLike, source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Before a job from ``source`` to ``destination`` runs: OutputPathError when ``report`` (or a genai job's output
    folder) is not a regular file (:func:`moe_onnx._ir.model_files.output_file`), SameFileError when it is a file the
    job reads or writes, which the report, written last, would replace: the input model or its external data, the
    output or its data file; for an onnxruntime-genai folder, a file of the input folder or one the output folder
    gets."""
    target = Path(os.path.realpath(model_files.output_file(report)))
    paths = job_paths(source, destination)
    files = [(Path(paths.source), "the input model")]
    # only an existing file can be the input's external data: the input is read for them only then (the job reads
    # it again)
    if target.exists():
        try:
            files += [(file, "the input model's external data") for file in
                      model_files.external_data_files(model_files.read_proto(paths.source), Path(paths.source).parent)]
        except model_files.ModelFileError:
            pass  # the job refuses the input itself, before any report is written
    if paths.genai is not None:
        model_files.refuse_other_than_a_folder(paths.folder)
        if target.exists() and target.is_relative_to(os.path.realpath(paths.genai.folder)):
            files.append((target, "a file of the input folder"))
        files += [(paths.folder / name, "a file the output folder gets")
                  for name in paths.genai.names_written(paths.destination)]
    files += zip(model_files.model_output_files(paths.destination), ("the output", "the output's data file"))
    for file, role in files:
        if target == Path(os.path.realpath(file)):
            raise SameFileError(f"--report {report}: is {role}; expected a path the job neither reads nor writes")


def _refuse_overwriting_input(source: str | os.PathLike, destination: str | os.PathLike,
                              proto: onnx.ModelProto) -> None:
    """SameFileError when a file the output writes is one the input (``proto``, read from ``source``) reads;
    OutputPathError when ``destination`` or its data file is not a regular file."""
    read = [(Path(source), "the input")]
    read += [(file, f"the external data of the input {source}")
             for file in sorted(model_files.external_data_files(proto, Path(source).parent))]
    target, data = model_files.model_output_files(destination)
    written = [(target, "the output"), (data, "the output's data file")]
    for out_file, out_role in written:
        for in_file, in_role in read:
            if _same_file(out_file, in_file):
                raise SameFileError(f"{out_role} {out_file} is the same file as {in_role} ({in_file}); "
                                    "write to another path")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False
