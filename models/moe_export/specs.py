"""What can be exported: families, export styles, size presets and the fixture naming.

This module needs no torch, so the verification and reporting side can use it too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral", "olmoe", "qwen2_moe")


@dataclass(frozen=True)
class Style:
    """How a block is put into the graph: which transformers, which patch, which exporter."""

    transformers_major: int
    dynamo: bool  # torch.onnx.export(dynamo=True) (torch.export + onnxscript) or the TorchScript exporter
    families: tuple[str, ...]
    description: str


_LOOP_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")
STYLES = {
    "batched_mm": Style(
        5, True, FAMILIES,
        "transformers 5 experts_implementation='batched_mm', torch.onnx.export(dynamo=True)",
    ),
    "tiled": Style(
        4, False, ("gpt_oss",),
        "transformers 4.57 GptOssExperts forced onto its accelerator branch (as optimum patches it), "
        "torch.onnx.export(dynamo=False) as optimum exports it",
    ),
    "tiled_dynamo": Style(
        4, True, ("gpt_oss",),
        "the 'tiled' block exported by torch.onnx.export(dynamo=True), the default exporter of recent torch",
    ),
    "tiled3": Style(
        5, True, _LOOP_FAMILIES,
        "transformers 5 experts patched to tile tokens over all experts and bmm gate_up/down "
        "(as optimum-intel patches them for OpenVINO), torch.onnx.export(dynamo=True)",
    ),
    "loop": Style(
        4, False, _LOOP_FAMILIES,
        "transformers 4.57 eager per-expert loop traced by torch.onnx.export(dynamo=False)",
    ),
    "loop_missing": Style(
        4, False, ("mixtral",),
        "as 'loop', but traced on an input that routes no token to one expert, so that expert is absent",
    ),
}  # fmt: skip

# Block-level facts the fuser has to check, by family (and by transformers major where they differ).
ACTIVATION = {family: "silu" for family in FAMILIES} | {"gpt_oss": "gpt_oss_swiglu"}
ACTIVATION_FORMULA = {
    "silu": "silu(gate) * up",
    "gpt_oss_swiglu": "g = min(gate, 7); (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 * g)",
}
ROUTER = {
    "gpt_oss": "linear(+bias) -> topk over logits -> softmax over the k values",
    "qwen3_moe": "linear -> softmax -> topk -> renormalize (norm_topk_prob=True)",
    "mixtral": "linear -> softmax -> topk -> renormalize (always)",
    "olmoe": "linear -> softmax -> topk (norm_topk_prob=False: no renormalization)",
    "qwen2_moe": "linear -> softmax -> topk (norm_topk_prob=False: no renormalization)",
}
RENORMALIZE = {"gpt_oss": False, "qwen3_moe": True, "mixtral": True, "olmoe": False, "qwen2_moe": False}


@dataclass(frozen=True)
class BlockSpec:
    """One MoE block to build and export."""

    family: str
    style: str
    size: str  # "tiny", "small" or "custom"
    hidden: int
    intermediate: int
    experts: int
    topk: int
    shared_intermediate: int | None = None  # Qwen2-MoE shared expert only

    @property
    def name(self) -> str:
        return f"{self.family}_{self.style}_{self.size}"

    @property
    def transformers_major(self) -> int:
        return STYLES[self.style].transformers_major

    @property
    def has_bias(self) -> bool:
        return self.family == "gpt_oss"

    @property
    def gate_up_layout(self) -> str:
        """'interleaved' (gate = columns 0::2), 'halves' (gate = first I rows) or 'separate' tensors."""
        if self.family == "gpt_oss":
            return "interleaved"
        return "halves" if self.transformers_major == 5 else "separate"

    @property
    def weight_layout(self) -> str:
        """Where the block's expert weights live, in the module (the graph may store them transposed)."""
        return {
            "interleaved": "gate_up_proj [E, H, 2I] (+ bias [E, 2I]), gate = [..., 0::2], up = [..., 1::2]; "
            "down_proj [E, I, H] (+ bias [E, H])",
            "halves": "gate_up_proj [E, 2I, H], gate = rows [0, I), up = rows [I, 2I); down_proj [E, H, I]",
            "separate": "per expert nn.Linear gate_proj/up_proj [I, H] and down_proj [H, I] "
            "(Mixtral: w1 = gate, w3 = up, w2 = down)",
        }[self.gate_up_layout]


_PRESETS = {
    "tiny": dict(hidden=32, intermediate=16, experts=4, topk=2),
    "small": dict(hidden=64, intermediate=32, experts=8, topk=4),
}
_SMALL_BY_FAMILY = {"gpt_oss": dict(intermediate=64), "mixtral": dict(topk=2)}
# The dynamo exporter's optimizer folds a constant-only node only while its inputs have at most 8192
# elements (Transpose of a single-use weight is folded at any size). Of the committed styles only
# 'tiled_dynamo' has such a node whose input can pass that limit: the bias Unsqueeze, input [E, 2I].
# Its 'small' fixture has E * 2I = 8704 so the graph keeps the Unsqueeze nodes as large models do,
# with H = 8 to stay small on disk.
_SMALL_BY_STYLE = {"tiled_dynamo": dict(hidden=8, intermediate=272, experts=16, topk=4)}


def preset(family: str, style: str, size: str) -> BlockSpec:
    """The committed fixture's shape for a family/style/size."""
    values = dict(_PRESETS[size])
    if size == "small":
        values.update(_SMALL_BY_FAMILY.get(family, {}))
        values.update(_SMALL_BY_STYLE.get(style, {}))
    shared = 2 * values["intermediate"] if family == "qwen2_moe" else None
    return BlockSpec(family, style, size, shared_intermediate=shared, **values)


def custom(base: BlockSpec, **overrides: int | None) -> BlockSpec:
    """A preset with some dimensions overridden (size becomes 'custom')."""
    given = {key: value for key, value in overrides.items() if value is not None}
    if not given:
        return base
    spec = replace(base, size="custom", **given)
    if spec.family == "qwen2_moe" and "shared_intermediate" not in given:
        spec = replace(spec, shared_intermediate=2 * spec.intermediate)
    return spec


def fixture_specs(transformers_major: int) -> list[BlockSpec]:
    """Every committed fixture that is exported with this transformers major version."""
    return [
        preset(family, style_name, size)
        for style_name, style in STYLES.items()
        if style.transformers_major == transformers_major
        for family in style.families
        for size in (("tiny",) if style_name == "loop_missing" else ("tiny", "small"))
    ]

# Whole-model exports committed as fixtures (models/fixtures/whole): one per export form the block
# fixtures do not cover, the smallest of each (see models/README.md, "Whole models").
WHOLE_FIXTURES = (
    "gpt_oss__tf457__torchscript",  # GPT-OSS CPU branch: per-expert loop over the hit experts
    "deepseek_v3__tf457__torchscript",  # sigmoid + bias + group-limited top-k router, loop, shared expert
    "olmoe__tf457__dynamo",  # loop over range(E) through torch.export
    "granitemoe__tf457__torchscript",  # ParallelExperts
    "phimoe__tf5__dynamo",  # sparsemixer routing
    "aria_text__tf5__dynamo",  # batched_mm with transposed expert weights
    "nemotron_h__tf5__dynamo",  # non-gated relu2 experts (hybrid pattern "E*": a MoE and an attention layer)
    "mixtral__tf5__torchscript",  # transformers 5 batched_mm through the TorchScript exporter
)
