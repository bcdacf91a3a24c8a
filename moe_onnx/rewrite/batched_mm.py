"""Fusions of transformers 5 ``batched_mm`` experts, as ``torch.onnx.export`` writes them.

Every (token, slot) pair runs its own expert: the tokens are repeated k times (repeat_interleave),
each slot gathers its expert's weights and a batched ``MatMul`` applies them, and the slot outputs
are multiplied by the routing weights and summed over k. Each exporter writes the frame its way
(the ``torchscript`` class attribute picks one):

- dynamo=True: ``Reshape(Expand(Unsqueeze(tokens, 1), [1, k, 1]), [-1, H])`` repeats the tokens,
  ``GatherND(W, Unsqueeze(Reshape(indices, [-1]), -1))`` gathers the weights, ``Split`` halves gate_up;
- dynamo=False (TorchScript): ``Flatten(Tile(Unsqueeze(tokens, 1), [1, k, 1]), 2)`` with the repeats
  computed from the shapes (OneHot), ``Gather(W, Reshape(indices, [-1]), axis=0)``, two ``Slice`` halves
  (torch.chunk) and the sum's [T, k, H] shape computed from the shapes.

Each rule replaces that block, from the repeated tokens to the ``ReduceSum`` over k, by one MOE node
fed by the router's TopK indices and by the exact tensor the slots were multiplied by (renormalized or
not). The router, the shared expert of Qwen2-MoE and the reshape back to [B, S, H] stay as they are
(passes over the fused graph may fold them: gating.py, shared_expert.py). At float16 and bfloat16 transformers
sums the slots in float32 and casts the sum back: each rule has a ``...Float32Sum`` twin for that frame
(:func:`_weighted_sum`). Weights come
[E, out, in] (``MatMul(GatherND(W), column)``) or, with transformers' ``is_transposed=True`` (AriaText,
and GPT-OSS's own layout), [E, in, out] (``MatMul(row, GatherND(W))``).

Shapes in names: T tokens, k experts per token, Tk = T * k slots, H hidden size, I expert
intermediate size, E experts.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
from onnxscript.rewriter import pattern

from .._ir.builder import typed
from .._ir.weights import Weight, weight, weight_value
from ..ops.moe import GEMM2_ACT, GEMM2_BIAS_SWIGLU_CLAMP, GEMM3_SWIGLU
from ._activation import clamped_swiglu, pointwise, read_clamped_swiglu, read_pointwise, read_swiglu, swiglu
from ._match import MoeFusion, constant_ints, emit_moe, require, shape_dims, static_last_dim
from ._router import Route, route


def _ints(value: ir.Value, what: str) -> list[int]:
    ints = constant_ints(value)
    require(ints is not None, f"{what} is not an integer constant")
    return ints


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
    """The GatherNDs (batch_dims 0) or Gathers (axis 0) that compute these bound values gather whole experts."""
    for name in names:
        node = b[name].producer()
        if node.op_type == "GatherND":
            require(node.attributes.get_int("batch_dims", 0) == 0, f"GatherND of {name} has batch_dims != 0")
        else:
            require(node.attributes.get_int("axis", 0) == 0, f"Gather of {name} is not along axis 0 (the experts)")


def _slice_bounds(node: ir.Node, width: int) -> tuple[int, int] | None:
    """``(start, end)`` of a step-1 Slice of the last axis of ``width`` columns, clamped; None if not one."""
    starts, ends = shape_dims(node.inputs[1]), shape_dims(node.inputs[2])
    axes = constant_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    steps = constant_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
    if starts is None or ends is None or axes not in ([-1], [1]) or steps != [1] \
            or not all(isinstance(bound, int) for bound in starts + ends) or len(starts) != 1 or len(ends) != 1:
        return None
    return tuple(min(width, max(0, bound + width if bound < 0 else bound)) for bound in (starts[0], ends[0]))


def _require_halves(first: ir.Value, second: ir.Value, two_i: int) -> None:
    """``first`` and ``second`` are gate_up's halves [0, I) and [I, 2I) along its last axis: the outputs of
    one Split, or two Slices (torch.chunk through TorchScript)."""
    node = first.producer()
    if node.op_type == "Split":
        require(node.attributes.get_int("axis", 0) in (1, -1), "gate_up is not split along its last axis")
        sizes = constant_ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        halves = sizes == [two_i // 2] * 2 if sizes is not None else node.attributes.get_int("num_outputs", 0) == 2
        require(halves, f"gate_up is not split into two halves of I = {two_i // 2}")
        return
    bounds = [_slice_bounds(half.producer(), two_i) for half in (first, second)]
    expected = [(0, two_i // 2), (two_i // 2, two_i)]
    require(bounds == expected, f"gate_up is sliced into columns {bounds}, expected the halves {expected}")


# ----------------------------------------------------------------------------- shared pattern parts

def _slots(op, tokens_TH, topk_indices_TK, torchscript: bool):
    """The tokens repeated k times, [Tk, H], and each slot's expert: a GatherND index [Tk, 1] (dynamo),
    or a Gather index [Tk] (TorchScript)."""
    tokens_T1H = op.Unsqueeze(tokens_TH, pattern.Var("repeat_axis"))
    expert_Tk = op.Reshape(topk_indices_TK, pattern.Var("index_flat_shape"))
    if torchscript:
        return op.Flatten(op.Tile(tokens_T1H, pattern.Var("repeat_shape")), _outputs=["tokens_TkH"]), expert_Tk
    tokens_TkH = op.Reshape(op.Expand(tokens_T1H, pattern.Var("repeat_shape")), pattern.Var("slots_shape"))
    return tokens_TkH, op.Unsqueeze(expert_Tk, pattern.Var("index_axis"))


def _chunk_halves(op, x):
    """``torch.chunk(x, 2, -1)`` as TorchScript writes it: the chunk width ``(size(-1) + 1) // 2`` from
    ``Shape(x)``, then ``Slice(x, 0, 1 * width, -1)`` and ``Slice(x, 1 * width, 2 * width, -1)`` (outputs
    named ``first_half`` and ``second_half``; the constants are checked by :func:`_require_halves`)."""
    width = op.Div(op.Add(op.Gather(op.Shape(x), pattern.Var("chunk_dim")), pattern.Var("chunk_round_up")),
                   pattern.Var("chunk_count"))
    first_end = op.Mul(width, pattern.Var("first_end_chunks"))
    first = op.Slice(x, pattern.Var("first_start"), first_end, pattern.Var("first_axes"), _outputs=["first_half"])
    second = op.Slice(x, first_end, op.Mul(width, pattern.Var("second_end_chunks")), pattern.Var("second_axes"),
                      _outputs=["second_half"])
    return first, second


def _per_slot(op, weights, expert, gathered: str, torchscript: bool):
    """Each slot's expert weights: ``Gather(weights, expert, axis=0)`` (TorchScript) or ``GatherND``."""
    gather = op.Gather if torchscript else op.GatherND
    return gather(weights, expert, _outputs=[gathered])


