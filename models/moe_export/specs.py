"""What can be exported: families, export styles, size presets and the fixture naming.

This module needs no torch, so the verification and reporting side can use it too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

_FIRST_FAMILIES = ("gpt_oss", "qwen3_moe", "mixtral", "olmoe", "qwen2_moe")  # a block in every transformers version
_BATCHED_MM_FAMILIES = _FIRST_FAMILIES + ("nemotron_h",)
FAMILIES = _BATCHED_MM_FAMILIES + ("deepseek_v3", "granitemoe", "jetmoe", "aria_text", "phimoe")


@dataclass(frozen=True)
class Style:
    """How a block is put into the graph: which transformers, which patch, which exporter."""

    transformers_major: int
    dynamo: bool  # torch.onnx.export(dynamo=True) (torch.export + onnxscript) or the TorchScript exporter
    families: tuple[str, ...]
    description: str
    broken: str | None = None  # why onnxruntime cannot match torch on this export (--check says so, not MISMATCH)


_LOOP_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")
STYLES = {
    "batched_mm": Style(
        5, True, _BATCHED_MM_FAMILIES,
        "transformers 5 experts_implementation='batched_mm', torch.onnx.export(dynamo=True)",
    ),
    "batched_mm_transposed": Style(
        5, True, ("aria_text",),
        "transformers 5 experts_implementation='batched_mm' of experts stored [E, in, out] (is_transposed=True), "
        "torch.onnx.export(dynamo=True)",
    ),
    "batched_mm_torchscript": Style(
        5, False, _BATCHED_MM_FAMILIES + ("aria_text",),
        "transformers 5 experts_implementation='batched_mm', torch.onnx.export(dynamo=False) (TorchScript: "
        "tokens repeated by Tile, per-slot weights by Gather, gate/up halves by Slice; AriaText's weights "
        "[E, in, out])",
    ),
    "sparsemixer_batched_mm": Style(
        5, True, ("phimoe",),
        "as 'batched_mm', for PhiMoE's sparsemixer router (successive ArgMax picks, no TopK)",
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
    "loop_cpu": Style(
        4, False, ("gpt_oss",),
        "transformers 4.57 GptOssExperts unpatched: on CPU its per-expert loop over the hit experts, indexing the "
        "stacked weights; plain torch.onnx.export(dynamo=False)",
    ),
    "loop_grouped": Style(
        4, False, ("deepseek_v3",),
        "transformers 4.57 DeepSeek-V3 MoE (sigmoid router with expert bias, group-limited top-k, renormalized and "
        "scaled; shared expert beside): its eager loop over range(E), torch.onnx.export(dynamo=False)",
    ),
    "sorted": Style(
        4, False, ("granitemoe", "jetmoe"),
        "transformers 4.57 GraniteMoe / JetMoe MoE (ParallelExperts: the routed rows sorted by expert, split by the "
        "traced expert counts), torch.onnx.export(dynamo=False)",
        broken="the export scatters each token's k rows with ScatterElements without reduction (duplicate "
        "indices): onnxruntime keeps one where torch's index_add_ sums them"
    ),
    "loop_dynamo": Style(
        4, True, ("olmoe",),
        "transformers 4.57 eager loop over range(num_experts) exported by torch.onnx.export(dynamo=True)",
    ),
    "parallel_experts_dynamo": Style(
        4, True, ("granitemoe", "jetmoe"),
        "transformers 4.57 ParallelExperts (tokens sorted by expert, one Linear per chunk) exported by "
        "torch.onnx.export(dynamo=True)",
    ),
    "sparsemixer_loop": Style(
        4, False, ("phimoe",),
        "as 'loop', for PhiMoE's sparsemixer router (successive ArgMax picks, no TopK)",
    ),
    "loop_missing": Style(
        4, False, ("mixtral",),
        "as 'loop', but traced on an input that routes no token to one expert, so that expert is absent",
    ),
}  # fmt: skip

# Block-level facts the fuser has to check, by family (and by transformers major where they differ).
ACTIVATION = {family: "silu" for family in FAMILIES} | {"gpt_oss": "gpt_oss_swiglu", "nemotron_h": "relu2"}
ACTIVATION_FORMULA = {
    "silu": "silu(gate) * up",
    "relu2": "relu(up)^2 (non-gated: down(relu2(up(x))))",
    "gpt_oss_swiglu": "g = min(gate, 7); (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 * g)",
}
ROUTER = {
    "gpt_oss": "linear(+bias) -> topk over logits -> softmax over the k values",
    "qwen3_moe": "linear -> softmax -> topk -> renormalize (norm_topk_prob=True)",
    "mixtral": "linear -> softmax -> topk -> renormalize (always)",
    "olmoe": "linear -> softmax -> topk (norm_topk_prob=False: no renormalization)",
    "qwen2_moe": "linear -> softmax -> topk (norm_topk_prob=False: no renormalization)",
    "granitemoe": "linear -> topk over logits -> softmax over the k values",
    "jetmoe": "linear -> topk over logits -> softmax over the k values",
    "deepseek_v3": "linear -> sigmoid; + e_score_correction_bias -> group-limited topk (n_group, topk_group) picks "
    "the experts; their sigmoid scores renormalized (norm_topk_prob=True) and scaled by routed_scaling_factor",
    "nemotron_h": "linear -> sigmoid -> (+ e_score_correction_bias) group-limited topk -> the sigmoid scores of "
    "the chosen experts -> renormalize (norm_topk_prob=True) * routed_scaling_factor",
    "aria_text": "linear -> topk over logits -> softmax over the k values",
    "phimoe": "linear -> sparsemixer: argmax, then argmax with the first masked to -inf; each weight a softmax "
              "of the logits masked near its pick",
}
RENORMALIZE = {"gpt_oss": False, "qwen3_moe": True, "mixtral": True, "olmoe": False, "qwen2_moe": False,
               "deepseek_v3": True, "granitemoe": False, "jetmoe": False, "nemotron_h": True, "aria_text": False,
               "phimoe": False}
ROUTED_SCALING_FACTOR = 2.5  # DeepSeek-V3's


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
    shared_intermediate: int | None = None  # the shared expert of SHARED_EXPERT_WIDTH's families only

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
        """'interleaved' (gate = columns 0::2), 'halves' (gate = first I rows), 'column_halves' (gate = first I
        columns), 'separate' tensors, 'parallel' (halves of ParallelExperts' input_linear) or 'none' (non-gated
        experts)."""
        if self.family == "gpt_oss":
            return "interleaved"
        if self.family in ("granitemoe", "jetmoe"):
            return "parallel"
        if self.family == "nemotron_h":
            return "none"
        if self.family == "aria_text":
            return "column_halves"
        return "halves" if self.transformers_major == 5 else "separate"

    @property
    def weight_layout(self) -> str:
        """Where the block's expert weights live, in the module (the graph may store them transposed)."""
        return {
            "interleaved": "gate_up_proj [E, H, 2I] (+ bias [E, 2I]), gate = [..., 0::2], up = [..., 1::2]; "
            "down_proj [E, I, H] (+ bias [E, H])",
            "halves": "gate_up_proj [E, 2I, H], gate = rows [0, I), up = rows [I, 2I); down_proj [E, H, I]",
            "column_halves": "gate_up_proj [E, H, 2I], gate = columns [0, I), up = columns [I, 2I); "
            "down_proj [E, I, H]",
            "separate": "per expert nn.Linear gate_proj/up_proj [I, H] and down_proj [H, I] "
            "(Mixtral: w1 = gate, w3 = up, w2 = down)",
            "parallel": "input_linear.weight [E, 2I, H], gate = rows [0, I), up = rows [I, 2I); "
            "output_linear.weight [E, H, I] (ParallelExperts)",
            "none": "up_proj [E, I, H], down_proj [E, H, I] (no gate)",
        }[self.gate_up_layout]


