"""Fusions of transformers 5 ``batched_mm`` experts, as ``torch.onnx.export(dynamo=True)`` writes them.

Every (token, slot) pair runs its own expert: the tokens are repeated k times (repeat_interleave),
each slot gathers its expert's weights with ``GatherND`` and a batched ``MatMul`` applies them, and
the slot outputs are multiplied by the routing weights and summed over k. Each rule replaces that
block, from the repeated tokens to the ``ReduceSum`` over k, by one MOE node fed by the router's
TopK indices and by the exact tensor the slots were multiplied by (renormalized or not). The router,
the shared expert of Qwen2-MoE and the reshape back to [B, S, H] stay as they are.

Shapes in names: T tokens, k experts per token, Tk = T * k slots, H hidden size, I expert
intermediate size, E experts.
"""

from __future__ import annotations

import dataclasses
import math

import onnx_ir as ir
from onnxscript.rewriter import pattern

from ..ops.moe import GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU
from ._match import MoeFusion, Weight, constant_ints, constant_scalar, emit_moe, require, weight, weight_value


def _ints(value: ir.Value, what: str) -> list[int]:
    ints = constant_ints(value)
    require(ints is not None, f"{what} is not an integer constant")
    return ints


def _bound(value: ir.Value | None, absent: float, what: str) -> float:
    """A clamp bound: ``absent`` when the Clip input is empty, else its scalar constant."""
    if value is None:
        return absent
    bound = constant_scalar(value)
    require(bound is not None, f"{what} is not a scalar constant")
    return bound


def _last_dim(value: ir.Value) -> int | None:
    shape = value.shape
    if shape is None or shape.rank() == 0 or not isinstance(shape[-1], int):
        return None
    return shape[-1]


def _weight(value: ir.Value, dtype: ir.DataType, what: str, shape: tuple[int | str, ...], layout: str) -> Weight:
    """The constant behind ``value`` (through layout-only ops), checked against ``shape`` (``layout``
    names its dims, E being the router's expert count); "2I" in ``shape`` stands for any even size."""
    w = weight(value)
    require(w is not None, f"{what} is not a constant tensor")
    fits = len(w.shape) == len(shape) and all(
        got == want if isinstance(want, int) else got % 2 == 0 for got, want in zip(w.shape, shape))
    require(fits, f"{what} has shape {list(w.shape)}, expected [{', '.join(map(str, shape))}] = {layout}")
    require(w.dtype == dtype, f"{what} is {w.dtype}, the tokens are {dtype}")
    return w


def _require_plain_gathers(b: dict, *names: str) -> None:
    """The GatherNDs that compute these bound values gather whole rows (batch_dims 0)."""
    for name in names:
        node = b[name].producer()
        require(node.attributes.get_int("batch_dims", 0) == 0, f"GatherND of {name} has batch_dims != 0")


# ----------------------------------------------------------------------------- shared pattern parts

def _slots(op, tokens_TH, topk_indices_TK):
    """The tokens repeated k times, [Tk, H], and each slot's expert as a GatherND index, [Tk, 1]."""
    tokens_TkH = op.Reshape(op.Expand(op.Unsqueeze(tokens_TH, pattern.Var("repeat_axis")),
                                      pattern.Var("repeat_shape")), pattern.Var("slots_shape"))
    expert_Tk1 = op.Unsqueeze(op.Reshape(topk_indices_TK, pattern.Var("index_flat_shape")),
                              pattern.Var("index_axis"))
    return tokens_TkH, expert_Tk1


def _swish(op, gate):
    """gate * Sigmoid(gate * alpha), or gate * Sigmoid(gate) (alpha 1: SiLU)."""
    return op.Mul(gate, op.Sigmoid(pattern.OrValue([op.Mul(gate, pattern.Var("alpha")), gate])))


def _alpha(b: dict) -> float:
    if b.get("alpha") is None:
        return 1.0
    alpha = constant_scalar(b["alpha"])
    require(alpha is not None and math.isfinite(alpha), "the swish alpha (Mul before Sigmoid) is not a finite scalar")
    return alpha


