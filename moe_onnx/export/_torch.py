"""The torch side of ``moe-onnx export``: the decoder traced on torch's meta device (shapes, no weights) with a
flat KV cache, and the checkpoint's tensors mapped onto its parameters as transformers' loading maps them.
Imported only by :func:`moe_onnx.export.export_checkpoint`, after it has checked that torch and transformers are
installed.

The mapping is transformers' own (``conversion_mapping.get_model_conversion_mapping`` and the renaming of
``core_model_loading``): each parameter is a renamed checkpoint tensor or the output of a ``WeightConverter``
(per-expert tensors stacked by ``MergeModulelist``, gate and up concatenated, transposed, split...). The converter
runs here on a range of the parameter's first axis at a time (the experts' tensors of that range, or that range of
a stacked source) where its operations leave that axis alone, so a layer's experts are never stacked whole.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable

import ml_dtypes
import numpy as np
import onnx_ir as ir
import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from transformers.cache_utils import DummyLayer, DynamicLayer
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    Interleave,
    MergeModulelist,
    Split,
    Transpose,
    WeightConverter,
    WeightRenaming,
    build_glob_alternation,
    dot_natural_key,
    rename_source_key,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from . import ExportError
from .checkpoint import FLOATS, Mxfp4Source, Source
from .families import ExportFamily
from ..genai_folder import INPUT_NAMES, OUTPUT_NAMES, CacheShape

OPSET = 18
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: the trace's module: FlatCacheDecoder holds the causal LM as ``model``, so each initializer is "model." + the
#: parameter's name
PREFIX = "model."
# the trace's sizes: distinct and above 1, so that no dim is taken for a constant
_TRACE_BATCH, _TRACE_SEQUENCE, _TRACE_PAST = 2, 3, 5
_NUMPY = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
          torch.bfloat16: np.dtype(ml_dtypes.bfloat16), torch.int64: np.dtype(np.int64),
          torch.int32: np.dtype(np.int32), torch.bool: np.dtype(np.bool_)}


def meta_model(config: transformers.PretrainedConfig, family: ExportFamily, dtype: str
               ) -> transformers.PreTrainedModel:
    """The checkpoint's causal LM on the meta device at ``dtype`` (the modules transformers keeps in float32 at
    float16, in float32), with the family's experts implementation and eager attention (the plain
    matmul-softmax-matmul the exporters write for any dtype), in eval mode; its non-persistent buffers (rotary
    frequencies) computed on the CPU, as transformers' loading initializes them."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the float modules: the checkpoint's format is read by the export itself
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=DTYPES[dtype], attn_implementation="eager",
                                         experts_implementation=family.experts_implementation)
    plan = model._get_dtype_plan(DTYPES[dtype])
    if plan:
        alternation, groups, _ = build_glob_alternation(list(plan))
        for name, parameter in list(model.named_parameters()):
            match = alternation.search(name)
            if match is not None:
                module, attribute = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
                setattr(module, attribute, torch.nn.Parameter(parameter.to(plan[groups[match.lastgroup]]),
                                                              requires_grad=False))
    return model.eval()


def buffers(model: transformers.PreTrainedModel) -> dict[str, np.ndarray]:
    """The model's non-persistent buffers (not in a checkpoint: rotary frequencies and the like), computed on the
    CPU by transformers' own initialization, by name."""
    values = {}
    for name, buffer in model.named_non_persistent_buffers():
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        module.register_buffer(attribute, torch.empty_like(buffer, device="cpu"), persistent=False)
    for name, parameter in model.named_parameters():
        parameter._is_hf_initialized = True  # left alone (on the meta device)
    for name, buffer in model.state_dict(keep_vars=True).items():
        buffer._is_hf_initialized = True
    model.initialize_weights()
    for name, buffer in model.named_non_persistent_buffers():
        if buffer.device.type != "cpu":
            raise ExportError(f"{model.config.model_type}: buffer {name} has no value off the meta device")
        values[name] = to_numpy(buffer)
    return values


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
    appended. Layers without attention (a decoder layer that is only a MoE block) hold no cache and are left out.
    With ``last_logits`` the logits are the last position's only ([batch, 1, vocabulary]: what a generator reads),
    so a prompt's other positions never reach the lm_head."""

    def __init__(self, model: transformers.PreTrainedModel, cache_class: type[transformers.DynamicCache],
                 cache_layers: list[int], last_logits: bool):
        super().__init__()
        self.model = model
        self.cache_class = cache_class
        self.cache_layers = cache_layers
        self.logits_to_keep = {"logits_to_keep": 1} if last_logits else {}

    def forward(self, input_ids, attention_mask, position_ids, past):
        cache = empty_cache(self.model, self.cache_class)
        for layer, key, value in zip(self.cache_layers, past[0::2], past[1::2], strict=True):
            cache.layers[layer].update(key, value)
        output = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=cache, use_cache=True, **self.logits_to_keep)
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


