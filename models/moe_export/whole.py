"""Tiny random-weight whole causal LMs of every MoE family, exported input_ids -> logits.

One generic tiny configuration (GENERIC_CONFIG: only the keys a family's config knows are passed) plus
one table of family quirks (FAMILIES); nothing is downloaded. See models/README.md ("Whole models").
"""

from __future__ import annotations

import json
import math
import re
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
import transformers

from . import blocks, patches
from .fixtures import sha256

OPSET = 18
VOCAB = 128
HIDDEN = 32
EXPERT_INTERMEDIATE = 24  # != HIDDEN and 2 * I != HIDDEN: no layout is ambiguous
REFERENCE_SHAPE = (2, 5)
ALTERNATE_SHAPE = (1, 7)
TRACE_SHAPE = (2, 32)  # enough tokens that a traced per-expert loop sees every expert of every layer
EXPERTS = 4
TOP_K = 2

# Keys of a family's config set when its default config has them (unknown keys are never passed).
GENERIC_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=48,  # dense MLPs (and experts of families that have a single intermediate size)
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,  # multi-head latent attention (DeepSeek-style) needs as many as query heads
    head_dim=8,
    max_position_embeddings=256,
    use_cache=False,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    # experts and routing
    num_experts=EXPERTS,
    num_local_experts=EXPERTS,
    n_routed_experts=EXPERTS,
    moe_num_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    num_experts_per_token=TOP_K,
    moe_topk=TOP_K,
    moe_k=TOP_K,
    top_k_experts=TOP_K,
    moe_intermediate_size=EXPERT_INTERMEDIATE,
    expert_ffn_hidden_size=EXPERT_INTERMEDIATE,
    n_shared_experts=1,
    num_shared_experts=1,
    moe_num_shared_experts=1,
    shared_expert_intermediate_size=EXPERT_INTERMEDIATE,
    moe_shared_expert_intermediate_size=EXPERT_INTERMEDIATE,
    n_group=1,
    topk_group=1,
    num_expert_group=1,
    # every layer a MoE layer
    first_k_dense_replace=0,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    moe_layer_freq=1,
    moe_layer_start_index=0,
    moe_layer_interval=1,
    interleave_moe_layer_step=1,
    num_dense_layers=0,
    mlp_layer_types=["sparse", "sparse"],
    # multi-head latent attention (DeepSeek-style)
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    # state-space / linear-attention layers
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_head_dim=16,
    mamba_d_state=8,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    ssm_state_size=8,
    n_groups=1,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)


@dataclass(frozen=True)
class Family:
    """A family's whole-model recipe: its text model_type, config overrides on GENERIC_CONFIG and notes."""

    model_type: str
    overrides: dict = field(default_factory=dict)
    note: str = ""


