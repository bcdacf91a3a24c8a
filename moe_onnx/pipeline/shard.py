"""``moe-onnx shard`` as a function: one model per rank and the manifest, the model fused first where it has no
fused block."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from .._ir import model_files
from ..check import read_valid
from ..distributed.manifest import MANIFEST_NAME, Manifest, rank_file, source_fingerprint
from ..distributed.shard import ShardError, has_blocks, write_ranks
from .optimize import optimize_file

__all__ = ["shard_file"]


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