def _weighted_sum(op, experts_TkH, routing_TK):
    """sum over k of routing_weights * expert outputs: [Tk, H] -> [T, k, H] -> [T, H]."""
    routing_Tk1 = op.Unsqueeze(op.Reshape(routing_TK, pattern.Var("routing_flat_shape")),
                               pattern.Var("routing_axis"))
    weighted_TkH = op.Mul(experts_TkH, routing_Tk1)
    return op.ReduceSum(op.Reshape(weighted_TkH, pattern.Var("sum_shape")), pattern.Var("sum_axis"),
                        _outputs=["out_TH"])


@dataclasses.dataclass(frozen=True)
class _Slots:
    """What the checks of the shared slot frame read: H, E (the router's width) and the tokens' type."""

    hidden: int
    experts: int
    dtype: ir.DataType


def _check_slots(b: dict) -> _Slots:
    """Checks the repeat, the expert index, the routing weights and the sum over k; returns H, E, type."""
    tokens, indices, routing = b["tokens_TH"], b["topk_indices_TK"], b["routing_TK"]
    topk = indices.producer()
    require(topk is not None and topk.op_type == "TopK" and indices.index() == 1,
            "the expert indices are not the indices output of a TopK")
    k = _ints(topk.inputs[1], "TopK k")[0]
    scores = topk.inputs[0]
    experts = _last_dim(scores)
    require(experts is not None, "the router scores have no static expert count (last dim)")
    require(topk.attributes.get_int("axis", -1) in (-1, scores.shape.rank() - 1),
            "TopK does not select along the last (expert) axis")
    hidden = _last_dim(tokens)
    require(tokens.shape is not None and tokens.shape.rank() == 2 and hidden is not None,
            "the tokens are not [T, H] with a static H")

    require(_ints(b["repeat_axis"], "repeat_interleave Unsqueeze axes") in ([1], [-2]),
            "repeat_interleave does not unsqueeze axis 1")
    repeat = _ints(b["repeat_shape"], "repeat_interleave Expand shape")
    require(repeat == [1, k, 1], f"repeat_interleave expands to {repeat}, expected [1, {k}, 1] (k from TopK)")
    require(_ints(b["slots_shape"], "repeated tokens shape") == [-1, hidden],
            f"the repeated tokens are not reshaped to [-1, {hidden}]")
    require(_ints(b["index_flat_shape"], "expert index shape") == [-1], "the expert indices are not flattened")
    require(_ints(b["index_axis"], "expert index Unsqueeze axes") in ([1], [-1]),
            "the expert index is not unsqueezed on its last axis")

    require(_last_dim(routing) == k, f"the routing weights are not [T, k={k}]")
    require(_ints(b["routing_flat_shape"], "routing weights shape") == [-1], "the routing weights are not flattened")
    require(_ints(b["routing_axis"], "routing weights Unsqueeze axes") in ([1], [-1]),
            "the routing weights are not unsqueezed on their last axis")
    sum_shape = _ints(b["sum_shape"], "sum reshape")
    require(sum_shape == [-1, k, hidden],
            f"the weighted slots are reshaped to {sum_shape}, expected [-1, {k}, {hidden}]")
    require(_ints(b["sum_axis"], "ReduceSum axes") in ([1], [-2]), "ReduceSum is not over the k axis")
    require(b["out_TH"].producer().attributes.get_int("keepdims", 1) == 0, "ReduceSum keeps the k axis")
    require(routing.dtype == tokens.dtype, "the routing weights and the tokens have different types")
    return _Slots(hidden, experts, tokens.dtype)


class _BatchedMmFusion(MoeFusion):
    """``check`` reads the block with ``_read`` (whose ``require`` fails the match with the check that
    failed) and keeps it for ``rewrite``, which onnxscript calls right after a successful check of
    the same match."""

    def check(self, context, **bindings) -> bool:
        self._block = self._read(bindings)
        return True


# ----------------------------------------------------------------------------- GPT-OSS

@dataclasses.dataclass(frozen=True)
class _GptOssBlock:
    gate_up: Weight
    gate_up_bias: Weight
    down: Weight
    down_bias: Weight
    alpha: float
    beta: float
    gate_parity: int