def _weighted_sum(op, experts_TkH, routing_TK, float32_sum: bool):
    """sum over k of routing_weights * expert outputs: [Tk, H] -> [T, k, H] -> [T, H]. With ``float32_sum``
    (float16/bfloat16 exports: transformers sums in float32 and casts the sum back, ``.to(hidden_states.dtype)``)
    ``Cast(ReduceSum(...))``, the products widened before the ReduceSum (``Cast(Reshape(Mul(...)))``) or, where
    the routing weights are float32 (Mixtral's router), the expert outputs widened before the Mul
    (``Mul(Cast(experts_TkH), routing)``)."""
    routing_Tk1 = op.Unsqueeze(op.Reshape(routing_TK, pattern.Var("routing_flat_shape")),
                               pattern.Var("routing_axis"))
    if not float32_sum:
        weighted_TkH = op.Mul(experts_TkH, routing_Tk1)
        return op.ReduceSum(op.Reshape(weighted_TkH, pattern.Var("sum_shape")), pattern.Var("sum_axis"),
                            _outputs=["sum_TH"])
    weighted_TkH = op.Mul(pattern.OrValue([op.Cast(experts_TkH, _outputs=["widened_experts"]), experts_TkH]),
                          routing_Tk1)
    slots_TkH = op.Reshape(weighted_TkH, pattern.Var("sum_shape"))
    sum_TH = op.ReduceSum(pattern.OrValue([op.Cast(slots_TkH, _outputs=["widened_slots"]), slots_TkH]),
                          pattern.Var("sum_axis"), _outputs=["sum_TH"])
    return op.Cast(sum_TH, _outputs=["out_TH"])


