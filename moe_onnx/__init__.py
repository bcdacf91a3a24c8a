"""moe-onnx: fused Mixture-of-Experts ops for ONNX.

Public API:

* :data:`DOMAIN`: the ops' domain; importing the package registers their onnx schemas.
* :func:`session`: an onnxruntime session running the ops on the C++ or the Python kernels.
* :func:`custom_ops_library`: path of the C++ library, for plain onnxruntime.
* :func:`optimize`: fuse the MoE blocks of an exported model into these ops; :data:`TARGETS` lists
  the forms it can make.
* :func:`quantize`: turn a fused model's MOE nodes into QMOE nodes (int8/int4 weights, MXFP4
  repacked) and measure the error against the fp32 model.
* :func:`generate`: generate tokens (and text) from a model folder in onnxruntime-genai's format, with its KV
  cache, on these sessions.
"""

from .ops import DOMAIN, OPSET_VERSION, MoeOpError
from .runtime import custom_ops_library, session

__all__ = ["COMPUTES", "DOMAIN", "OPSET_VERSION", "OUR_OPS_TARGETS", "TARGETS", "MoeOpError", "custom_ops_library",
           "generate", "optimize", "quantize", "session"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """:data:`TARGETS`, :data:`OUR_OPS_TARGETS` and :data:`COMPUTES` (:mod:`moe_onnx.rewrite.targets`), read
    when first used: ``import moe_onnx`` loads no part of the rewriter."""
    if name in ("TARGETS", "OUR_OPS_TARGETS", "COMPUTES"):
        from .rewrite import targets

        return getattr(targets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def optimize(model, target: str = "moe", *, fuse_routers: bool = True, portable: bool = False,
             compute: str = "fp32"):
    """Fuse the MoE blocks of an exported model; returns ``(optimized_model, report)``.

    ``model`` is a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model`` (a path or ModelProto gives a
    ModelProto back). A path is read as ``moe-onnx optimize`` reads it: a file the command refuses (unreadable,
    external data missing or short, a model ``moe-onnx check`` finds invalid) raises
    :class:`moe_onnx._ir.model_files.ModelFileError` (a ValueError) with the command's message. The ModelProto of a
    path holds every weight, its external data read into memory, so it saves anywhere (``onnx.save``, or
    ``onnx.save_model(..., save_as_external_data=True)`` for data of its own); the whole model is then in memory:
    for models over 2 GB use ``moe-onnx optimize`` (:func:`moe_onnx.pipeline.optimize_file`), which streams the
    weights from file to file. A ModelProto or ``onnx_ir.Model`` keeps its tensors as they are: external ones
    still name their files (``onnx_ir.save(model, path, external_data=NAME)`` writes an ``onnx_ir.Model``'s
    anew, anywhere). ``target="moe"`` makes one MOE node per block, ``"grouped"`` the chain
    MoeInitRouting -> MoeRowParallelLinear -> activation -> MoeRowParallelLinear -> MoeFinalizeRouting,
    ``"ort"`` onnxruntime's com.microsoft::MoE where it expresses the block (our MOE stays where it does
    not; the report's near-misses say why), so the model runs on onnxruntime without our library.
    ``fuse_routers`` (default) also makes each fused block's router one MoeGatingTopK node where its
    chain is a known one (softmax -> top-k, top-k -> softmax, DeepSeek-V3's group-limited sigmoid
    router); the report notes the routers left as exported, with the reason. ``fuse_routers=False``
    keeps every router as exported. ``portable=True`` also writes each moe_onnx node's function body
    (standard ONNX ops, :mod:`moe_onnx.rewrite.portable`) into the model as a model-local function, so it runs
    on plain onnxruntime and onnx.reference.ReferenceEvaluator too (slower, the same numbers); where our
    library is registered onnxruntime still runs our kernels. ``compute="bf16"`` records accuracy_level 3 on
    every MOE, QMOE and MoeRowParallelLinear of the result: their GEMMs may round both operands to
    bfloat16 (float32 accumulation), which the kernels do where the CPU has AMX-BF16 or AVX512-BF16
    (:mod:`moe_onnx.rewrite.compute`; ``"fp32"``, the default, keeps them exact). The report
    (:class:`moe_onnx.rewrite.OptimizeReport`) lists fused blocks per rule, near-misses with the check
    that failed, notes, the compute, and nodes and parameters before and after. Raises ValueError for an
    unknown target or compute (before reading the file).
    """
    from .rewrite import optimize as _optimize  # onnxscript is imported only when needed

    return _optimize(model, target, fuse_routers=fuse_routers, portable=portable, compute=compute)


def quantize(model, bits: int = 8, block_size: int = 0, *, zero_points: bool = False,
             accuracy_level: int | None = None, repack_mxfp4: bool = True, linears: bool = False,
             embedding: bool = False, measure: bool = True, backend: str = "cpp", sizes=None, seed: int = 0):
    """Quantize the expert weights of a fused model; returns ``(quantized_model, report)``.

    ``model`` is a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model`` fused by :func:`optimize`
    (target "moe"; run it first: a model without MOE nodes is refused, unless ``linears`` finds layers to
    quantize); the result has the same kind
    (a path gives a ModelProto). A path is read as ``moe-onnx quantize`` reads it (a file the command refuses
    raises :class:`moe_onnx._ir.model_files.ModelFileError` with its message) and loaded whole, external data
    included: the ModelProto holds every weight and saves anywhere. Every MOE node becomes a QMOE node whose
    weights are ``bits`` 4 or 8 integers with one scale per output column (``block_size`` 0) or per block of
    ``block_size`` inputs (a power of two in [16, 256] dividing every K), symmetric or with ``zero_points``, and
    the QMOE ``accuracy_level`` (0: float activations; 3: bfloat16 GEMM operands allowed in prefill; 4: int8
    activations; None, the default: 4 with ``linears``, for the MatMulNBits nodes too, else each MOE's own, 3
    after ``optimize(..., compute="bf16")``, else 0). An
    MOE whose weights are exactly MXFP4 (GPT-OSS's format) is repacked as quant_type mxfp4 without
    requantizing unless ``repack_mxfp4`` is False. With ``linears``, every other MatMul and Gemm whose weight is
    a constant float32/float16 matrix (attention projections, dense MLPs, lm_head; not the routers, nor a
    weight with K below ``block_size``, which is then required) becomes onnxruntime's
    ``com.microsoft::MatMulNBits`` with the same bits, block size and zero points; ``report.linears`` lists
    them, ``report.linears_float`` those left float and why. With ``embedding``, the token embedding (a Gather of
    a graph input's ids from a constant float table) becomes onnxruntime's ``com.microsoft::GatherBlockQuantized``
    with the same bits, block size (required) and zero points (``report.embeddings``, ``report.embeddings_float``).
    With ``measure`` (default), both models run on ``backend`` on random inputs (seeded by ``seed``)
    at ``sizes`` (default :data:`moe_onnx.verify.DEFAULT_SIZES`) and ``report.error`` holds the error
    of every output and every quantized layer's output.

    The report is a :class:`moe_onnx.rewrite.quantize.QuantizeReport` (``summary()``, ``document()``).
    Raises :class:`moe_onnx.rewrite.quantize.QuantizeError` (a ValueError) for bad settings, a model
    with nothing to quantize, or weights the settings cannot quantize (a block size that does not divide K).
    For models over 2 GB use ``moe-onnx quantize`` (:func:`moe_onnx.pipeline.quantize_file`), which
    streams the weights to disk.
    """
    from .pipeline.quantize import quantize as quantize_in_memory
    from .rewrite.quantize import QuantizeSettings
    from .verify import DEFAULT_SIZES

    settings = QuantizeSettings(bits, block_size, zero_points, accuracy_level, repack_mxfp4, linears, embedding)
    return quantize_in_memory(model, settings, measure=measure, backend=backend,
                              sizes=DEFAULT_SIZES if sizes is None else sizes, seed=seed)


def generate(folder, prompt: str | None = None, *, prompt_ids=None, max_new_tokens: int, threads: int | None = None,
             sample: bool = False, seed: int | None = None, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None, backend: str = "cpp"):
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` (text: the folder's tokenizer.json, read by the
    ``tokenizers`` package of the ``generate`` extra) or ``prompt_ids``, as ``moe-onnx generate`` does; returns a
    :class:`moe_onnx.generation.Generation` (``tokens``, ``text``, ``stop``, prefill and decode tokens/s,
    ``summary()``).

    ``folder`` is in onnxruntime-genai's format (genai_config.json, the decoder, tokenizer.json): the decoder runs
    on :func:`session` (``backend``, ``threads`` intra-op threads) with its KV cache, one run over the prompt and
    one per new token, until an eos token, ``max_new_tokens`` or the context length. Greedy, or with ``sample``
    drawn by ``seed`` (default 0) after ``temperature``, ``top_k`` and ``top_p`` (those not given: the config's
    search section). Raises :class:`moe_onnx.generation.GenerateError` (a ValueError) for bad settings or a prompt
    that leaves no room in the context, :class:`moe_onnx._ir.model_files.ModelFileError` for a folder, config,
    decoder or tokenizer that cannot be read; onnxruntime's exceptions come through unchanged.
    """
    from .generation import generate as _generate

    return _generate(folder, prompt, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, threads=threads,
                     sample=sample, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p, backend=backend)