# Family quirks, one row each; everything else comes from GENERIC_CONFIG.
_GROUPED = dict(num_experts=8, n_routed_experts=8, n_group=4, topk_group=2)  # group-limited top-k, E = 8
FAMILIES: dict[str, Family] = {
    "afmoe": Family("afmoe", dict(num_dense_layers=0, layer_types=["full_attention"] * 2)),
    "aria_text": Family("aria_text", note="the text model of Aria (aria itself is image-text only)"),
    "axk1": Family("axk1", _GROUPED),
    "axk2": Family("axk2", _GROUPED),
    "bailing_hybrid": Family("bailing_hybrid", dict(num_expert_group=1, first_k_dense_replace=0)),
    "beam": Family("beam"),
    "cohere2_moe": Family("cohere2_moe"),
    "dbrx": Family(
        "dbrx",
        dict(d_model=HIDDEN, n_heads=4, n_layers=2, max_seq_len=256,
             attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
             ffn_config=dict(ffn_hidden_size=EXPERT_INTERMEDIATE, moe_num_experts=EXPERTS, moe_top_k=TOP_K)),
    ),
    "deepseek_v2": Family("deepseek_v2", dict(topk_method="greedy")),
    "deepseek_v3": Family("deepseek_v3", _GROUPED, "sigmoid + e_score_correction_bias, n_group 4 / topk_group 2"),
    "deepseek_v32": Family("deepseek_v32", _GROUPED),
    "deepseek_v4": Family("deepseek_v4", dict(_GROUPED, mlp_layer_types=["moe", "moe"])),
    "dots1": Family("dots1", _GROUPED),
    "dots3_note_text": Family("dots3_note_text", _GROUPED),
    "ernie4_5_moe": Family("ernie4_5_moe"),
    "exaone_moe": Family("exaone_moe"),
    "flex_olmo": Family("flex_olmo"),
    "flint": Family("flint"),
    "gemma4_text": Family("gemma4_text", dict(enable_moe_block=True)),
    "glm4_moe": Family("glm4_moe", _GROUPED),
    "glm4_moe_lite": Family("glm4_moe_lite", _GROUPED),
    "glm_moe_dsa": Family("glm_moe_dsa", _GROUPED),
    "gpt_oss": Family("gpt_oss", dict(layer_types=["full_attention"] * 2)),
    "granitemoe": Family("granitemoe"),
    "granitemoe_swa": Family("granitemoe_swa"),
    "granitemoehybrid": Family("granitemoehybrid", dict(layer_types=["mamba", "attention"])),
    "granitemoeshared": Family("granitemoeshared"),
    "hunyuan_v1_moe": Family("hunyuan_v1_moe"),
    "hy_v3": Family("hy_v3"),
    "hy_v4": Family("hy_v4", _GROUPED),
    "inkling_text": Family("inkling_text"),
    "inkling2_text": Family("inkling2_text"),
    "jamba": Family("jamba", dict(expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2,
                                  attn_layer_offset=1, use_mamba_kernels=False)),
    "jetmoe": Family("jetmoe", dict(kv_channels=8, num_key_value_heads=2)),
    "kimi_linear": Family("kimi_linear"),
    "kolibri1": Family("kolibri1"),
    "laguna": Family("laguna"),
    "lfm2_moe": Family("lfm2_moe", dict(num_dense_layers=0, layer_types=["conv", "full_attention"])),
    "llama4_text": Family("llama4_text", dict(interleave_moe_layer_step=1, intermediate_size=EXPERT_INTERMEDIATE,
                                             intermediate_size_mlp=48)),
    "longcat_flash": Family("longcat_flash", dict(zero_expert_num=2, num_layers=1)),
    "mellum": Family("mellum"),
    "mimo_v2_flash": Family("mimo_v2_flash", dict(num_key_value_heads=2), "sliding-window layers double the kv heads"),
    "minimax": Family("minimax", dict(layer_types=["full_attention"] * 2)),
    "minimax_m2": Family("minimax_m2"),
    "minimax_m3_vl_text": Family("minimax_m3_vl_text"),
    "mixtral": Family("mixtral"),
    "nemotron_h": Family("nemotron_h", dict(hybrid_override_pattern="E*", layers_block_type=["moe", "attention"])),
    "olmoe": Family("olmoe"),
    "phimoe": Family("phimoe"),
    "qwen2_moe": Family("qwen2_moe"),
    "qwen3_5_moe_text": Family("qwen3_5_moe_text", dict(layer_types=["linear_attention", "full_attention"])),
    "qwen3_moe": Family("qwen3_moe"),
    "qwen3_next": Family("qwen3_next", dict(layer_types=["linear_attention", "full_attention"])),
    "qwen4_exp_text": Family("qwen4_exp_text", dict(
        layer_types=["linear_attention", "full_attention"], indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2)),
    "solar_open": Family("solar_open"),
    "zaya": Family("zaya", dict(num_experts_per_tok=1), "ZAYA supports top-1 routing only"),
}  # fmt: skip

# MoE model types found in transformers that have no causal-LM whole model here, and why.
SKIPPED = {
    "aria": "image-text model; its text model is exported as aria_text",
    "llama4": "image-text model; its text model is exported as llama4_text",
    "qwen3_5_moe": "image-text model; its text model is exported as qwen3_5_moe_text",
    "qwen4_exp": "image-text model; its text model is exported as qwen4_exp_text",
    "dots3_note": "image-text model; its text model is exported as dots3_note_text",
    "gemma4": "image-text model; its text model is exported as gemma4_text",
    "gptsan-japanese": "not a causal LM in AutoModelForCausalLM",
    "nllb-moe": "encoder-decoder translation model",
    "switch_transformers": "encoder-decoder model",
    "vitpose": "vision model",
    "vitpose_backbone": "vision model",
    "doge": "cross-domain MoE: single-neuron experts retrieved by product keys from embedding tables, "
    "no expert MLPs for a MoE op",
    "openai_privacy_filter": "token-classification model, no causal LM",
}
_MULTIMODAL_ONLY = "no AutoModelForCausalLM for this model type (multimodal parts, or not wired as a causal LM)"