@dataclasses.dataclass(frozen=True)
class _Slots:
    """What the shared slot frame fixes: the tokens [T, H], the router's top-k, and H."""

    tokens_TH: ir.Value
    route: Route
    hidden: int

    def routing_weights(self, op, notes: list[str]) -> ir.Value:
        """MOE's routing weights: the router's, cast to the tokens' type where the block multiplied by float32
        ones (MOE takes them in the tokens' type, docs/ops/MOE.md; ``notes`` says so once)."""
        weights, dtype = self.route.weights, self.tokens_TH.dtype
        if weights.dtype == dtype:
            return weights
        note = (f"the export multiplies the {dtype.name} expert outputs by float32 routing weights; MOE takes "
                f"them rounded to {dtype.name}")
        if note not in notes:
            notes.append(note)
        return typed(op.Cast(weights, to=dtype), dtype, weights.shape)


def _shown(dims: list | None) -> str:
    """A folded shape tensor for a message: known ints, and ``name[axis]`` for a dim known at run time."""
    if dims is None:
        return "not foldable"
    return "[" + ", ".join(str(d) if not isinstance(d, tuple) else f"{d[0].name}[{d[1]}]" for d in dims) + "]"


def _token_count(dim, tokens_TH: ir.Value) -> bool:
    """Whether a shape element is T, the tokens' count: -1, their dim 0 at run time, or its static value."""
    return dim == -1 or dim == (tokens_TH, 0) or (isinstance(dim, int) and dim == tokens_TH.shape[0])


def _check_slots(b: dict, torchscript: bool) -> _Slots:
    """Checks the router, the repeat, the expert index, the routing weights and the sum over k."""
    tokens, routing = b["tokens_TH"], b["routing_TK"]
    found = route(b["topk_indices_TK"], routing)
    k = found.k
    hidden = static_last_dim(tokens)
    require(tokens.shape is not None and tokens.shape.rank() == 2 and hidden is not None,
            "the tokens are not [T, H] with a static H")

    require(_ints(b["repeat_axis"], "repeat_interleave Unsqueeze axes") in ([1], [-2]),
            "repeat_interleave does not unsqueeze axis 1")
    repeat = shape_dims(b["repeat_shape"])
    repeater = "Tile repeats" if torchscript else "Expand shape"
    require(repeat is not None, f"the repeat_interleave {repeater} is not a shape computation folding to [1, k, 1]")
    require(repeat == [1, k, 1], f"repeat_interleave {'tiles' if torchscript else 'expands'} to {_shown(repeat)}, "
            f"expected [1, {k}, 1] (k from TopK)")
    if torchscript:
        require(b["tokens_TkH"].producer().attributes.get_int("axis", 1) == 2,
                "the tiled tokens [T, k, H] are not flattened at axis 2 into [T * k, H]")
    else:
        require(_ints(b["slots_shape"], "repeated tokens shape") == [-1, hidden],
                f"the repeated tokens are not reshaped to [-1, {hidden}]")
        require(_ints(b["index_axis"], "expert index Unsqueeze axes") in ([1], [-1]),
                "the expert index is not unsqueezed on its last axis")
    require(_ints(b["index_flat_shape"], "expert index shape") == [-1], "the expert indices are not flattened")

    require(_ints(b["routing_flat_shape"], "routing weights shape") == [-1], "the routing weights are not flattened")
    require(_ints(b["routing_axis"], "routing weights Unsqueeze axes") in ([1], [-1]),
            "the routing weights are not unsqueezed on their last axis")
    sum_shape = shape_dims(b["sum_shape"])
    require(sum_shape is not None, "the sum reshape is not a shape computation")
    require(len(sum_shape) == 3 and _token_count(sum_shape[0], tokens) and sum_shape[1:] == [k, hidden],
            f"the weighted slots are reshaped to {_shown(sum_shape)}, expected [-1 or T, {k}, {hidden}]")
    require(_ints(b["sum_axis"], "ReduceSum axes") in ([1], [-2]), "ReduceSum is not over the k axis")
    require(b["sum_TH"].producer().attributes.get_int("keepdims", 1) == 0, "ReduceSum keeps the k axis")
    _check_sum_types(b, tokens.dtype)
    return _Slots(tokens, found, hidden)


