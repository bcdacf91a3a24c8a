"""Fuzzing every op with mostly-invalid nodes: the numpy reference, the Python backend and the C++
backend must agree on each node.

A node starts as a valid case of the op's case table (tests/cases/<op>.py) and goes through a few
mutations: input dtypes (also ones no op allows), ranks and dims (0, 1, mismatched, huge beside a
0), index values (-1, >= E, 2**63 - 1...), offsets (permuted, wrapping), attribute values
(out-of-range ints, nan/inf, wrong strings, wrong types, unknown names), inputs removed or added,
fewer outputs, other inputs made initializers. Then either all three give the same outputs (within
the case's tolerance) or all three fail with MoeOpError / INVALID_ARGUMENT and the same message
(onnxruntime's node prefix aside). The C++ kernels run in this process, so the sanitizer build
(custom_ops/sanitize.sh) catches their memory errors here.

The examples are derandomized (the same nodes on every run); MOE_ONNX_FUZZ_EXAMPLES sets how many per op.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings

import numpy as np
import onnx
import pytest
from backends import KERNEL_CREATION, as_float64, kernel_error, run_case
from cases import ALL_CASES, Case, bf16_tolerance
from cases.moe import BF16, TOL
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

from moe_onnx.ops import OPS, MoeOpError
from moe_onnx.ops._common import BF16_OPERANDS
from moe_onnx.runtime import BACKENDS

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("MOE_ONNX_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DTYPES = [np.dtype(t) for t in (np.float32, np.float16, BF16, np.int8, np.int32, np.int64, np.uint8, np.int16,
                                np.uint16, np.uint64, np.float64, np.complex64, np.bool_)]
HUGE = 2**16
SIZES = [0, 1, 2, 3, 5, HUGE, 2**31, 2**40]  # huge sizes only where another dim is 0
MAX_ELEMENTS = 1 << 16  # per input, after a mutation
MAX_OUTPUT_ELEMENTS = 1 << 24  # per output, as shape inference gives it
INDEX_VALUES = [-1, -2, 2**31 - 1, -2**31, 2**32, 2**63 - 1, -2**63]
FLOAT_VALUES = [math.nan, math.inf, -math.inf, 1e30, -0.0]
ATTR_VALUES = {
    "int": [-2**63, -2**31 - 1, -2, -1, 0, 1, 2, 3, 4, 8, 2**31, 2**62 + 1, 2**63 - 1],
    "float": [math.nan, math.inf, -math.inf, -1.0, 0.0, 0.5, 1.702, 7.0, 1e38],
    "string": ["", "GEMM2_BIAS_SWIGLU_CLAMP", "GEMM3_SWIGLU", "GEMM2_ACT", "relu2", "gelu_tanh", "gemm3_swiglu", "SWIGLU", "GEMM3_SWIGLU\x00x", "it's\n",
               "é", "\xa0", b"\xff", b"GEMM3_SWIGLU\xe2\x82"],  # \xa0: Python's repr escapes it; invalid UTF-8
    "ints": [[0], [0, 1], [1, 0], [-1, 2], [0, 4], [2, 8], [0, 2**62], [2**63 - 1, -2**63], [0, 1, 2]],
}
SIZE_ATTRIBUTES = {"expert_num", "expert_capacity"}
# A node of a group of several ranks needs its ranks: on one process the reference refuses it and the
# backends start MPI to find the group missing; the fuzzer keeps these at 1 or below.
GROUP_SIZE_ATTRIBUTES = {"ep_world_size", "tp_world_size"}
# Ops that count slots per expert (num_experts entries per rank): a huge num_experts is too big to count.
COUNTED_EXPERTS_OPS = {"MoeDistributeDispatch"}


# ----------------------------------------------------------------------------- mutations

def _cast(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a`` as ``dtype`` the way astype converts (wrapping, nan to whatever), without warnings."""
    if a.dtype.kind == "c":
        a = a.real
    if BF16 in (a.dtype, dtype) and dtype.kind not in "fV" and a.dtype != dtype:
        a = a.astype(np.float32)  # ml_dtypes converts bfloat16 through float32 only
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return a.astype(dtype)