_PRESETS = {
    "tiny": dict(hidden=32, intermediate=16, experts=4, topk=2),
    "small": dict(hidden=64, intermediate=32, experts=8, topk=4),
}
_SMALL_BY_FAMILY = {"gpt_oss": dict(intermediate=64), "mixtral": dict(topk=2), "deepseek_v3": dict(topk=2),
                    "phimoe": dict(topk=2)}
# the shared expert's width, as a multiple of I
SHARED_EXPERT_WIDTH = {"qwen2_moe": 2, "deepseek_v3": 2, "nemotron_h": 2, "aria_text": 1}
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
    shared = SHARED_EXPERT_WIDTH[family] * values["intermediate"] if family in SHARED_EXPERT_WIDTH else None
    return BlockSpec(family, style, size, shared_intermediate=shared, **values)


def custom(base: BlockSpec, **overrides: int | None) -> BlockSpec:
    """A preset with some dimensions overridden (size becomes 'custom')."""
    given = {key: value for key, value in overrides.items() if value is not None}
    if not given:
        return base
    spec = replace(base, size="custom", **given)
    if spec.family in SHARED_EXPERT_WIDTH and "shared_intermediate" not in given:
        spec = replace(spec, shared_intermediate=SHARED_EXPERT_WIDTH[spec.family] * spec.intermediate)
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
