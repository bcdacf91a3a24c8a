"""The formal signature of every op: inputs, outputs, type constraints and attributes.

Standard library only, so that the C++ build reads it without numpy or onnx:
custom_ops/cmake/gen_op_tables.py writes the kernels' tables of input names, optional flags and
element types from it (docs/building.md). Each op module (moe.py, ...) adds its validation and
numpy reference to its signature to make the op's :class:`~moe_onnx.ops.OpDef`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FLOAT_TYPES = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")
INDEX_TYPES = ("tensor(int32)", "tensor(int64)")
FLOAT_OR_INT8_TYPES = (*FLOAT_TYPES, "tensor(int8)")


@dataclasses.dataclass(frozen=True)
class Param:
    """A formal input or output."""

    name: str
    type_str: str  # a type-constraint name or a concrete "tensor(...)"
    doc: str
    optional: bool = False


@dataclasses.dataclass(frozen=True)
class Attr:
    """A formal attribute; ``default=None`` means required (or, for ``ints``, 'not given').

    ``choices``: the values a string attribute may take when given (its checks say whether the
    default, e.g. ``""`` for 'not given', is allowed besides them). ``check_choice`` checks them and
    the C++ build makes an enum of them (custom_ops/cmake/gen_op_tables.py).
    """

    name: str
    kind: str  # "int", "float", "string" or "ints"
    doc: str
    default: Any = None
    required: bool = False
    choices: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Signature:
    """The formal parts of one op: what a node of it may have, before any rule between them."""

    name: str
    doc: str
    inputs: tuple[Param, ...]
    outputs: tuple[Param, ...]
    type_constraints: tuple[tuple[str, tuple[str, ...], str], ...]
    attributes: tuple[Attr, ...]

    def attr_spec(self, name: str) -> Attr:
        for attr in self.attributes:
            if attr.name == name:
                return attr
        raise KeyError(name)

    def allowed_types(self, param: Param) -> tuple[str, ...]:
        """The "tensor(...)" types ``param`` may have: its constraint's, or its own concrete type."""
        for name, types, _ in self.type_constraints:
            if name == param.type_str:
                return types
        return (param.type_str,)


MOE = Signature(
    name="MOE",
    doc=("Fused Mixture-of-Experts block. Computes only the selected experts: "
         "y[t] = sum_j routing_weights[t, j] * expert_{idx[t, j]}(hidden_states[t]). See docs/ops/MOE.md."),
    inputs=(
        Param("hidden_states", "T", "[*, H]: the tokens, rank >= 2; T = product of the leading dims."),
        Param("routing_weights", "T", "[T, k] (or [*, k] with T rows): weight of each selected expert."),
        Param("router_topk_output_indices", "T_ind", "[T, k] (or [*, k]): the selected experts, in [0, E)."),
        Param("weight_0", "T", "GEMM2: gate_up [E, H, 2I], gate and up interleaved. GEMM3: gate [E, I, H]. "
              "GEMM2_ACT: up [E, I, H]."),
        Param("bias_0", "T", "GEMM2: gate_up bias [E, 2I]. GEMM2_ACT: up bias [E, I]. GEMM3: must be absent.",
              optional=True),
        Param("weight_1", "T", "GEMM2: down [E, I, H]. GEMM3: up [E, I, H]. GEMM2_ACT: down [E, H, I]."),
        Param("bias_1", "T", "GEMM2: down bias [E, H]. GEMM2_ACT: down bias [E, H]. GEMM3: must be absent.",
              optional=True),
        Param("weight_2", "T", "GEMM3: down [E, H, I]. GEMM2 and GEMM2_ACT: must be absent.", optional=True),
    ),
    outputs=(Param("y", "T", "Same shape and type as hidden_states."),),
    type_constraints=(
        ("T", FLOAT_TYPES, "Floating-point activations and weights."),
        ("T_ind", INDEX_TYPES, "Expert indices."),
    ),
    attributes=(
        Attr("expert_type", "string", "GEMM2_BIAS_SWIGLU_CLAMP (GPT-OSS), GEMM3_SWIGLU (Mixtral, Qwen, OLMoE) or "
             "GEMM2_ACT (non-gated: down(activation(up(x))), Nemotron-H).", required=True,
             choices=("GEMM2_BIAS_SWIGLU_CLAMP", "GEMM3_SWIGLU", "GEMM2_ACT")),
        Attr("expert_alpha", "float", "The swish beta: swish(z) = z * sigmoid(expert_alpha * z).", default=1.0),
        Attr("expert_beta", "float", "GEMM2 only, and a GEMM2 node must set it: the clamp bound (> 0, inf for "
             "none). The default 0.0 is OpenVINO's and is rejected (it would clamp every activation to 0).",
             default=0.0),
        Attr("gate_parity", "int", "GEMM2 only: gate = gate_up[..., gate_parity::2]; up is the other half.",
             default=0),
        Attr("activation", "string", "GEMM2_ACT only, and a GEMM2_ACT node must set it: relu, relu2 (relu "
             "squared), gelu (erf), gelu_tanh, silu or identity. The default '' means not given.", default="",
             choices=("relu", "relu2", "gelu", "gelu_tanh", "silu", "identity")),
    ),
)


