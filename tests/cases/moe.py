"""MOE case table and an independent per-token oracle."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from . import Case, bf16_compute

OP = "MOE"
GEMM2, GEMM3, GEMM2_ACT = "GEMM2_BIAS_SWIGLU_CLAMP", "GEMM3_SWIGLU", "GEMM2_ACT"
BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float32): (1e-5, 1e-5), np.dtype(np.float16): (2e-2, 2e-2), BF16: (5e-2, 5e-2)}


def routed_tokens(rng, tokens, hidden, experts, k, dtype, index_dtype, lead=None, indices=None, scale=1.0):
    """The routed inputs of MOE and QMOE, drawn from ``rng`` in this order: hidden_states [tokens, hidden] (reshaped
    to ``lead`` + [hidden] when given), indices [tokens, k] (``indices`` when given, else k distinct experts a
    token) and routing weights [tokens, k], each row summing to 1."""
    x = (rng.standard_normal((tokens, hidden)) * scale).astype(np.float32).astype(dtype)
    if lead is not None:
        x = x.reshape(*lead, hidden)
    if indices is None:
        indices = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]) if tokens else np.zeros((0, k))
    indices = np.asarray(indices).astype(index_dtype).reshape(tokens, k)
    weights = rng.random((tokens, k)).astype(np.float32)
    weights = (weights / np.maximum(weights.sum(-1, keepdims=True), 1e-6)).astype(dtype)
    return x, weights, indices


def make_inputs(tokens=7, hidden=8, inter=6, experts=4, k=2, expert_type=GEMM2, dtype=np.float32,
                index_dtype=np.int64, bias=True, lead=None, indices=None, seed=0, scale=1.0):
    """Random MOE inputs: hidden_states, routing_weights, indices, weight_0, bias_0, weight_1, bias_1, weight_2."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)

    def rand(*shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(np.float32).astype(dtype)

    x, weights, indices = routed_tokens(rng, tokens, hidden, experts, k, dtype, index_dtype, lead, indices, scale)
    if expert_type == GEMM2:
        w0, w1 = rand(experts, hidden, 2 * inter, s=0.3), rand(experts, inter, hidden, s=0.3)
        b0 = rand(experts, 2 * inter, s=0.3) if bias else None
        b1 = rand(experts, hidden, s=0.3) if bias else None
        return [x, weights, indices, w0, b0, w1, b1, None]
    if expert_type == GEMM2_ACT:
        w0, w1 = rand(experts, inter, hidden, s=0.3), rand(experts, hidden, inter, s=0.3)
        b0 = rand(experts, inter, s=0.3) if bias else None
        b1 = rand(experts, hidden, s=0.3) if bias else None
        return [x, weights, indices, w0, b0, w1, b1, None]
    w0, w1, w2 = rand(experts, inter, hidden, s=0.3), rand(experts, inter, hidden, s=0.3), rand(experts, hidden, inter, s=0.3)
    return [x, weights, indices, w0, None, w1, None, w2]


# GEMM2_ACT's activations on one float64 value, from the textbook formulas.
SCALAR_ACTIVATIONS = {
    "relu": lambda z: z if not z <= 0 else 0.0,
    "relu2": lambda z: (z if not z <= 0 else 0.0) ** 2,
    "gelu": lambda z: z * (1 + math.erf(z / math.sqrt(2))) / 2,
    "gelu_tanh": lambda z: z * (1 + math.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z * z * z))) / 2,
    "silu": lambda z: z / (1 + math.exp(-z)) if z > -700 else 0.0,
    "identity": lambda z: z,
}


def oracle(x, weights, indices, w0, b0, w1, b1, w2, *, expert_type, expert_alpha=1.0, expert_beta=0.0, gate_parity=0,
           activation="", accuracy_level=0):
    """Token by token, slot by slot, in float64: written apart from the reference on purpose (exact at every
    accuracy_level)."""
    flat = x.reshape(int(np.prod(x.shape[:-1])), x.shape[-1]).astype(np.float64)
    k = indices.shape[-1]
    idx = indices.reshape(-1, k)
    wts = weights.reshape(-1, k).astype(np.float64)
    out = np.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(k):
            e = int(idx[t, j])
            if expert_type == GEMM2:
                gu = flat[t] @ w0[e].astype(np.float64) + (0 if b0 is None else b0[e].astype(np.float64))
                gate = np.array([min(v, expert_beta) for v in gu[gate_parity::2]])
                up = np.array([max(-expert_beta, min(v, expert_beta)) for v in gu[1 - gate_parity::2]])
                act = (up + 1) * gate / (1 + np.exp(-expert_alpha * gate))
                y = act @ w1[e].astype(np.float64) + (0 if b1 is None else b1[e].astype(np.float64))
            elif expert_type == GEMM2_ACT:
                up = w0[e].astype(np.float64) @ flat[t] + (0 if b0 is None else b0[e].astype(np.float64))
                act = np.array([SCALAR_ACTIVATIONS[activation](float(v)) for v in up])
                y = w1[e].astype(np.float64) @ act + (0 if b1 is None else b1[e].astype(np.float64))
            else:
                gate = w0[e].astype(np.float64) @ flat[t]
                up = w1[e].astype(np.float64) @ flat[t]
                y = w2[e].astype(np.float64) @ (gate / (1 + np.exp(-expert_alpha * gate)) * up)
            out[t] += wts[t, j] * y
    return out.reshape(x.shape)