class BatchedMmGptOss(_BatchedMmFusion):
    """GPT-OSS experts (biases, interleaved gate/up, clamped SwiGLU) -> MOE GEMM2_BIAS_SWIGLU_CLAMP::

        tokens_TkH = Reshape(Expand(Unsqueeze(tokens_TH, 1), [1, k, 1]), [-1, H])
        expert_Tk1 = Unsqueeze(Reshape(TopK(scores)[1], [-1]), -1)
        gate_up_Tk2I = Squeeze(MatMul(Unsqueeze(tokens_TkH, 1), GatherND(gate_up_EH2I, expert_Tk1)), 1)
                       + GatherND(gate_up_bias_E2I, expert_Tk1)        (then Squeeze(Unsqueeze(., a), a))
        gate = Clip(Slice(gate_up_Tk2I, p, end, -1, 2), , beta)      p = gate_parity
        up = Clip(Slice(gate_up_Tk2I, 1 - p, end, -1, 2), -beta, beta)
        act_TkI = (up + 1) * (gate * Sigmoid(gate * alpha))          (alpha 1 may be left out)
        down_TkH = Squeeze(MatMul(Unsqueeze(act_TkI, 1), GatherND(down_EIH, expert_Tk1)), 1)
                   + GatherND(down_bias_EH, expert_Tk1)                 (then Squeeze(Unsqueeze(., a), a))
        out_TH = ReduceSum(Reshape(down_TkH * Unsqueeze(Reshape(routing_TK, [-1]), -1), [-1, k, H]), 1)
    """

    def pattern(self, op, tokens_TH, topk_indices_TK, routing_TK, gate_up_EH2I, gate_up_bias_E2I,
                down_EIH, down_bias_EH, gate_up_row_axis, down_row_axis, gate_up_noop_axis, down_noop_axis,
                gate_start, gate_end, gate_axes, gate_step, up_start, up_end, up_axes, up_step, one):
        tokens_TkH, expert_Tk1 = _slots(op, tokens_TH, topk_indices_TK)
        gate_up_Tk2I = op.Add(
            op.Squeeze(op.MatMul(op.Unsqueeze(tokens_TkH, gate_up_row_axis),
                                 op.GatherND(gate_up_EH2I, expert_Tk1, _outputs=["gate_up_TkH2I"])),
                       gate_up_row_axis),
            op.GatherND(gate_up_bias_E2I, expert_Tk1, _outputs=["gate_up_bias_Tk2I"]))
        gate_up_Tk2I = op.Squeeze(op.Unsqueeze(gate_up_Tk2I, gate_up_noop_axis), gate_up_noop_axis)
        gate_TkI = op.Clip(op.Slice(gate_up_Tk2I, gate_start, gate_end, gate_axes, gate_step),
                           pattern.Var("gate_min", can_match_none=True), pattern.Var("gate_max", can_match_none=True))
        up_TkI = op.Clip(op.Slice(gate_up_Tk2I, up_start, up_end, up_axes, up_step),
                         pattern.Var("up_min", can_match_none=True), pattern.Var("up_max", can_match_none=True))
        act_TkI = op.Mul(op.Add(up_TkI, one), _swish(op, gate_TkI))
        down_TkH = op.Add(
            op.Squeeze(op.MatMul(op.Unsqueeze(act_TkI, down_row_axis),
                                 op.GatherND(down_EIH, expert_Tk1, _outputs=["down_TkIH"])),
                       down_row_axis),
            op.GatherND(down_bias_EH, expert_Tk1, _outputs=["down_bias_TkH"]))
        down_TkH = op.Squeeze(op.Unsqueeze(down_TkH, down_noop_axis), down_noop_axis)
        return _weighted_sum(op, down_TkH, routing_TK)

    @staticmethod
    def _read(b: dict) -> _GptOssBlock:
        slots = _check_slots(b)
        E, H, dtype = slots.experts, slots.hidden, slots.dtype
        gate_up = _weight(b["gate_up_EH2I"], dtype, "gate_up", (E, H, "2I"), "[E, H, 2I]")
        two_i = gate_up.shape[2]
        gate_up_bias = _weight(b["gate_up_bias_E2I"], dtype, "gate_up bias", (E, two_i), "[E, 2I]")
        down = _weight(b["down_EIH"], dtype, "down", (E, two_i // 2, H), "[E, I, H]")
        down_bias = _weight(b["down_bias_EH"], dtype, "down bias", (E, H), "[E, H]")
        _require_plain_gathers(b, "gate_up_TkH2I", "gate_up_bias_Tk2I", "down_TkIH", "down_bias_TkH")
        for axis in ("gate_up_row_axis", "down_row_axis"):
            require(_ints(b[axis], "bmm Unsqueeze axes") in ([1], [-2]), "the bmm does not multiply [Tk, 1, in] rows")

        starts = (_ints(b["gate_start"], "gate Slice start"), _ints(b["up_start"], "up Slice start"))
        require(sorted(starts) == [[0], [1]],
                f"the gate and up Slices start at {starts[0]} and {starts[1]}, expected 0 and 1 (interleaved)")
        for half, start in zip(("gate", "up"), starts):
            step = _ints(b[f"{half}_step"], f"{half} Slice step")
            require(step == [2], f"the {half} Slice step is {step}, expected 2 (interleaved)")
            require(_ints(b[f"{half}_axes"], f"{half} Slice axes") in ([1], [-1]),
                    f"the {half} Slice is not on the last axis")
            end = _ints(b[f"{half}_end"], f"{half} Slice end")
            require(len(end) == 1 and len(range(start[0], min(end[0], two_i), 2)) == two_i // 2,
                    f"the {half} Slice ends at {end}: not all I = {two_i // 2} columns")

        gate_min = _bound(b["gate_min"], -math.inf, "gate clamp min")
        require(gate_min == -math.inf,
                f"the gate clamp has a lower bound ({gate_min}); MOE clamps the gate from above only")
        beta = _bound(b["gate_max"], math.inf, "gate clamp max")
        require(beta > 0, f"the gate clamp bound is {beta}, must be > 0")
        up_min, up_max = _bound(b["up_min"], -math.inf, "up clamp min"), _bound(b["up_max"], math.inf, "up clamp max")
        require(up_min == -beta and up_max == beta,
                f"up is clamped to [{up_min}, {up_max}], expected [-{beta}, {beta}] (the gate's bound)")
        require(constant_scalar(b["one"]) == 1.0, f"up is offset by {constant_scalar(b['one'])}, expected +1")
        return _GptOssBlock(gate_up, gate_up_bias, down, down_bias, _alpha(b), beta, starts[0][0])

    def rewrite(self, op, tokens_TH, topk_indices_TK, routing_TK, **_):
        block = self._block
        return emit_moe(op, tokens_TH, routing_TK, topk_indices_TK, expert_type=GEMM2_BIAS_SWIGLU_CLAMP,
                        weight_0=weight_value(op, block.gate_up, "moe_gate_up_EH2I"),
                        bias_0=weight_value(op, block.gate_up_bias, "moe_gate_up_bias_E2I"),
                        weight_1=weight_value(op, block.down, "moe_down_EIH"),
                        bias_1=weight_value(op, block.down_bias, "moe_down_bias_EH"),
                        expert_alpha=block.alpha, expert_beta=block.beta, gate_parity=block.gate_parity)


# ----------------------------------------------------------------------------- Qwen3 / Mixtral / OLMoE / Qwen2

@dataclasses.dataclass(frozen=True)
class _SwigluBlock:
    gate_up: Weight
    down: Weight
    gate_half: int
    alpha: float


class BatchedMmSwiglu(_BatchedMmFusion):
    """SwiGLU experts with one gate_up [E, 2I, H] tensor (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE)
    -> MOE GEMM3_SWIGLU::

        tokens_TkH = Reshape(Expand(Unsqueeze(tokens_TH, 1), [1, k, 1]), [-1, H])
        expert_Tk1 = Unsqueeze(Reshape(TopK(scores)[1], [-1]), -1)
        gate_up_Tk2I = Squeeze(MatMul(GatherND(gate_up_E2IH, expert_Tk1), Unsqueeze(tokens_TkH, -1)), -1)
        first, second = Split(gate_up_Tk2I, axis=-1, num_outputs=2)
        act_TkI = first * Sigmoid(first) * second      (or the halves swapped: gate_half 1;
                                                        Sigmoid(first * alpha) for a swish other than SiLU)
        down_TkH = Squeeze(MatMul(GatherND(down_EHI, expert_Tk1), Unsqueeze(act_TkI, -1)), -1)
        out_TH = ReduceSum(Reshape(down_TkH * Unsqueeze(Reshape(routing_TK, [-1]), -1), [-1, k, H]), 1)

    The gate (MOE weight_0) is the half of gate_up whose Split output goes through the Sigmoid.
    """

    def pattern(self, op, tokens_TH, topk_indices_TK, routing_TK, gate_up_E2IH, down_EHI,
                gate_up_col_axis, down_col_axis):
        tokens_TkH, expert_Tk1 = _slots(op, tokens_TH, topk_indices_TK)
        gate_up_Tk2I = op.Squeeze(op.MatMul(op.GatherND(gate_up_E2IH, expert_Tk1, _outputs=["gate_up_Tk2IH"]),
                                            op.Unsqueeze(tokens_TkH, gate_up_col_axis)),
                                  gate_up_col_axis)
        first, second = op.Split(gate_up_Tk2I, _allow_other_inputs=True, _outputs=["first_half", "second_half"])
        act_TkI = pattern.OrValue([op.Mul(_swish(op, first), second), op.Mul(_swish(op, second), first)],
                                  tag_var="gate_half", tag_values=[0, 1])
        down_TkH = op.Squeeze(op.MatMul(op.GatherND(down_EHI, expert_Tk1, _outputs=["down_TkHI"]),
                                        op.Unsqueeze(act_TkI, down_col_axis)),
                              down_col_axis)
        return _weighted_sum(op, down_TkH, routing_TK)

    @staticmethod
    def _read(b: dict) -> _SwigluBlock:
        slots = _check_slots(b)
        E, H, dtype = slots.experts, slots.hidden, slots.dtype
        gate_up = _weight(b["gate_up_E2IH"], dtype, "gate_up", (E, "2I", H), "[E, 2I, H]")
        two_i = gate_up.shape[1]
        down = _weight(b["down_EHI"], dtype, "down", (E, H, two_i // 2), "[E, H, I]")
        _require_plain_gathers(b, "gate_up_Tk2IH", "down_TkHI")
        for axis in ("gate_up_col_axis", "down_col_axis"):
            require(_ints(b[axis], "bmm Unsqueeze axes") in ([2], [-1]),
                    "the bmm does not multiply [Tk, in, 1] columns")

        split = b["first_half"].producer()
        require(split.attributes.get_int("axis", 0) in (1, -1), "gate_up is not split along its last axis")
        sizes = constant_ints(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else None
        halves = sizes == [two_i // 2] * 2 if sizes is not None else split.attributes.get_int("num_outputs", 0) == 2
        require(halves, f"gate_up is not split into two halves of I = {two_i // 2}")
        return _SwigluBlock(gate_up, down, b["gate_half"], _alpha(b))

    def rewrite(self, op, tokens_TH, topk_indices_TK, routing_TK, **_):
        block = self._block
        experts, two_i, hidden = block.gate_up.shape
        i = two_i // 2
        gate_rows = slice(0, i) if block.gate_half == 0 else slice(i, two_i)
        up_rows = slice(i, two_i) if block.gate_half == 0 else slice(0, i)
        return emit_moe(op, tokens_TH, routing_TK, topk_indices_TK, expert_type=GEMM3_SWIGLU,
                        weight_0=weight_value(op, block.gate_up, "moe_gate_EIH", lambda a: a[:, gate_rows],
                                              (experts, i, hidden)),
                        weight_1=weight_value(op, block.gate_up, "moe_up_EIH", lambda a: a[:, up_rows],
                                              (experts, i, hidden)),
                        weight_2=weight_value(op, block.down, "moe_down_EHI"),
                        expert_alpha=block.alpha)


FUSIONS = [BatchedMmGptOss, BatchedMmSwiglu]
