"""The model families ``moe-onnx export`` knows and how each one exports (no torch here).

One row per transformers ``model_type``: the ``type`` onnxruntime-genai knows the decoder by, transformers 5's
experts implementation the export takes (its default ``grouped_mm`` does not export, models/README.md). The rows
are the families whose whole models fuse through torch.onnx's dynamo exporter (docs/whole_models.md) and whose
cache is keys and values: each exports with a KV cache and matches transformers' generate token for token
(tests/test_export_kv.py, the fixtures under models/fixtures/kv/). The fusing families it does not export are in
REFUSED with the reason; a checkpoint of a known family whose layers keep other state than keys and values (Mamba,
convolution, linear attention) is refused when it loads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExportFamily:
    """How one model family exports: ``genai_type`` is genai_config.json's ``model.type``, the decoder-only type
    onnxruntime-genai 0.18 knows the family by, else ``llama`` (its plain decoder: genai reads the decoder's inputs
    and outputs from the config, whatever the attention inside)."""

    model_type: str
    genai_type: str = "llama"
    experts_implementation: str = "batched_mm"


#: genai_config.json's model.type of the families onnxruntime-genai 0.18 knows (by their dense relative's name)
_GENAI_TYPES = {"ernie4_5_moe": "ernie4_5", "flex_olmo": "olmo", "gpt_oss": "gptoss", "granitemoe": "granite",
                "granitemoe_swa": "granite", "granitemoehybrid": "granite", "granitemoeshared": "granite",
                "mixtral": "mistral", "olmoe": "olmo", "phimoe": "phimoe", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}
FAMILIES: dict[str, ExportFamily] = {
    model_type: ExportFamily(model_type, _GENAI_TYPES.get(model_type, "llama"))
    for model_type in (
        "afmoe", "aria_text", "axk1", "beam", "cohere2_moe", "deepseek_v3", "dots1", "ernie4_5_moe", "exaone_moe",
        "flex_olmo", "flint", "glm4_moe", "glm4_moe_lite", "gpt_oss", "granitemoe", "granitemoe_swa",
        "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "jetmoe", "kolibri1", "laguna", "lfm2_moe",
        "mellum", "mimo_v2_flash", "minimax", "minimax_m2", "mixtral", "nemotron_h", "olmoe", "phimoe", "qwen2_moe",
        "qwen3_moe", "solar_open",
    )
}

_INDEXED = "its sparse (indexed) attention caches the indexer's keys beside the keys and values"
_LINEAR = "its {} layers cache a recurrent state, not keys and values"
#: families whose whole models fuse through the dynamo exporter (docs/whole_models.md) that export refuses, and why
REFUSED: dict[str, str] = {
    "axk2": _INDEXED,
    "bailing_hybrid": _LINEAR.format("linear-attention"),
    "deepseek_v32": _INDEXED,
    "dots3_note_text": _INDEXED,
    "glm_moe_dsa": _INDEXED,
    "inkling_text": _LINEAR.format("hybrid (linear and sliding-window attention)"),
    "jamba": _LINEAR.format("Mamba"),
    "kimi_linear": _LINEAR.format("linear-attention"),
    "qwen3_5_moe_text": _LINEAR.format("linear-attention"),
    "qwen3_next": _LINEAR.format("linear-attention"),
}