def _check_sum_types(b: dict, dtype: ir.DataType) -> None:
    """The weighted sum's Casts (see :func:`_weighted_sum`) compute what MOE does at the tokens' type ``dtype``:
    Casts before the sum widen to float32, the sum is cast back to ``dtype`` (MOE accumulates in float32 and
    rounds once), and the routing weights are ``dtype``, or float32 where the products are (rounded to
    ``dtype`` for MOE: :meth:`_Slots.routing_weights`)."""
    widened = [name for name in ("widened_experts", "widened_slots") if b.get(name) is not None]
    for name in widened:
        require(b[name].dtype == ir.DataType.FLOAT, f"the weighted sum casts {name.split('_')[1]} to {b[name].dtype}, "
                f"expected FLOAT (a sum of {dtype} values widened to float32)")
    out = b.get("out_TH") or b["sum_TH"]
    require(out.dtype == dtype, f"the weighted sum is {out.dtype}, the tokens are {dtype}")
    routing = b["routing_TK"].dtype
    allowed = (dtype, ir.DataType.FLOAT) if "widened_experts" in widened else (dtype,)
    require(routing in allowed, f"the routing weights are {routing}, the tokens {dtype}"
            + (" and the products float32" if len(allowed) > 1 else ""))


# ----------------------------------------------------------------------------- GPT-OSS

@dataclasses.dataclass(frozen=True)
class _GptOssBlock:
    slots: _Slots
    gate_up: Weight
    gate_up_bias: Weight
    down: Weight
    down_bias: Weight
    alpha: float
    beta: float
    gate_parity: int