def _meta_run(model: transformers.PreTrainedModel, **inputs):
    """``model(**inputs)`` on the meta device, under a fake-tensor mode with a shape environment: a value read
    from data (JetMoe's expert sizes, ``tolist()``) is a symbol there, where plain meta tensors have none."""
    with torch.no_grad(), FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True):
        return model(**inputs)


def cache_class(model: transformers.PreTrainedModel) -> type[transformers.DynamicCache]:
    """The cache class ``model`` makes for itself: DynamicCache, or a subclass of it that the family insists on
    (MiniMax's, for its linear-attention states)."""
    output = _meta_run(model, input_ids=torch.zeros(1, 1, dtype=torch.int64, device="meta"), use_cache=True)
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
    """Example inputs of the trace on the meta device (a batch of 2, 3 new tokens after 5 cached ones) and the
    cache's shape per layer. The cache is the model's own, of a 1-token prefill into :func:`empty_cache`, repeated
    to 5 tokens of each sequence: so its layers, kv heads and key and value sizes are the family's, whatever its
    attention (multi-head latent attention's keys are wider than its values, sliding-window layers may have other
    heads)."""
    batch, sequence, past = _TRACE_BATCH, _TRACE_SEQUENCE, _TRACE_PAST
    meta = {"device": "meta", "dtype": torch.int64}
    input_ids = torch.zeros(batch, past + sequence, **meta)
    positions = torch.arange(past + sequence, **meta).expand(batch, past + sequence)
    prefill = _meta_run(model, input_ids=input_ids[:1, :1], attention_mask=torch.ones(1, 1, **meta),
                        position_ids=positions[:1, :1], past_key_values=empty_cache(model, cache_class), use_cache=True)
    cache, shapes = [], []
    for layer, entry in enumerate(prefill.past_key_values.layers):
        if not isinstance(entry, DummyLayer):
            for state in (entry.keys, entry.values):
                heads, size = int(state.shape[1]), int(state.shape[3])
                cache.append(torch.zeros(batch, heads, past, size, dtype=state.dtype, device="meta"))
            shapes.append(CacheShape(layer, int(entry.keys.shape[1]), int(entry.keys.shape[3])))
    attention_mask = torch.ones(batch, past + sequence, **meta)
    return (input_ids[:, past:], attention_mask, positions[:, past:], tuple(cache)), shapes


def trace_decoder(model: transformers.PreTrainedModel, last_logits: bool) -> tuple[ir.Model, list[CacheShape]]:
    """``model``'s decoder with a flat KV cache, traced on the meta device by the dynamo exporter (without its
    optimizer, which would read the weights), with dynamic batch_size, sequence_length, past_sequence_length and
    total_sequence_length. Every initializer is a parameter or buffer of ``model`` ("model." + its name), without
    data. Returns the model and the cache's shape per layer that has one."""
    cache_type = cache_class(model)
    inputs, cache_shapes = trace_inputs(model, cache_type)
    decoder = FlatCacheDecoder(model, cache_type, [shape.layer for shape in cache_shapes], last_logits).eval()
    input_names, output_names = io_names(decoder.cache_layers)
    dynamic = torch.export.Dim.DYNAMIC  # torch.export relates the dims itself (total = past + sequence)
    pair, cache = {0: dynamic, 1: dynamic}, {0: dynamic, 2: dynamic}
    shapes = (pair, pair, pair, (cache,) * len(inputs[3]))
    # fake_tensor_cache_enabled=False: the fake tensors' dispatch cache rebuilds each hit's symbolic-shaped outputs,
    # which costs more than the dispatch it saves on these traces (the whole export ~18% less CPU time)
    with warnings.catch_warnings(), torch.no_grad(), torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(decoder, inputs, dynamo=True, opset_version=OPSET, input_names=input_names,
                                    output_names=output_names, dynamic_shapes=shapes, verbose=False, optimize=False)
    return program.model, cache_shapes


