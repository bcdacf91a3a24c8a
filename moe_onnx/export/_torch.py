"""The torch side of ``moe-onnx export``: load a checkpoint with transformers and export its decoder with a flat
KV cache through torch.onnx. Imported only by :func:`moe_onnx.export.export_checkpoint`, after it has checked
that torch and transformers are installed."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import onnx_ir as ir
import torch
import transformers
from safetensors import safe_open
from transformers.cache_utils import DummyLayer, DynamicLayer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from . import ExportError
from .families import ExportFamily
from .genai_config import INPUT_NAMES, OUTPUT_NAMES, CacheShape

OPSET = 18
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# the trace's sizes: distinct and above 1, so that no dim is taken for a constant
_TRACE_BATCH, _TRACE_SEQUENCE, _TRACE_PAST = 2, 3, 5


def load_model(checkpoint: Path, family: ExportFamily, dtype: str) -> transformers.PreTrainedModel:
    """The checkpoint's causal LM in eval mode at ``dtype``, with the family's experts implementation and
    eager attention (the plain matmul-softmax-matmul the exporters write for any dtype).

    The weights are read one parameter at a time: transformers' load takes the checkpoint's tensors from
    :func:`checkpoint_tensors` (read with ``pread``, not memory-mapped) and, with its asynchronous loading off,
    reads the tensors of each parameter only when it converts them (stacking an expert's tensors into the fused
    expert parameters), so the load holds the model and one parameter's checkpoint tensors, not the checkpoint's
    pages beside the model."""
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with contextlib.ExitStack() as files, _environment(HF_DEACTIVATE_ASYNC_LOAD="1"):
        model = model_class.from_pretrained(
            None, config=config, state_dict=checkpoint_tensors(checkpoint, files), dtype=DTYPES[dtype],
            attn_implementation="eager", experts_implementation=family.experts_implementation)
    return model.eval()


def checkpoint_tensors(checkpoint: Path, files: contextlib.ExitStack) -> dict[str, object]:
    """The checkpoint's tensors by name, each unread (safetensors' slice of a file opened with its ``pread``
    backend: ``tensor[...]`` reads it into memory of its own) from ``model.safetensors`` or the files that
    ``model.safetensors.index.json`` names; the files stay open until ``files`` closes."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (checkpoint / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {checkpoint}")
    tensors = {}
    for name in names:
        weights = files.enter_context(safe_open(checkpoint / name, framework="pt", backend="pread"))
        tensors.update((key, weights.get_slice(key)) for key in weights.keys())
    return tensors