def _resized(a: np.ndarray, axis: int, size: int) -> np.ndarray | None:
    """``a`` with ``size`` entries along ``axis`` (cut, or repeated cyclically, or zeros); None when too
    big, or when a huge size would not be beside a 0 (long float sums round apart: no contract question)."""
    other = math.prod(d for i, d in enumerate(a.shape) if i != axis)
    if other * size > MAX_ELEMENTS or size >= HUGE and other:
        return None
    if a.shape[axis] == 0 or other == 0:
        return np.zeros(a.shape[:axis] + (size,) + a.shape[axis + 1:], a.dtype)
    return np.take(a, np.arange(size) % a.shape[axis], axis=axis)


def _present(case: Case, kinds: str | None = None) -> list[int]:
    return [i for i, a in enumerate(case.padded_inputs())
            if a is not None and (kinds is None or a.dtype.kind in kinds)]


def _with_input(case: Case, i: int, value: np.ndarray | None) -> Case:
    inputs = case.padded_inputs()
    inputs[i] = value
    return dataclasses.replace(case, inputs=inputs)


def retype(draw, case: Case) -> Case:
    """One input cast to another dtype (possibly one no op allows)."""
    i = draw(st.sampled_from(_present(case)))
    return _with_input(case, i, _cast(case.padded_inputs()[i], draw(st.sampled_from(DTYPES))))


def rerank(draw, case: Case) -> Case:
    """One input with a leading or trailing axis added, an axis removed, or flattened."""
    i = draw(st.sampled_from(_present(case)))
    a = case.padded_inputs()[i]
    how = draw(st.sampled_from(["lead", "trail", "drop", "flatten"]))
    if how == "lead":
        a = a[None]
    elif how == "trail":
        a = a[..., None]
    elif how == "flatten":
        a = a.reshape(-1)
    elif a.ndim:
        axis = draw(st.integers(0, a.ndim - 1))
        shape = a.shape[:axis] + a.shape[axis + 1:]
        a = np.take(a, [0], axis=axis).reshape(shape) if a.shape[axis] else np.zeros(shape, a.dtype)
    return _with_input(case, i, a if a.size <= MAX_ELEMENTS else case.padded_inputs()[i])


def resize_one(draw, case: Case) -> Case:
    """One dim of one input changed (so the inputs disagree)."""
    i = draw(st.sampled_from(_present(case)))
    a = case.padded_inputs()[i]
    if not a.ndim:
        return case
    axis = draw(st.integers(0, a.ndim - 1))
    size = draw(st.sampled_from(SIZES + [a.shape[axis] + 1, max(a.shape[axis] - 1, 0), 2 * a.shape[axis]]))
    resized = _resized(a, axis, size)
    return case if resized is None else _with_input(case, i, resized)


def resize_all(draw, case: Case) -> Case:
    """Every dim that equals one chosen dim changed alike (a consistent new E, H, k or N, or a coincidence)."""
    i = draw(st.sampled_from(_present(case)))
    a = case.padded_inputs()[i]
    if not a.ndim:
        return case
    old = a.shape[draw(st.integers(0, a.ndim - 1))]
    size = draw(st.sampled_from(SIZES + [old + 1, max(old - 1, 0)]))
    inputs = case.padded_inputs()
    for j, b in enumerate(inputs):
        for axis in range(b.ndim if b is not None else 0):
            if b.shape[axis] == old:
                b = _resized(b, axis, size)
                if b is None:
                    return case
        inputs[j] = b
    return dataclasses.replace(case, inputs=inputs)


def poke(draw, case: Case) -> Case:
    """One entry of one input set to an edge value (an index past the end, -1, 2**63 - 1, nan...)."""
    present = [i for i in _present(case) if case.padded_inputs()[i].size]
    if not present:
        return case
    i = draw(st.sampled_from(present))
    a = case.padded_inputs()[i].copy()
    flat = a.reshape(-1)
    at = draw(st.integers(0, flat.size - 1))
    if a.dtype.kind in "iu":
        value = draw(st.sampled_from(INDEX_VALUES + [int(flat.max()) + 1, int(flat.max()) + 2, flat.size]))
        flat[at] = _cast(np.array([value], np.int64) if value < 2**63 else np.array([value], np.uint64), a.dtype)[0]
    elif a.dtype.kind == "b":
        flat[at] = not flat[at]
    else:
        flat[at] = _cast(np.array([draw(st.sampled_from(FLOAT_VALUES))]), a.dtype)[0]
    return _with_input(case, i, a)


