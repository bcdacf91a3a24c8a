"""MoeGatingTopK case table (the routers of Mixtral/Qwen, DeepSeek-V2 and DeepSeek-V3) and an
independent per-row oracle."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from . import Case

OP = "MoeGatingTopK"
BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float32): (1e-5, 1e-6), np.dtype(np.float16): (2e-3, 1e-3), BF16: (1e-2, 1e-2)}


def _order(values, allowed):
    """Positions best first: allowed, then NaN, then larger, then lower position."""
    return sorted(range(len(values)), key=lambda e: (not allowed[e], not math.isnan(values[e]),
                                                     0.0 if math.isnan(values[e]) else -values[e], e))


def oracle(logits, bias=None, *, k, score_func="softmax", n_group=1, topk_group=0, group_select="sum_top2",
           renormalize=0, eps=0.0, routed_scaling_factor=1.0):
    """Row by row in Python floats (float64): written apart from the reference on purpose."""
    experts = logits.shape[-1]
    rows = logits.reshape(-1, experts).astype(np.float64)
    size, keep = experts // n_group, topk_group or n_group
    weights, indices, scores = [], [], []
    for row in rows:
        if score_func == "softmax":
            top = max(row)
            exps = [math.exp(x - top) for x in row]
            s = [e / sum(exps) for e in exps]
        else:
            s = [0.0 if x < -700 else 1.0 / (1.0 + math.exp(-x)) for x in row]  # exp(700+) overflows
        sel = [v + (0.0 if bias is None else float(bias[e])) for e, v in enumerate(s)]
        allowed = [True] * experts
        if n_group > 1:
            group_scores = []
            for g in range(n_group):
                members = sorted(sel[g * size:(g + 1) * size], reverse=True)
                group_scores.append(members[0] + members[1] if group_select == "sum_top2" else members[0])
            kept = set(_order(group_scores, [True] * n_group)[:keep])
            allowed = [e // size in kept for e in range(experts)]
        chosen = _order(sel, allowed)[:k]
        w = [s[e] for e in chosen]
        if renormalize:
            total = sum(w) + eps
            w = [v / total for v in w]
        weights.append([v * routed_scaling_factor for v in w])
        indices.append(chosen)
        scores.append(s)
    lead = logits.shape[:-1]
    return (np.array(weights).reshape(*lead, k).astype(logits.dtype),
            np.array(indices, dtype=np.int64).reshape(*lead, k),
            np.array(scores).reshape(logits.shape).astype(logits.dtype))


def gating_case(name, *, shape=(6, 8), k=2, dtype=np.float32, bias=False, seed=5, logits=None, **attrs):
    """A case with random logits of ``shape`` (or the given ``logits``) and, with ``bias``, a random expert bias."""
    rng = np.random.default_rng(seed)
    if logits is None:
        logits = rng.standard_normal(shape).astype(np.float32)
    logits = np.asarray(logits, dtype=np.float32)
    expert_bias = (rng.standard_normal(logits.shape[-1]) * 0.1).astype(np.float32).astype(dtype) if bias else None
    rtol, atol = TOL[np.dtype(dtype)]
    return Case(OP, name, [logits.astype(dtype), expert_bias], {"k": k, **attrs}, rtol=rtol, atol=atol)


DEEPSEEK_V3 = dict(score_func="sigmoid", n_group=4, topk_group=2, renormalize=1, eps=1e-20,
                   routed_scaling_factor=2.5)
DEEPSEEK_V2 = dict(n_group=4, topk_group=2, group_select="max", routed_scaling_factor=16.0)
TIES = [[1.0, 2.0, 2.0, 0.5, 2.0, 1.0, 0.0, 1.0],  # three equal best: 1, 2, 4 in index order
        [0.0] * 8,                                  # all equal: 0, 1, ...
        [3.0, 1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 1.0]]
# groups of 2: groups 1 and 3 hold the same scores, so they tie (sum_top2 and max) behind group 0;
# keeping 2 groups takes group 1, the lower one
GROUP_TIES = [[5.0, 5.0, 2.0, 1.0, 0.0, 0.0, 1.0, 2.0]]
_base = gating_case("softmax_top2")
_v3 = gating_case("deepseek_v3", shape=(7, 16), k=4, bias=True, **DEEPSEEK_V3)
_logits, _bias = _v3.inputs

CASES = [
    _base,
    gating_case("softmax_renormalize", renormalize=1),  # top-k then softmax (Mixtral, GPT-OSS) is this
    gating_case("softmax_scaled", k=3, routed_scaling_factor=0.5),
    gating_case("sigmoid_no_bias", score_func="sigmoid", k=3),
    gating_case("sigmoid_bias", shape=(9, 8), score_func="sigmoid", bias=True, renormalize=1, eps=1e-20),
    _v3,
    gating_case("deepseek_v3_bf16", shape=(7, 16), k=4, bias=True, dtype=BF16, **DEEPSEEK_V3),
    gating_case("deepseek_v3_fp16", shape=(7, 16), k=4, bias=True, dtype=np.float16, **DEEPSEEK_V3),
    gating_case("deepseek_v2_max", shape=(5, 16), k=3, **DEEPSEEK_V2),
    gating_case("groups_all_kept", shape=(5, 16), k=4, n_group=4, topk_group=4, bias=True),
    gating_case("groups_topk_group_0_means_all", shape=(5, 16), k=4, n_group=4, bias=True),
    gating_case("groups_one_kept_k_fills_it", shape=(5, 16), k=4, n_group=4, topk_group=1, score_func="sigmoid"),
    gating_case("group_ties_lower_group_first", logits=GROUP_TIES, k=3, n_group=4, topk_group=2),
    gating_case("group_ties_max", logits=GROUP_TIES, k=4, n_group=4, topk_group=2, group_select="max"),
    gating_case("n_group_1_explicit", n_group=1, topk_group=1, group_select="max"),
    gating_case("ties_lower_index_first", logits=TIES, k=3),
    gating_case("ties_sigmoid", logits=TIES, k=3, score_func="sigmoid"),
    gating_case("k_equals_e", k=8, renormalize=1),
    gating_case("k1", k=1),
    gating_case("one_row", shape=(1, 8), k=2, bias=True, score_func="sigmoid"),
    gating_case("no_rows", shape=(0, 8), k=2, bias=True, **{**DEEPSEEK_V3, "n_group": 2, "topk_group": 1}),
    gating_case("rank3", shape=(2, 3, 8), k=2, renormalize=1),
    gating_case("rank1", shape=(8,), k=2),
    gating_case("one_expert", shape=(4, 1), k=1),
    gating_case("fp16_softmax", shape=(9, 8), k=2, dtype=np.float16, renormalize=1),
    gating_case("bf16_sigmoid_bias", shape=(9, 8), k=2, dtype=BF16, score_func="sigmoid", bias=True),
    gating_case("large_logits", logits=[[80.0, -90.0, 88.0, 0.0, -1e4, 1e4, 3.0, 2.0]], k=3, score_func="sigmoid"),
    gating_case("nan_logit_first", logits=[[0.0, 1.0, np.nan, 2.0, 0.5, -1.0, 0.0, 3.0]], k=2, score_func="sigmoid"),
    gating_case("nan_logit_softmax", logits=[[0.0, 1.0, np.nan, 2.0], [1.0, 2.0, 3.0, 4.0]], k=2),
    gating_case("wide_e256", shape=(3, 256), k=8, bias=True, **{**DEEPSEEK_V3, "n_group": 8, "topk_group": 4}),
    _base.mutated("scores_not_asked", None, outputs=2),
    _v3.mutated("bias_constant", None, constant=(1,)),
    # errors: attributes
    _base.mutated("k_missing", r"attribute 'k' is required", k=None),
    _base.mutated("k_0", r"attribute 'k' is 0; expected a value >= 1", k=0),
    _base.mutated("k_over_e", r"attribute 'k' is 9; expected at most E = 8 \(the last dim of input 'logits'\)", k=9),
    _v3.mutated("k_over_kept_groups", r"attribute 'k' is 9; expected at most topk_group \* E / n_group = 2 \* 16 / 4 "
                r"= 8, the experts of the kept groups", k=9),
    _base.mutated("score_func_other", r"attribute 'score_func' is 'tanh'; expected one of 'softmax', 'sigmoid'",
                  score_func="tanh"),
    _base.mutated("n_group_0", r"attribute 'n_group' is 0; expected a value >= 1", n_group=0),
    _base.mutated("n_group_not_divisor", r"attribute 'n_group' is 3; expected a divisor of E = 8", n_group=3),
    _base.mutated("topk_group_negative", r"attribute 'topk_group' is -1; expected 0 \(all groups\) or 1..n_group = 1",
                  topk_group=-1),
    _v3.mutated("topk_group_over_n_group", r"attribute 'topk_group' is 5; expected 0 \(all groups\) or 1..n_group = 4",
                topk_group=5),
    _base.mutated("group_select_other", r"attribute 'group_select' is 'min'; expected one of 'sum_top2', 'max'",
                  group_select="min"),
    _v3.mutated("sum_top2_single_expert_groups", r"attribute 'group_select' is 'sum_top2'; expected 'max' for groups "
                r"of 1 expert \(E / n_group = 16 / 16\)", n_group=16, topk_group=8),
    _base.mutated("renormalize_2", r"attribute 'renormalize' is 2; expected one of 0, 1", renormalize=2),
    _base.mutated("eps_nan", r"attribute 'eps' is nan; expected a finite number", eps=float("nan")),
    _base.mutated("scaling_inf", r"attribute 'routed_scaling_factor' is inf; expected a finite number",
                  routed_scaling_factor=float("inf")),
    _base.mutated("attr_k_float", r"attribute 'k' has type FLOAT; expected INT", k=2.0),
    _base.mutated("attr_score_func_int", r"attribute 'score_func' has type INT; expected STRING", score_func=1),
    _base.mutated("attr_misspelled", r"attribute 'topk_groups' is not an attribute of MoeGatingTopK; expected one "
                  r"of 'k', ", session=True, topk_groups=1),
    # errors: types and shapes
    _base.mutated("logits_int32", r"input 'logits' has type int32; expected float32, float16, bfloat16",
                  logits=_base.inputs[0].astype(np.int32)),
    _base.mutated("logits_float64", r"input 'logits' has type float64; expected float32, float16, bfloat16",
                  logits=_base.inputs[0].astype(np.float64)),
    _v3.mutated("bias_fp16", r"input 'bias' has type float16; expected float32, the type of input 'logits'",
                bias=_bias.astype(np.float16)),
    _v3.mutated("bias_rank2", r"input 'bias' has rank 2 \(shape \[1, 16\]\); expected rank 1", bias=_bias[None]),
    _v3.mutated("bias_wrong_e", r"input 'bias' dim 0 is 8; expected E = 16", bias=_bias[:8]),
    _base.mutated("logits_scalar", r"input 'logits' has rank 0 \(shape \[\]\); expected rank >= 1",
                  logits=np.array(1.0, np.float32)),
]