# The SwiGLU / activation attributes QMOE shares with MOE, with the same meaning.
_EXPERT_ATTRS = MOE.attributes


def _tp_attrs(what: str) -> tuple[Attr, ...]:
    """The tensor-parallel group of a node (docs/distributed.md): its size and this rank's place in it."""
    return (
        Attr("tp_world_size", "int", f"Ranks in the tensor-parallel group (>= 1); 1: one process, no "
             f"communication. > 1: {what}", default=1),
        Attr("tp_rank_id", "int", "This rank's index in its tensor-parallel group, in [0, tp_world_size).",
             default=0),
    )


MOE = dataclasses.replace(MOE, attributes=(*MOE.attributes, *_tp_attrs(
    "the weights hold this rank's slice of the intermediate size I (docs/distributed.md); the partial y "
    "of every rank is summed over the group in float32 (the all-reduce) and rounded once to T. The down "
    "bias (bias_1) counts once: only tp_rank_id 0 adds it."), Attr(
    "accuracy_level", "int", "The least accuracy the expert GEMMs may use, as onnxruntime's MatMulNBits "
    "attribute of that name. 0: exact float32 (fp16/bf16 inputs widened). 3: each GEMM may round both its "
    "operands (the activation rows and the weights) to bfloat16, round to nearest even, and accumulate in "
    "float32; biases, the activation, the routing weights and the sum over the slots stay float32. Where the "
    "CPU has no bf16 dot-product instruction (AMX-BF16, AVX512-BF16), 3 computes 0's exact result.", default=0)))

