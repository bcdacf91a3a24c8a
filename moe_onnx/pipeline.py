"""``moe-onnx optimize`` as a function: read a model file, fuse its MoE blocks, write the result,
check it and, on request, verify it against the original."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from shutil import SameFileError

import onnx

from . import io
from .check import check_loaded, check_model
from .rewrite import OptimizeReport, optimize_ir
from .verify import DEFAULT_SIZES, VerifyResult, format_sizes, verify

__all__ = ["OptimizeResult", "SameFileError", "optimize_file"]


@dataclasses.dataclass
class OptimizeResult:
    """What :func:`optimize_file` did: the optimization report, the problems ``moe-onnx check``
    finds in the written model, and the verification (None when not asked for)."""

    report: OptimizeReport
    problems: list[str]
    verified: VerifyResult | None = None

    @property
    def ok(self) -> bool:
        """The written model passes the check and, when verified, matches the original."""
        return not self.problems and (self.verified is None or self.verified.ok)

    def summary(self) -> str:
        lines = [self.report.summary()]
        if self.problems:
            lines.append("the optimized model does not pass `moe-onnx check`:")
            lines += [f"  {problem}" for problem in self.problems]
        if self.verified is not None:
            lines += [f"verify ({self.verified.backend} backend):", self.verified.summary()]
            if any(r.compared and not r.ok for r in self.verified.results):
                lines.append("MISMATCH: the optimized model differs from the original")
        return "\n".join(lines)

    def document(self) -> dict:
        """The report (and the verify results) as a JSON-ready dict."""
        document = dataclasses.asdict(self.report)
        if self.verified is not None:
            v = self.verified
            document["verify"] = {"ok": v.ok, "backend": v.backend, "sizes": [dataclasses.asdict(r) for r in v.results],
                                  "original_ms": v.original_ms, "optimized_ms": v.optimized_ms, "error": v.error}
        return document

    def write_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as handle:
            json.dump(self.document(), handle, indent=2)


def optimize_file(source: str | os.PathLike, destination: str | os.PathLike, target: str = "moe", *,
                  verify_backend: str | None = None, sizes: Sequence[Sequence[int]] = DEFAULT_SIZES,
                  threads: int | None = None, progress: Callable[[str], None] | None = None,
                  fuse_routers: bool = True, portable: bool = False) -> OptimizeResult:
    """Fuse the MoE blocks of the model at ``source`` (``target``, ``fuse_routers`` and ``portable`` as in
    :func:`moe_onnx.optimize`)
    and write it to ``destination`` (with external data when large, see :func:`moe_onnx.io.save`);
    then check the written model and, when ``verify_backend`` is given, compare both models on
    that backend at ``sizes`` with ``threads`` intra-op threads (:func:`moe_onnx.verify.verify`).
    ``progress`` receives stage messages.

    Raises SameFileError when ``destination`` or its data file is a file the input reads (the
    weights are read from them lazily while the output is written); :class:`moe_onnx.io.ModelFileError`
    when ``source`` cannot be read or fails ``moe-onnx check`` ("the input model is invalid"), or
    ``destination`` cannot be written (nothing is left there); ValueError for an unknown target.
    """
    say = progress or (lambda message: None)
    say(f"loading {source}")
    proto = io.read_proto(source)
    _refuse_overwriting_input(source, destination, proto)
    say(f"checking {source}")
    _require_valid_input(source, proto)
    model = io.load(source, proto)
    report = optimize_ir(model, target, progress=progress, fuse_routers=fuse_routers, portable=portable)
    say(f"saving {destination}")
    io.save(model, destination, progress=progress)
    result = OptimizeResult(report, check_model(destination))
    if verify_backend is not None:
        say(f"verifying on the {verify_backend} backend at sizes {format_sizes(sizes)}")
        result.verified = verify(source, destination, backend=verify_backend, sizes=sizes, threads=threads)
    return result


def _refuse_overwriting_input(source: str | os.PathLike, destination: str | os.PathLike,
                              proto: onnx.ModelProto) -> None:
    """SameFileError when a file the output writes is one the input (``proto``, read from ``source``) reads."""
    read = [(Path(source), "the input")]
    read += [(file, f"the external data of the input {source}")
             for file in sorted(io.external_data_files(proto, Path(source).parent))]
    written = [(Path(destination), "the output"), (io.data_file(destination), "the output's data file")]
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


def _require_valid_input(source: str | os.PathLike, proto: onnx.ModelProto) -> None:
    """ModelFileError with the first problem `moe-onnx check` finds in the input, if any."""
    problems = check_loaded(proto, Path(source))
    if problems:
        lines = [line for problem in problems for line in problem.splitlines()]
        more = f" (and more: see `moe-onnx check {source}`)" if len(lines) > 1 else ""
        raise io.ModelFileError(f"{source}: the input model is invalid: {lines[0]}{more}")