G2 = dict(expert_type=GEMM2, expert_alpha=1.702, expert_beta=7.0)
G3 = dict(expert_type=GEMM3)
WEIGHTS = (3, 4, 5, 6, 7)


def _case(name, attrs, atol=None, **kw):
    inputs = make_inputs(expert_type=attrs.get("expert_type", GEMM2), **kw)
    dtype = inputs[0].dtype
    rtol, default_atol = TOL.get(dtype, (1e-5, 1e-5))
    atol = default_atol if atol is None else atol
    return Case("MOE", name, inputs, dict(attrs), constant=WEIGHTS, rtol=rtol, atol=atol)




_base2 = _case("gemm2_fp32", G2)
_base3 = _case("gemm3_fp32", G3)
_x, _w, _i = _base2.inputs[:3]


def _act(activation):
    return dict(expert_type=GEMM2_ACT, activation=activation)


_base_act = _case("act_relu2_fp32", _act("relu2"))
_k_blocks_over_512_gemm3 = _case("gemm3_k_blocks_over_512", G3, tokens=9, hidden=530, inter=520, experts=3, k=2,
                                 scale=0.2, atol=1e-4)

CASES = [
    _base2,
    _base3,
    _case("gemm2_no_bias", G2, bias=False),
    _case("gemm2_gate_parity_1", {**G2, "gate_parity": 1}),
    _case("gemm2_no_clamp", {**G2, "expert_beta": float("inf")}, scale=5.0),
    _case("gemm2_clamp_hit", {**G2, "expert_beta": 0.5}, scale=8.0),
    _case("gemm2_fp16", G2, dtype=np.float16),
    _case("gemm2_bf16", G2, dtype=BF16),
    _case("gemm2_int32_indices", G2, index_dtype=np.int32),
    _case("gemm2_rank3", G2, tokens=6, lead=(2, 3)),
    _case("gemm2_rank4", G2, tokens=12, lead=(2, 3, 2)),
    _case("gemm3_fp16", G3, dtype=np.float16),
    _case("gemm3_bf16", G3, dtype=BF16),
    _case("gemm3_int32_indices", G3, index_dtype=np.int32),
    _case("gemm3_alpha", {**G3, "expert_alpha": 0.5}),
    _case("gemm3_rank3", G3, tokens=6, lead=(3, 2)),
    _case("one_token", G2, tokens=1),
    _case("gemm3_one_token", G3, tokens=1),
    _case("empty", G2, tokens=0),
    _case("hidden_size_zero", G3, hidden=0),
    _case("gemm3_empty", G3, tokens=0, lead=(0, 5)),
    _case("all_on_one_expert", G2, k=1, indices=np.full(7, 2)),
    _case("experts_without_tokens", G3, experts=8, k=2, indices=np.tile([1, 3], (7, 1))),
    _case("k_equals_e", G2, experts=4, k=4),
    _case("gemm3_k_equals_e", G3, experts=3, k=3),
    _case("k1", G3, k=1),
    _case("same_expert_twice", G2, k=2, indices=np.tile([1, 1], (7, 1))),
    _case("more_tokens", G3, tokens=65, hidden=16, inter=12, experts=8, k=2),
    # K > 512 (the C++ GEMM blocks K by 512); outputs reach ~30, so rounding allows ~1e-4 absolute
    _case("k_blocks_over_512", G2, tokens=9, hidden=530, inter=520, experts=3, k=2, scale=0.2, atol=1e-4),
    _k_blocks_over_512_gemm3,
    # accuracy_level 3: bfloat16 GEMM operands allowed (rows enough for the kernels' prefill paths too)
    bf16_compute(_case("gemm2_more_tokens", G2, tokens=40), "gemm2_bf16_compute"),
    bf16_compute(_case("gemm3_fp16_more_tokens", G3, tokens=40, dtype=np.float16), "gemm3_fp16_bf16_compute"),
    bf16_compute(_case("act_silu_bf16", _act("silu"), dtype=BF16, tokens=40), "act_silu_bf16_bf16_compute"),
    bf16_compute(_case("gemm3_empty", G3, tokens=0), "empty_bf16_compute"),
    bf16_compute(_k_blocks_over_512_gemm3, "gemm3_k_blocks_over_512_bf16_compute"),
    Case("MOE", "routing_rank3", [_x, _w.reshape(7, 1, 2), _i.reshape(7, 1, 2), *_base2.inputs[3:]], dict(G2),
         constant=WEIGHTS),
    # GEMM2_ACT: every activation, with and without biases, each float type, the edge cases
    _base_act,
    *(_case(f"act_{a}_fp32", _act(a)) for a in ("relu", "gelu", "gelu_tanh", "silu", "identity")),
    *(_case(f"act_{a}_no_bias", _act(a), bias=False) for a in ("relu2", "gelu", "silu")),
    _base_act.mutated("act_up_bias_only", None, bias_1=None),
    _base_act.mutated("act_down_bias_only", None, bias_0=None),
    *(_case(f"act_{a}_fp16", _act(a), dtype=np.float16) for a in ("relu2", "gelu_tanh", "silu")),
    *(_case(f"act_{a}_bf16", _act(a), dtype=BF16) for a in ("relu2", "gelu", "identity")),
    _case("act_int32_indices", _act("gelu"), index_dtype=np.int32),
    _case("act_rank3", _act("relu2"), tokens=6, lead=(2, 3)),
    _case("act_one_token", _act("relu2"), tokens=1),
    _case("act_empty", _act("relu2"), tokens=0),
    _case("act_empty_rank3", _act("gelu"), tokens=0, lead=(0, 5)),
    _case("act_k_equals_e", _act("silu"), experts=4, k=4),
    _case("act_all_on_one_expert", _act("relu2"), k=1, indices=np.full(7, 2)),
    _case("act_experts_without_tokens", _act("gelu"), experts=8, k=2, indices=np.tile([1, 3], (7, 1))),
    _case("act_inter_zero", _act("relu2"), inter=0),  # y = down bias only
    _case("act_more_tokens", _act("relu2"), tokens=65, hidden=16, inter=40, experts=8, k=2),
    _case("act_k_blocks_over_512", _act("gelu_tanh"), tokens=9, hidden=530, inter=520, experts=3, k=2, scale=0.2,
          atol=1e-4),
    _base_act.mutated("act_nan_propagates", None,
                      hidden_states=np.where(np.arange(7)[:, None] == 3, np.nan, _base_act.inputs[0]).astype(np.float32)),
    _base2.mutated("nan_propagates", None,
            hidden_states=np.where(np.arange(7)[:, None] == 3, np.nan, _x).astype(np.float32)),
    # errors: values
    _base2.mutated("index_too_large", runtime=True, error=r"router_topk_output_indices\[.*\] = 4 is outside \[0, 4\)",
            router_topk_output_indices=np.where(_i == _i[2, 1], 4, _i)),
    _base2.mutated("index_negative", runtime=True, error=r"router_topk_output_indices\[.*\] = -1 is outside \[0, 4\)",
            router_topk_output_indices=np.where(_i == _i[0, 0], -1, _i)),
    # errors: attributes
    _base2.mutated("unknown_expert_type", r"attribute 'expert_type' is 'SWIGLU'; expected one of", expert_type="SWIGLU"),
    _base2.mutated("expert_type_with_nul", r"attribute 'expert_type' is 'GEMM3_SWIGLU\\x00x'; expected one of",
            expert_type="GEMM3_SWIGLU\x00x"),  # escaped as Python's repr escapes it: a raw NUL cut the message
    _base2.mutated("expert_type_quote_newline", r"attribute 'expert_type' is \"it's\\n\"; expected one of",
            expert_type="it's\n"),
    _base2.mutated("expert_type_invalid_utf8", "attribute 'expert_type' is 'GEMM3\ufffd\ufffdx\\\\xa0'; expected",
            expert_type=b"GEMM3\xff\xe2\x82x\xc2\xa0"),  # decoded as Python decodes it with errors="replace"
    _base2.mutated("missing_expert_type", r"attribute 'expert_type' is required", expert_type=None),
    _base2.mutated("clamp_bound_zero", r"attribute 'expert_beta' is 0.0; expected a value > 0", expert_beta=0.0),
    _base2.mutated("clamp_bound_absent", r"attribute 'expert_beta' is 0.0; expected a value > 0", expert_beta=None),
    _base2.mutated("alpha_nan", r"attribute 'expert_alpha' is nan", expert_alpha=float("nan")),
    _base2.mutated("gate_parity_2", r"attribute 'gate_parity' is 2; expected one of 0, 1", gate_parity=2),
    # errors: attribute types (helper.make_node types an attribute by its Python value) and names
    _base2.mutated("attr_alpha_int", r"attribute 'expert_alpha' has type INT; expected FLOAT", expert_alpha=2),
    _base2.mutated("attr_beta_int", r"attribute 'expert_beta' has type INT; expected FLOAT", expert_beta=7),
    _base2.mutated("attr_beta_string", r"attribute 'expert_beta' has type STRING; expected FLOAT", expert_beta="7"),
    _base2.mutated("attr_beta_floats", r"attribute 'expert_beta' has type FLOATS; expected FLOAT", expert_beta=[7.0]),
    _base2.mutated("attr_parity_float", r"attribute 'gate_parity' has type FLOAT; expected INT", gate_parity=1.0),
    _base2.mutated("attr_type_ints", r"attribute 'expert_type' has type INTS; expected STRING", expert_type=[1]),
    _base2.mutated("tp_world_size_0", r"attribute 'tp_world_size' is 0; expected >= 1", tp_world_size=0),
    _base2.mutated("tp_rank_outside", r"attribute 'tp_rank_id' is 2; expected 0 <= tp_rank_id < tp_world_size = 2",
                   tp_world_size=2, tp_rank_id=2),
    _base2.mutated("tp_rank_negative", r"attribute 'tp_rank_id' is -1; expected 0 <= tp_rank_id < tp_world_size = 1",
                   tp_rank_id=-1),
    _base2.mutated("attr_misspelled", r"attribute 'expert_alhpa' is not an attribute of MOE; expected one of "
            r"'expert_type', 'expert_alpha', 'expert_beta', 'gate_parity', 'activation', 'tp_world_size', "
            r"'tp_rank_id', 'accuracy_level'$", session=True,
            expert_alhpa=1.0),
    _base2.mutated("accuracy_level_4", r"attribute 'accuracy_level' is 4; expected one of 0, 3$", accuracy_level=4),
    _base3.mutated("accuracy_level_1", r"attribute 'accuracy_level' is 1; expected one of 0, 3$", accuracy_level=1),
    _base2.mutated("attr_accuracy_level_float", r"attribute 'accuracy_level' has type FLOAT; expected INT$",
                   accuracy_level=3.0),
    # errors: shapes and types
    _base2.mutated("hidden_rank1", r"input 'hidden_states' has rank 1 .*expected rank >= 2", hidden_states=_x[0]),
    _base2.mutated("weight_0_rank2", r"input 'weight_0' has rank 2 .*expected rank 3",
            weight_0=_base2.inputs[3][0]),
    _base2.mutated("weight_1_wrong_inter", r"input 'weight_1' dim 1 is 5; expected I = 6",
            weight_1=_base2.inputs[5][:, :5]),
    _base2.mutated("weight_0_odd", r"input 'weight_0' dim 2 is 11; expected an even size",
            weight_0=_base2.inputs[3][:, :, :11]),
    _base2.mutated("hidden_mismatch", r"input 'weight_0' dim 1 is 7; expected H = 8",
            weight_0=_base2.inputs[3][:, :7]),
    _base2.mutated("experts_mismatch", r"input 'weight_1' dim 0 is 3; expected E = 4",
            weight_1=_base2.inputs[5][:3]),
    _base2.mutated("bias_1_wrong", r"input 'bias_1' dim 1 is 4; expected H = 8", bias_1=_base2.inputs[6][:, :4]),
    _base2.mutated("k_mismatch", r"input 'router_topk_output_indices' dim -1 is 1; expected k = 2",
            router_topk_output_indices=_i[:, :1]),
    _base2.mutated("tokens_mismatch", r"input 'routing_weights' leading dims \(product\) is 6; expected T = 7",
            routing_weights=_w[:6]),
    _base2.mutated("index_float", r"input 'router_topk_output_indices' has type float32; expected int32, int64",
            router_topk_output_indices=_i.astype(np.float32)),
    _base2.mutated("routing_fp16", r"input 'routing_weights' has type float16; expected float32",
            routing_weights=_w.astype(np.float16)),
    _base2.mutated("hidden_int8", r"input 'hidden_states' has type int8; expected float32, float16, bfloat16",
            hidden_states=_x.astype(np.int8)),
    _base2.mutated("hidden_uint16", r"input 'hidden_states' has type uint16; expected float32, float16, bfloat16",
            hidden_states=_x.astype(np.uint16)),
    _base2.mutated("index_int16", r"input 'router_topk_output_indices' has type int16; expected int32, int64",
            router_topk_output_indices=_i.astype(np.int16)),
    _base2.mutated("index_uint64", r"input 'router_topk_output_indices' has type uint64; expected int32, int64",
            router_topk_output_indices=_i.astype(np.uint64)),
    _base2.mutated("weight_2_for_gemm2", r"input 'weight_2' is given, but GEMM2_BIAS_SWIGLU_CLAMP does not use it",
            weight_2=_base3.inputs[7]),
    _base3.mutated("bias_for_gemm3", r"input 'bias_0' is given, but GEMM3_SWIGLU does not use it",
            bias_0=_base2.inputs[4]),
    _base3.mutated("gemm3_missing_down", r"input 'weight_2' is required", weight_2=None),
    _base3.mutated("gemm3_down_shape", r"input 'weight_2' dim 2 is 5; expected I = 6",
            weight_2=_base3.inputs[7][:, :, :5]),
    # errors: GEMM2_ACT
    _base_act.mutated("act_missing_activation", r"attribute 'activation' is required for GEMM2_ACT$", activation=None),
    _base_act.mutated("act_empty_activation", r"attribute 'activation' is required for GEMM2_ACT$", activation=""),
    _base_act.mutated("act_unknown_activation", r"attribute 'activation' is 'swish'; expected one of 'relu', 'relu2', "
                      r"'gelu', 'gelu_tanh', 'silu', 'identity'$", activation="swish"),
    _base_act.mutated("act_activation_int", r"attribute 'activation' has type INT; expected STRING", activation=2),
    _base3.mutated("activation_on_gemm3", r"attribute 'activation' is 'relu'; GEMM3_SWIGLU does not use it \(its "
                   r"activation is SwiGLU\): leave it empty$", activation="relu"),
    _base2.mutated("activation_on_gemm2", r"attribute 'activation' is 'silu'; GEMM2_BIAS_SWIGLU_CLAMP does not use it",
                   activation="silu"),
    _base_act.mutated("act_expert_alpha", r"attribute 'expert_alpha' is 0.5; GEMM2_ACT does not use it: leave the "
                      r"default 1.0$", expert_alpha=0.5),
    # a float attribute is float32 in a node: the message shows the value every backend sees
    _base_act.mutated("act_expert_alpha_float32", r"attribute 'expert_alpha' is 1.7020000219345093; GEMM2_ACT does not "
                      r"use it", expert_alpha=1.702),
    _base_act.mutated("act_expert_beta", r"attribute 'expert_beta' is 7.0; GEMM2_ACT does not use it: leave the "
                      r"default 0.0$", expert_beta=7.0),
    _base_act.mutated("act_gate_parity", r"attribute 'gate_parity' is 1; GEMM2_ACT does not use it: leave the "
                      r"default 0$", gate_parity=1),
    _base_act.mutated("act_weight_2_given", r"input 'weight_2' is given, but GEMM2_ACT does not use it",
                      weight_2=_base3.inputs[7]),
    _base_act.mutated("act_missing_down", r"input 'weight_1' is required", weight_1=None),
    _base_act.mutated("act_up_hidden", r"input 'weight_0' dim 2 is 7; expected H = 8",
                      weight_0=_base_act.inputs[3][:, :, :7]),
    _base_act.mutated("act_down_inter", r"input 'weight_1' dim 2 is 5; expected I = 6",
                      weight_1=_base_act.inputs[5][:, :, :5]),
    _base_act.mutated("act_down_experts", r"input 'weight_1' dim 0 is 3; expected E = 4",
                      weight_1=_base_act.inputs[5][:3]),
    _base_act.mutated("act_bias_0_wrong", r"input 'bias_0' dim 1 is 4; expected I = 6",
                      bias_0=_base_act.inputs[4][:, :4]),
    _base_act.mutated("act_bias_1_wrong", r"input 'bias_1' dim 1 is 4; expected H = 8",
                      bias_1=_base_act.inputs[6][:, :4]),
    _base_act.mutated("act_bias_0_rank3", r"input 'bias_0' has rank 3 .*expected rank 2",
                      bias_0=_base_act.inputs[4][:, :, None]),
    _base_act.mutated("act_index_too_large", runtime=True,
                      error=r"router_topk_output_indices\[.*\] = 4 is outside \[0, 4\)",
                      router_topk_output_indices=np.where(_i == _i[2, 1], 4, _i)),
]
