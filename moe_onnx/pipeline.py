"""``moe-onnx optimize``, ``moe-onnx quantize`` and ``moe-onnx shard`` as functions: read a model file, fuse
its MoE blocks (or quantize its MOE nodes), write the result, check it and verify it against the original
(optimize: on request; quantize: the error against the fp32 model); or write one model per rank, fusing
the model first where it has no fused block."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from shutil import SameFileError

import onnx
import onnx_ir as ir

from ._ir import model_files
from .check import check_model, read_valid, require_valid
from .distributed.manifest import MANIFEST_NAME, Manifest, rank_file, source_fingerprint
from .distributed.shard import ShardError, has_blocks, write_ranks
from .genai_folder import GenaiFolder, is_genai_folder
from .ops import DOMAIN
from .quantization import QuantizeReport, QuantizeSettings, measure_error, quantize_ir
from .rewrite import OptimizeReport, optimize_ir
from .verify import DEFAULT_SIZES, VerifyResult, format_sizes, verify

__all__ = ["OptimizeResult", "QuantizeResult", "SameFileError", "optimize_file", "quantize_file", "shard_file"]


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
        _write_json(self.document(), path)


def _write_json(document: dict, path: str | os.PathLike) -> None:
    """Write ``document`` to ``path`` through :func:`moe_onnx._ir.model_files.replacing`."""
    with model_files.replacing(path) as staged:
        staged.write_text(json.dumps(document, indent=2))


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

    Raises SameFileError when ``destination`` or its data file is a file the input reads (the
    weights are read from them lazily while the output is written);
    :class:`moe_onnx._ir.model_files.ModelFileError` when ``source`` cannot be read or fails ``moe-onnx check`` ("the input model is invalid"), or
    ``destination`` cannot be written (nothing is left there); ValueError for an unknown target.
    """
    say = progress or (lambda message: None)
    genai = GenaiFolder(source) if is_genai_folder(source) else None
    if genai is not None:
        genai_destination = Path(destination)
        source, destination = genai.decoder_path, genai_destination / genai.decoder_path.name
    model = _load_input(source, destination, say)
    if genai is not None:  # once the input is known to be valid
        model_files.output_directory(genai_destination)
    report = optimize_ir(model, target, progress=progress, fuse_routers=fuse_routers, portable=portable,
                         compute=compute)
    say(f"saving {destination}")
    written = _save(model, destination, progress)
    if genai is not None:
        say(f"copying the rest of the onnxruntime-genai folder {genai.folder}")
        genai.copy_to(genai_destination, destination, library=bool(report.our_ops_left()))
    result = OptimizeResult(report, check_model(written))
    if verify_backend is not None:
        say(f"verifying on the {verify_backend} backend at sizes {format_sizes(sizes)}")
        result.verified = verify(source, written, backend=verify_backend, sizes=sizes, threads=threads,
                                 bf16_blocks=report.bf16_blocks)
    return result


@dataclasses.dataclass
class QuantizeResult:
    """What :func:`quantize_file` did: the report (with the measured error) and the problems: those
    ``moe-onnx check`` finds in the written model, or why the error could not be measured."""

    report: QuantizeReport
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        lines = [self.report.summary()]
        if self.problems:
            lines.append("problems with the quantized model:")
            lines += [f"  {problem}" for problem in self.problems]
        return "\n".join(lines)

    def document(self) -> dict:
        return {**self.report.document(), "problems": self.problems}

    def write_json(self, path: str | os.PathLike) -> None:
        _write_json(self.document(), path)


