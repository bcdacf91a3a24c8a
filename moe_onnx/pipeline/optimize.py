"""``moe-onnx optimize`` as a function: read a model file (or an onnxruntime-genai folder), fuse its MoE blocks,
write the result, check it and, on request, verify it against the original."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

from ..check import check_model
from ..rewrite import OptimizeReport, optimize_ir
from ..verify import DEFAULT_SIZES, VerifyResult, format_sizes, verify
from ._files import load_input, write_json, write_output
from .genai import job_paths

__all__ = ["OptimizeResult", "optimize_file"]


@dataclasses.dataclass
class OptimizeResult:
    """What :func:`optimize_file` did: the optimization report, the problems ``moe-onnx check``
    finds in the written model, and the verification (None when not asked for)."""

    report: OptimizeReport
    problems: list[str]
    verified: VerifyResult | None = None

    @property
    def ok(self) -> bool:
        """The written model passes the check, needs no library for target "ort" and, when verified,
        matches the original."""
        return not self.problems and not self.report.needs_our_library and (self.verified is None or self.verified.ok)

    def summary(self) -> str:
        lines = [self.report.summary()]
        if self.report.needs_our_library:
            lines.append(f"target ort: moe_onnx ops stay ({', '.join(self.report.our_ops_left())}; the near-misses "
                         "say why for refused blocks); the model still needs our library")
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
                                  "original_ms": v.original_ms, "optimized_ms": v.optimized_ms, "error": v.error,
                                  "bf16_tolerance": v.bf16_tolerance, "tolerance": v.tolerance,
                                  "precision": v.precision}
        return document

    def write_json(self, path: str | os.PathLike) -> None:
        write_json(self.document(), path)


def optimize_file(source: str | os.PathLike, destination: str | os.PathLike, target: str = "moe", *,
                  verify_backend: str | None = None, sizes: Sequence[Sequence[int]] = DEFAULT_SIZES,
                  threads: int | None = None, progress: Callable[[str], None] | None = None,
                  fuse_routers: bool = True, portable: bool = False, compute: str = "fp32") -> OptimizeResult:
    """Fuse the MoE blocks of the model at ``source`` (``target``, ``fuse_routers``, ``portable`` and
    ``compute`` as in :func:`moe_onnx.optimize`)
    and write it to ``destination`` (with external data when large, see
    :func:`moe_onnx._ir.model_files.save`); then check the written model and, when ``verify_backend`` is
    given, compare both models on that backend at ``sizes`` with ``threads`` intra-op threads
    (:func:`moe_onnx.verify.verify`; with bf16 compute, within the tolerance of its bf16 blocks).
    ``progress`` receives stage messages.

    A ``source`` that is an onnxruntime-genai model folder (one holding ``genai_config.json``) makes
    ``destination`` a folder that onnxruntime-genai runs: the decoder that genai_config.json names, optimized,
    beside copies of the folder's other files and, when the model keeps moe_onnx ops, of our C++ library, which
    genai_config.json then names as the decoder's ``custom_ops_library``
    (:meth:`moe_onnx.genai_folder.GenaiFolder.copy_to`).

    Raises SameFileError when ``destination`` or its data file is a file the input reads (the weights are read from
    them lazily while the output is written); :class:`moe_onnx._ir.model_files.ModelFileError` when ``source`` cannot
    be read or fails ``moe-onnx check`` ("the input model is invalid"), or ``destination`` cannot be written (nothing
    is left there); ValueError for an unknown target.
    """
    say = progress or (lambda message: None)
    paths = job_paths(source, destination)
    model, inferred = load_input(paths, say)
    report = optimize_ir(model, target, progress=progress, fuse_routers=fuse_routers, portable=portable,
                         compute=compute, inferred=inferred)
    written = write_output(model, paths, progress, library=bool(report.our_ops_left()))
    result = OptimizeResult(report, check_model(written))
    if verify_backend is not None:
        say(f"verifying on the {verify_backend} backend at sizes {format_sizes(sizes)}")
        result.verified = verify(paths.source, written, backend=verify_backend, sizes=sizes, threads=threads,
                                 bf16_blocks=report.bf16_blocks)
    return result