_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k_experts", "moe_top_k")


def transformers_tag() -> str:
    return "tf457" if blocks.transformers_major() == 4 else "tf5"


def export_stem(family: str, exporter: str, tag: str | None = None) -> str:
    return f"{family}__{tag or transformers_tag()}__{exporter}"


def discover_moe_model_types() -> dict[str, str]:
    """Every model type of the installed transformers whose config has a top-k-experts key -> what happens to it."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = {}
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        try:
            keys = _flat_keys(AutoConfig.for_model(model_type).to_dict())
        except Exception:  # noqa: BLE001 - configs that cannot be built without arguments are not MoE configs here
            continue
        if not any(key in _TOPK_KEYS or "expert" in key for key in keys):
            continue
        if model_type in FAMILIES:
            found[model_type] = "exported"
        elif model_type in SKIPPED:
            found[model_type] = SKIPPED[model_type]
        elif model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            found[model_type] = _MULTIMODAL_ONLY
        else:
            found[model_type] = "NOT IN moe_export/whole.py FAMILIES"
    return found


def _flat_keys(config: dict) -> set[str]:
    keys = set()
    for key, value in config.items():
        keys.add(str(key))
        if isinstance(value, dict):
            keys |= _flat_keys(value)
    return keys


def tiny_config(family: str, changes: dict | None = None):
    """The family's config: GENERIC_CONFIG keys that its default config has, then the family's overrides, then
    ``changes``."""
    from transformers import AutoConfig

    recipe = FAMILIES[family]
    defaults = AutoConfig.for_model(recipe.model_type).to_dict()
    kwargs = {key: value for key, value in GENERIC_CONFIG.items() if key in defaults}
    kwargs.update(recipe.overrides)
    kwargs.update(changes or {})
    config = AutoConfig.for_model(recipe.model_type, **kwargs)
    config._attn_implementation = "eager"
    return config


def _randomize(model: torch.nn.Module) -> None:
    """Weights N(0, 1/fan_in) so activations stay O(1); embeddings N(0, 1); biases N(0, 0.1^2).

    Expert tensors [E, a, b] hold [in, out] or [out, in]; their fan-in is the smaller of a and b, which
    is H for gate/up and I for down here (I < H < 2I). Other 1-D parameters (norms, SSM constants) keep
    their initialisation.
    """
    for name, param in model.named_parameters():
        if param.dim() == 1:
            if name.endswith("bias"):
                torch.nn.init.normal_(param, std=0.1)
            continue
        if "embed" in name or name.startswith("transformer.wte"):
            torch.nn.init.normal_(param, std=1.0)
            continue
        if param.dim() == 3 and "conv" not in name:
            fan_in = min(param.shape[1], param.shape[2])
        else:
            fan_in = param[0].numel()
        torch.nn.init.normal_(param, std=1.0 / math.sqrt(fan_in))


_ROUTED_EXPERTS = re.compile(r"(^|\.)experts$")


def moe_layers(model: torch.nn.Module) -> list[int]:
    """Indices of the decoder layers that hold routed experts (a module named `experts` or `*Experts`)."""
    layer_lists = [
        module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "blocks", "h")
    ]
    if not layer_lists:
        raise RuntimeError("no decoder layer list found")
    found = []
    for index, layer in enumerate(layer_lists[0]):
        for name, module in layer.named_modules():
            in_attention = "attn" in name or "attention" in name
            if not in_attention and (_ROUTED_EXPERTS.search(name) or type(module).__name__.endswith("Experts")):
                found.append(index)
                break
    return found


class LogitsOnly(torch.nn.Module):
    """(input_ids[, attention_mask]) -> logits of a causal LM, no cache."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def build_model(family: str, seed: int = 0, experts_implementation: str | None = None):
    """The family's tiny causal LM with seeded random weights, in eval mode, wrapped to return logits."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    kwargs = {"experts_implementation": experts_implementation} if experts_implementation else {}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    _randomize(model)
    return LogitsOnly(model.eval()).eval(), config


class _RoutingRecorder:
    """Records the expert indices of every top-k over E scores while active (torch.topk and Tensor.topk)."""

    def __init__(self, experts: int, top_k: int):
        self.experts, self.top_k, self.calls = experts, top_k, []

    def __enter__(self):
        self._function, self._method = torch.topk, torch.Tensor.topk
        recorder = self

        def recording(function):
            def topk(input, k, *args, **kwargs):
                result = function(input, k, *args, **kwargs)
                if k == recorder.top_k and input.shape[-1] == recorder.experts:
                    recorder.calls.append(frozenset(result[1].flatten().tolist()))
                return result

            return topk

        torch.topk, torch.Tensor.topk = recording(self._function), recording(self._method)
        return self

    def __exit__(self, *exc):
        torch.topk, torch.Tensor.topk = self._function, self._method


def _experts_and_top_k(config) -> tuple[int, int]:
    settings = config.to_dict()
    settings.update(settings.get("ffn_config") or {})
    experts = next(settings[key] for key in ("num_experts", "num_local_experts", "n_routed_experts",
                                             "moe_num_experts") if settings.get(key))  # fmt: skip
    top_k = next(settings[key] for key in _TOPK_KEYS if settings.get(key))
    return experts, top_k


def _input_ids(shape, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, shape, generator=generator)


def _covering_input(model, config, shape, first_seed: int) -> tuple[torch.Tensor, bool]:
    """Random input_ids that route tokens to every expert in every routed layer, if 200 tries find one.

    Traced per-expert loops (TorchScript) keep only the experts hit while tracing, so the trace and the
    reference inputs must reach all of them for the export to be valid on them.
    """
    experts, top_k = _experts_and_top_k(config)
    for seed in range(first_seed, first_seed + 200):
        candidate = _input_ids(shape, seed)
        with _RoutingRecorder(experts, top_k) as recorder, torch.no_grad():
            model(candidate)
        if recorder.calls and all(len(hit) == experts for hit in recorder.calls):
            return candidate, True
    return _input_ids(shape, first_seed), False


def _export(model, trace_input, path: Path, dynamo: bool) -> None:
    """dynamo: input_ids -> logits. TorchScript: (input_ids, attention_mask) -> logits, as optimum exports:
    without a mask, transformers 4.57 derives a packed-sequence mask from position ids, which it cannot trace."""
    common = dict(opset_version=OPSET, output_names=["logits"])
    if dynamo:
        common["input_names"] = ["input_ids"]
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
        torch.onnx.export(
            model, (trace_input,), str(path), dynamo=True, external_data=False, verbose=False,
            dynamic_shapes={"input_ids": {0: batch, 1: seq}}, **common,
        )  # fmt: skip
    else:
        axes = {0: "batch", 1: "seq"}
        with patches.masks_without_vmap():
            torch.onnx.export(
                model, (trace_input, torch.ones_like(trace_input)), str(path), dynamo=False,
                input_names=["input_ids", "attention_mask"],
                dynamic_axes={"input_ids": axes, "attention_mask": axes, "logits": axes}, **common,
            )  # fmt: skip


def export_whole(family: str, exporter: str, out_dir: Path, seed: int = 0, experts_implementation: str | None = None,
                 stem: str | None = None) -> dict:
    """Build and export one whole model to <stem>.onnx and <stem>.npz; returns its record.

    transformers 5 models use experts_implementation "batched_mm" unless told otherwise (its default,
    "grouped_mm", does not export: see models/README.md); 4.57 has no experts implementations.
    """
    stem = stem or export_stem(family, exporter)
    implementation = experts_implementation or ("batched_mm" if blocks.transformers_major() >= 5 else None)
    model, config = build_model(family, seed, implementation)
    trace, traced_all = _covering_input(model, config, TRACE_SHAPE, seed + 1000)
    reference, reference_all = _covering_input(model, config, REFERENCE_SHAPE, seed + 2000)
    alternate, alternate_all = _covering_input(model, config, ALTERNATE_SHAPE, seed + 3000)
    path = out_dir / f"{stem}.onnx"
    out_dir.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _export(model, trace, path, dynamo=exporter == "dynamo")
    with torch.no_grad():
        expected, expected_alt = model(reference).numpy(), model(alternate).numpy()
    np.savez(
        path.with_suffix(".npz"),
        input_ids=reference.numpy(), expected=expected, input_ids_alt=alternate.numpy(), expected_alt=expected_alt,
    )  # fmt: skip
    experts, top_k = _experts_and_top_k(config)
    layers = moe_layers(model.model)
    return dict(
        kind="whole",
        file=path.name,
        reference=path.with_suffix(".npz").name,
        family=family,
        model_type=FAMILIES[family].model_type,
        model_class=type(model.model).__name__,
        exporter="dynamo" if exporter == "dynamo" else "torchscript",
        experts_implementation=implementation,
        opset=OPSET,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
        hidden_size=HIDDEN,
        num_experts=experts,
        top_k=top_k,
        num_layers=config.num_hidden_layers if hasattr(config, "num_hidden_layers") else None,
        moe_layers=len(layers),
        moe_layer_indices=layers,
        trace_shape=list(TRACE_SHAPE),
        inputs_reach_every_expert=traced_all and reference_all and alternate_all,
        inputs=[value.name for value in onnx.load(str(path), load_external_data=False).graph.input],
        bytes=path.stat().st_size,
        sha256=sha256(path),
        note=FAMILIES[family].note or None,
    )


def export_and_record(family: str, exporter: str, out_dir: Path, seed: int = 0) -> dict:
    """export_whole, recording a failure (its last error line and traceback) instead of raising."""
    try:
        record = dict(status="ok", **export_whole(family, exporter, out_dir, seed))
    except Exception as error:  # noqa: BLE001 - every failure is a survey result
        return record_failure(out_dir, family, exporter, _summary(error), traceback.format_exc())
    (out_dir / f"{export_stem(family, exporter)}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


_TRANSFORMERS_FRAME = re.compile(r'transformers/(?:models/\w+/)?(\w+\.py)", line (\d+)')


def _summary(error: BaseException) -> str:
    """The root cause's type and first message line, and the last transformers source line involved."""
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    text = f"{type(cause).__name__}: {lines[0] if lines else ''}"
    frames = _TRANSFORMERS_FRAME.findall("".join(traceback.format_exception(error)))
    if frames:
        return f"{text} (at {frames[-1][0]}:{frames[-1][1]})"
    last = traceback.extract_tb(cause.__traceback__)[-1:] if cause.__traceback__ else []
    return text + "".join(f" (in {Path(frame.filename).name} {frame.name})" for frame in last)