class BatchedMmGptOss(MoeFusion):
    """GPT-OSS experts (biases, interleaved gate/up, clamped SwiGLU) -> MOE GEMM2_BIAS_SWIGLU_CLAMP::

        tokens_TkH = Reshape(Expand(Unsqueeze(tokens_TH, 1), [1, k, 1]), [-1, H])
        expert_Tk1 = Unsqueeze(Reshape(TopK(scores)[1], [-1]), -1)
        gate_up_Tk2I = Squeeze(MatMul(Unsqueeze(tokens_TkH, 1), GatherND(gate_up_EH2I, expert_Tk1)), 1)
                       + GatherND(gate_up_bias_E2I, expert_Tk1)        (then Squeeze(Unsqueeze(., a), a))
                       (TorchScript: Gather(gate_up_EH2I, Reshape(TopK(scores)[1], [-1])), no Squeeze(Unsqueeze))
        gate = Clip(Slice(gate_up_Tk2I, p, end, -1, 2), , beta)      p = gate_parity
        up = Clip(Slice(gate_up_Tk2I, 1 - p, end, -1, 2), -beta, beta)
        act_TkI = (up + 1) * (gate * Sigmoid(gate * alpha))          (alpha 1 may be left out)
        down_TkH = Squeeze(MatMul(Unsqueeze(act_TkI, 1), GatherND(down_EIH, expert_Tk1)), 1)
                   + GatherND(down_bias_EH, expert_Tk1)                 (then Squeeze(Unsqueeze(., a), a))
        out_TH = ReduceSum(Reshape(down_TkH * Unsqueeze(Reshape(routing_TK, [-1]), -1), [-1, k, H]), 1)
    """

    torchscript = False  # the exporter's frame (module docstring)
    float32_sum = False  # the weighted sum in float32, cast back (_weighted_sum)

    def pattern(self, op, tokens_TH, topk_indices_TK, routing_TK, gate_up_EH2I, gate_up_bias_E2I,
                down_EIH, down_bias_EH, gate_up_row_axis, down_row_axis, gate_up_row_squeeze, down_row_squeeze):
        tokens_TkH, expert = _slots(op, tokens_TH, topk_indices_TK, self.torchscript)

        def biased_bmm(x_TkIn, weights, bias, gathered, gathered_bias, row_axis, row_squeeze, noop_axis):
            """x @ W[expert] + b[expert]; the dynamo export adds a no-op Squeeze(Unsqueeze(., a), a)."""
            y = op.Add(op.Squeeze(op.MatMul(op.Unsqueeze(x_TkIn, row_axis),
                                            _per_slot(op, weights, expert, gathered, self.torchscript)), row_squeeze),
                       _per_slot(op, bias, expert, gathered_bias, self.torchscript))
            if self.torchscript:
                return y
            axis = pattern.Var(noop_axis)
            return op.Squeeze(op.Unsqueeze(y, axis), axis)

        gate_up_Tk2I = biased_bmm(tokens_TkH, gate_up_EH2I, gate_up_bias_E2I, "gate_up_TkH2I", "gate_up_bias_Tk2I",
                                  gate_up_row_axis, gate_up_row_squeeze, "gate_up_noop_axis")
        down_TkH = biased_bmm(clamped_swiglu(op, gate_up_Tk2I), down_EIH, down_bias_EH, "down_TkIH", "down_bias_TkH",
                              down_row_axis, down_row_squeeze, "down_noop_axis")
        return _weighted_sum(op, down_TkH, routing_TK, self.float32_sum)

    def read(self, context, **b) -> _GptOssBlock:
        slots = _check_slots(b, self.torchscript)
        E, H, dtype = slots.route.experts, slots.hidden, slots.tokens_TH.dtype
        gate_up = _weight(b["gate_up_EH2I"], dtype, "gate_up", (E, H, "2I"), "[E, H, 2I]")
        two_i = gate_up.shape[2]
        gate_up_bias = _weight(b["gate_up_bias_E2I"], dtype, "gate_up bias", (E, two_i), "[E, 2I]")
        down = _weight(b["down_EIH"], dtype, "down", (E, two_i // 2, H), "[E, I, H]")
        down_bias = _weight(b["down_bias_EH"], dtype, "down bias", (E, H), "[E, H]")
        _require_plain_gathers(b, "gate_up_TkH2I", "gate_up_bias_Tk2I", "down_TkIH", "down_bias_TkH")
        for axis in ("gate_up_row_axis", "down_row_axis", "gate_up_row_squeeze", "down_row_squeeze"):
            require(_ints(b[axis], f"bmm axes {axis}") in ([1], [-2]), "the bmm does not multiply [Tk, 1, in] rows")
        activation = read_clamped_swiglu(b["act"], two_i)
        return _GptOssBlock(slots, gate_up, gate_up_bias, down, down_bias, activation.alpha, activation.limit,
                            activation.gate_parity)

    def emit(self, op, block: _GptOssBlock) -> ir.Value:
        route = block.slots.route
        return emit_moe(op, block.slots.tokens_TH, block.slots.routing_weights(op, self.notes), route.indices,
                        expert_type=GEMM2_BIAS_SWIGLU_CLAMP,
                        weight_0=weight_value(op, block.gate_up, "moe_gate_up_EH2I"),
                        bias_0=weight_value(op, block.gate_up_bias, "moe_gate_up_bias_E2I"),
                        weight_1=weight_value(op, block.down, "moe_down_EIH"),
                        bias_1=weight_value(op, block.down_bias, "moe_down_bias_EH"),
                        expert_alpha=block.alpha, expert_beta=block.beta, gate_parity=block.gate_parity)


# ----------------------------------------------------------------------------- Qwen3 / Mixtral / OLMoE / Qwen2

@dataclasses.dataclass(frozen=True)
class _SwigluBlock:
    slots: _Slots
    gate_up: Weight
    down: Weight
    gate_half: int
    alpha: float


def _bmm(op, x_TkIn, weights, expert, axis, squeeze_axis, gathered: str, transposed: bool, torchscript: bool):
    """Each slot's ``x @ W[expert]``, [Tk, out]: ``Squeeze(MatMul(GatherND(W [E, out, in]), Unsqueeze(x, -1)), -1)``,
    or with ``transposed`` weights ``Squeeze(MatMul(Unsqueeze(x, 1), GatherND(W [E, in, out])), 1)``
    (Gather for ``torchscript``)."""
    per_slot = _per_slot(op, weights, expert, gathered, torchscript)
    if transposed:
        return op.Squeeze(op.MatMul(op.Unsqueeze(x_TkIn, axis), per_slot), squeeze_axis)
    return op.Squeeze(op.MatMul(per_slot, op.Unsqueeze(x_TkIn, axis)), squeeze_axis)


class BatchedMmSwiglu(MoeFusion):
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
    TorchScript (``torchscript``): the frame of the module docstring, the halves
    ``Slice(gate_up_Tk2I, 0, I, -1)`` and ``Slice(gate_up_Tk2I, I, 2I, -1)`` (I computed from the shape).
    """

    # the weights' layout: [E, out, in] (MatMul(weights, column)), or [E, in, out] (MatMul(row, weights))
    transposed = False
    torchscript = False  # the exporter's frame (module docstring)
    float32_sum = False  # the weighted sum in float32, cast back (_weighted_sum)

    def pattern(self, op, tokens_TH, topk_indices_TK, routing_TK, gate_up_weights, down_weights,
                gate_up_axis, down_axis, gate_up_squeeze, down_squeeze):
        tokens_TkH, expert = _slots(op, tokens_TH, topk_indices_TK, self.torchscript)
        gate_up_Tk2I = _bmm(op, tokens_TkH, gate_up_weights, expert, gate_up_axis, gate_up_squeeze, "gate_up_per_slot",
                            self.transposed, self.torchscript)
        if self.torchscript:
            first, second = _chunk_halves(op, gate_up_Tk2I)
        else:
            first, second = op.Split(gate_up_Tk2I, _allow_other_inputs=True, _outputs=["first_half", "second_half"])
        down_TkH = _bmm(op, swiglu(op, first, second), down_weights, expert, down_axis, down_squeeze, "down_per_slot",
                        self.transposed, self.torchscript)
        return _weighted_sum(op, down_TkH, routing_TK, self.float32_sum)

    def read(self, context, **b) -> _SwigluBlock:
        slots = _check_slots(b, self.torchscript)
        E, H, dtype = slots.route.experts, slots.hidden, slots.tokens_TH.dtype
        if self.transposed:
            gate_up = _weight(b["gate_up_weights"], dtype, "gate_up", (E, H, "2I"), "[E, H, 2I]")
            two_i = gate_up.shape[2]
            down = _weight(b["down_weights"], dtype, "down", (E, two_i // 2, H), "[E, I, H]")
        else:
            gate_up = _weight(b["gate_up_weights"], dtype, "gate_up", (E, "2I", H), "[E, 2I, H]")
            two_i = gate_up.shape[1]
            down = _weight(b["down_weights"], dtype, "down", (E, H, two_i // 2), "[E, H, I]")
        _require_plain_gathers(b, "gate_up_per_slot", "down_per_slot")
        axes, operand = (([1], [-2]), "[Tk, 1, in] rows") if self.transposed else (([2], [-1]), "[Tk, in, 1] columns")
        for axis in ("gate_up_axis", "down_axis", "gate_up_squeeze", "down_squeeze"):
            require(_ints(b[axis], f"bmm axes {axis}") in axes, f"the bmm does not multiply {operand}")

        _require_halves(b["first_half"], b["second_half"], two_i)
        activation = read_swiglu(b["act"])
        return _SwigluBlock(slots, gate_up, down, 0 if activation.gate is b["first_half"] else 1, activation.alpha)

    def emit(self, op, block: _SwigluBlock) -> ir.Value:
        experts, hidden = block.gate_up.shape[0], block.slots.hidden
        i = block.down.shape[1] if self.transposed else block.down.shape[2]
        halves = (slice(0, i), slice(i, 2 * i))
        gate_rows, up_rows = halves if block.gate_half == 0 else halves[::-1]
        # an expert's [out, in] matrix (MOE's layout) from its slice of the weights
        out_in = (lambda a: a.T) if self.transposed else (lambda a: a)
        route = block.slots.route
        return emit_moe(op, block.slots.tokens_TH, block.slots.routing_weights(op, self.notes), route.indices,
                        expert_type=GEMM3_SWIGLU,
                        weight_0=weight_value(op, block.gate_up, "moe_gate_EIH", lambda a: out_in(a)[gate_rows],
                                              (experts, i, hidden)),
                        weight_1=weight_value(op, block.gate_up, "moe_up_EIH", lambda a: out_in(a)[up_rows],
                                              (experts, i, hidden)),
                        weight_2=weight_value(op, block.down, "moe_down_EHI", out_in if self.transposed else None,
                                              (experts, hidden, i)),
                        expert_alpha=block.alpha)


class BatchedMmSwigluTransposed(BatchedMmSwiglu):
    """:class:`BatchedMmSwiglu` with the weights stored [E, in, out] (transformers' ``batched_mm`` with
    ``is_transposed=True``, AriaText): gate_up [E, H, 2I] split into column halves, down [E, I, H]::

        gate_up_Tk2I = Squeeze(MatMul(Unsqueeze(tokens_TkH, 1), GatherND(gate_up_EH2I, expert_Tk1)), 1)
        down_TkH = Squeeze(MatMul(Unsqueeze(act_TkI, 1), GatherND(down_EIH, expert_Tk1)), 1)
    """

    transposed = True



# ----------------------------------------------------------------------------- Nemotron-H (non-gated experts)

@dataclasses.dataclass(frozen=True)
class _NonGatedBlock:
    slots: _Slots
    up: Weight
    down: Weight
    activation: str


class BatchedMmNonGated(MoeFusion):
    """Non-gated experts ``down(act(up(x)))`` (Nemotron-H's relu², transformers' has_gate=False)
    -> MOE GEMM2_ACT::

        tokens_TkH = Reshape(Expand(Unsqueeze(tokens_TH, 1), [1, k, 1]), [-1, H])
        expert_Tk1 = Unsqueeze(Reshape(TopK(scores)[1], [-1]), -1)
        up_TkI = Squeeze(MatMul(GatherND(up_EIH, expert_Tk1), Unsqueeze(tokens_TkH, -1)), -1)
        act_TkI = act(up_TkI)              relu, relu², GELU, SiLU or none (_activation.pointwise)
        down_TkH = Squeeze(MatMul(GatherND(down_EHI, expert_Tk1), Unsqueeze(act_TkI, -1)), -1)
        out_TH = ReduceSum(Reshape(down_TkH * Unsqueeze(Reshape(routing_TK, [-1]), -1), [-1, k, H]), 1)
    """

    torchscript = False  # the exporter's frame (module docstring)
    float32_sum = False  # the weighted sum in float32, cast back (_weighted_sum)

    def pattern(self, op, tokens_TH, topk_indices_TK, routing_TK, up_EIH, down_EHI, up_col_axis, down_col_axis,
                up_col_squeeze, down_col_squeeze):
        tokens_TkH, expert = _slots(op, tokens_TH, topk_indices_TK, self.torchscript)
        up_TkI = op.Squeeze(op.MatMul(_per_slot(op, up_EIH, expert, "up_TkIH", self.torchscript),
                                      op.Unsqueeze(tokens_TkH, up_col_axis)),
                            up_col_squeeze, _outputs=["up_TkI"])
        down_TkH = op.Squeeze(op.MatMul(_per_slot(op, down_EHI, expert, "down_TkHI", self.torchscript),
                                        op.Unsqueeze(pointwise(op, up_TkI), down_col_axis)),
                              down_col_squeeze)
        return _weighted_sum(op, down_TkH, routing_TK, self.float32_sum)

    def read(self, context, **b) -> _NonGatedBlock:
        slots = _check_slots(b, self.torchscript)
        E, H, dtype = slots.route.experts, slots.hidden, slots.tokens_TH.dtype
        up = _weight(b["up_EIH"], dtype, "up", (E, "I", H), "[E, I, H]")
        inter = up.shape[1]
        down = _weight(b["down_EHI"], dtype, "down", (E, H, inter), "[E, H, I]")
        _require_plain_gathers(b, "up_TkIH", "down_TkHI")
        for axis in ("up_col_axis", "down_col_axis", "up_col_squeeze", "down_col_squeeze"):
            require(_ints(b[axis], f"bmm axes {axis}") in ([2], [-1]),
                    "the bmm does not multiply [Tk, in, 1] columns")
        return _NonGatedBlock(slots, up, down, read_pointwise(b["act"], b["up_TkI"]))

    def emit(self, op, block: _NonGatedBlock) -> ir.Value:
        route = block.slots.route
        return emit_moe(op, block.slots.tokens_TH, block.slots.routing_weights(op, self.notes), route.indices,
                        expert_type=GEMM2_ACT,
                        weight_0=weight_value(op, block.up, "moe_up_EIH"),
                        weight_1=weight_value(op, block.down, "moe_down_EHI"), activation=block.activation)


# ----------------------------------------------------------------------------- the TorchScript exports

class BatchedMmGptOssTorchScript(BatchedMmGptOss):
    """:class:`BatchedMmGptOss` as ``torch.onnx.export(dynamo=False)`` writes it (module docstring)."""

    torchscript = True


class BatchedMmSwigluTorchScript(BatchedMmSwiglu):
    """:class:`BatchedMmSwiglu` as ``torch.onnx.export(dynamo=False)`` writes it (module docstring)."""

    torchscript = True


class BatchedMmSwigluTransposedTorchScript(BatchedMmSwigluTransposed):
    """:class:`BatchedMmSwigluTransposed` as ``torch.onnx.export(dynamo=False)`` writes it (module docstring)."""

    torchscript = True


class BatchedMmNonGatedTorchScript(BatchedMmNonGated):
    """:class:`BatchedMmNonGated` as ``torch.onnx.export(dynamo=False)`` writes it (module docstring)."""

    torchscript = True


def _summing_in_float32(rule: type[MoeFusion]) -> type[MoeFusion]:
    """``rule`` for the float16 and bfloat16 exports, which sum the weighted slots in float32 and cast the sum
    back to the tokens' type (:func:`_weighted_sum`)."""
    doc = f":class:`{rule.__name__}` with the weighted slots summed in float32 and cast back (float16, bfloat16)."
    return type(f"{rule.__name__}Float32Sum", (rule,), {"float32_sum": True, "__doc__": doc, "__module__": __name__})


_AT_THE_TOKENS_TYPE = [BatchedMmGptOss, BatchedMmSwiglu, BatchedMmSwigluTransposed, BatchedMmNonGated,
                       BatchedMmGptOssTorchScript, BatchedMmSwigluTorchScript, BatchedMmSwigluTransposedTorchScript,
                       BatchedMmNonGatedTorchScript]
FUSIONS = _AT_THE_TOKENS_TYPE + [_summing_in_float32(rule) for rule in _AT_THE_TOKENS_TYPE]