QMOE = Signature(
    name="QMOE",
    doc=("MOE with quantized expert weights (int8, int4 or MXFP4) in onnxruntime's QMoE layout: every weight is "
         "[E, N, K] (N outputs, K inputs) with K packed into bytes, dequantized by per-column or block-wise "
         "scales and optional zero points. y is MOE's on the dequantized weights. See docs/ops/QMOE.md."),
    inputs=(
        *MOE.inputs[:3],  # the tokens and their routing, as MOE
        Param("weight_0", "tensor(uint8)", "GEMM2: gate_up [E, 2I, H*bits/8] (rows interleaved by gate_parity). "
              "GEMM3: gate [E, I, H*bits/8]. GEMM2_ACT: up [E, I, H*bits/8]."),
        MOE.inputs[4],  # bias_0
        Param("weight_1", "tensor(uint8)", "GEMM2 and GEMM2_ACT: down [E, H, I*bits/8]. GEMM3: up [E, I, H*bits/8]."),
        Param("bias_1", "T", "GEMM2 and GEMM2_ACT: down bias [E, H]. GEMM3: must be absent.", optional=True),
        Param("weight_2", "tensor(uint8)", "GEMM3: down [E, H, I*bits/8]. GEMM2 and GEMM2_ACT: must be absent.",
              optional=True),
        Param("scales_0", "T_scale", "weight_0's scales: [E, N] per column (block_size 0) or [E, N, K/block_size]."),
        Param("scales_1", "T_scale", "weight_1's scales, as scales_0."),
        Param("scales_2", "T_scale", "weight_2's scales, as scales_0; required with weight_2.", optional=True),
        Param("zero_points_0", "tensor(uint8)", "weight_0's zero points, packed as the weights: [E, ceil(N*bits/8)] "
              "per column or [E, N, ceil(K/block_size*bits/8)]. Absent: 2^(bits-1). quant_type int only.",
              optional=True),
        Param("zero_points_1", "tensor(uint8)", "weight_1's zero points, as zero_points_0.", optional=True),
        Param("zero_points_2", "tensor(uint8)", "weight_2's zero points, as zero_points_0.", optional=True),
    ),
    outputs=MOE.outputs,
    type_constraints=(
        ("T", FLOAT_TYPES, "Floating-point activations and biases."),
        ("T_ind", INDEX_TYPES, "Expert indices."),
        ("T_scale", (*FLOAT_TYPES, "tensor(uint8)"), "Scales: T or float32 for quant_type int, uint8 "
         "(E8M0 exponents, 2^(s - 127)) for mxfp4."),
    ),
    attributes=(
        *_EXPERT_ATTRS,
        Attr("bits", "int", "Bits per weight: 4 (two per byte, the even K index in the low nibble) or 8.",
             required=True),
        Attr("block_size", "int", "0: one scale (and zero point) per output column; else a power of two in "
             "[16, 256] dividing K: one per block of block_size inputs. mxfp4: 32.", default=0),
        Attr("quant_type", "string", "int: w = (q - zero_point) * scale; mxfp4: q is an E2M1 code (bits 4, "
             "block_size 32, uint8 E8M0 scales, no zero points), w = e2m1(q) * 2^(s - 127).", default="int",
             choices=("int", "mxfp4")),
        Attr("accuracy_level", "int", "The least accuracy the expert GEMMs may use, as QMoE's attribute of that "
             "name. 0: activations stay in floating point (the dequantized weights' exact result); 3: as MOE's "
             "3: rows of more than a few tokens (prefill) may take the dequantized weights and the activation "
             "rows rounded to bfloat16 with float32 accumulation, where the CPU has AMX-BF16 or AVX512-BF16 "
             "(decode and other CPUs: 0's result); 4: activations are quantized to int8 per row and block for "
             "int8 dot products (quant_type int only).", default=0),
    ),
)


MOE_INIT_ROUTING = Signature(
    name="MoeInitRouting",
    doc=("Sorts the (token, k) slots by expert and gathers their rows, dropless [rows, H] or drop/pad "
         "[E, C, H], optionally quantized to int8. See docs/ops/MoeInitRouting.md."),
    inputs=(
        Param("x", "T", "[N, H]: the tokens."),
        Param("expert_idx", "T_ind", "[N, k]: each token's experts; -1 or an id outside the active range: not routed."),
        Param("scale", "tensor(float)", "quant_mode -1: [N] per-token scale carried to expanded_scale. "
              "0: [1] or [H] (required). 1: smooth scale [end - start, H] or [1, H].", optional=True),
        Param("offset", "tensor(float)", "quant_mode 0 only: [1] or [H] (absent: 0).", optional=True),
    ),
    outputs=(
        Param("expanded_x", "T_out", "Dropless [rows, H], rows = N*k or min(active_num, N*k); drop/pad [E, C, H]. "
              "int8 when quantized. Unused rows are 0."),
        Param("expanded_row_idx", "tensor(int32)", "[N*k]: gather form slot -> row, scatter form row -> slot; -1 "
              "where there is none."),
        Param("expert_tokens_count_or_cumsum", "tensor(int64)", "[end - start] cumsum or counts, or [end - start, 2] "
              "(expert, count) pairs padded with (-1, 0).", optional=True),
        Param("expanded_scale", "tensor(float)", "One scale per row of expanded_x ([rows] or [E, C]); 0 where "
              "there is none.", optional=True),
    ),
    type_constraints=(
        ("T", FLOAT_OR_INT8_TYPES, "The tokens."),
        ("T_ind", INDEX_TYPES, "Expert ids."),
        ("T_out", FLOAT_OR_INT8_TYPES, "expanded_x: the type of x, or int8 when quant_mode is 0 or 1."),
    ),
    attributes=(
        Attr("expert_num", "int", "E, the number of experts (>= 1).", required=True),
        Attr("active_num", "int", "Dropless: at most this many rows (-1 or 0: no limit).", default=-1),
        Attr("expert_capacity", "int", "Drop/pad: C, the rows per expert (>= 1). Dropless: 0.", default=0),
        Attr("drop_pad_mode", "int", "0 dropless, 1 drop/pad.", default=0),
        Attr("expert_tokens_num_type", "int", "0 cumsum, 1 count, 2 key_value.", default=0),
        Attr("expert_tokens_num_flag", "int", "1: output expert_tokens_count_or_cumsum; 0: no such output.",
             default=1),
        Attr("quant_mode", "int", "-1 none, 0 static int8, 1 dynamic int8.", default=-1),
        Attr("active_expert_range", "ints", "[start, end): the experts routed here (default [0, expert_num])."),
        Attr("row_idx_type", "int", "expanded_row_idx form: 0 gather (slot -> row), 1 scatter (row -> slot).",
             default=0),
    ),
)