def quantize_file(source: str | os.PathLike, destination: str | os.PathLike, settings: QuantizeSettings, *,
                  measure: bool = True, backend: str = "cpp", sizes: Sequence[Sequence[int]] = DEFAULT_SIZES,
                  seed: int = 0, progress: Callable[[str], None] | None = None) -> QuantizeResult:
    """Quantize the MOE nodes of the fused model at ``source`` into QMOE nodes (with ``settings.linears``, its
    other linear layers into MatMulNBits; see :func:`moe_onnx.quantization.quantize_ir`) and write it to ``destination`` (the quantized weights
    are computed one expert at a time while writing; external data when large); then check it and,
    with ``measure``, run both models on ``backend`` on random inputs (seeded by ``seed``) at
    ``sizes`` and put the error of every output and every quantized layer in the report.

    A ``source`` that is an onnxruntime-genai model folder makes ``destination`` a complete one, as
    :func:`optimize_file` does: its decoder quantized, the folder's other files copied, our library copied and
    named in genai_config.json.

    Raises what :func:`optimize_file` raises for the files, and
    :class:`moe_onnx.quantization.QuantizeError` for bad settings or a model with nothing to quantize
    (nothing is written then).
    """
    settings.check()
    say = progress or (lambda message: None)
    genai = GenaiFolder(source) if is_genai_folder(source) else None
    if genai is not None:
        genai_destination = Path(destination)
        source, destination = genai.decoder_path, genai_destination / genai.decoder_path.name
    model = _load_input(source, destination, say)
    if genai is not None:
        model_files.output_directory(genai_destination)
    report = quantize_ir(model, settings, progress=progress)
    say(f"saving {destination}")
    written = _save(model, destination, progress)
    if genai is not None:
        say(f"copying the rest of the onnxruntime-genai folder {genai.folder}")
        genai.copy_to(genai_destination, destination, library=_has_our_ops(model))
    result = QuantizeResult(report, check_model(written))
    if measure and not result.problems:
        say(f"measuring the error on the {backend} backend at sizes {format_sizes(sizes)}")
        try:
            report.error = measure_error(source, written, report.layers, linears=report.linears, backend=backend,
                                         sizes=sizes, seed=seed)
        except Exception as error:  # noqa: BLE001 -- onnxruntime's errors share no base class
            text = str(error).strip()
            result.problems.append(f"the error could not be measured on the {backend} backend: "
                                   f"{text.splitlines()[0] if text else type(error).__name__}")
    return result


def shard_file(source: str | os.PathLike, out_dir: str | os.PathLike, tp: int, ep: int = 1,
               progress: Callable[[str], None] | None = None) -> Manifest:
    """Write the ``tp * ep`` rank models of the model at ``source`` as ``out_dir/rank<g>.onnx``
    (:func:`moe_onnx.distributed.shard.write_ranks`) and ``out_dir/shard.json``
    (:class:`~moe_onnx.distributed.manifest.Manifest`); returns the manifest. A model without fused MoE
    blocks is optimized first (target moe, :func:`optimize_file`), once, into a temporary file in
    ``out_dir``. Raises :class:`moe_onnx.distributed.shard.ShardError` (see
    :func:`moe_onnx.distributed.shard.shard_ir`; no rank file is written then) and
    :class:`moe_onnx._ir.model_files.ModelFileError` for a file that cannot be read or written, or an input
    ``moe-onnx check`` finds invalid (:func:`moe_onnx.check.read_valid`)
    (:class:`~moe_onnx._ir.model_files.OutputPathError`, before anything is written, for an ``out_dir`` that is
    not a directory or a rank file that is not a regular file)."""
    say = progress or (lambda message: None)
    if tp < 1 or ep < 1:
        raise ShardError(f"tp = {tp}, ep = {ep}: both must be >= 1")
    say(f"loading and checking {source}")
    proto = read_valid(source)
    fingerprint = source_fingerprint(source)
    out_dir = model_files.output_directory(out_dir)
    for rank in range(tp * ep):  # refuse a rank file that is not a regular file before writing any
        model_files.model_output_files(out_dir / rank_file(rank))
    model_files.output_file(out_dir / MANIFEST_NAME)
    with tempfile.TemporaryDirectory(prefix=".fused.", dir=out_dir) as staging:
        fused = source
        if not has_blocks(proto.graph.node):
            fused = Path(staging) / "fused.onnx"
            say("no fused MoE block: optimizing first (target moe)")
            optimize_file(source, fused, "moe", progress=progress)
            proto = model_files.read_proto(fused)
        manifest = write_ranks(fused, proto, out_dir, tp, ep, source_name=str(Path(source).name),
                               fingerprint=fingerprint, progress=progress)
    manifest.write(out_dir)
    return manifest


def _has_our_ops(model: ir.Model) -> bool:
    return any(node.domain == DOMAIN for node in ir.traversal.RecursiveGraphIterator(model.graph))


def _save(model: ir.Model, destination: str | os.PathLike, progress: Callable[[str], None] | None) -> Path:
    """Save ``model`` to ``destination`` (:func:`moe_onnx._ir.model_files.save`); returns the file written (the
    target of a symbolic link: its external data, named after it, lies beside it)."""
    model_files.save(model, destination, progress=progress)
    return model_files.output_file(destination)


def _load_input(source: str | os.PathLike, destination: str | os.PathLike, say: Callable[[str], None]) -> ir.Model:
    """The valid model at ``source``, its weights left on disk, once it is sure writing ``destination``
    does not overwrite a file it reads."""
    say(f"loading {source}")
    proto = model_files.read_proto(source)
    _refuse_overwriting_input(source, destination, proto)
    say(f"checking {source}")
    require_valid(source, proto)
    return model_files.load(source, proto)


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
