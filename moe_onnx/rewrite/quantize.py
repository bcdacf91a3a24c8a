"""The Quantize pass: each MOE node of a fused model becomes a QMOE (and, when asked, each linear layer a
MatMulNBits, the token embedding a GatherBlockQuantized).

Each MOE weight becomes QMOE's ``[E, N, K]`` layout (GEMM2_BIAS_SWIGLU_CLAMP's two weights are
transposed from MOE's ``[E, K, N]``) and is quantized by :func:`moe_onnx.ops.qmoe.quantize` (int8 or
int4, per column or block-wise, symmetric or with zero points). An MOE whose weights are exactly
MXFP4 values (every block of 32 along K an E2M1 value times one power of two, as GPT-OSS's
checkpoint is once transformers dequantizes it) is repacked as quant_type mxfp4 instead: no
requantization, no error. The quantized initializers are computed while the model is written, one
expert at a time, like the rewriter's (``_ir/weights.py``). The error against the fp32 model is measured by the
quantize job (``moe_onnx/pipeline/quantize.py``); its report types are here, in the :class:`QuantizeReport`.

The weight formats (the packing, the E2M1 table, the rounding) live in ``moe_onnx/ops/qmoe.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from .._ir.builder import TapeBuilder, replace
from .._ir.inference import ORT_DOMAIN
from .._ir.nodes import attribute_value
from .._ir.passes import RewritePass, RewriteResult, rewritten
from .._ir.weights import Weight, initializer_expert, release_external, streamed_initializer
from .._ir.weights import weight as constant_weight
from ..ops import DOMAIN, IN_OUR_DOMAIN, signatures
from ..ops._common import EXACT
from ..ops.moe import GEMM2_BIAS_SWIGLU_CLAMP, LINEARS
from ..ops.qmoe import (
    ACCURACY_LEVELS,
    E2M1_VALUES,
    E8M0_BIAS,
    INT8_ACTIVATIONS,
    MXFP4_BLOCK,
    QUANT_INT,
    QUANT_MXFP4,
    SCALES,
    ZERO_POINTS,
    StoredMxfp4,
    pack_codes,
    quantize as quantize_weight,
)
from ..verify import format_sizes

__all__ = ["EmbeddingReport", "ErrorReport", "ErrorStat", "LayerReport", "LinearReport", "LinearSkipped",
           "Quantize", "QuantizeError", "QuantizeReport", "QuantizeSettings", "keep_stored_mxfp4", "mxfp4_exact"]

BITS = (4, 8)


class QuantizeError(ValueError):
    """Arguments or a model that cannot be quantized; the message names the setting or the node."""


@dataclasses.dataclass(frozen=True)
class QuantizeSettings:
    """How to quantize: ``bits`` 4 or 8; ``block_size`` 0 (one scale per output column) or a power of
    two in [16, 256]; ``zero_points`` (asymmetric) or symmetric; the QMOE ``accuracy_level`` (None: 4 with
    ``linears``, see :attr:`level`, else each MOE's own, 3 after ``optimize --compute bf16``, else 0);
    ``repack_mxfp4``: an MOE whose weights are exactly MXFP4 becomes quant_type mxfp4 whatever the bits asked
    for; ``linears``: the other linear layers (MatMul and Gemm with a constant weight matrix) become
    com.microsoft::MatMulNBits too, with the same bits, block size (required: MatMulNBits has no per-column
    scales) and zero points; ``embedding``: the token embedding table (a Gather of the token ids from a constant
    matrix) becomes com.microsoft::GatherBlockQuantized with the same bits and block size (required)."""

    bits: int = 8
    block_size: int = 0
    zero_points: bool = False
    accuracy_level: int | None = None
    repack_mxfp4: bool = True
    linears: bool = False
    embedding: bool = False

    def check(self) -> None:
        """QuantizeError naming the first setting out of range."""
        if self.bits not in BITS:
            raise QuantizeError(f"bits is {self.bits}; expected 4 or 8")
        block = self.block_size
        if block != 0 and not (16 <= block <= 256 and block & (block - 1) == 0):
            raise QuantizeError(f"block_size is {block}; expected 0 (one scale per output column) "
                                "or a power of two in [16, 256]")
        if self.accuracy_level is not None and self.accuracy_level not in ACCURACY_LEVELS:
            raise QuantizeError(f"accuracy_level is {self.accuracy_level}; expected one of "
                                f"{', '.join(map(str, ACCURACY_LEVELS))}")
        if self.linears and block == 0:
            raise QuantizeError("linears: MatMulNBits quantizes in blocks along K; block_size 0 (per column) is "
                                "not available: give a block size (a power of two in [16, 256])")
        if self.embedding and block == 0:
            raise QuantizeError("embedding: GatherBlockQuantized quantizes each row in blocks; block_size 0 (per "
                                "column) is not available: give a block size (a power of two in [16, 256])")

    @property
    def level(self) -> int | None:
        """The accuracy_level asked for; with ``linears`` and none given, 4 (int8 activations) for the QMOE and
        MatMulNBits nodes, the multiply llama.cpp's Q4_0 mix does: on the Qwen3-30B-A3B shape its decode is
        1.06-1.23x level 0's tokens/s, the logits' error unchanged (docs/benchmarks.md, generation); None: each
        MOE's own."""
        if self.accuracy_level is None and self.linears:
            return INT8_ACTIVATIONS
        return self.accuracy_level

    def describe(self) -> str:
        block = "per column" if self.block_size == 0 else f"block {self.block_size}"
        zero = "with zero points" if self.zero_points else "symmetric"
        level = "each MOE's" if self.level is None else self.level
        return f"int{self.bits}, {block}, {zero}, accuracy_level {level}"

    def level_for(self, moe_level: int, mxfp4: bool) -> int:
        """A QMOE's accuracy_level: the one asked for, else its MOE's ``moe_level``; an MXFP4 node keeps its
        MOE's where int8 activations (4, quant_type int only) were asked for."""
        if self.level is None or (mxfp4 and self.level == INT8_ACTIVATIONS):
            return moe_level
        return self.level


# ----------------------------------------------------------------------------- MXFP4

# the code of each E2M1 magnitude, indexed by twice the magnitude (0, 1, 2, 3, 4, 6, 8, 12); the other
# slots hold 0, whose value (0) then differs from the magnitude looked up, as for any value between codes
_CODE_OF_DOUBLED = np.zeros(16, np.uint8)
_CODE_OF_DOUBLED[(2 * E2M1_VALUES[:8]).astype(np.int64)] = np.arange(8)


def mxfp4_exact(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``matrix`` [N, K] as MXFP4, when every block of 32 along K is exactly E2M1 values times one power of
    two: ``(packed codes [N, K/2] uint8, E8M0 scales [N, K/32] uint8)``; None otherwise.

    A block's scale is 2^(floor(log2(max |w|)) - 2), which maps its largest value into [4, 8): the
    smallest power of two that holds the largest value, so every other value of an exact block is an
    E2M1 value at that scale too.
    """
    rows, k = matrix.shape
    if k % MXFP4_BLOCK:
        return None
    blocks = matrix.astype(np.float32).reshape(rows, k // MXFP4_BLOCK, MXFP4_BLOCK)
    if not np.isfinite(blocks).all():
        return None
    magnitude = np.abs(blocks)
    peak = magnitude.max(axis=-1)
    _, peak_exponent = np.frexp(peak)  # peak = m * 2^e, m in [0.5, 1): floor(log2(peak)) = e - 1
    exponent = np.where(peak > 0, peak_exponent - 3, 0)
    if (exponent + E8M0_BIAS < 0).any() or (exponent + E8M0_BIAS > 254).any():
        return None
    magnitude *= np.exp2(-exponent).astype(np.float32)[..., None]  # exact: a power of two; now < 8
    index = _CODE_OF_DOUBLED[(magnitude * 2).astype(np.uint8)]
    if not np.array_equal(E2M1_VALUES[index], magnitude):
        return None
    codes = (index | (np.signbit(blocks).view(np.uint8) << 3)).reshape(rows, k)
    return pack_codes(codes, 4), (exponent + E8M0_BIAS).astype(np.uint8)


# ----------------------------------------------------------------------------- one MOE node

@dataclasses.dataclass(frozen=True)
class _ExpertWeight:
    """One MOE weight as QMOE takes it, [E, N, K]; ``transposed``: MOE stores it [E, K, N]."""

    index: int  # the input position, the same in MOE and QMOE
    value: ir.Value
    transposed: bool

    @property
    def name(self) -> str:
        return signatures.MOE.inputs[self.index].name

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, a, b = (int(d) for d in self.value.const_value.shape)
        return (experts, b, a) if self.transposed else (experts, a, b)

    def expert(self, e: int) -> np.ndarray:
        """Expert ``e``'s [N, K] float32 matrix (a lazy initializer computes that expert alone)."""
        matrix = np.asarray(initializer_expert(self.value, e), dtype=np.float32)
        return matrix.T if self.transposed else matrix

    @property
    def stored_mxfp4(self) -> StoredMxfp4 | None:
        """The initializer when it holds MXFP4 codes and scales as stored (a checkpoint's experts, read by
        moe_onnx.export) in MOE's [E, K, N] layout, which QMOE's [E, N, K] transposes; else None."""
        tensor = self.value.const_value
        return tensor if self.transposed and isinstance(tensor, StoredMxfp4) else None


class _QuantizedParts:
    """The QMOE inputs made from one weight (packed weight, scales[, zero points]), one expert at a
    time: ``encode(e)`` gives expert ``e``'s parts, and each part's slice is kept until that part's
    initializer takes it, so an expert is quantized once while the model is written. ``shapes``, each part's
    (None: absent), where the caller knows them: then nothing is encoded before the write (an expert held from
    here to the write, for every weight of a model, holds a layer's worth of memory per layer); else expert 0 is
    encoded now to learn them, and kept for the writer."""

    def __init__(self, experts: int, encode: Callable[[int], Sequence[np.ndarray | None]],
                 shapes: Sequence[tuple[int, ...] | None] | None = None):
        self._encode = encode
        if shapes is None:
            first = self._encode_expert(0)
            self.shapes = [None if part is None else (experts, *part.shape) for part in first]
            self._pending: list[dict[int, np.ndarray]] = [{} if part is None else {0: part} for part in first]
        else:
            self.shapes = list(shapes)
            self._pending = [{} for _ in self.shapes]

    def _encode_expert(self, e: int) -> list[np.ndarray | None]:
        return list(self._encode(e))

    def slice(self, part: int, e: int) -> np.ndarray:
        if e not in self._pending[part]:
            for pending, array in zip(self._pending, self._encode_expert(e)):
                if array is not None:
                    pending[e] = array
        return self._pending[part].pop(e)


@dataclasses.dataclass
class _QuantizedLayer:
    """What the report gives of every quantized node: its name and output, the format of its weights, and
    their bytes before and after."""

    node: str
    output: str
    bits: int
    block_size: int
    zero_points: bool
    accuracy_level: int
    weight_bytes_before: int
    weight_bytes_after: int


@dataclasses.dataclass
class LayerReport(_QuantizedLayer):
    """One MOE node made a QMOE: how its weights were stored and their bytes before and after."""

    routing_weights: str  # the node's routing_weights
    indices: str  # the node's router_topk_output_indices
    expert_type: str
    quant_type: str
    stored: bool = False  # MXFP4 codes and scales taken as stored (a checkpoint's), not found by a scan

    def describe(self) -> str:
        if self.stored:
            how = "mxfp4 (the checkpoint's codes and scales, as stored)"
        elif self.quant_type == QUANT_MXFP4:
            how = "mxfp4 (the weights are exactly MXFP4: repacked, not requantized)"
        else:
            block = "per column" if self.block_size == 0 else f"block {self.block_size}"
            how = f"int{self.bits} {block}{', zero points' if self.zero_points else ''}"
        return (f"{self.node} ({self.expert_type}): {how}, weights {self.weight_bytes_before:,} -> "
                f"{self.weight_bytes_after:,} bytes")


def _expert_weights(node: ir.Node, graph: ir.Graph) -> list[_ExpertWeight]:
    """The node's weights in QMOE's order; QuantizeError for one that is not an initializer of ``graph``."""
    expert_type = node.attributes["expert_type"].as_string()
    weights = []
    for index, *_ in LINEARS[expert_type]:
        value = node.inputs[index]
        if value is None or value.const_value is None or graph.initializers.get(value.name) is not value:
            raise QuantizeError(f"MOE node '{node.name}': input '{signatures.MOE.inputs[index].name}' is not an "
                                "initializer; "
                                "quantize needs constant expert weights")
        weights.append(_ExpertWeight(index, value, transposed=expert_type == GEMM2_BIAS_SWIGLU_CLAMP))
    return weights


def _check_divides(node: ir.Node, weights: Sequence[_ExpertWeight], settings: QuantizeSettings) -> None:
    for w in weights:
        k = w.shape[2]
        if settings.block_size and k % settings.block_size:
            raise QuantizeError(f"MOE node '{node.name}': block_size {settings.block_size} does not divide K = {k}, "
                                f"the inputs of {w.name} ([E, N, K] = {list(w.shape)}); choose a block size that "
                                "divides every K of the model, or 0 (per column)")
        if settings.bits == 4 and k % 2:
            raise QuantizeError(f"MOE node '{node.name}': int4 packs two K values per byte, but K of {w.name} is "
                                f"{k} (odd); use bits 8")


def _is_mxfp4(weights: Sequence[_ExpertWeight]) -> bool:
    """Every expert of every weight is exactly MXFP4. Reads one expert at a time, unmapping external data
    after each, and stops at the first miss."""
    for w in weights:
        for e in range(w.shape[0]):
            exact = mxfp4_exact(w.expert(e)) is not None
            release_external([w.value])
            if not exact:
                return False
    return True


#: how a node's experts are stored in its QMOE: as the MXFP4 tensors hold them, repacked as exactly MXFP4, or
#: quantized to int
_STORED, _EXACT, _INT = "stored", "exact", "int"


def _plan(graph: ir.Graph, node: ir.Node, settings: QuantizeSettings) -> tuple[list[_ExpertWeight], str]:
    """The node's weights and how they are stored (_STORED, _EXACT or _INT); QuantizeError when the settings
    cannot quantize them."""
    weights = _expert_weights(node, graph)
    if settings.repack_mxfp4 and all(w.stored_mxfp4 is not None for w in weights):
        return weights, _STORED
    if settings.repack_mxfp4 and _is_mxfp4(weights):
        return weights, _EXACT
    _check_divides(node, weights, settings)
    return weights, _INT


def _quantize_node(graph: ir.Graph, node: ir.Node, weights: Sequence[_ExpertWeight], how: str,
                   settings: QuantizeSettings) -> LayerReport:
    """Replace MOE ``node`` by a QMOE with lazily quantized ``weights``; returns what was done."""
    mxfp4 = how != _INT
    layer = LayerReport(
        node=node.name or node.outputs[0].name, output=node.outputs[0].name, routing_weights=node.inputs[1].name,
        indices=node.inputs[2].name, expert_type=node.attributes["expert_type"].as_string(),
        quant_type=QUANT_MXFP4 if mxfp4 else QUANT_INT, bits=4 if mxfp4 else settings.bits,
        block_size=MXFP4_BLOCK if mxfp4 else settings.block_size, zero_points=not mxfp4 and settings.zero_points,
        accuracy_level=settings.level_for(attribute_value(node, "accuracy_level", EXACT), mxfp4),
        weight_bytes_before=0, weight_bytes_after=0, stored=how == _STORED)

    def encoder(w: _ExpertWeight) -> Callable[[int], Sequence[np.ndarray | None]]:
        if how == _STORED:
            return lambda e: (*w.stored_mxfp4.mxfp4_expert(e), None)
        if how == _EXACT:
            return lambda e: mxfp4_exact(w.expert(e))
        return lambda e: quantize_weight(w.expert(e), bits=layer.bits, block_size=layer.block_size,
                                         symmetric=not layer.zero_points)

    inputs = list(node.inputs) + [None] * (len(signatures.QMOE.inputs) - len(node.inputs))
    for w in weights:
        experts, n, k = w.shape  # MXFP4's parts: codes [E, N, K / 2], E8M0 scales [E, N, K / 32]
        parts = _QuantizedParts(experts, encoder(w), [(experts, n, k // 2), (experts, n, k // MXFP4_BLOCK), None]
                                if mxfp4 else None)
        positions = (w.index, SCALES[w.index], ZERO_POINTS[w.index])
        for part, (position, shape) in enumerate(zip(positions, parts.shapes)):
            if shape is None:
                continue
            name = signatures.QMOE.inputs[position].name
            dtype = ir.DataType.FLOAT if name.startswith("scales") and not mxfp4 else ir.DataType.UINT8
            inputs[position] = streamed_initializer(graph, f"{layer.node}.{name}",
                                                    lambda e, p=parts, i=part: p.slice(i, e), dtype, shape,
                                                    sources=[w.value])
            layer.weight_bytes_after += math.prod(shape) * int(dtype.itemsize)
        layer.weight_bytes_before += w.value.const_value.nbytes
    while inputs[-1] is None:
        inputs.pop()

    op = TapeBuilder()
    kept = {name: attr for name, attr in node.attributes.items() if name != "accuracy_level"}
    qmoe = op.QMOE(*inputs, **IN_OUR_DOMAIN, _name=node.name, **kept,
                   bits=layer.bits, block_size=layer.block_size, quant_type=layer.quant_type,
                   accuracy_level=layer.accuracy_level)
    replace(node, qmoe, op)
    return layer


# ----------------------------------------------------------------------------- linear layers

#: the weight types MatMulNBits' CPU kernel takes (its scales have the activations' type)
_LINEAR_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
#: the ops that end the search for a router's consumer: another layer starts there
_LAYER_OPS = {"MatMul", "Gemm", "MOE", "QMOE", "MatMulNBits"}
#: rows of a linear's weight quantized at a time while the model is written
_ROWS_PER_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class _Linear:
    """A MatMul or Gemm whose weight ``weight`` is a constant matrix (an initializer, possibly through layout
    ops such as a Transpose): [K, N], or [N, K] when ``transposed`` (Gemm's transB); ``bias``: a Gemm's C."""

    node: ir.Node
    weight: Weight
    transposed: bool
    bias: ir.Value | None = None

    @property
    def k(self) -> int:
        return self.weight.shape[1 if self.transposed else 0]

    @property
    def n(self) -> int:
        return self.weight.shape[0 if self.transposed else 1]

    @property
    def how(self) -> str:
        through = "".join(f" <- {step.kind}" for step in self.weight.steps)
        return f"{self.node.op_type} (weight {self.weight.source.name}{through})"


@dataclasses.dataclass
class LinearReport(_QuantizedLayer):
    """One MatMul or Gemm with a constant weight made a com.microsoft::MatMulNBits: its weight's bytes before
    and after. A weight value several layers read is quantized once: the others name that layer in
    ``shares_weight_of`` and count 0 bytes. ``float_kept``: other nodes read the float weight too (a tied
    embedding's Gather), so it stays in the model beside the quantized one."""

    op: str
    k: int
    n: int
    shares_weight_of: str | None = None
    float_kept: bool = False

    def describe(self) -> str:
        padded = f", K padded to {-(-self.k // self.block_size) * self.block_size}" if self.k % self.block_size else ""
        if self.shares_weight_of is not None:
            stored = f"reads the quantized weight of {self.shares_weight_of}"
        else:
            stored = f"weight {self.weight_bytes_before:,} -> {self.weight_bytes_after:,} bytes"
        kept = " (the float weight stays for its other readers)" if self.float_kept else ""
        return f"{self.node}: {self.op}, K {self.k}, N {self.n}{padded}: {stored}{kept}"


@dataclasses.dataclass
class LinearSkipped:
    """A MatMul or Gemm with a constant weight left in float, and why."""

    node: str
    weight: str
    reason: str


def _linear_candidate(graph: ir.Graph, node: ir.Node) -> _Linear | None:
    """``node`` as a linear layer when it is a MatMul or Gemm of the default domain whose weight is a matrix
    held by an initializer of ``graph`` (directly or through layout ops); None for any other node."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
        return None
    weight = constant_weight(node.inputs[1])
    if (weight is None or len(weight.shape) != 2 or graph.initializers.get(weight.source.name) is not weight.source
            or weight.source.is_graph_input()):
        return None
    if node.op_type == "Gemm":
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        return _Linear(node, weight, attribute_value(node, "transB", 0) == 1, bias)
    return _Linear(node, weight, transposed=False)


def _feeds_router(node: ir.Node, depth: int = 8) -> bool:
    """Whether ``node``'s output reaches a MoeGatingTopK, or an MOE/QMOE's routing inputs, before another layer
    (a MatMul, Gemm, MOE) starts: the node is a router."""
    frontier, seen = [node], {id(node)}
    for _ in range(depth):
        following = []
        for current in frontier:
            for output in current.outputs:
                for reader, index in output.uses():
                    if reader.op_type == "MoeGatingTopK" or (reader.op_type in ("MOE", "QMOE") and index in (1, 2)):
                        return True
                    if reader.op_type not in _LAYER_OPS and id(reader) not in seen:
                        seen.add(id(reader))
                        following.append(reader)
        frontier = following
    return False


def _why_float(linear: _Linear, settings: QuantizeSettings) -> str | None:
    """Why ``linear`` stays float (None: it is quantized)."""
    node, dtype = linear.node, linear.weight.dtype
    if dtype not in _LINEAR_TYPES:
        return f"its weight is {dtype.name.lower()} (MatMulNBits on onnxruntime's CPU takes float32 or float16)"
    if node.op_type == "Gemm":
        if attribute_value(node, "alpha", 1.0) != 1.0 or attribute_value(node, "transA", 0) != 0:
            return "a Gemm with alpha != 1 or transA (MatMulNBits computes A @ B)"
        bias = linear.bias
        if bias is not None and (bias.const_value is None or attribute_value(node, "beta", 1.0) != 1.0
                                 or tuple(bias.const_value.shape) != (linear.n,) or bias.dtype != dtype):
            return "a Gemm whose C is not a constant bias [N] with beta 1 (MatMulNBits' bias)"
    if _feeds_router(node):
        return "a router (its scores choose the experts: kept float, as llama.cpp keeps ffn_gate_inp)"
    if linear.k < settings.block_size:
        return f"K = {linear.k} is below the block size {settings.block_size} (the block would be mostly padding)"
    return None


def _plan_linears(graph: ir.Graph, settings: QuantizeSettings) -> tuple[list[_Linear], list[LinearSkipped]]:
    """The linear layers of ``graph`` (not its subgraphs) that MatMulNBits takes, and those left float."""
    linears, skipped = [], []
    for node in graph:
        linear = _linear_candidate(graph, node)
        if linear is None:
            continue
        reason = _why_float(linear, settings)
        if reason is None:
            linears.append(linear)
        else:
            skipped.append(LinearSkipped(node.name or node.outputs[0].name, linear.weight.source.name, reason))
    return linears, skipped


class _LinearRows:
    """A linear's weight as MatMulNBits quantizes it, [N, K] padded with zeros to whole blocks along K (zeros
    change no block's scale or zero point), ``_ROWS_PER_CHUNK`` rows at a time: a chunk is an "expert" of
    :class:`_QuantizedParts`."""

    def __init__(self, linear: _Linear, block_size: int):
        self._linear = linear
        self.blocks = -(-linear.k // block_size)
        self.padded_k = self.blocks * block_size
        self.shape = (-(-linear.n // _ROWS_PER_CHUNK), _ROWS_PER_CHUNK, self.padded_k)

    def expert(self, chunk: int) -> np.ndarray:
        start = chunk * _ROWS_PER_CHUNK
        stop = min(self._linear.n, start + _ROWS_PER_CHUNK)
        weight = self._linear.weight
        matrix = np.zeros((stop - start, self.padded_k), np.float32)
        # the chunk's rows alone: a view of a memory-mapped source (unmapped next), or a lazy source's range
        matrix[:, :self._linear.k] = weight.rows(0, start, stop) if self._linear.transposed else \
            weight.rows(1, start, stop).T
        release_external([weight.source])
        return matrix


def _row_slices(parts: _QuantizedParts, part: int) -> Callable[[int], np.ndarray]:
    """Row ``r`` of part ``part`` of a linear's quantized weight: its chunk is quantized once and held while
    its rows are written (the writer asks for the rows in order)."""
    held: dict[int, np.ndarray] = {}

    def row(r: int) -> np.ndarray:
        chunk, offset = divmod(r, _ROWS_PER_CHUNK)
        if chunk not in held:
            held.clear()
            held[chunk] = parts.slice(part, chunk)
        return held[chunk][offset]

    return row


def _linear_initializers(graph: ir.Graph, linear: _Linear, settings: QuantizeSettings, *,
                         rows_shape: bool = False) -> list[ir.Value | None]:
    """MatMulNBits' initializers for ``linear``'s weight, computed while the model is written: B [N, blocks,
    block_size * bits / 8] uint8 (with ``rows_shape``, GatherBlockQuantized's [N, blocks * block_size * bits / 8]),
    scales [N, blocks] of the weight's type, zero points [N, ceil(blocks * bits / 8)] uint8 (None when
    symmetric), packed low bits first as QMOE's."""
    rows = _LinearRows(linear, settings.block_size)
    blob = settings.block_size * settings.bits // 8
    row_shape = (rows.blocks * blob,) if rows_shape else (rows.blocks, blob)

    def encode(matrix: np.ndarray) -> Sequence[np.ndarray | None]:
        packed, scales, zero_points = quantize_weight(matrix, bits=settings.bits, block_size=settings.block_size,
                                                      symmetric=not settings.zero_points)
        return packed.reshape(len(matrix), *row_shape), scales, zero_points

    shapes = [(linear.n, *row_shape), (linear.n, rows.blocks),
              (linear.n, -(-rows.blocks * settings.bits // 8)) if settings.zero_points else None]
    parts = _QuantizedParts(rows.shape[0], lambda chunk: encode(rows.expert(chunk)), shapes)
    dtypes = [ir.DataType.UINT8, linear.weight.dtype, ir.DataType.UINT8]
    return [None if shape is None else streamed_initializer(
                graph, f"{linear.weight.source.name}.{name}", _row_slices(parts, part), dtype, shape,
                sources=[linear.weight.source])
            for part, (name, shape, dtype) in enumerate(zip(("B", "scales", "zero_points"), shapes, dtypes))]


def _quantize_linears(graph: ir.Graph, linears: Sequence[_Linear], settings: QuantizeSettings) -> list[LinearReport]:
    """Replace each of ``linears`` by a com.microsoft::MatMulNBits (the same output); a weight value several
    of them read is quantized once, its bytes counted on the first."""
    made: dict[int, tuple[str, list[ir.Value | None]]] = {}  # id of a weight value -> (its first layer, parts)
    reports = []
    for linear in linears:
        node, key = linear.node, id(linear.node.inputs[1])
        report = LinearReport(
            node=node.name or node.outputs[0].name, output=node.outputs[0].name, op=linear.how, k=linear.k,
            n=linear.n, bits=settings.bits, block_size=settings.block_size, zero_points=settings.zero_points,
            accuracy_level=settings.level, weight_bytes_before=0, weight_bytes_after=0)
        if key in made:
            report.shares_weight_of = made[key][0]
        else:
            made[key] = (report.node, _linear_initializers(graph, linear, settings))
            report.weight_bytes_before = linear.weight.source.const_value.nbytes
            report.weight_bytes_after = sum(math.prod(v.shape.numpy()) * int(v.dtype.itemsize)
                                            for v in made[key][1] if v is not None)
        packed, scales, zero_points = made[key][1]
        reports.append(report)
        inputs = [node.inputs[0], packed, scales, zero_points, None, linear.bias]
        while inputs[-1] is None:
            inputs.pop()
        op = TapeBuilder()
        matmul = op.MatMulNBits(*inputs, _domain=ORT_DOMAIN, _version=1, _name=node.name, K=linear.k, N=linear.n,
                                bits=settings.bits, block_size=settings.block_size, accuracy_level=settings.level)
        replace(node, matmul, op)
    return reports


# ----------------------------------------------------------------------------- the token embedding

@dataclasses.dataclass
class EmbeddingReport(_QuantizedLayer):
    """The token embedding's Gather made a com.microsoft::GatherBlockQuantized: its table's bytes before and
    after; ``float_kept``: another node reads the float table too (an lm_head tied to it, left float)."""

    vocabulary: int
    hidden: int
    float_kept: bool = False

    def describe(self) -> str:
        kept = " (the float table stays for its other readers: quantize them too with --linears)" \
            if self.float_kept else ""
        return (f"{self.node}: embedding [{self.vocabulary}, {self.hidden}] -> GatherBlockQuantized int{self.bits} "
                f"block {self.block_size}, {self.weight_bytes_before:,} -> {self.weight_bytes_after:,} bytes{kept}")


def _embeddings(graph: ir.Graph, settings: QuantizeSettings) -> tuple[list[_Linear], list[LinearSkipped]]:
    """The main graph's token embeddings: Gathers on axis 0 of a graph input's integer ids from a constant float
    matrix [vocabulary, hidden] (an initializer, possibly behind layout ops), as linears whose weight is [N, K] =
    [vocabulary, hidden]; and those left float, with the reason."""
    found, skipped = [], []
    inputs = set(graph.inputs)
    for node in graph:
        if node.domain not in ("", "ai.onnx") or node.op_type != "Gather" or node.inputs[1] not in inputs \
                or node.attributes.get_int("axis", 0) != 0:
            continue
        table = constant_weight(node.inputs[0])
        if table is None or len(table.shape) != 2 or graph.initializers.get(table.source.name) is not table.source:
            continue
        linear = _Linear(node, table, transposed=True)
        name = node.name or node.outputs[0].name
        if table.dtype not in _LINEAR_TYPES:
            skipped.append(LinearSkipped(name, table.source.name, f"its table is {table.dtype.name.lower()} "
                                         "(GatherBlockQuantized's CPU kernel takes float32 or float16 scales)"))
        elif linear.k % settings.block_size:
            skipped.append(LinearSkipped(name, table.source.name, f"hidden size {linear.k} is not a multiple of the "
                                         f"block size {settings.block_size}"))
        else:
            found.append(linear)
    return found, skipped


def _quantize_embeddings(graph: ir.Graph, tables: Sequence[_Linear], settings: QuantizeSettings
                         ) -> list[EmbeddingReport]:
    """Replace each embedding Gather by a com.microsoft::GatherBlockQuantized of its table quantized along the
    hidden axis (gather_axis 0, quantize_axis 1; MatMulNBits' packing: the data [vocabulary, hidden * bits / 8],
    scales [vocabulary, hidden / block_size], zero points 2^(bits-1) when symmetric)."""
    reports = []
    for table in tables:
        node = table.node
        packed, scales, zero_points = _linear_initializers(graph, table, settings, rows_shape=True)
        report = EmbeddingReport(node=node.name or node.outputs[0].name, output=node.outputs[0].name,
                                 bits=settings.bits, block_size=settings.block_size,
                                 zero_points=settings.zero_points, accuracy_level=EXACT,
                                 weight_bytes_before=table.weight.source.const_value.nbytes,
                                 weight_bytes_after=sum(math.prod(v.shape.numpy()) * int(v.dtype.itemsize)
                                                        for v in (packed, scales, zero_points) if v is not None),
                                 vocabulary=table.n, hidden=table.k)
        inputs = [packed, node.inputs[1], scales, zero_points]
        while inputs[-1] is None:
            inputs.pop()
        op = TapeBuilder()
        gathered = op.GatherBlockQuantized(*inputs, _domain=ORT_DOMAIN, _version=1, _name=node.name, gather_axis=0,
                                           quantize_axis=1, block_size=settings.block_size, bits=settings.bits)
        replace(node, gathered, op)
        reports.append(report)
    return reports


# ----------------------------------------------------------------------------- the model

@dataclasses.dataclass
class ErrorStat:
    """The error of one tensor over every size tried: max |quantized - fp32| and that over max |fp32|
    (:mod:`moe_onnx.compare`: a NaN or an infinity where the fp32 model has another value is an infinite error).
    For a layer, also the tokens routed, those ``rerouted`` (whose set of selected experts differs from the
    fp32 model's: quantization moved a near tie of the router's scores) and the largest change of the
    routing weight of an expert that both select for a token (``routing_weight_change``)."""

    name: str
    max_abs: float
    relative: float
    reference_max: float
    tokens: int | None = None
    rerouted: int | None = None
    routing_weight_change: float | None = None


@dataclasses.dataclass
class ErrorReport:
    """:func:`measure_error`'s result: every output's error, and every quantized layer's output's (MOE
    nodes in ``layers``, linear layers in ``linears``)."""

    backend: str
    sizes: list[list[int]]
    seed: int
    outputs: list[ErrorStat]
    layers: list[ErrorStat]
    linears: list[ErrorStat] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class QuantizeReport:
    """What quantization did: the settings, each MOE node made a QMOE, each linear layer made a MatMulNBits
    and those left float (with ``settings.linears``), notes, and (when measured) the error."""

    settings: QuantizeSettings
    layers: list[LayerReport]
    notes: list[str] = dataclasses.field(default_factory=list)
    error: ErrorReport | None = None
    linears: list[LinearReport] = dataclasses.field(default_factory=list)
    linears_float: list[LinearSkipped] = dataclasses.field(default_factory=list)
    embeddings: list[EmbeddingReport] = dataclasses.field(default_factory=list)
    embeddings_float: list[LinearSkipped] = dataclasses.field(default_factory=list)

    @property
    def weight_bytes_before(self) -> int:
        return sum(layer.weight_bytes_before for layer in self.layers)

    @property
    def weight_bytes_after(self) -> int:
        return sum(layer.weight_bytes_after for layer in self.layers)

    def summary(self) -> str:
        experts = bool(self.layers) or not self.settings.linears  # a dense model's linears alone: no MOE lines
        lines = [f"quantize: {len(self.layers)} MOE node{'s' if len(self.layers) != 1 else ''} -> QMOE "
                 f"({self.settings.describe()})"] if experts else []
        lines += [f"  {layer.describe()}" for layer in self.layers]
        if self.settings.linears:
            s = self.settings
            lines.append(f"quantize: {len(self.linears)} linear layer{'s' if len(self.linears) != 1 else ''} -> "
                         f"com.microsoft::MatMulNBits (int{s.bits}, block {s.block_size}, "
                         f"{'with zero points' if s.zero_points else 'symmetric'}, accuracy_level "
                         f"{self.linears[0].accuracy_level if self.linears else '-'})")
            lines += [f"  {linear.describe()}" for linear in self.linears]
            lines += [f"  left float: {skipped.node} (weight {skipped.weight}): {skipped.reason}"
                      for skipped in self.linears_float]
        if self.settings.embedding:
            lines.append(f"quantize: {len(self.embeddings)} token embedding"
                         f"{'s' if len(self.embeddings) != 1 else ''} -> com.microsoft::GatherBlockQuantized")
            lines += [f"  {embedding.describe()}" for embedding in self.embeddings]
            lines += [f"  left float: {skipped.node} (table {skipped.weight}): {skipped.reason}"
                      for skipped in self.embeddings_float]
        lines += [f"  note: {note}" for note in self.notes]
        before, after = self.weight_bytes_before, self.weight_bytes_after
        if experts:
            lines.append(f"expert weights: {before:,} -> {after:,} bytes ({after / max(before, 1):.3f}x)")
        if self.settings.linears:
            before = sum(linear.weight_bytes_before for linear in self.linears)
            after = sum(linear.weight_bytes_after for linear in self.linears)
            lines.append(f"linear weights: {before:,} -> {after:,} bytes ({after / max(before, 1):.3f}x)")
        if self.error is not None:
            e = self.error
            lines.append(f"error vs the unquantized model ({e.backend} backend, sizes {format_sizes(e.sizes)}, "
                         f"seed {e.seed}; relative = max abs error / max |unquantized value|):")
            lines += [f"  output '{s.name}': max abs {s.max_abs:.3g}, relative {s.relative:.3g}" for s in e.outputs]
            lines += [f"  layer '{layer.node}' (output '{s.name}'): max abs {s.max_abs:.3g}, relative "
                      f"{s.relative:.3g}, tokens rerouted {s.rerouted}/{s.tokens}, routing weights moved by up to "
                      f"{s.routing_weight_change:.3g}" for layer, s in zip(self.layers, e.layers)]
            lines += [f"  linear '{linear.node}' (output '{s.name}'): max abs {s.max_abs:.3g}, relative "
                      f"{s.relative:.3g}" for linear, s in zip(self.linears, e.linears)]
            if any(s.rerouted or s.routing_weight_change for s in e.layers):
                lines.append("  (the router is not quantized, but its input is an earlier layer's output: a rerouted "
                             "token, or a routing weight that moves, changes a layer's output by more than its "
                             "own weights' quantization error)")
        return "\n".join(lines)

    def document(self) -> dict:
        """The report as a JSON-ready dict."""
        return dataclasses.asdict(self)


def _is_moe(node: ir.Node) -> bool:
    return node.domain == DOMAIN and node.op_type == "MOE"


def _quantize(model: ir.Model, settings: QuantizeSettings, progress: Callable[[str], None] | None) -> QuantizeReport:
    """Replace every MOE node of ``model``'s main graph by a QMOE, in place (MOE nodes inside subgraphs
    are left as they are, with a note), and with ``settings.linears`` every MatMul and Gemm of the main
    graph whose weight is a constant float32/float16 matrix by a com.microsoft::MatMulNBits (K padded with
    zeros to whole blocks), except routers (they choose the experts) and weights with K below the block
    size, which stay float and are listed with the reason. The quantized weights are computed when the
    model is written (or read). Raises QuantizeError for bad settings, a model with nothing to quantize
    (no MOE node; with ``linears``, no linear layer either), or a node whose weights the settings cannot
    quantize (nothing is changed then)."""
    say = progress or (lambda message: None)
    settings.check()
    nodes = [node for node in model.graph if _is_moe(node)]
    nested = [node for node in ir.traversal.RecursiveGraphIterator(model.graph) if _is_moe(node)
              and node.graph is not model.graph]
    linears, left_float = _plan_linears(model.graph, settings) if settings.linears else ([], [])
    tables, tables_float = _embeddings(model.graph, settings) if settings.embedding else ([], [])
    if not nodes and not linears and not tables:
        raise QuantizeError(_nothing_to_quantize(model.graph, settings, left_float + tables_float))
    if nodes:
        say(f"planning {len(nodes)} MOE node{'s' if len(nodes) != 1 else ''} (their weights are quantized as they "
            "are written)")
    plans = [(node, *_plan(model.graph, node, settings)) for node in nodes]
    report = QuantizeReport(settings, [], linears_float=left_float, embeddings_float=tables_float)
    for node, weights, how in plans:
        report.layers.append(_quantize_node(model.graph, node, weights, how, settings))
    if linears:
        say(f"planning {len(linears)} linear layers")
        report.linears = _quantize_linears(model.graph, linears, settings)
    if tables:
        report.embeddings = _quantize_embeddings(model.graph, tables, settings)
    if linears or tables:
        model.opset_imports.setdefault(ORT_DOMAIN, 1)
    if nested:
        report.notes.append(f"{len(nested)} MOE node(s) inside subgraphs (If/Loop/Scan bodies) stay unquantized: "
                            + ", ".join(f"'{node.name}'" for node in nested))
    repacked = [layer.node for layer in report.layers if layer.quant_type == QUANT_MXFP4]
    if repacked and settings.level == INT8_ACTIVATIONS:
        report.notes.append(f"accuracy_level {settings.level} does not apply to the MXFP4 nodes "
                            f"({', '.join(repacked)}): they keep their MOE's")
    common_passes.RemoveUnusedNodesPass()(model)  # drops the float weights
    for linear, report_line in (*zip(linears, report.linears), *zip(tables, report.embeddings)):
        report_line.float_kept = linear.weight.source.name in model.graph.initializers
    return report


class Quantize(RewritePass):
    """Quantizing a model in place as a pass (the pass protocol of ``moe_onnx/_ir/passes.py``; :func:`_quantize`
    says what it does and raises): the MOE nodes made QMOE, the linears made MatMulNBits and the embedding made
    GatherBlockQuantized as rewrites, those left float as near-misses; the whole :class:`QuantizeReport` in
    ``report`` once it ran."""

    def __init__(self, settings: QuantizeSettings, progress: Callable[[str], None] | None = None) -> None:
        self.settings, self.progress = settings, progress
        self.report: QuantizeReport | None = None

    def call(self, model: ir.Model) -> RewriteResult:
        self.report = report = _quantize(model, self.settings, self.progress)
        skipped = [{"rule": rule, "node": line.node, "reason": line.reason}
                   for rule, lines in (("MatMulNBits", report.linears_float),
                                       ("GatherBlockQuantized", report.embeddings_float)) for line in lines]
        return rewritten(model, {"QMOE": len(report.layers), "MatMulNBits": len(report.linears),
                                 "GatherBlockQuantized": len(report.embeddings)},
                         near_misses=skipped, notes=report.notes)


def _nothing_to_quantize(graph: ir.Graph, settings: QuantizeSettings, left_float: Sequence[LinearSkipped]) -> str:
    """Why a model has nothing to quantize: its experts are QMOE already (quantized before; or onnxruntime's QMoE, as
    onnxruntime-genai's model builder writes int4 models), or it is not fused; and with --linears or --embedding,
    what stayed float."""
    quantized = [node for node in graph if (node.domain, node.op_type) in ((DOMAIN, "QMOE"), (ORT_DOMAIN, "QMoE"))]
    asked = " and ".join(what for what, on in (("no linear layer (MatMul or Gemm with a constant weight matrix)",
                                                settings.linears),
                                               ("no token embedding (a Gather of the token ids from a constant "
                                                "table)", settings.embedding)) if on)
    why = f" ({len(left_float)} left float; '{left_float[0].node}': {left_float[0].reason})" if left_float else ""
    if quantized:
        ours = sorted({f"{attribute_value(n, 'quant_type', QUANT_INT)} {attribute_value(n, 'bits', 0)}-bit"
                       for n in quantized if n.domain == DOMAIN})
        contrib = sorted({f"{attribute_value(n, 'expert_weight_bits', 4)}-bit" for n in quantized
                          if n.domain == ORT_DOMAIN})
        kinds = "; ".join(f"{op}, {', '.join(bits)}" for op, bits in (("QMOE", ours), ("com.microsoft::QMoE", contrib))
                          if bits)
        more = f"; {asked} to quantize{why}" if asked else (
            ": nothing is left to quantize (--linears and --embedding quantize the other layers)")
        return (f"the model's {len(quantized)} expert block{'s are' if len(quantized) != 1 else ' is'} quantized "
                f"already ({kinds}){more}")
    if asked:
        return f"the model has no MOE node and {asked} to quantize{why}"
    return ("the model has no MOE node (moe_onnx domain) to quantize; quantize takes a model fused by "
            "`moe-onnx optimize` (target moe): run that first")


def keep_stored_mxfp4(model: ir.Model) -> list[LayerReport]:
    """Every MOE node of ``model``'s main graph whose expert weights all hold MXFP4 as stored (a checkpoint's
    experts, read by moe_onnx.export) becomes a QMOE of quant_type mxfp4 with those codes and scales, bit for
    bit (never widened); the other nodes stay as they are. Returns what was done, node by node."""
    settings = QuantizeSettings(bits=4)
    layers = []
    for node in [node for node in model.graph if _is_moe(node)]:
        weights = _expert_weights(node, model.graph)
        if all(w.stored_mxfp4 is not None for w in weights):
            layers.append(_quantize_node(model.graph, node, weights, _STORED, settings))
    if layers:
        common_passes.RemoveUnusedNodesPass()(model)
    return layers