ROW_PARALLEL_LINEAR = Signature(
    name="MoeRowParallelLinear",
    doc=("Grouped linear over contiguous row ranges: expert i owns rows [expert_offset[i], expert_offset[i+1]) "
         "of X and computes X @ W[i]^T + B[i]; other rows are 0. Tensor parallelism splits K, all-reduces the "
         "partials and adds B once. See docs/ops/MoeRowParallelLinear.md."),
    inputs=(
        Param("X", "T1", "[*, K], rank >= 1 (or [*, K_d] per rank when input_is_parallel); rows = product of *."),
        Param("expert_offset", "tensor(int64)", "[E + 1]: expert i owns rows [expert_offset[i], expert_offset[i+1])."),
        Param("W", "T1", "[E, N, K] (each rank holds [E, N, K_d]): the nn.Linear weight of each expert."),
        Param("B", "T2", "[E, N]: the bias of each expert, added once after the all-reduce.", optional=True),
    ),
    outputs=(Param("Y", "T2", "[*, N] with X's leading dims; X's type, int32 for int8 X."),),
    type_constraints=(
        ("T1", FLOAT_OR_INT8_TYPES, "Activations and weights."),
        ("T2", ("tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(int32)"),
         "Bias and output: the type of X, int32 for int8 X."),
    ),
    attributes=(
        Attr("num_experts", "int", "E. Optional; must equal W's dim 0 when given."),
        Attr("in_features", "int", "K, the full input width over all ranks. Optional; on one process it must "
                                   "equal X's last dim and W's dim 2 when given."),
        Attr("out_features", "int", "N. Optional; must equal W's dim 1 when given."),
        Attr("bias_term", "int", "1: B is required; 0: B must be absent. Optional; absent means 'whether B is given'."),
        Attr("input_is_parallel", "int", "0: every rank gets the full X and takes its K-slice; 1: each rank gets "
                                         "its own X_d. No effect on one process.", default=0),
        *_tp_attrs("W holds this rank's K-slice W_d; the partials are summed over the group (float32 for "
                   "floating-point X, int32 for int8) and B is added once, after."),
        Attr("accuracy_level", "int", "The least accuracy the GEMM may use, as MOE's. 0: exact (float32 "
             "accumulation; int8: int32). 3 (floating-point X only): X's rows and W may be rounded to bfloat16, "
             "round to nearest even, with float32 accumulation; B stays float32. Where the CPU has no bf16 "
             "dot-product instruction (AMX-BF16, AVX512-BF16), 3 computes 0's exact result. int8 X must "
             "leave 0 (its int32 product is exact).", default=0),
    ),
)


