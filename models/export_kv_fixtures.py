"""Write the KV-cache export fixtures: per family a tiny random checkpoint made here (nothing downloaded),
exported by ``moe-onnx export`` (fused), and transformers' greedy generation from it as the reference.

    python models/export_kv_fixtures.py --out-dir models/fixtures/kv        # --family qwen3_moe: one

Needs torch and transformers 5 (the export environment of models/README.md, or ``pip install -e '.[export]'``).
Each ``<family>/`` folder holds what ``moe-onnx export`` wrote (``model.onnx``, ``genai_config.json``, the
tokenizer files; not our C++ library, which the export copies in for onnxruntime-genai: tests register it
themselves) and ``reference.npz``: ``prompt_ids`` [1, P], and transformers' ``generate(do_sample=False)`` of
``NEW_TOKENS`` tokens: ``tokens`` [NEW_TOKENS] and the ``logits`` [NEW_TOKENS, vocab] each step chose from.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers
from export_genai_fixtures import save_tokenizer

from moe_onnx.export import export_checkpoint
from moe_onnx.pipeline import GENAI_CONFIG

NEW_TOKENS = 32
PROMPT_IDS = [[1, 17, 42, 5, 88, 23, 61]]  # <s> and six words
VOCAB_SIZE = 96  # save_tokenizer's vocabulary
_SMALL = dict(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)


def qwen3_moe_model() -> transformers.PreTrainedModel:
    config = transformers.Qwen3MoeConfig(**_SMALL, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                         mlp_only_layers=[])
    return transformers.Qwen3MoeForCausalLM(config)


def mixtral_model() -> transformers.PreTrainedModel:
    config = transformers.MixtralConfig(**_SMALL, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def gpt_oss_model() -> transformers.PreTrainedModel:
    config = transformers.GptOssConfig(**_SMALL, intermediate_size=24, layer_types=["sliding_attention",
                                       "full_attention"], sliding_window=4, num_local_experts=4,
                                       num_experts_per_tok=2)
    return transformers.GptOssForCausalLM(config)


FAMILIES: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "qwen3_moe": qwen3_moe_model,
    "mixtral": mixtral_model,
    "gpt_oss": gpt_oss_model,
}


def save_checkpoint(family: str, directory: Path, seed: int = 0) -> None:
    """The family's tiny model with seeded random weights (float32) and the word-level tokenizer."""
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    with torch.no_grad():  # random norms too: the default init leaves them at one
        for name, parameter in model.named_parameters():
            parameter.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    save_tokenizer(directory)


def reference(checkpoint: Path, family: str) -> dict[str, np.ndarray]:
    """transformers' greedy generation of NEW_TOKENS tokens after PROMPT_IDS (no stop at the end token),
    with the model as moe-onnx export loads it."""
    from moe_onnx.export import _torch
    from moe_onnx.export.families import FAMILIES as EXPORT_FAMILIES

    model = _torch.load_model(checkpoint, EXPORT_FAMILIES[family], "fp32")
    prompt = torch.tensor(PROMPT_IDS)
    with torch.no_grad():
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                   max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                                   output_logits=True, return_dict_in_generate=True)
    tokens = generated.sequences[0, prompt.shape[1]:].numpy()
    logits = torch.cat(generated.logits).numpy()
    assert tokens.shape == (NEW_TOKENS,), tokens.shape
    return dict(prompt_ids=prompt.numpy(), tokens=tokens, logits=logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "fixtures" / "kv")
    parser.add_argument("--family", choices=FAMILIES, action="append", help="default: every family")
    args = parser.parse_args()
    for family in args.family or FAMILIES:
        out = args.out_dir / family
        with tempfile.TemporaryDirectory() as work:
            checkpoint = Path(work) / family
            save_checkpoint(family, checkpoint)
            if out.exists():
                shutil.rmtree(out)
            result = export_checkpoint(checkpoint, out)
            if not result.ok:
                raise SystemExit(f"{family}: the export is not ok:\n{result.summary()}")
            np.savez(out / "reference.npz", **reference(checkpoint, family))
        config_file = out / GENAI_CONFIG
        config = json.loads(config_file.read_text())
        library = config["model"]["decoder"]["session_options"].pop("custom_ops_library", None)
        if library:
            (out / library).unlink()
        config_file.write_text(json.dumps(config, indent=4) + "\n")
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{out}: {size / 1024:.0f} KiB ({', '.join(sorted(f.name for f in out.iterdir()))})")


if __name__ == "__main__":
    main()