def scramble(draw, case: Case) -> Case:
    """An integer input reversed, permuted, or with a neighbour pair whose difference wraps int64."""
    present = [i for i in _present(case, "iu") if case.padded_inputs()[i].size > 1]
    if not present:
        return case
    i = draw(st.sampled_from(present))
    a = case.padded_inputs()[i].reshape(-1).copy()
    how = draw(st.sampled_from(["reverse", "permute", "wrap"]))
    if how == "reverse":
        a = a[::-1]
    elif how == "permute":
        a = a[np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(a.size)]
    else:  # [.., 2**63 - 1, -2, ..]: each step wraps in int64 arithmetic
        at = draw(st.integers(0, a.size - 2))
        a[at:at + 2] = _cast(np.array([2**63 - 1, -2], np.int64), a.dtype)
    return _with_input(case, i, a.reshape(case.padded_inputs()[i].shape))


def set_attribute(draw, case: Case) -> Case:
    """One attribute set to an edge value, a value of another type, or removed; or an unknown name."""
    specs = {a.name: a.kind for a in OPS[case.op].attributes}
    name = draw(st.sampled_from(sorted(specs) + ["expert_gamma"]))
    kind = specs.get(name, "int")
    if draw(st.integers(0, 5)) == 0:  # a value of another type
        kind = draw(st.sampled_from(sorted(ATTR_VALUES)))
    attrs = dict(case.attrs)
    values = ATTR_VALUES[kind]
    if name in SIZE_ATTRIBUTES:  # sizes of outputs: too big to allocate, or so big they overflow
        values = [v for v in values if not (isinstance(v, int) and 2**20 <= v < 2**62)]
    if name == "num_experts" and case.op in COUNTED_EXPERTS_OPS:  # sizes buffers, not outputs: memory, no contract
        values = [v for v in values if not (isinstance(v, int) and v > 2**20)]
    if name in GROUP_SIZE_ATTRIBUTES:  # a group of several ranks runs under mpirun only (tests/test_comm_mpi.py)
        values = [v for v in values if not (isinstance(v, int) and v > 1)]
    value = draw(st.sampled_from(values + [None]))
    if value is None:
        attrs.pop(name, None)
    else:
        attrs[name] = value
    return dataclasses.replace(case, attrs=attrs)


def toggle_input(draw, case: Case) -> Case:
    """An optional input removed, or an absent one taken from another case of the op."""
    optional = [i for i, p in enumerate(OPS[case.op].inputs) if p.optional]
    if not optional:  # MoeDistributeDispatch: every input is required
        return case
    i = draw(st.sampled_from(optional))
    if case.padded_inputs()[i] is not None:
        return _with_input(case, i, None)
    donors = [c.padded_inputs()[i] for c in ALL_CASES if c.op == case.op and c.padded_inputs()[i] is not None]
    return _with_input(case, i, draw(st.sampled_from(donors))) if donors else case


def fewer_outputs(draw, case: Case) -> Case:
    """The node with its first n outputs only, at least the required ones (or all)."""
    outputs = OPS[case.op].outputs
    required = sum(not p.optional for p in outputs)
    return dataclasses.replace(case, outputs=draw(st.sampled_from([None] + list(range(max(required, 1),
                                                                                     len(outputs) + 1)))))


def restore(draw, case: Case) -> Case:
    """Other inputs made initializers (the kernels see them at creation) or graph inputs."""
    present = _present(case)
    return dataclasses.replace(case, constant=tuple(sorted(draw(st.sets(st.sampled_from(present))))))


MUTATIONS = [retype, rerank, resize_one, resize_all, poke, poke, scramble, set_attribute, set_attribute,
             toggle_input, fewer_outputs, restore]


def _small(case: Case) -> bool:
    return sum(a.size for a in case.padded_inputs() if a is not None) <= 4096


BASES = {op: [c for c in ALL_CASES if c.op == op and c.error is None and _small(c)] for op in OPS}


@st.composite
def fuzzed_cases(draw, op: str) -> Case:
    """A valid case of ``op`` after one to four mutations."""
    case = draw(st.sampled_from(BASES[op]))
    for _ in range(draw(st.integers(1, 4))):
        case = draw(st.sampled_from(MUTATIONS))(draw, case)
    assume(_outputs_fit(case))
    return dataclasses.replace(case, name="fuzzed")


