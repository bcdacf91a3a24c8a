"""The model families ``moe-onnx export`` knows and how each one exports (no torch here).

One row per transformers ``model_type``: the ``type`` onnxruntime-genai knows the decoder by, transformers 5's
experts implementation the export takes (its default ``grouped_mm`` does not export, models/README.md). Every
family here exports through torch.onnx's dynamo exporter (``torch.export``), which gives a graph the optimize pass
fuses and that matches transformers' generate token for token with the KV cache (tests/test_export_kv.py, the
fixtures under models/fixtures/kv/).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExportFamily:
    """How one model family exports: ``genai_type`` is genai_config.json's ``model.type`` (a decoder-only
    type onnxruntime-genai 0.18 knows)."""

    model_type: str
    genai_type: str
    experts_implementation: str = "batched_mm"


FAMILIES: dict[str, ExportFamily] = {
    family.model_type: family
    for family in (
        ExportFamily("qwen3_moe", genai_type="qwen3"),
        ExportFamily("mixtral", genai_type="mistral"),
        ExportFamily("gpt_oss", genai_type="gptoss"),
    )
}
