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
from pathlib import Path

import numpy as np
import torch
import transformers
from export_genai_fixtures import save_tokenizer
from moe_export import whole

from moe_onnx.export import FAMILIES as EXPORT_FAMILIES
from moe_onnx.export import export_checkpoint
from moe_onnx.genai_folder import GENAI_CONFIG

NEW_TOKENS = 32
PROMPT_IDS = [[1, 17, 42, 5, 88, 23, 61]]  # <s> and six words
VOCAB_SIZE = 96  # save_tokenizer's vocabulary
# the fixtures' changes to moe_export.whole's tiny configs (whose cache-less exports docs/whole_models.md surveys)
_CACHE_CONFIG = dict(vocab_size=VOCAB_SIZE, use_cache=True)
_FAMILY_CONFIG = {
    "gpt_oss": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4),
    # attention layers only: moe-onnx export refuses the Mamba and convolution layers of these hybrids
    "granitemoehybrid": dict(layer_types=["attention", "attention"], shared_intermediate_size=24),
    "lfm2_moe": dict(layer_types=["full_attention", "full_attention"]),
}


def tiny_model(family: str, changes: dict | None = None) -> transformers.PreTrainedModel:
    """The family's tiny causal LM (moe_export.whole's config with the tokenizer's vocabulary and a cache, then
    ``changes``)."""
    config = whole.tiny_config(family, _CACHE_CONFIG | _FAMILY_CONFIG.get(family, {}) | (changes or {}))
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_checkpoint(family: str, directory: Path, seed: int = 0) -> None:
    """The family's tiny model with seeded random weights (float32) and the word-level tokenizer."""
    torch.manual_seed(seed)
    model = tiny_model(family)
    with torch.no_grad():  # random norms too: the default init leaves them at one
        for name, parameter in model.named_parameters():
            parameter.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    save_tokenizer(directory)


def reference(checkpoint: Path, family: str) -> dict[str, np.ndarray]:
    """transformers' greedy generation of NEW_TOKENS tokens after PROMPT_IDS (no stop at the end token), the
    checkpoint loaded by transformers in float32 (a quantized one dequantized as transformers does on a CPU; its
    quantizer leaves the unquantized tensors in the checkpoint's bfloat16, so the model is cast to float32 after,
    as the export computes)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager",
        experts_implementation=EXPORT_FAMILIES[family].experts_implementation).float().eval()
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
    parser.add_argument("--family", choices=EXPORT_FAMILIES, action="append", help="default: every family")
    parser.add_argument("--checkpoint-dir", type=Path,
                        help="also keep each tiny checkpoint there, as <dir>/<family> (models/fixtures/checkpoints "
                             "holds qwen3_moe's: the README's quick start exports it)")
    args = parser.parse_args()
    for family in args.family or EXPORT_FAMILIES:
        out = args.out_dir / family
        with tempfile.TemporaryDirectory() as work:
            checkpoint = Path(work) / family
            save_checkpoint(family, checkpoint)
            if args.checkpoint_dir:
                shutil.copytree(checkpoint, args.checkpoint_dir / family, dirs_exist_ok=True)
            if out.exists():
                shutil.rmtree(out)
            result = export_checkpoint(checkpoint, out, last_logits=False)  # every position's, as committed
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
