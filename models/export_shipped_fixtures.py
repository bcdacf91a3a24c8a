"""Write the shipped-format fixtures: tiny random checkpoints in the formats models ship in, each with what
``moe-onnx export`` writes for it and transformers' greedy tokens from it (transformers dequantizes a quantized
checkpoint on a CPU) as the reference.

    python models/export_shipped_fixtures.py                  # every fixture; --name gpt_oss_mxfp4: one

Needs torch, transformers 5.23 and accelerate (transformers reads MXFP4 and FP8 checkpoints only with it; the
export itself does not), nothing downloaded. Each ``<name>/`` under ``models/fixtures/shipped/`` holds:

* ``checkpoint/``: config.json (its ``quantization_config``), model.safetensors and the tokenizer files, made from
  the family's tiny random model (models/export_kv_fixtures.py) by :data:`FORMATS`' conversion: GPT-OSS's experts
  as MXFP4 blocks and scales (random codes, ``export_genai_fixtures.mxfp4_experts``) and the rest bfloat16; the
  linear layers' weights as float8_e4m3fn with float32 inverse scales per block of ``FP8_BLOCK`` (as DeepSeek-V3
  and Qwen3-*-FP8 ship them; routers, embeddings, lm_head and norms bfloat16); or every tensor bfloat16;
* ``export/``: ``moe-onnx export checkpoint -o export`` (fp32; not our C++ library, which the tests register);
* ``reference.npz``: ``prompt_ids`` [1, 7], transformers' ``generate(do_sample=False)`` of 32 ``tokens`` and the
  ``logits`` [32, vocab] of each step, from the checkpoint loaded by transformers in float32.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from export_genai_fixtures import mxfp4_experts
from export_kv_fixtures import reference, save_tokenizer, tiny_model
from safetensors.numpy import load_file

from moe_onnx.export import export_checkpoint
from moe_onnx.export.checkpoint import TensorSpec, write_safetensors
from moe_onnx.genai_folder import GENAI_CONFIG

FP8_BLOCK = (8, 8)  # small enough that the tiny weights hold several blocks a side
FP8_MAX = 448.0  # float8_e4m3fn's largest value


@dataclass(frozen=True)
class Shipped:
    """One fixture: the family, the format its checkpoint ships in and the changes to its tiny config."""

    family: str
    format: str  # a key of FORMATS
    config: dict


SHIPPED = {
    "gpt_oss_mxfp4": Shipped("gpt_oss", "mxfp4", dict(intermediate_size=32)),  # K = H = I = 32: whole blocks
    "qwen3_moe_fp8": Shipped("qwen3_moe", "fp8", dict(moe_intermediate_size=24)),
    "deepseek_v3_fp8": Shipped("deepseek_v3", "fp8", {}),
    "mixtral_bf16": Shipped("mixtral", "bf16", {}),
}


def _bf16(array: np.ndarray) -> np.ndarray:
    return array.astype(ml_dtypes.bfloat16) if array.dtype.kind == "f" else array


def _fp8_linear(name: str, array: np.ndarray) -> bool:
    """A linear layer's weight the FP8 checkpoints store in float8: a projection's 2-D weight, not a router's."""
    return array.ndim == 2 and name.endswith("proj.weight")


def fp8_blocks(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` [N, K] as float8_e4m3fn and its float32 inverse scales [ceil(N/bn), ceil(K/bk)]: each block's
    largest magnitude maps to 448."""
    (n, k), (bn, bk) = weight.shape, FP8_BLOCK
    scales = np.empty((-(-n // bn), -(-k // bk)), np.float32)
    quantized = np.empty((n, k), ml_dtypes.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = weight[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scales[i, j] = max(float(np.abs(block).max()), 1e-12) / FP8_MAX
            quantized[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (block / scales[i, j]).astype(
                ml_dtypes.float8_e4m3fn)
    return quantized, scales


def _as_shipped(tensors: dict[str, np.ndarray], fmt: str, extra: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, array in tensors.items():
        if fmt == "fp8" and _fp8_linear(name, array):
            out[name], out[name + "_scale_inv"] = fp8_blocks(array)
        elif fmt == "mxfp4" and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            continue  # the blocks and scales in ``extra`` stand for them
        else:
            out[name] = _bf16(array)
    return {**out, **extra}


def _quantization_config(fmt: str) -> dict | None:
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(FP8_BLOCK)}
    return None


def save_shipped(shipped: Shipped, directory: Path, seed: int = 0) -> None:
    """The family's tiny model with seeded random weights, saved in the fixture's format with the tokenizer."""
    torch.manual_seed(seed)
    model = tiny_model(shipped.family, shipped.config)
    extra = {}
    with torch.no_grad():  # random norms and biases too: the default init leaves them at one and zero
        for name, parameter in model.named_parameters():
            parameter.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(parameter))
        if shipped.format == "mxfp4":
            for layer_id, layer in enumerate(model.model.layers):
                for projection in ("gate_up_proj", "down_proj"):
                    parameter = getattr(layer.mlp.experts, projection)  # [E, K, N]
                    blocks, scales, values = mxfp4_experts((parameter.shape[0], parameter.shape[2],
                                                            parameter.shape[1]))
                    parameter.copy_(values.transpose(1, 2))
                    prefix = f"model.layers.{layer_id}.mlp.experts.{projection}"
                    extra[prefix + "_blocks"], extra[prefix + "_scales"] = blocks.numpy(), scales.numpy()
    with tempfile.TemporaryDirectory() as work:
        model.save_pretrained(work)  # the checkpoint's names (one tensor per expert where the family's are so)
        tensors = load_file(Path(work) / "model.safetensors")
        config = json.loads((Path(work) / "config.json").read_text())
    directory.mkdir(parents=True, exist_ok=True)
    shipped_tensors = _as_shipped(tensors, shipped.format, extra)
    write_safetensors(directory / "model.safetensors", {name: TensorSpec.of(array)
                                                        for name, array in sorted(shipped_tensors.items())},
                      metadata={"format": "pt"})
    config["dtype"] = "bfloat16"
    quantization = _quantization_config(shipped.format)
    if quantization:
        config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_tokenizer(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "fixtures" / "shipped")
    parser.add_argument("--name", choices=SHIPPED, action="append", help="default: every fixture")
    args = parser.parse_args()
    for name in args.name or SHIPPED:
        shipped, folder = SHIPPED[name], args.out_dir / name
        if folder.exists():
            shutil.rmtree(folder)
        save_shipped(shipped, folder / "checkpoint")
        result = export_checkpoint(folder / "checkpoint", folder / "export")
        if not result.ok:
            raise SystemExit(f"{name}: the export is not ok:\n{result.summary()}")
        np.savez(folder / "reference.npz", **reference(folder / "checkpoint", shipped.family))
        config_file = folder / "export" / GENAI_CONFIG
        config = json.loads(config_file.read_text())
        library = config["model"]["decoder"]["session_options"].pop("custom_ops_library", None)
        if library:
            (folder / "export" / library).unlink()
        config_file.write_text(json.dumps(config, indent=4) + "\n")
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"{folder}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
