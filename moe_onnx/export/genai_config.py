"""genai_config.json for an exported checkpoint, in the format onnxruntime-genai 0.18's model builder writes
(models/fixtures/genai/*/genai_config.json): the decoder's file, its input and output names, the attention
shape, the special token ids and the search defaults (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass

#: the decoder's input and output names; ``%d`` is the layer
INPUT_NAMES = {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
               "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
OUTPUT_NAMES = {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}

#: search settings that generation_config.json may set, with the builder's defaults
_SEARCH_DEFAULTS = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0,
                    "length_penalty": 1.0, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0, "temperature": 1.0,
                    "top_k": 50, "top_p": 1.0}


@dataclass(frozen=True)
class CacheShape:
    """The KV cache of one decoder layer: its index, kv heads and the head size of its keys (its values' may be
    narrower, under multi-head latent attention)."""

    layer: int
    kv_heads: int
    head_size: int


def genai_config(config: dict, generation: dict, genai_type: str, decoder: str, cache: list[CacheShape]) -> dict:
    """The genai_config.json of a decoder file named ``decoder`` exported from a checkpoint whose config.json is
    ``config`` (and generation_config.json ``generation``, or {}); ``genai_type`` is ``model.type``; ``cache`` the
    decoder's cache layers. The attention shape is the first cache layer's and the layer count runs to the last
    one (genai 0.18 reads each past's kv heads from the decoder and skips a layer without one, but sizes keys and
    values alike by head_size: latent attention, whose values are narrower than its keys, runs in
    ``moe-onnx generate``, which reads every dim from the decoder, not in genai).

    The presents are the pasts with the new tokens appended (they grow each step), so the past and present
    buffers are not shared."""
    context_length = config["max_position_embeddings"]
    search = {key: generation.get(key, config.get(key, default)) for key, default in _SEARCH_DEFAULTS.items()}
    search.update(early_stopping=True, max_length=context_length, min_length=0, past_present_share_buffer=False)
    return {
        "model": {
            "bos_token_id": generation.get("bos_token_id", config.get("bos_token_id")),
            "context_length": context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": decoder,
                "head_size": cache[0].head_size,
                "hidden_size": config["hidden_size"],
                "inputs": dict(INPUT_NAMES),
                "outputs": dict(OUTPUT_NAMES),
                "num_attention_heads": config["num_attention_heads"],
                "num_hidden_layers": cache[-1].layer + 1,
                "num_key_value_heads": cache[0].kv_heads,
            },
            "eos_token_id": generation.get("eos_token_id", config.get("eos_token_id")),
            "pad_token_id": generation.get("pad_token_id", config.get("pad_token_id")),
            "type": genai_type,
            "vocab_size": config["vocab_size"],
        },
        "search": dict(sorted(search.items())),
    }