@contextlib.contextmanager
def _environment(**variables: str):
    """Set environment ``variables`` while the block runs, then restore what was there."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def refuse_states(model: transformers.PreTrainedModel) -> None:
    """ExportError when a layer caches anything but keys and values (transformers' cache layer types: a Mamba,
    convolution or linear-attention state, the indexer keys of sparse attention): the decoder's inputs and
    genai_config.json name keys and values only. Layers that cache nothing (a MoE-only layer) are fine."""
    cache = transformers.DynamicCache(config=model.config)
    kinds = {type(layer).__name__ for layer in cache.layers} - {"DynamicLayer", "DynamicSlidingWindowLayer",
                                                                 "DummyLayer"}
    if kinds:
        raise ExportError(f"{model.config.model_type}: its cache holds {', '.join(sorted(kinds))} layers (state "
                          f"other than keys and values, layer_types {getattr(model.config, 'layer_types', None)}); "
                          f"moe-onnx export writes a decoder with a KV cache only")


class FlatCacheDecoder(torch.nn.Module):
    """A causal LM as a function of flat tensors: (input_ids, attention_mask, position_ids, past key, past value,
    ... of each layer in ``cache_layers``) -> (logits, present key, present value, ...), each past and present
    [batch, kv heads, length, key or value head size]; the presents are the pasts with this step's keys and values
    appended. Layers without attention (a decoder layer that is only a MoE block) hold no cache and are left out."""

    def __init__(self, model: transformers.PreTrainedModel, cache_class: type[transformers.DynamicCache],
                 cache_layers: list[int]):
        super().__init__()
        self.model = model
        self.cache_class = cache_class
        self.cache_layers = cache_layers

    def forward(self, input_ids, attention_mask, position_ids, past):
        cache = empty_cache(self.model, self.cache_class)
        for layer, key, value in zip(self.cache_layers, past[0::2], past[1::2], strict=True):
            cache.layers[layer].update(key, value)
        output = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=cache, use_cache=True)
        presents = []
        for layer in self.cache_layers:
            presents += [output.past_key_values.layers[layer].keys, output.past_key_values.layers[layer].values]
        return (output.logits, *presents)


def io_names(cache_layers: list[int]) -> tuple[list[str], list[str]]:
    """The decoder's input and output names (genai_config.json's, layer by layer)."""
    inputs = [INPUT_NAMES["input_ids"], INPUT_NAMES["attention_mask"], INPUT_NAMES["position_ids"]]
    outputs = [OUTPUT_NAMES["logits"]]
    for layer in cache_layers:
        inputs += [INPUT_NAMES["past_key_names"] % layer, INPUT_NAMES["past_value_names"] % layer]
        outputs += [OUTPUT_NAMES["present_key_names"] % layer, OUTPUT_NAMES["present_value_names"] % layer]
    return inputs, outputs


def cache_class(model: transformers.PreTrainedModel) -> type[transformers.DynamicCache]:
    """The cache class ``model`` makes for itself: DynamicCache, or a subclass of it that the family insists on
    (MiniMax's, for its linear-attention states)."""
    with torch.no_grad():
        output = model(input_ids=torch.zeros(1, 1, dtype=torch.int64), use_cache=True)
    return type(output.past_key_values)


def empty_cache(model: transformers.PreTrainedModel, cache_class: type[transformers.DynamicCache]
                ) -> transformers.DynamicCache:
    """An empty ``cache_class`` with a layer per decoder layer: transformers' DummyLayer where the layer caches
    nothing (a MoE-only layer), else a full DynamicLayer (a sliding window is masked, never cut from the cache)."""
    cache = cache_class()
    cache.layers = [DummyLayer() if isinstance(layer, DummyLayer) else DynamicLayer()
                    for layer in transformers.DynamicCache(config=model.config).layers]
    return cache


def trace_inputs(model: transformers.PreTrainedModel, cache_class: type[transformers.DynamicCache]
                 ) -> tuple[tuple[torch.Tensor, ...], list[CacheShape]]:
    """Example inputs of the trace (a batch of 2, 3 new tokens after 5 cached ones) and the cache's shape per
    layer. The cache is the model's own, of a 1-token prefill into :func:`empty_cache`, repeated to 5 tokens of
    each sequence: so its layers, kv heads and key and value sizes are the family's, whatever its attention
    (multi-head latent attention's keys are wider than its values, sliding-window layers may have other heads).
    One token, because the eager experts gather each token's expert weights (a real model's whole batch of
    tokens would gather several times a layer's experts)."""
    generator = torch.Generator().manual_seed(0)
    batch, sequence, past = _TRACE_BATCH, _TRACE_SEQUENCE, _TRACE_PAST
    input_ids = torch.randint(0, model.config.vocab_size, (batch, past + sequence), generator=generator)
    positions = torch.arange(past + sequence).expand(batch, past + sequence)
    with torch.no_grad():
        prefill = model(input_ids=input_ids[:1, :1], attention_mask=torch.ones(1, 1, dtype=torch.int64),
                        position_ids=positions[:1, :1], past_key_values=empty_cache(model, cache_class),
                        use_cache=True)
    cache, shapes = [], []
    for layer, entry in enumerate(prefill.past_key_values.layers):
        if not isinstance(entry, DummyLayer):
            cache += [entry.keys.repeat(batch, 1, past, 1), entry.values.repeat(batch, 1, past, 1)]
            shapes.append(CacheShape(layer, entry.keys.shape[1], entry.keys.shape[3]))
    attention_mask = torch.ones(batch, past + sequence, dtype=torch.int64)
    return (input_ids[:, past:], attention_mask, positions[:, past:], tuple(cache)), shapes


def export_decoder(model: transformers.PreTrainedModel, path: Path) -> list[CacheShape]:
    """Export ``model``'s decoder with a flat KV cache through the dynamo exporter to ``path`` (its weights in
    ``path``.data), with dynamic batch_size, sequence_length, past_sequence_length and total_sequence_length.
    Returns the cache's shape per layer that has one."""
    cache_type = cache_class(model)
    inputs, cache_shapes = trace_inputs(model, cache_type)
    decoder = FlatCacheDecoder(model, cache_type, [shape.layer for shape in cache_shapes]).eval()
    input_names, output_names = io_names(decoder.cache_layers)
    dynamic = torch.export.Dim.DYNAMIC  # torch.export relates the dims itself (total = past + sequence)
    pair, cache = {0: dynamic, 1: dynamic}, {0: dynamic, 2: dynamic}
    shapes = (pair, pair, pair, (cache,) * len(inputs[3]))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(decoder, inputs, dynamo=True, opset_version=OPSET, input_names=input_names,
                                    output_names=output_names, dynamic_shapes=shapes, verbose=False)
    _tidy(program.model, _dim_names(input_names, output_names))
    program.save(str(path), external_data=True)
    return cache_shapes


def _dim_names(input_names: list[str], output_names: list[str]) -> dict[str, dict[int, str]]:
    cache = {0: "batch_size", 2: "past_sequence_length"}
    names = {"input_ids": {0: "batch_size", 1: "sequence_length"},
             "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
             "position_ids": {0: "batch_size", 1: "sequence_length"},
             "logits": {0: "batch_size", 1: "sequence_length"}}
    names.update({name: cache for name in input_names[3:]})
    names.update({name: {0: "batch_size", 2: "total_sequence_length"} for name in output_names[1:]})
    return names


def _tidy(model: ir.Model, names: dict[str, dict[int, str]]) -> None:
    """Give the graph's inputs' and outputs' symbolic dims the names genai and verify read (the dynamo exporter
    names them after its symbols: s0, s1 + s0, ...), and drop the nodes' doc strings and metadata (the
    exporter's source locations: most of a small model's bytes)."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        node.doc_string = None
        node.metadata_props.clear()
    for value in (*model.graph.inputs, *model.graph.outputs):
        if value.shape is None:
            continue
        dims = list(value.shape)
        for axis, name in names.get(value.name, {}).items():
            dims[axis] = ir.SymbolicDim(name)
        value.shape = ir.Shape(dims)