def record_failure(out_dir: Path, family: str, exporter: str, message: str, details: str = "") -> dict:
    """Write the failed export's record (and remove any partial output)."""
    stem = export_stem(family, exporter)
    for leftover in (out_dir / f"{stem}.onnx", out_dir / f"{stem}.npz"):
        leftover.unlink(missing_ok=True)
    record = dict(
        status="failed", family=family, exporter=exporter, transformers_version=transformers.__version__,
        error=message[:300], traceback=details,
    )  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def installed_families() -> list[str]:
    """The FAMILIES whose model type the installed transformers has."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return [family for family, recipe in FAMILIES.items() if recipe.model_type in CONFIG_MAPPING_NAMES]


def load_records(directory: Path) -> dict[str, dict]:
    """Every <stem>.json export record in a directory, by stem."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(directory.glob("*__*__*.json"))}


def write_index(directory: Path) -> None:
    """INDEX.md: one line per attempted export, the file or why it failed."""
    lines = ["# Whole-model exports", "", "| export | result |", "|---|---|"]
    for stem, record in load_records(directory).items():
        if record["status"] == "ok":
            result = f"`{record['file']}` ({record['bytes'] // 1024} KB, {record['moe_layers']} MoE layers)"
        else:
            result = "FAILED: " + record["error"].replace("|", "\\|")
        lines.append(f"| {stem} | {result} |")
    temporary = directory / "INDEX.md.tmp"
    temporary.write_text("\n".join(lines) + "\n")
    temporary.replace(directory / "INDEX.md")
