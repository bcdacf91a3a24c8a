"""Export one block to ONNX the way its style's users do, with reference data from torch."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
import transformers

from . import blocks
from .fixtures import ExportRecord
from .specs import ACTIVATION, ACTIVATION_FORMULA, RENORMALIZE, ROUTER, STYLES, BlockSpec

OPSET = 18
REFERENCE_SHAPE = (2, 3)  # the shape tests read as `hidden_states` / `expected`
ALTERNATE_SHAPE = (1, 5)  # a second (batch, seq) for checking the dynamic dims
TRACE_SHAPE = (2, 5)  # for the styles whose graph does not depend on the trace input's routing
# The loops over range(E) rather than over the experts the trace hit: their exports run on any input.
_RANGE_LOOP_NOTES = {
    "olmoe": "transformers 4.57 OLMoE loops over range(num_experts): every expert is exported, any input works.",
    "deepseek_v3": "transformers 4.57 DeepSeek-V3 loops over range(n_routed_experts), skipping while tracing the "
    "experts that get no token; the trace input reaches all, so every expert is exported and any input works.",
}


def _random_hidden(shape: tuple[int, int], hidden: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, hidden, generator=generator) * blocks.REFERENCE_INPUT_STD


def _hit_experts(block, spec: BlockSpec, hidden_states: torch.Tensor) -> frozenset[int]:
    return frozenset(blocks.router_choices(block, spec, hidden_states).flatten().tolist())


def _input_routing_to(block, spec: BlockSpec, shape, wanted, first_seed: int) -> torch.Tensor | None:
    """A random input whose set of reached experts `wanted` accepts, if one turns up in 2000 tries."""
    for seed in range(first_seed, first_seed + 2000):
        candidate = _random_hidden(shape, spec.hidden, seed)
        if wanted(_hit_experts(block, spec, candidate)):
            return candidate
    return None


def _loop_inputs(block, spec: BlockSpec, seed: int):
    """Trace, reference and alternate inputs for the traced loop styles.

    The TorchScript exporter unrolls `for expert in expert_hit`: it Splits the NonZero of the hit mask
    into as many rows as the trace hit and binds row i to the i-th traced expert's weights. The export
    therefore runs correctly only on inputs that reach exactly the traced experts (another count fails
    in that Split; the same count with other experts silently uses the wrong weights), so the reference
    inputs are chosen to reach exactly the traced set.
    Returns (trace, reference, alternate, traced experts, whether such reference inputs were found).
    """
    everything = frozenset(range(spec.experts))
    if spec.style == "loop_missing":
        trace = _input_routing_to(block, spec, REFERENCE_SHAPE, lambda hit: len(everything - hit) == 1, seed + 1000)
    else:
        tokens_per_sequence = max(REFERENCE_SHAPE[1], 4 * -(-spec.experts // spec.topk))
        trace = _input_routing_to(block, spec, (2, tokens_per_sequence), lambda hit: hit == everything, seed + 1000)
    if trace is None:
        raise RuntimeError(f"{spec.name}: found no trace input with the wanted expert coverage")
    traced = _hit_experts(block, spec, trace)
    reference = _input_routing_to(block, spec, REFERENCE_SHAPE, traced.__eq__, seed + 4000)
    alternate = _input_routing_to(block, spec, ALTERNATE_SHAPE, traced.__eq__, seed + 7000)
    found = reference is not None and alternate is not None
    if reference is None:
        reference = _random_hidden(REFERENCE_SHAPE, spec.hidden, seed + 1)
    if alternate is None:
        alternate = _random_hidden(ALTERNATE_SHAPE, spec.hidden, seed + 2)
    return trace, reference, alternate, traced, found


def _sorted_inputs(block, spec: BlockSpec, seed: int):
    """Trace (= reference) and alternate inputs for the sorted style: its export splits the routed rows by the
    trace's per-expert counts, so it runs only on inputs with the same counts; the alternate input has them in
    another (batch, seq) of as many tokens. Returns (trace, reference, alternate, whether one was found)."""
    reference = _random_hidden(REFERENCE_SHAPE, spec.hidden, seed + 1)

    def counts(hidden_states):
        return torch.bincount(blocks.router_choices(block, spec, hidden_states).flatten(), minlength=spec.experts)

    wanted = counts(reference)
    shape = REFERENCE_SHAPE[::-1]
    for candidate_seed in range(seed + 7000, seed + 27000):
        candidate = _random_hidden(shape, spec.hidden, candidate_seed)
        if torch.equal(counts(candidate), wanted):
            return reference, reference, candidate, True
    return reference, reference, _random_hidden(shape, spec.hidden, seed + 2), False


def _run(block, hidden_states: torch.Tensor) -> list[np.ndarray]:
    with torch.no_grad():
        result = block(hidden_states)
    outputs = result if isinstance(result, tuple) else (result,)
    return [output.detach().numpy() for output in outputs]


def _output_names(spec: BlockSpec, count: int) -> list[str]:
    extra = "router_scores" if spec.family == "gpt_oss" else "router_logits"
    return ["output"] + [extra] * (count - 1)


def export_block(spec: BlockSpec, onnx_path: Path, *, keep_router_output: bool = True, seed: int = 0) -> ExportRecord:
    """Build, export and record one block; writes `onnx_path` and the matching `.npz` reference data."""
    block = blocks.build_block(spec, seed=seed)
    exported = block if keep_router_output else _FirstOutput(block)

    missing: list[int] = []
    note = None
    if "loop" in spec.style and not STYLES[spec.style].dynamo:  # a TorchScript loop: valid for its trace only
        trace_input, reference, alternate, traced, found = _loop_inputs(block, spec, seed)
        if spec.family in _RANGE_LOOP_NOTES:
            note = _RANGE_LOOP_NOTES[spec.family]
        else:
            missing = sorted(set(range(spec.experts)) - traced)
            note = (
                "the unrolled loop runs correctly only on inputs routed to exactly the traced experts "
                f"{sorted(traced)}; the reference inputs "
                + ("are chosen so." if found else "are NOT such inputs (none found): onnxruntime will fail on them.")
            )
    elif spec.style == "sorted":
        trace_input, reference, alternate, found = _sorted_inputs(block, spec, seed)
        note = (
            "the export splits the routed rows by the trace's expert counts: it runs only on inputs with those counts "
            + ("(the alternate input has them); " if found else "(no alternate input with them found); ")
            + STYLES[spec.style].broken
        )
    else:
        trace_input = _random_hidden(TRACE_SHAPE, spec.hidden, seed + 3)
        reference = _random_hidden(REFERENCE_SHAPE, spec.hidden, seed + 1)
        alternate = _random_hidden(ALTERNATE_SHAPE, spec.hidden, seed + 2)

    output_names = _output_names(spec, len(_run(exported, reference)))
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    exporter = _export_dynamo if STYLES[spec.style].dynamo else _export_torchscript
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exporter(exported, trace_input, onnx_path, output_names)

    arrays = {}
    for suffix, inputs in (("", reference), ("_alt", alternate)):
        arrays[f"hidden_states{suffix}"] = inputs.numpy()
        for name, value in zip(output_names, _run(exported, inputs), strict=True):
            key = "expected" if name == "output" else f"expected_{name}"
            arrays[f"{key}{suffix}"] = value
    np.savez(onnx_path.with_suffix(".npz"), **arrays)

    return ExportRecord.describe(
        spec,
        onnx_path,
        exporter=STYLES[spec.style].description,
        opset=OPSET,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
        activation=ACTIVATION[spec.family],
        activation_formula=ACTIVATION_FORMULA[ACTIVATION[spec.family]],
        router=ROUTER[spec.family],
        renormalize=RENORMALIZE[spec.family],
        missing_experts=missing,
        trace_shape=list(trace_input.shape[:2]),
        note=note,
    )


class _FirstOutput(torch.nn.Module):
    """Keeps only the block output of a module that also returns router scores or logits."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, hidden_states):
        result = self.block(hidden_states)
        return result[0] if isinstance(result, tuple) else result


def _export_torchscript(block, trace_input, path: Path, output_names: list[str]) -> None:
    dynamic_axes = {"hidden_states": {0: "batch", 1: "seq"}, "output": {0: "batch", 1: "seq"}}
    for name in output_names[1:]:
        dynamic_axes[name] = {0: "tokens"}
    torch.onnx.export(
        block,
        (trace_input,),
        str(path),
        dynamo=False,
        opset_version=OPSET,
        input_names=["hidden_states"],
        output_names=output_names,
        dynamic_axes=dynamic_axes,
    )


def _export_dynamo(block, trace_input, path: Path, output_names: list[str]) -> None:
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    torch.onnx.export(
        block,
        (trace_input,),
        str(path),
        dynamo=True,
        opset_version=OPSET,
        input_names=["hidden_states"],
        output_names=output_names,
        dynamic_shapes=({0: batch, 1: seq},),  # by position: the forward's argument is not always named hidden_states
        external_data=False,
        verbose=False,
    )
