"""Random checkpoints at real models' shapes, written as those models ship, tensor by tensor (numpy only: a 13 GB or
61 GB checkpoint is never held in memory): GPT-OSS-20B (24 layers, MXFP4 experts as openai ships them, the rest
bfloat16) and Qwen3-30B-A3B (48 layers, bfloat16, one tensor per expert), at their full vocabularies, with a BPE
tokenizer over the vocabulary (token ids are fed directly; llama.cpp's converter needs merges).

Values: bfloat16 weights uniform in magnitude over [2^-9, 2^-5) with random signs (about transformers' 0.02 init),
norms 1, biases and GPT-OSS's attention sinks 0; MXFP4 codes uniform, scales 2^-7..2^-5. Written in shards of at
most 4 GiB with their index, as the released checkpoints are.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from moe_onnx.export.checkpoint import TensorSpec, write_safetensors

SHARD_BYTES = 4 << 30
_BF16 = np.dtype(ml_dtypes.bfloat16)
# bfloat16 bit patterns of 2^-9 and 2^-5 (exponent bits only): random mantissas between them
_LOW, _HIGH = 0x3B00, 0x3D00


def _random_bf16(shape: tuple[int, ...], seed: int) -> TensorSpec:
    """bfloat16 [shape], each row range drawn when written (seeded by ``seed`` and the range's start)."""
    def rows(start: int, stop: int) -> np.ndarray:
        rng = np.random.default_rng([seed, start])
        bits = rng.integers(_LOW, _HIGH, (stop - start, *shape[1:]), dtype=np.uint16)
        bits |= (rng.integers(0, 2, bits.shape, dtype=np.uint16) << 15)
        return bits.view(ml_dtypes.bfloat16)
    return TensorSpec(shape, _BF16, rows)


def _constant(shape: tuple[int, ...], value: float) -> TensorSpec:
    return TensorSpec(shape, _BF16, lambda start, stop: np.full((stop - start, *shape[1:]), value, ml_dtypes.bfloat16))


def _random_uint8(shape: tuple[int, ...], seed: int, low: int, high: int) -> TensorSpec:
    def rows(start: int, stop: int) -> np.ndarray:
        return np.random.default_rng([seed, start]).integers(low, high, (stop - start, *shape[1:]), dtype=np.uint8)
    return TensorSpec(shape, np.dtype(np.uint8), rows)


def gpt_oss_20b(layers: int = 24) -> tuple[dict, dict[str, TensorSpec]]:
    """GPT-OSS-20B's config.json (as released, ``layers`` deep) and tensors (openai's names and formats)."""
    hidden, experts, heads, kv_heads, head_dim, vocab = 2880, 32, 64, 8, 64, 201088
    config = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": head_dim, "hidden_act": "silu",
        "hidden_size": hidden, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": hidden, "layer_types": [("sliding_attention", "full_attention")[i % 2]
                                                      for i in range(layers)],
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": heads,
        "num_experts_per_tok": 4, "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
        "num_local_experts": experts, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                 "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                 "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": vocab, "bos_token_id": 199998,
    }
    tensors = {"model.embed_tokens.weight": _random_bf16((vocab, hidden), 1)}
    for layer in range(layers):
        p, seed = f"model.layers.{layer}", 100 * (layer + 2)
        attention = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}
        for i, (name, rows) in enumerate(attention.items()):
            tensors[f"{p}.self_attn.{name}.weight"] = _random_bf16((rows, hidden), seed + i)
            tensors[f"{p}.self_attn.{name}.bias"] = _constant((rows,), 0.0)
        tensors[f"{p}.self_attn.o_proj.weight"] = _random_bf16((hidden, heads * head_dim), seed + 5)
        tensors[f"{p}.self_attn.o_proj.bias"] = _constant((hidden,), 0.0)
        tensors[f"{p}.self_attn.sinks"] = _constant((heads,), 0.0)
        tensors[f"{p}.input_layernorm.weight"] = _constant((hidden,), 1.0)
        tensors[f"{p}.post_attention_layernorm.weight"] = _constant((hidden,), 1.0)
        tensors[f"{p}.mlp.router.weight"] = _random_bf16((experts, hidden), seed + 6)
        tensors[f"{p}.mlp.router.bias"] = _constant((experts,), 0.0)
        for i, (name, rows, k) in enumerate((("gate_up_proj", 2 * hidden, hidden), ("down_proj", hidden, hidden))):
            tensors[f"{p}.mlp.experts.{name}_blocks"] = _random_uint8((experts, rows, k // 32, 16), seed + 10 + i,
                                                                      0, 256)
            tensors[f"{p}.mlp.experts.{name}_scales"] = _random_uint8((experts, rows, k // 32), seed + 20 + i,
                                                                      120, 123)
            tensors[f"{p}.mlp.experts.{name}_bias"] = _constant((experts, rows), 0.0)
    tensors["model.norm.weight"] = _constant((hidden,), 1.0)
    tensors["lm_head.weight"] = _random_bf16((vocab, hidden), 2)
    return config, tensors


def qwen3_30b_a3b(layers: int = 48) -> tuple[dict, dict[str, TensorSpec]]:
    """Qwen3-30B-A3B's config.json (as released, ``layers`` deep) and bfloat16 tensors (one per expert)."""
    hidden, intermediate, experts, heads, kv_heads, head_dim, vocab = 2048, 768, 128, 32, 4, 128, 151936
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": head_dim,
        "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": intermediate, "norm_topk_prob": True, "num_attention_heads": heads,
        "num_experts": experts, "num_experts_per_tok": 8, "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": vocab, "pad_token_id": 151643,
    }
    tensors = {"model.embed_tokens.weight": _random_bf16((vocab, hidden), 1)}
    for layer in range(layers):
        p, seed = f"model.layers.{layer}", 1000 * (layer + 2)
        for i, (name, shape) in enumerate((("q_proj", (heads * head_dim, hidden)),
                                           ("k_proj", (kv_heads * head_dim, hidden)),
                                           ("v_proj", (kv_heads * head_dim, hidden)),
                                           ("o_proj", (hidden, heads * head_dim)))):
            tensors[f"{p}.self_attn.{name}.weight"] = _random_bf16(shape, seed + i)
        tensors[f"{p}.self_attn.q_norm.weight"] = _constant((head_dim,), 1.0)
        tensors[f"{p}.self_attn.k_norm.weight"] = _constant((head_dim,), 1.0)
        tensors[f"{p}.input_layernorm.weight"] = _constant((hidden,), 1.0)
        tensors[f"{p}.post_attention_layernorm.weight"] = _constant((hidden,), 1.0)
        tensors[f"{p}.mlp.gate.weight"] = _random_bf16((experts, hidden), seed + 5)
        for e in range(experts):
            for i, (name, shape) in enumerate((("gate_proj", (intermediate, hidden)),
                                               ("up_proj", (intermediate, hidden)),
                                               ("down_proj", (hidden, intermediate)))):
                tensors[f"{p}.mlp.experts.{e}.{name}.weight"] = _random_bf16(shape, seed + 10 + 3 * e + i)
    tensors["model.norm.weight"] = _constant((hidden,), 1.0)
    tensors["lm_head.weight"] = _random_bf16((vocab, hidden), 2)
    return config, tensors


#: the full-depth checkpoints: name -> (maker, full depth, bytes a layer (about))
SHIPPED = {"gpt_oss_20b": (gpt_oss_20b, 24, 0.47e9), "qwen3_30b_a3b": (qwen3_30b_a3b, 48, 1.26e9)}


def spec_bytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


def _shards(tensors: dict[str, TensorSpec]) -> Iterator[dict[str, TensorSpec]]:
    shard, size = {}, 0
    for name, spec in tensors.items():
        if shard and size + spec_bytes(spec) > SHARD_BYTES:
            yield shard
            shard, size = {}, 0
        shard[name] = spec
        size += spec_bytes(spec)
    if shard:
        yield shard


def write_checkpoint(folder: Path, config: dict, tensors: dict[str, TensorSpec]) -> int:
    """The checkpoint in ``folder``: config.json, the safetensors shards and their index, the tokenizer; returns
    the bytes of the tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = list(_shards(tensors))
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / name, shard, rows_per_write=256, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(spec_bytes(spec) for spec in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_bpe_tokenizer(folder, config["vocab_size"])
    return total


def save_bpe_tokenizer(folder: Path, vocab: int) -> None:
    """A BPE tokenizer over ``vocab`` tokens (<pad> <s> </s> <unk> a b ab, then w7, w8, ...) with the one merge
    "a b": llama.cpp's converter writes a BPE ("gpt2") vocabulary, which llama.cpp loads only with merges; no
    transformers needed (tokenizer.json and a tokenizer_config.json naming the special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<s>", "</s>", "<unk>", "a", "b", "ab"]
    words += [f"w{i}" for i in range(len(words), vocab)]
    tokenizer = Tokenizer(models.BPE({word: i for i, word in enumerate(words)}, [("a", "b")], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "unk_token": "<unk>", "model_max_length": 1 << 20}, indent=2))