def _outputs_fit(case: Case) -> bool:
    """False when shape inference gives an output more than MAX_OUTPUT_ELEMENTS elements: a huge dim
    beside a 0 in the inputs can still make a big output (MoeDistributeDispatch's padding rows of drop/pad
    with no tokens), one too big to compute but small enough to be no contract error."""
    try:
        inferred = onnx.shape_inference.infer_shapes(case.model())
    except Exception:  # an invalid node: the kernels must refuse it
        return True
    for output in inferred.graph.output:
        dims = output.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims) and math.prod(d.dim_value for d in dims) > MAX_OUTPUT_ELEMENTS:
            return False
    return True


# ----------------------------------------------------------------------------- the property

Outcome = tuple  # ("ok", outputs) or (onnxruntime status name, message)
# A backend's statuses for a MoeOpError: INVALID_ARGUMENT, or what onnxruntime makes of it when a
# kernel's constructor (the C++ kernels check attributes and constant inputs there) throws it.
CONTRACT_ERRORS = {"INVALID_ARGUMENT", KERNEL_CREATION}
# onnxruntime's own graph check refuses complex inputs to any custom op before a kernel exists:
# there the reference must fail too, with any message.
ORT_REFUSED = re.compile(r"^\[ONNXRuntimeError\] : \d+ : INVALID_GRAPH : This is an invalid model\. Type Error: "
                         r"Type 'tensor\(complex64\)' of input parameter")


def reference_outcome(case: Case) -> Outcome:
    """The reference's outputs, or ("INVALID_ARGUMENT", message) for MoeOpError (anything else propagates)."""
    try:
        return "ok", case.run_reference(node_name=case.node_name)
    except MoeOpError as error:
        return "INVALID_ARGUMENT", str(error)


def backend_outcome(case: Case, backend: str, valid: bool, model: onnx.ModelProto | None = None) -> Outcome:
    """The backend's outputs, or (status, kernel message) of its error, or ("not a kernel error", text).
    A MoeOpError from moe_onnx.session() itself (an attribute name the op lacks, which onnxruntime
    cannot show a kernel) is the contract error too. ``model``: run this model of the case's node (run_case)."""
    try:
        return "ok", run_case(case, backend, valid=valid, model=model)
    except MoeOpError as error:
        return "INVALID_ARGUMENT", str(error)
    except Exception as error:  # onnxruntime's errors have no common base class
        return kernel_error(error) or ("not a kernel error", str(error))


def describe(case: Case) -> str:
    """A reproducer: inputs (dtype, shape, small values), attributes, outputs, initializers."""
    lines = [f"{case.op} attrs={case.attrs!r} outputs={case.outputs} constant={case.constant}"]
    for p, a in zip(OPS[case.op].inputs, case.padded_inputs()):
        if a is not None:
            values = f" = {a.tolist()!r}" if max((a.size, *a.shape)) <= 16 else ""
            lines.append(f"  {p.name}: {a.dtype}{list(a.shape)}{values}")
    return "\n".join(lines)


def disagreement(case: Case, model: onnx.ModelProto | None = None) -> str | None:
    """How a backend disagrees with the reference on ``case`` (run as ``model``, default its own); None when
    all three agree."""
    expected = reference_outcome(case)
    for backend in BACKENDS:
        got = backend_outcome(case, backend, valid=expected[0] == "ok", model=model)
        if expected[0] != "ok":
            if not (got[0] in CONTRACT_ERRORS and got[1] == expected[1] or ORT_REFUSED.search(got[1])):
                return f"{backend}: {got}\nreference: {expected}"
            continue
        if got[0] != "ok":
            return f"{backend}: {got}\nthe reference gives outputs"
        if len(got[1]) != len(expected[1]):
            return f"{backend}: {len(got[1])} outputs; the reference's {len(expected[1])}"
        for i, (g, e) in enumerate(zip(got[1], expected[1])):
            if (g.dtype, g.shape) != (e.dtype, e.shape):
                return f"{backend}: output {i} is {g.dtype}{list(g.shape)}; the reference's {e.dtype}{list(e.shape)}"
            rtol, atol = TOL.get(e.dtype, (case.rtol, case.atol))
            if case.attrs.get("accuracy_level") == BF16_OPERANDS:  # kernels with bf16 GEMM operands
                atol = max(atol, case.atol) + bf16_tolerance(case, expected[1])
            try:
                np.testing.assert_allclose(as_float64(g), as_float64(e), rtol=max(rtol, case.rtol),
                                           atol=max(atol, case.atol), err_msg=f"{backend}: output {i}")
            except AssertionError as error:
                return str(error)
    return None


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # nan/inf inputs: numpy says so, the backends agree
@pytest.mark.parametrize("op", list(OPS))
@FUZZ
@given(data=st.data())
def test_backends_agree(op, data):
    case = data.draw(fuzzed_cases(op))
    note(describe(case))
    problem = disagreement(case)
    assert problem is None, problem