def dim_names(input_names: list[str], output_names: list[str], last_logits: bool) -> dict[str, dict[int, str]]:
    """The names genai and verify read for the symbolic dims of the decoder's inputs and outputs."""
    cache = {0: "batch_size", 2: "past_sequence_length"}
    names = {"input_ids": {0: "batch_size", 1: "sequence_length"},
             "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
             "position_ids": {0: "batch_size", 1: "sequence_length"},
             "logits": {0: "batch_size"} if last_logits else {0: "batch_size", 1: "sequence_length"}}
    names.update({name: cache for name in input_names[3:]})
    names.update({name: {0: "batch_size", 2: "total_sequence_length"} for name in output_names[1:]})
    return names


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy, bfloat16 as ml_dtypes' bfloat16."""
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.contiguous().numpy()


def to_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


# ----------------------------------------------------------------------------- the checkpoint's tensors

class ParameterSource:
    """One parameter of the model as computed from the checkpoint: its numpy ``dtype`` and ``shape``, and
    :meth:`rows` of its first axis. ``how`` says where it comes from (for messages)."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: np.dtype,
                 rows: Callable[[int, int], np.ndarray], how: str, mxfp4: Mxfp4Source | None = None):
        self.name, self.shape, self.dtype, self._rows, self.how = name, shape, dtype, rows, how
        self.mxfp4 = mxfp4  # the MXFP4 tensor it is, unconverted (GPT-OSS's experts)

    def rows(self, start: int, stop: int) -> np.ndarray:
        array = self._rows(start, stop)
        expected = (stop - start, *self.shape[1:]) if self.shape else ()
        if tuple(array.shape) != expected:
            raise ExportError(f"parameter {self.name}: {self.how} gives shape {list(array.shape)} for rows "
                              f"[{start}, {stop}), expected {list(expected)}")
        return array.astype(self.dtype, copy=False)


def parameter_sources(model: transformers.PreTrainedModel, sources: dict[str, Source]
                      ) -> tuple[dict[str, ParameterSource], list[str]]:
    """Each parameter and persistent buffer of ``model`` (meta) as computed from the checkpoint's ``sources``, by
    name, and the checkpoint tensors nothing reads. A tied parameter (lm_head tied to the embedding) reads its
    source's. Raises ExportError naming a parameter that no checkpoint tensor gives."""
    state = model.state_dict()
    conversions = get_model_conversion_mapping(model)
    renamings = [entry for entry in conversions if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in conversions if isinstance(entry, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    groups: dict[str, tuple[WeightConverter | None, dict[str, list[str]]]] = {}
    unused = []
    for key in sorted(sources, key=dot_natural_key):  # the natural order: expert 10 after expert 9
        renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if renamed not in state and key in state:
            renamed, pattern = rename_source_key(key, [], [], model.base_model_prefix, state)
        if renamed not in state:
            unused.append(key)
            continue
        if state[renamed].is_floating_point() and sources[key].dtype not in FLOATS:  # it would be cast silently
            raise ExportError(f"checkpoint tensor {key} is {sources[key].dtype}; the model's parameter {renamed} is "
                              f"{_NUMPY[state[renamed].dtype]}: expected a floating-point tensor")
        converter = by_pattern.get(pattern) if pattern is not None else None
        entry = groups.setdefault(renamed, (copy.deepcopy(converter), {}))
        entry[1].setdefault(pattern if converter is not None else key, []).append(key)
    parameters: dict[str, ParameterSource] = {}
    for first, (converter, keys) in groups.items():
        if converter is None:
            (key,) = [key for pattern_keys in keys.values() for key in pattern_keys]
            parameters[first] = _renamed(first, state[first], sources[key])
        else:
            conversion = _Conversion(model, state, first, converter,
                                     {p: [sources[k] for k in ks] for p, ks in keys.items()})
            for target in conversion.targets():
                parameters[target] = ParameterSource(target, tuple(state[target].shape), _NUMPY[state[target].dtype],
                                                     lambda start, stop, t=target, c=conversion: c.rows(t, start, stop),
                                                     f"{type(converter).__name__} of {sorted(keys)}")
    for target, source in model.all_tied_weights_keys.items():
        if target not in parameters and source in parameters:
            parameters[target] = parameters[source]
    missing = sorted(name for name in state if name not in parameters)
    if missing:
        raise ExportError(f"the checkpoint has no tensor for {len(missing)} of the model's parameters: "
                          f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} (does config.json "
                          f"describe these weights?)")
    # what transformers too leaves unread on purpose (DeepSeek-V3's multi-token-prediction layer); any other tensor
    # nothing reads means the config and the weights disagree
    ignored = [re.compile(pattern) for pattern in model._keys_to_ignore_on_load_unexpected or ()]
    unread = [key for key in unused if not any(pattern.search(key) for pattern in ignored)]
    if unread:
        raise ExportError(f"no parameter of the model reads {len(unread)} of the checkpoint's tensors: "
                          f"{', '.join(unread[:3])}{' ...' if len(unread) > 3 else ''} (does config.json describe "
                          f"these weights?)")
    return parameters, unused


def _renamed(name: str, parameter: torch.Tensor, source: Source) -> ParameterSource:
    """A parameter that is a checkpoint tensor as stored (cast to the parameter's type)."""
    shape = tuple(parameter.shape)
    if tuple(source.shape) != shape:
        raise ExportError(f"checkpoint tensor {source.name} has shape {list(source.shape)}; the model's parameter "
                          f"{name} is {list(shape)}")
    return ParameterSource(name, shape, _NUMPY[parameter.dtype], source.rows, f"checkpoint tensor {source.name}",
                           mxfp4=source if isinstance(source, Mxfp4Source) else None)


def _keeps_first_axis(operation, rank: int) -> bool:
    """Whether a conversion operation acts on each index of its tensors' first axis alone (so it commutes with
    taking a range of that axis)."""
    def other(dim: int) -> bool:
        return dim % rank != 0

    if isinstance(operation, Transpose):
        return not operation.check_dims and other(operation.dim0) and other(operation.dim1)
    if isinstance(operation, (Concatenate, Chunk, Split, Interleave)):
        return other(operation.dim)
    return False


class _Conversion:
    """A transformers WeightConverter over its checkpoint tensors (by source pattern), run on a range of its
    targets' first axis: with the experts of that range (a leading MergeModulelist stacks one tensor per expert),
    or that range of each stacked source, when its other operations leave the first axis alone; else on the
    whole tensors. A range's targets are kept until each is read (one run gives them all)."""

    def __init__(self, model: transformers.PreTrainedModel, state: dict[str, torch.Tensor], first: str,
                 converter: WeightConverter, sources: dict[str, list[Source]]):
        self.model, self.first, self.converter, self.sources = model, first, converter, sources
        self.shapes = {target: tuple(state[target].shape) for target in self.targets()}
        self.dtype = state[first].dtype
        operations = converter.operations
        rank = max(len(shape) for shape in self.shapes.values())
        stacked = isinstance(operations[0], MergeModulelist) and operations[0].dim == 0
        rest_keep = rank > 0 and all(_keeps_first_axis(op, rank) for op in operations[1 if stacked else 0:])
        firsts = {shape[0] if shape else None for shape in self.shapes.values()}
        experts = firsts.pop() if len(firsts) == 1 else None
        lists = list(sources.values())
        if stacked and rest_keep and all(len(pattern_sources) == experts for pattern_sources in lists):
            self.mode = "experts"
        elif not stacked and rest_keep and all(len(pattern_sources) == 1 and pattern_sources[0].shape[:1] == (experts,)
                                               for pattern_sources in lists):
            self.mode = "rows"
        else:
            self.mode = "whole"
        self._kept: tuple[tuple[int, int], dict[str, torch.Tensor]] | None = None  # a range's targets not read yet
        self._check_shapes()

    def _check_shapes(self) -> None:
        """ExportError, before anything is read, when the converter run on the sources' shapes alone (meta tensors)
        fails or does not give the parameters' shapes: an expert's tensor transposed or of another size."""
        def meta(source: Source):
            return lambda: torch.empty(source.shape, dtype=self.dtype, device="meta")

        given = [source for sources in self.sources.values() for source in sources]
        what = (f"{type(self.converter).__name__} of the checkpoint tensors "
                f"{', '.join(f'{source.name} {list(source.shape)}' for source in given[:3])}"
                f"{' ...' if len(given) > 3 else ''}")
        try:
            converted = self._convert({pattern: [meta(source) for source in sources]
                                       for pattern, sources in self.sources.items()})
        except Exception as error:  # noqa: BLE001 - torch's shape errors have no one class
            first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
            raise ExportError(f"parameter {self.first}: {what} fails: {first}") from None
        for target, shape in self.shapes.items():
            got = tuple(converted[target].shape) if target in converted else None
            if got != shape:
                raise ExportError(f"parameter {target}: {what} gives {list(got) if got else 'nothing'}; expected "
                                  f"{list(shape)}")

    def targets(self) -> list[str]:
        """The parameters this converter makes (its first target's name with each target pattern in its place)."""
        patterns = self.converter.target_patterns
        chunk = next((op for op in self.converter.operations if isinstance(op, Chunk)), None)
        if chunk is not None and chunk.num_shards_attribute is not None:
            patterns = chunk.get_target_patterns(patterns, config=self.model.config)
        return [self.first.replace(patterns[0], pattern, 1) for pattern in patterns]

    def rows(self, target: str, start: int, stop: int) -> np.ndarray:
        span = (0, self.shapes[target][0] if self.shapes[target] else 1) if self.mode == "whole" else (start, stop)
        if self._kept is None or self._kept[0] != span or target not in self._kept[1]:
            self._kept = (span, self._run(*span))
        result = self._kept[1].pop(target)  # each target is read once per range: the others wait for theirs
        if not self._kept[1]:
            self._kept = None
        return to_numpy(result[start:stop] if self.mode == "whole" and result.dim() else result)

    def _run(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """The converter's targets for the range [start, stop) of their first axis (whole mode: all of them)."""
        def read(source: Source, begin: int | None = None, end: int | None = None):
            begin, end = (0, source.shape[0] if source.shape else 1) if begin is None else (begin, end)
            return lambda: to_torch(source.rows(begin, end)).to(self.dtype)

        collected = {}
        for pattern, sources in self.sources.items():
            if self.mode == "experts":  # one tensor per expert: those of the range
                collected[pattern] = [read(source) for source in sources[start:stop]]
            elif self.mode == "rows":  # one stacked tensor: the range of it
                collected[pattern] = [read(sources[0], start, stop)]
            else:
                collected[pattern] = [read(source) for source in sources]
        return self._convert(collected)

    def _convert(self, collected: dict[str, list[Callable[[], torch.Tensor]]]) -> dict[str, torch.Tensor]:
        """The converter's targets from ``collected``: per source pattern, a callable per tensor giving it."""
        self.converter.collected_tensors = collected  # transformers' loading fills it the same way (callables)
        with torch.no_grad():
            converted = self.converter.convert(self.first, model=self.model, config=self.model.config)
        return {name: (value[0] if isinstance(value, list) else value) for name, value in converted.items()}