MOE_FINALIZE_ROUTING = Signature(
    name="MoeFinalizeRouting",
    doc=("Un-permutes the expert outputs of a MoeInitRouting layout and sums each token's k slots: "
         "out[t] = x1[t] + x2[t] + sum_j scales[t, j] * (expanded_x[row(t, j)] + bias[expert_idx[t, j]]). "
         "See docs/ops/MoeFinalizeRouting.md."),
    inputs=(
        Param("expanded_x", "T", "The expert outputs: dropless [R, H], drop/pad [E, C, H]."),
        Param("expanded_row_idx", "T_ind", "[N*k] from MoeInitRouting: gather (slot -> row) or scatter (row -> slot)."),
        Param("x1", "T", "[N, H]: residual, added as is.", optional=True),
        Param("x2", "T", "[N, H]: shared-expert output, added as is.", optional=True),
        Param("bias", "T", "[E, H]: expert bias, added to each routed slot before scaling.", optional=True),
        Param("scales", "T", "[N, k]: routing weights (absent: 1).", optional=True),
        Param("expert_idx", "T_ind", "[N, k]: each slot's expert, to index bias (unused without bias).",
              optional=True),
    ),
    outputs=(Param("out", "T", "[N, H], the type of expanded_x."),),
    type_constraints=(
        ("T", FLOAT_TYPES, "Activations, biases and weights."),
        ("T_ind", INDEX_TYPES, "Row indices and expert ids."),
    ),
    attributes=(
        Attr("drop_pad_mode", "int", "0 dropless (expanded_x [R, H]), 1 drop/pad (expanded_x [E, C, H]).", default=0),
        Attr("row_idx_type", "int", "expanded_row_idx form: 0 gather (slot -> row), 1 scatter (row -> slot).",
             default=0),
    ),
)


MOE_GATING_TOPK = Signature(
    name="MoeGatingTopK",
    doc=("Router: scores s = softmax or sigmoid of the logits, an optional expert bias for selection only, "
         "group-limited top-k (DeepSeek), renormalize and scale: the [*, k] weights and indices MOE and "
         "MoeInitRouting take. See docs/ops/MoeGatingTopK.md."),
    inputs=(
        Param("logits", "T", "[*, E]: the router logits, rank >= 1; rows = product of the leading dims."),
        Param("bias", "T", "[E]: expert bias added to the scores to choose the experts, not to weight them "
              "(DeepSeek-V3 e_score_correction_bias).", optional=True),
    ),
    outputs=(
        Param("weights", "T", "[*, k]: the chosen experts' scores (renormalized, scaled)."),
        Param("indices", "tensor(int64)", "[*, k]: the chosen experts, best first (ties: lower index first)."),
        Param("scores", "T", "[*, E]: the scores s, before the bias.", optional=True),
    ),
    type_constraints=(("T", FLOAT_TYPES, "Logits, bias, weights and scores."),),
    attributes=(
        Attr("k", "int", "Experts per row, 1 <= k <= E.", required=True),
        Attr("score_func", "string", "softmax or sigmoid: s over the E logits of a row.", default="softmax",
             choices=("softmax", "sigmoid")),
        Attr("n_group", "int", "Expert groups (E % n_group == 0); 1: plain top-k.", default=1),
        Attr("topk_group", "int", "Groups kept per row, 1..n_group; 0 means n_group (all).", default=0),
        Attr("group_select", "string", "A group's score: sum_top2 (the sum of its two best selection scores, "
             "DeepSeek-V3) or max (DeepSeek-V2).", default="sum_top2", choices=("sum_top2", "max")),
        Attr("renormalize", "int", "1: weights = w / (sum(w) + eps); 0: the scores as they are.", default=0),
        Attr("eps", "float", "Added to the renormalize denominator (DeepSeek: 1e-20).", default=0.0),
        Attr("routed_scaling_factor", "float", "Multiplies the weights, after renormalize.", default=1.0),
    ),
)


def _group_attrs() -> tuple[Attr, ...]:
    """The expert- and tensor-parallel layout of a dispatch/combine node (docs/distributed.md)."""
    return (
        Attr("ep_world_size", "int", "Ranks in the expert-parallel group (>= 1); each owns num_experts / "
             "ep_world_size consecutive experts.", default=1),
        Attr("ep_rank_id", "int", "This rank's index in its expert-parallel group, in [0, ep_world_size).",
             default=0),
        Attr("tp_world_size", "int", "Ranks in the tensor-parallel group (>= 1). World = ep_world_size * "
             "tp_world_size; global rank = ep_rank_id * tp_world_size + tp_rank_id.", default=1),
        Attr("tp_rank_id", "int", "This rank's index in its tensor-parallel group, in [0, tp_world_size).",
             default=0),
    )