# ----------------------------------------------------------------------------- corrupted assist_info

def _combine_case(name: str, capacity: int, ids: list[list[int]], experts: int = 4) -> Case:
    """A valid one-rank MoeDistributeCombine case on the assist_info of a real dispatch."""
    from moe_onnx.ops.distribute_dispatch import moe_distribute_dispatch

    rng = np.random.default_rng(len(name))
    expert_ids = np.array(ids, dtype=np.int64).reshape(len(ids), -1)
    x = rng.standard_normal((len(ids), 3)).astype(np.float32)
    expand_x, _, assist = moe_distribute_dispatch(x, expert_ids, num_experts=experts, expert_capacity=capacity)
    inputs = [rng.standard_normal(expand_x.shape).astype(np.float32), assist,
              rng.random(expert_ids.shape).astype(np.float32), x]
    return Case("MoeDistributeCombine", name, inputs, {"num_experts": experts})


def _corruptions(case: Case) -> list[Case]:
    """``case`` with assist_info corrupted: each entry set to edge values (-2, -1, 0, its neighbours, the
    length, int64's ends), and each section reversed, rotated or cut short."""
    assist = case.inputs[1]
    values = [-2, -1, 0, 1, assist.size, 2**31, 2**63 - 1, -2**63]
    out = []
    for i, v in enumerate(assist.tolist()):
        for value in sorted({*values, v - 1, v + 1} - {v}):
            if -2**63 <= value < 2**63:
                changed = assist.copy()
                changed[i] = value
                out.append(case.mutated(f"{case.name}_at{i}_{value}", None, assist_info=changed))
    header = 8 + 1 + 1 + 2  # one rank: then slot_to_send and arrival_to_row
    for start, end in ((header, assist.size), (8, assist.size), (0, assist.size)):
        for how, section in (("reversed", assist[start:end][::-1]), ("rotated", np.roll(assist[start:end], 1))):
            out.append(case.mutated(f"{case.name}_{how}_{start}", None,
                                    assist_info=np.concatenate([assist[:start], section])))
    out += [case.mutated(f"{case.name}_cut{n}", None, assist_info=assist[:n]) for n in (0, 7, 8, assist.size - 1)]
    out.append(case.mutated(f"{case.name}_longer", None, assist_info=np.append(assist, 0)))
    return out


def _one_slot_fewer_sent(case: Case) -> Case:
    """``case`` with its first kept slot dropped and send_counts[0] one less, slot_to_send still one-to-one:
    a self-consistent send side that no longer matches recv_counts[0] (one EP rank: the all-to-all is a copy)."""
    assist = case.inputs[1].copy()
    slots = assist[12:12 + case.inputs[2].size]  # one rank: slot_to_send starts at 8 + 1 + 1 + 2
    kept = np.flatnonzero(slots >= 0)
    slots[kept[0]] = -1
    slots[kept[1:]] = np.argsort(np.argsort(slots[kept[1:]]))
    assist[11] -= 1
    return case.mutated(f"{case.name}_one_slot_fewer_sent", None, assist_info=assist)


_DROPLESS = _combine_case("dropless", 0, [[0, 2], [1, 2], [2, 3]])
_DROP_PAD = _combine_case("drop_pad", 1, [[0, 2], [0, 2], [3, 1]])
# assist_info is a run-time input: each base case's node, with symbolic input dims, is one model (one session
# per backend) for all its corruptions
ASSIST_MODELS = {base.name: base.model(symbolic=True) for base in (_DROPLESS, _DROP_PAD)}
CORRUPTED = [(base.name, c) for base in (_DROPLESS, _DROP_PAD) for c in _corruptions(base)]
CORRUPTED.append((_DROPLESS.name, _one_slot_fewer_sent(_DROPLESS)))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("base, case", CORRUPTED, ids=[c.name for _, c in CORRUPTED])
def test_corrupted_assist_info(base, case):
    """A corrupted assist_info is refused in the reference's words by both backends (or, where it still
    describes a valid combine, gives the reference's numbers): never a crash, never a read out of bounds."""
    problem = disagreement(case, model=ASSIST_MODELS[base])
    assert problem is None, f"{describe(case)}\n{problem}"
