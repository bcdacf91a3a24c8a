"""``moe-onnx export``: a local Hugging Face checkpoint folder (config.json, safetensors, tokenizer files), as it
ships (unquantized, MXFP4 or FP8: :mod:`moe_onnx.export.checkpoint`), becomes an onnxruntime-genai model folder: a
decoder with a KV cache (inputs ``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.%d.key/.value``;
outputs ``logits``, ``present.%d.key/.value``; dynamic batch, sequence and past lengths), fused by the optimize pass
unless asked not to, with ``genai_config.json`` and the tokenizer files beside it.

The decoder is traced once on torch's meta device, without weights; each weight is computed from the checkpoint's
tensors while the model is written, a range of rows at a time (docs/export.md says why and what it costs). torch
and transformers are needed only here (the ``export`` extra); they are imported when an export starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx_ir as ir

from .._ir import model_files
from ..check import check_model
from ..genai_folder import check_checkpoint_config, copy_tokenizer, new_config, write_config
from ..pipeline.optimize import OptimizeResult
from ..rewrite import optimize_ir
from ..rewrite.quantize import (
    LayerReport,
    Quantize,
    QuantizeError,
    QuantizeReport,
    QuantizeSettings,
    keep_stored_mxfp4,
)
from .checkpoint import FORMATS, Checkpoint, CheckpointError, check_routing, quant_method
from .families import FAMILIES, REFUSED, ExportFamily
from .initializers import CheckpointTensor, attach

__all__ = ["DTYPES", "FAMILIES", "DECODER", "ExportError", "ExportFailure", "ExportResult", "export_checkpoint"]

DTYPES = ("fp32", "fp16", "bf16")
DECODER = "model.onnx"


class ExportError(ValueError):
    """A checkpoint or setting ``moe-onnx export`` refuses (exit 2): a family it does not know or does not export
    with a KV cache, a cache of other state than keys and values, an unknown dtype, torch or transformers missing."""


class ExportFailure(RuntimeError):
    """transformers could not load the checkpoint, or torch.onnx could not export it (exit 1)."""


@dataclasses.dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote: the folder, the family, the optimize result (None with
    ``optimize=False``), the checkpoint's tensors transformers leaves unread too (``unused``), the MOE nodes whose
    MXFP4 experts became QMOE as stored (``stored_mxfp4``) and what quantization did (``quantized``, None when
    not asked for)."""

    out_dir: Path
    family: ExportFamily
    optimized: OptimizeResult | None
    unused: list[str] = dataclasses.field(default_factory=list)
    stored_mxfp4: list[LayerReport] = dataclasses.field(default_factory=list)
    quantized: QuantizeReport | None = None

    @property
    def ok(self) -> bool:
        return self.optimized is None or self.optimized.ok

    def summary(self) -> str:
        lines = [f"exported {self.family.model_type} (dynamo exporter, experts {self.family.experts_implementation}) "
                 f"to {self.out_dir}"]
        if self.optimized is not None:
            lines.append(self.optimized.summary())
            if not self.optimized.report.fused_blocks:
                lines.append("no MoE block was fused (the near-misses above say why): the model runs as exported")
        if self.stored_mxfp4:
            lines.append(f"experts: {len(self.stored_mxfp4)} MOE node{'s' if len(self.stored_mxfp4) != 1 else ''} -> "
                         f"QMOE mxfp4, the checkpoint's codes and scales as stored "
                         f"({sum(layer.weight_bytes_after for layer in self.stored_mxfp4):,} bytes)")
        if self.quantized is not None:
            lines.append(self.quantized.summary())
        if self.unused:
            lines.append(f"checkpoint tensors the model does not read (as transformers): {len(self.unused)} "
                         f"({', '.join(self.unused[:3])}{' ...' if len(self.unused) > 3 else ''})")
        return "\n".join(lines)


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "fp32", *,
                      optimize: bool = True, quantize: QuantizeSettings | None = None, last_logits: bool = True,
                      progress: Callable[[str], None] | None = None) -> ExportResult:
    """Export the checkpoint folder ``checkpoint`` at ``dtype`` into the folder ``out_dir`` (created when
    missing): ``model.onnx`` and its external data, ``genai_config.json`` and the tokenizer files. Unless ``optimize``
    is false the decoder is fused as :func:`moe_onnx.pipeline.optimize_file` fuses it, and our C++ library is
    copied into the folder and named in genai_config.json (onnxruntime-genai loads it from there). With
    ``last_logits`` the decoder's logits are the last position's only (what a generator reads).

    Experts stored as MXFP4 (GPT-OSS's checkpoint) become QMOE nodes holding the checkpoint's codes and scales as
    stored; ``quantize`` quantizes the fused model further as :class:`moe_onnx.rewrite.quantize.Quantize` does (the
    other experts to int4/int8, with its ``linears`` the linear layers to MatMulNBits, with its ``embedding`` the
    token embedding to GatherBlockQuantized), each weight quantized from the checkpoint's tensors as it is written.

    The decoder is traced once on torch's meta device (no weights), and each weight is computed from the
    checkpoint's tensors when it is written (:mod:`moe_onnx.export._torch`): the model is never held in memory.

    Raises ExportError for a family :data:`FAMILIES` lacks (with the reason for those :data:`REFUSED` names), a
    checkpoint format it does not read, a checkpoint whose layers cache other state than keys and values, an
    unknown dtype or torch/transformers missing; ModelFileError when the checkpoint's config cannot be read or
    ``out_dir`` cannot be written; OutputPathError when ``out_dir`` is not a folder; ExportFailure when the
    checkpoint's tensors or the trace fail.
    """
    say = progress or (lambda message: None)
    checkpoint = Path(checkpoint)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if quantize is not None:
        if not optimize:
            raise ExportError("quantizing needs the fused model (its MOE nodes): leave out --no-optimize")
        try:
            quantize.check()
        except QuantizeError as error:
            raise ExportError(str(error)) from None
    if not checkpoint.is_dir():
        found = "is not a folder" if checkpoint.exists() else "no such folder"
        raise model_files.ModelFileError(f"{checkpoint}: {found}; expected a Hugging Face checkpoint folder "
                                         "(config.json, safetensors)")
    document = model_files.read_json(checkpoint / "config.json")
    document.string("model_type")
    config = document.data
    generation_path = checkpoint / "generation_config.json"
    generation = model_files.read_json(generation_path) if generation_path.exists() else model_files.JsonObject(
        generation_path, {}, "")
    family = FAMILIES.get(config["model_type"])
    if config["model_type"] in REFUSED:
        raise ExportError(f"{checkpoint}: model_type {config['model_type']!r} is not exported with a KV cache: "
                          f"{REFUSED[config['model_type']]}")
    if family is None:
        raise ExportError(f"{checkpoint}: model_type {config.get('model_type')!r} is not a family moe-onnx export "
                          f"knows (it knows {', '.join(sorted(FAMILIES))})")
    try:
        checkpoint_format = quant_method(config)
    except CheckpointError as error:
        raise ExportError(f"{checkpoint / 'config.json'}: {error}") from None
    if checkpoint_format == "mxfp4" and family.model_type != "gpt_oss":
        raise ExportError(f"{checkpoint}: quantization_config mxfp4 is read for gpt_oss (its experts' blocks and "
                          f"scales), not for model_type {family.model_type!r}")
    with contextlib.ExitStack() as stack:
        tensors = stack.enter_context(Checkpoint(checkpoint, config))
        stack.enter_context(_checkpoint_errors_as_they_are())
        sources = tensors.sources()
        check_checkpoint_config(document, generation)
        check_routing(document)
        try:
            from . import _torch
        except ImportError as error:
            raise ExportError(f"needs torch and transformers ({error}): pip install 'moe-onnx[export]'") from None
        say(f"reading {checkpoint} ({FORMATS[checkpoint_format]}, {tensors.bytes() / 2**30:.2f} GiB)")
        transformers_config = _attempt(f"transformers cannot read {checkpoint / 'config.json'}",
                                       _torch.transformers.AutoConfig.from_pretrained, checkpoint)
        model = _attempt(f"transformers cannot build {family.model_type}", _torch.meta_model, transformers_config,
                         family, dtype)
        _torch.refuse_states(model)
        parameters, unused = _attempt(f"cannot map {checkpoint}'s tensors onto the model", _torch.parameter_sources,
                                      model, sources)
        # once the checkpoint is known to be read exactly; OUT changes only when the export completes
        out = stack.enter_context(model_files.replacing_folder(out_dir))
        say("tracing the decoder with its KV cache on the meta device (dynamo exporter)")
        graph, cache = _attempt(f"torch.onnx cannot export {checkpoint}", _torch.trace_decoder, model, last_logits)
        attach(graph, _torch.PREFIX, parameters, _torch.buffers(model), ExportFailure)
        del model
        say("folding constants (onnxscript optimizer)")
        _fold(graph)
        _tidy(graph, _torch.dim_names([v.name for v in graph.graph.inputs], [v.name for v in graph.graph.outputs],
                                      last_logits))
        genai = new_config(config, generation.data, family.genai_type, DECODER, cache)
        report, stored, quantized = None, [], None
        if optimize:
            say("optimizing the decoder (the fusions of moe-onnx optimize)")
            report = optimize_ir(graph, "moe", progress=progress)
            stored = keep_stored_mxfp4(graph)
        if quantize is not None:
            try:
                quantize_pass = Quantize(quantize, progress)
                quantize_pass(graph)
                quantized = quantize_pass.report
            except QuantizeError as error:
                raise ExportError(f"{checkpoint}: {error}") from None
        say(f"writing {Path(out_dir) / DECODER}")
        model_files.save(graph, out / DECODER, progress=progress, external_data=True)
        del graph
        problems = check_model(out / DECODER)
        copy_tokenizer(checkpoint, out)
        write_config(out, genai, library=report is not None and bool(report.our_ops_left()))
    return ExportResult(Path(out_dir), family, None if report is None else OptimizeResult(report, problems), unused, stored,
                        quantized)


