"""Random-weight MoE blocks built from transformers' own config and module classes (nothing downloaded)."""

from __future__ import annotations

import importlib
import math
import types

import torch
import transformers

from . import patches
from .specs import ROUTED_SCALING_FACTOR, BlockSpec

# family -> (modeling module, config class, sparse MoE block class)
_CLASSES = {
    "gpt_oss": ("gpt_oss", "GptOssConfig", "GptOssMLP"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock"),
    "mixtral": ("mixtral", "MixtralConfig", "MixtralSparseMoeBlock"),
    "olmoe": ("olmoe", "OlmoeConfig", "OlmoeSparseMoeBlock"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE"),
    "granitemoe": ("granitemoe", "GraniteMoeConfig", "GraniteMoeMoE"),
    "jetmoe": ("jetmoe", "JetMoeConfig", "JetMoeMoE"),
    "nemotron_h": ("nemotron_h", "NemotronHConfig", "NemotronHMoE"),
    "aria_text": ("aria", "AriaTextConfig", "AriaTextMoELayer"),
    "phimoe": ("phimoe", "PhimoeConfig", "PhimoeSparseMoeBlock"),
}

REFERENCE_INPUT_STD = 3.0  # large enough that GPT-OSS's clamp at 7 is reached by a few percent of activations


def transformers_major() -> int:
    return int(transformers.__version__.split(".")[0])


def _config_kwargs(spec: BlockSpec) -> dict:
    common = dict(
        hidden_size=spec.hidden,
        num_experts_per_tok=spec.topk,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
    )
    if spec.family in ("gpt_oss", "granitemoe", "phimoe"):
        return dict(common, intermediate_size=spec.intermediate, num_local_experts=spec.experts)
    if spec.family == "jetmoe":  # its attention is sized by kv_channels
        common.pop("num_key_value_heads")
        return dict(common, intermediate_size=spec.intermediate, num_local_experts=spec.experts, kv_channels=8)
    if spec.family == "aria_text":
        return dict(common, intermediate_size=spec.intermediate, moe_num_experts=spec.experts, moe_topk=spec.topk,
                    moe_num_shared_experts=spec.shared_intermediate // spec.intermediate)
    if spec.family == "mixtral":
        return dict(common, intermediate_size=spec.intermediate, num_local_experts=spec.experts)
    if spec.family == "olmoe":
        return dict(common, intermediate_size=spec.intermediate, num_experts=spec.experts, norm_topk_prob=False)
    if spec.family == "qwen3_moe":
        return dict(common, moe_intermediate_size=spec.intermediate, num_experts=spec.experts, norm_topk_prob=True)
    if spec.family == "qwen2_moe":
        return dict(
            common,
            moe_intermediate_size=spec.intermediate,
            shared_expert_intermediate_size=spec.shared_intermediate,
            num_experts=spec.experts,
            norm_topk_prob=False,
        )
    if spec.family == "deepseek_v3":  # groups of two experts, half the groups allowed
        groups = spec.experts // 2
        return dict(
            common,
            moe_intermediate_size=spec.intermediate,
            n_routed_experts=spec.experts,
            n_shared_experts=spec.shared_intermediate // spec.intermediate,
            n_group=groups,
            topk_group=max(1, groups // 2),
            norm_topk_prob=True,
            routed_scaling_factor=ROUTED_SCALING_FACTOR,
            first_k_dense_replace=0,
        )
    if spec.family == "nemotron_h":  # one MoE layer (no Mamba or attention layer is built)
        return dict(
            {key: value for key, value in common.items() if key != "num_hidden_layers"},
            layers_block_type=["moe"],
            head_dim=8,
            moe_intermediate_size=spec.intermediate,
            moe_shared_expert_intermediate_size=spec.shared_intermediate,
            n_routed_experts=spec.experts,
            n_group=1,
            topk_group=1,
        )
    raise ValueError(f"unknown family {spec.family!r}")


def _experts_implementation(style: str) -> str | None:
    if style in ("batched_mm", "batched_mm_transposed", "sparsemixer_batched_mm", "batched_mm_torchscript"):
        return "batched_mm"
    if style == "tiled3":
        patches.register_tiled_experts()
        return patches.TILED_EXPERTS_IMPLEMENTATION
    return None  # transformers 4.57 has no experts implementations


def _randomize(block: torch.nn.Module, spec: BlockSpec) -> None:
    """Fill every parameter: weights N(0, 1/fan_in) scaled so activations stay O(1), biases N(0, 0.1^2)
    (DeepSeek-V3's expert selection bias, a buffer, too)."""
    if spec.family == "deepseek_v3":
        torch.nn.init.normal_(block.gate.e_score_correction_bias, std=0.1)
    for name, param in block.named_parameters():
        if param.dim() == 1 or name.endswith("_bias"):
            torch.nn.init.normal_(param, std=0.1)
            continue
        if param.dim() == 2:  # nn.Linear / router weight [out, in]
            fan_in = param.shape[1]
        elif "down" in name or "output_linear" in name:
            fan_in = spec.intermediate
        else:
            fan_in = spec.hidden
        torch.nn.init.normal_(param, std=1.0 / math.sqrt(fan_in))
    for name, buffer in block.named_buffers():
        if name.endswith("e_score_correction_bias"):  # a router's selection-only bias (Nemotron-H)
            torch.nn.init.normal_(buffer, std=0.1)


def build_block(spec: BlockSpec, seed: int = 0) -> torch.nn.Module:
    """The family's sparse MoE module with random weights, patched for the requested export style."""
    if transformers_major() != spec.transformers_major:
        raise RuntimeError(
            f"style {spec.style!r} is exported with transformers {spec.transformers_major}.x, "
            f"this environment has {transformers.__version__}"
        )
    module_name, config_name, block_name = _CLASSES[spec.family]
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    config_class = getattr(transformers, config_name)
    config = config_class(**_config_kwargs(spec))
    implementation = _experts_implementation(spec.style)
    if implementation is not None:
        config._experts_implementation = implementation

    torch.manual_seed(seed)
    block = getattr(modeling, block_name)(config)
    _randomize(block, spec)
    if spec.style in ("tiled", "tiled_dynamo"):
        block.experts.forward = types.MethodType(patches.gpt_oss_tiled_experts_forward, block.experts)
    return block.eval()


def router_choices(block: torch.nn.Module, spec: BlockSpec, hidden_states: torch.Tensor) -> torch.Tensor:
    """The [T, k] expert indices the block's router picks for these tokens."""
    tokens = hidden_states.reshape(-1, spec.hidden)
    if spec.family == "deepseek_v3":  # the group-limited top-k of the router itself
        return block.gate(tokens)[0]
    if spec.family == "gpt_oss":
        router = block.router
    elif spec.family in ("granitemoe", "jetmoe"):  # the gating module's linear layer
        router = block.router.layer
    else:
        router = block.gate
    if isinstance(router, torch.nn.Linear):  # transformers 4.57 routers are a plain linear + softmax
        logits = router(tokens)
    else:
        logits = torch.nn.functional.linear(tokens, router.weight, getattr(router, "bias", None))
    return torch.topk(logits, spec.topk, dim=-1).indices
