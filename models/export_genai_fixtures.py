"""Write the onnxruntime-genai fixtures: tiny random Hugging Face checkpoints of the MoE families that
onnxruntime-genai's model builder builds for the CPU execution provider, each built at fp32, fp16 and int4.

    python models/export_genai_fixtures.py --out-dir models/fixtures/genai

Needs torch, transformers 5 and onnxruntime-genai 0.18 (the export environment of models/README.md, plus
``pip install onnxruntime-genai==0.18.0``); nothing is downloaded. Each checkpoint is made from its config
class with seeded random weights, saved with a small word-level tokenizer built here, then given to
``python -m onnxruntime_genai.models.builder -i CHECKPOINT -o OUT -p PRECISION -e cpu``. Every
``<family>_<precision>/`` folder keeps what the builder wrote that onnxruntime-genai reads: ``model.onnx``
(with ``model.onnx.data`` when the builder writes one), ``genai_config.json`` and the tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

PRECISIONS = ("fp32", "fp16", "int4")

#: the files of a builder's output folder that onnxruntime-genai reads (the rest: the builder's cache)
KEPT_FILES = ("model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja")

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
VOCAB_SIZE = 96  # unlike every projection width: the builder takes any Linear with vocab_size outputs for lm_head


def gpt_oss_model() -> transformers.PreTrainedModel:
    config = transformers.GptOssConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=32, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
        sliding_window=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.GptOssForCausalLM(config)


def lfm2_moe_model() -> transformers.PreTrainedModel:
    config = transformers.Lfm2MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_dense_layers=0, layer_types=["conv", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    return transformers.Lfm2MoeForCausalLM(config)


FAMILIES: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "gpt_oss": gpt_oss_model,
    "lfm2_moe": lfm2_moe_model,
}


#: the magnitudes of MXFP4's e2m1 codes 0-7 (code 8-15: the same, negative)
FP4_MAGNITUDES = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))


def mxfp4_experts(shape_enk: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP4 expert weights of shape [E, N, K], as GPT-OSS checkpoints store them: the blocks
    ``[E, N, K/32, 16]`` (two codes a byte, the even one low), the scales ``[E, N, K/32]`` (biased exponents)
    and the float weights they decode to."""
    experts, n, k = shape_enk
    codes = torch.randint(0, 16, (experts, n, k // 32, 32), dtype=torch.uint8)
    scales = torch.randint(119, 122, (experts, n, k // 32), dtype=torch.uint8)  # 2^-8..2^-6: |w| < 0.1
    values = FP4_MAGNITUDES[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    weights = (values * torch.pow(2.0, scales.float() - 127.0).unsqueeze(-1)).reshape(experts, n, k)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, scales, weights


def gpt_oss_mxfp4(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """Make the experts' weights MXFP4 values; returns their blocks and scales by the names the released
    checkpoints give them (the builder's int4 GPT-OSS reads its experts from those)."""
    tensors = {}
    for layer_id, layer in enumerate(model.model.layers):
        experts, prefix = layer.mlp.experts, f"model.layers.{layer_id}.mlp.experts"
        for projection in ("gate_up_proj", "down_proj"):
            parameter = getattr(experts, projection)  # [E, K, N]
            blocks, scales, weights = mxfp4_experts((parameter.shape[0], parameter.shape[2], parameter.shape[1]))
            parameter.copy_(weights.transpose(1, 2))
            tensors[f"{prefix}.{projection}_blocks"], tensors[f"{prefix}.{projection}_scales"] = blocks, scales
    return tensors


def save_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over VOCAB_SIZE tokens (the specials, then w4, w5, ...), as a fast tokenizer."""
    words = SPECIAL_TOKENS + [f"w{i}" for i in range(len(SPECIAL_TOKENS), VOCAB_SIZE)]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)


def save_checkpoint(family: str, directory: Path, seed: int = 0) -> None:
    """The family's tiny model with seeded random weights (float32), and the tokenizer, as a checkpoint folder."""
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    with torch.no_grad():  # the default init leaves biases at zero and norms at one: random values test more
        for name, parameter in model.named_parameters():
            parameter.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(parameter))
        extra = gpt_oss_mxfp4(model) if family == "gpt_oss" else {}
    model.save_pretrained(directory)
    if extra:  # beside the model's own tensors, in the one weights file
        weights_file = directory / "model.safetensors"
        save_file({**load_file(weights_file), **extra}, weights_file, metadata={"format": "pt"})
    save_tokenizer(directory)


def build(checkpoint: Path, out: Path, precision: str, cache: Path) -> None:
    """Run onnxruntime-genai's builder on ``checkpoint`` for the CPU execution provider; keep only KEPT_FILES."""
    with tempfile.TemporaryDirectory() as staging:
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", staging,
                   "-p", precision, "-e", "cpu", "-c", str(cache)]
        completed = subprocess.run(command, capture_output=True, text=True)
        if completed.returncode != 0:
            sys.exit(f"builder failed for {checkpoint.name} {precision}:\n{completed.stdout[-3000:]}"
                     f"\n{completed.stderr[-3000:]}")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for name in KEPT_FILES:
            if (Path(staging) / name).exists():
                shutil.copy2(Path(staging) / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "fixtures" / "genai")
    parser.add_argument("--family", choices=FAMILIES, action="append", help="default: every family")
    parser.add_argument("--precision", choices=PRECISIONS, action="append", help="default: every precision")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        for family in args.family or FAMILIES:
            checkpoint = Path(work) / family
            save_checkpoint(family, checkpoint)
            for precision in args.precision or PRECISIONS:
                out = args.out_dir / f"{family}_{precision}"
                build(checkpoint, out, precision, Path(work) / "cache")
                size = sum(f.stat().st_size for f in out.iterdir())
                print(f"{out}: {size / 1024:.0f} KiB ({', '.join(sorted(f.name for f in out.iterdir()))})")


if __name__ == "__main__":
    main()