def _fold(model: ir.Model) -> None:
    """What torch.onnx's optimize step does to an export, on the model with its lazy weights: onnxscript's
    optimizer (constant folding, dead code) and its ONNX fusions. A node that reads a checkpoint tensor is never
    folded (at a real size none would be: the folding's size limit is 8192 elements): a weight stays the
    checkpoint's, behind its layout ops, at any size."""
    import onnxscript.optimizer
    import onnxscript.rewriter.onnx_fusions

    def should_fold(node: ir.Node) -> bool | None:
        reads_checkpoint = any(value is not None and isinstance(value.const_value, CheckpointTensor)
                               for value in node.inputs)
        return False if reads_checkpoint else None

    onnxscript.optimizer.optimize_ir(model, should_fold=should_fold)
    onnxscript.rewriter.onnx_fusions.fuse(model)


def _tidy(model: ir.Model, names: dict[str, dict[int, str]]) -> None:
    """Give the graph's inputs' and outputs' symbolic dims the names genai and verify read (the dynamo exporter
    names them after its symbols: s0, s1 + s0, ...), and drop the nodes' doc strings and metadata (the
    exporter's source locations: most of a small model's bytes)."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        node.doc_string = None
        node.metadata_props.clear()
    for value in model.graph.initializers.values():
        value.metadata_props.clear()
    for value in (*model.graph.inputs, *model.graph.outputs):
        if value.shape is None:
            continue
        dims = list(value.shape)
        for axis, name in names.get(value.name, {}).items():
            dims[axis] = ir.SymbolicDim(name)
        value.shape = ir.Shape(dims)


@contextlib.contextmanager
def _checkpoint_errors_as_they_are() -> Iterator[None]:
    """A checkpoint tensor's own error when it is read (a damaged scale, rows of a shape the mapping did not give),
    raised as itself where a pass of onnxscript or onnx_ir that read the tensor wrapped it in its own error."""
    try:
        yield
    except Exception as error:
        cause = error
        while cause is not None and not isinstance(cause, (CheckpointError, ExportError)):
            cause = cause.__cause__
        if cause is None or cause is error:
            raise
        raise cause from None


def _attempt(what: str, function: Callable, *args):
    """``function(*args)``; ExportFailure naming ``what`` and the root cause's type and first line when it fails."""
    try:
        return function(*args)
    except ExportError:
        raise
    except Exception as error:  # noqa: BLE001 - torch and transformers raise anything; the user gets one line
        cause = error
        while cause.__cause__ is not None:
            cause = cause.__cause__
        first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
        raise ExportFailure(f"{what}: {type(cause).__name__}: {first}") from None