MOE_DISTRIBUTE_DISPATCH = Signature(
    name="MoeDistributeDispatch",
    doc=("Expert parallelism, first half: sends every (token, k) slot of this rank to the ranks that own its "
         "expert (all-to-all-v in the EP group, then all-gather-v in the TP group) and returns the rows of this "
         "rank's experts, sorted by (local expert, global token), dropless or padded to a capacity with drops. "
         "See docs/ops/MoeDistributeDispatch.md."),
    inputs=(
        Param("x", "T", "[Bs, H]: this rank's tokens (Bs may differ between ranks and may be 0)."),
        Param("expert_ids", "T_ind", "[Bs, K]: each token's experts, distinct within a row, in [0, num_experts)."),
    ),
    outputs=(
        Param("expand_x", "T", "Dropless [A, H]: A = the world's slots routed to this rank's experts. Drop/pad "
              "[E_local * C, H]: local expert l's rows at [l * C, l * C + kept_l), the rest 0."),
        Param("expert_offset", "tensor(int64)", "[E_local + 1]: local expert l owns rows [expert_offset[l], "
              "expert_offset[l+1]) of expand_x (drop/pad: l * C), MoeRowParallelLinear's expert_offset."),
        Param("assist_info", "tensor(int64)", "1-D: what MoeDistributeCombine needs to send the rows back "
              "(layout in docs/ops/MoeDistributeDispatch.md)."),
    ),
    type_constraints=(
        ("T", FLOAT_TYPES, "The tokens."),
        ("T_ind", INDEX_TYPES, "Expert ids."),
    ),
    attributes=(
        Attr("num_experts", "int", "E, the experts over all ranks (>= 1, divisible by ep_world_size).",
             required=True),
        Attr("expert_capacity", "int", "0: dropless. C >= 1: each expert keeps its first C slots in global "
             "token order (over all ranks) and drops the rest.", default=0),
        *_group_attrs(),
    ),
)


MOE_DISTRIBUTE_COMBINE = Signature(
    name="MoeDistributeCombine",
    doc=("Expert parallelism, second half: the inverse path of MoeDistributeDispatch (reduce-scatter-v of the "
         "TP partials, all-to-all-v back in the EP group), then out[t] = x1[t] + x2[t] + "
         "sum_j scales[t, j] * y(t, j) over the kept slots. See docs/ops/MoeDistributeCombine.md."),
    inputs=(
        Param("expand_y", "T", "The expert outputs on dispatch's expand_x rows: [A, H] or [E_local * C, H] "
              "(with tp_world_size > 1, this rank's partial sums)."),
        Param("assist_info", "tensor(int64)", "The matching MoeDistributeDispatch's assist_info."),
        Param("scales", "T", "[Bs, K]: each slot's routing weight."),
        Param("x1", "T", "[Bs, H]: residual, added as is.", optional=True),
        Param("x2", "T", "[Bs, H]: shared-expert output, added as is.", optional=True),
    ),
    outputs=(Param("out", "T", "[Bs, H]: this rank's tokens, or, with gather_tokens = 1, [sum of Bs over the "
                   "world, H]: every rank's tokens in global rank order."),),
    type_constraints=(("T", FLOAT_TYPES, "Activations and weights."),),
    attributes=(
        Attr("num_experts", "int", "E, as the matching dispatch.", required=True),
        Attr("gather_tokens", "int", "1: out is every rank's result in global rank order (an all-gather-v over "
             "the world), for models whose ranks all hold the full sequence; 0: this rank's tokens.", default=0),
        *_group_attrs(),
    ),
)


SIGNATURES: tuple[Signature, ...] = (MOE, MOE_INIT_ROUTING, ROW_PARALLEL_LINEAR, MOE_FINALIZE_ROUTING,
                                        MOE_GATING_TOPK, QMOE, MOE_DISTRIBUTE_DISPATCH, MOE_DISTRIBUTE_COMBINE)
