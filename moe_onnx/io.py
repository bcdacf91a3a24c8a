"""Loading and saving models of any size: weights stay on disk until they are written out."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

#: models whose weights exceed this are written with external data (protobuf's limit is 2 GB)
EXTERNAL_DATA_THRESHOLD = 1 << 30


def load(path: str | os.PathLike) -> ir.Model:
    """Read a model; external tensors stay lazy (memory-mapped when read)."""
    return ir.load(path)


def weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def save(model: ir.Model, path: str | os.PathLike, progress: Callable[[str], None] | None = None) -> None:
    """Write a model; with external data (``<name>.data`` beside it) when its weights are large or
    already external. Lazy tensors are computed one at a time as they are written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    external = any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())
    if not external and weight_bytes(model) < EXTERNAL_DATA_THRESHOLD:
        ir.save(model, path)
        return
    step = 0

    def report(tensor, info) -> None:
        nonlocal step
        step += 1
        if progress and (step == info.total or step % max(1, info.total // 20) == 0):
            progress(f"  wrote {step}/{info.total} tensors")

    ir.save(model, path, external_data=f"{path.name}.data", callback=report, max_workers=1)
