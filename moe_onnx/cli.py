"""The ``moe-onnx`` command line: argument parsing only; the work lives in the package modules
(``check``: :func:`moe_onnx.check.check_file`; ``optimize``: :func:`moe_onnx.pipeline.optimize_file`;
``quantize``: :func:`moe_onnx.pipeline.quantize_file`; ``shard``: :func:`moe_onnx.pipeline.shard_file`;
``pack``: :func:`moe_onnx.runtime.pack_weights`; ``run``: :func:`moe_onnx.distributed.run.launch`;
``generate``: :func:`moe_onnx.generation.generate`; ``export``: :func:`moe_onnx.export.export_checkpoint`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ._ir.inference import ShapeInferenceError
from ._ir.model_files import ModelFileError, OutputPathError, read_complete
from ._ir.progress import Progress
from .check import check_file
from .rewrite.targets import COMPUTES, TARGETS
from .runtime import BACKENDS
from .verify import DEFAULT_SIZES, format_sizes, parse_sizes


def _check(args: argparse.Namespace) -> int:
    status = 0
    for path in args.models:
        ok, verdict = check_file(path)
        print(verdict)
        status = status if ok else 1
    return status


def _pack(args: argparse.Namespace) -> int:
    from .runtime import pack_weights

    try:
        result = pack_weights(args.model, args.dir, threads=args.threads, progress=Progress())
    except Exception as error:  # the model's files, the library, onnxruntime's errors (their own classes)
        print(f"moe-onnx pack: {' '.join(str(error).split()) or type(error).__name__}", file=sys.stderr)
        return 1
    if not result.files:
        print(f"moe-onnx pack: {args.model} has no MOE, QMOE or MoeRowParallelLinear node whose weights are "
              "initializers; nothing to pack", file=sys.stderr)
        return 1
    for path, size in result.files:
        print(f"{path}  {size / 2**20:.1f} MiB")
    print(f"packed {len(result.files)} file(s), {result.bytes / 2**30:.2f} GiB in {result.seconds:.1f} s "
          f"({result.bytes / 1e9 / max(result.seconds, 1e-9):.2f} GB/s)")
    return 0


def _optimize(args: argparse.Namespace) -> int:
    from .pipeline import optimize_file  # onnxscript is imported only when needed

    return _run_pipeline("optimize", args, lambda: optimize_file(
        args.input, args.output, args.target, progress=Progress(),
        verify_backend=args.backend if args.verify else None, sizes=args.sizes, threads=args.threads,
        fuse_routers=not args.keep_routers, portable=args.portable, compute=args.compute))


def _quantize(args: argparse.Namespace) -> int:
    from .pipeline import quantize_file
    from .rewrite.quantize import QuantizeSettings

    settings = QuantizeSettings(args.bits, args.block_size, args.zero_points, args.accuracy_level,
                                repack_mxfp4=not args.no_mxfp4, linears=args.linears, embedding=args.embedding)
    return _run_pipeline("quantize", args, lambda: quantize_file(
        args.input, args.output, settings, measure=not args.no_measure, backend=args.backend, sizes=args.sizes,
        seed=args.seed, progress=Progress()))


def _run_pipeline(command: str, args: argparse.Namespace, run: Callable) -> int:
    """Run a pipeline function, print its summary and write its --report; the exit code: 2 for an output
    that would overwrite the input or is not a regular file (OUT or --report), a --report that is a file the job
    reads or writes, and bad settings, 1 for a file error, a model onnx shape inference rejects or a result that is
    not ok."""
    from .pipeline import SameFileError, check_report_path
    from .rewrite.quantize import QuantizeError
    from .rewrite.portable import PortableError

    try:
        if args.report:
            check_report_path(args.report, args.input, args.output)
        result = run()
    except (SameFileError, QuantizeError, PortableError, OutputPathError) as error:
        print(f"moe-onnx {command}: {error}", file=sys.stderr)
        return 2
    except (ModelFileError, ShapeInferenceError) as error:
        print(f"moe-onnx {command}: {error}", file=sys.stderr)
        return 1
    print(result.summary())
    if args.report:
        try:
            result.write_json(args.report)
        except ModelFileError as error:
            print(f"moe-onnx {command}: the report {error}", file=sys.stderr)
            return 1
    return 0 if result.ok else 1


def _export(args: argparse.Namespace) -> int:
    from .export import ExportError, ExportFailure, export_checkpoint
    from .rewrite.quantize import QuantizeSettings

    quantize = None
    if args.bits is not None or args.linears or args.embedding:
        if args.bits is None:
            print("moe-onnx export: --linears and --embedding quantize with --bits: give --bits 4 or 8",
                  file=sys.stderr)
            return 2
        quantize = QuantizeSettings(args.bits, args.block_size, args.zero_points, args.accuracy_level,
                                    linears=args.linears, embedding=args.embedding)
    try:
        result = export_checkpoint(args.checkpoint, args.output, args.dtype, optimize=not args.no_optimize,
                                   quantize=quantize, last_logits=not args.all_logits, progress=Progress())
    except (ExportError, OutputPathError) as error:
        print(f"moe-onnx export: {error}", file=sys.stderr)
        return 2
    except (ExportFailure, ModelFileError, ShapeInferenceError) as error:
        print(f"moe-onnx export: {error}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0 if result.ok else 1


def _shard(args: argparse.Namespace) -> int:
    from .distributed.shard import ShardError
    from .pipeline import shard_file

    try:
        manifest = shard_file(args.input, args.output, args.tp, args.ep, progress=Progress())
    except (ShardError, OutputPathError) as error:
        print(f"moe-onnx shard: {error}", file=sys.stderr)
        return 2
    except ModelFileError as error:
        print(f"moe-onnx shard: {error}", file=sys.stderr)
        return 1
    print(f"wrote {manifest.world} rank models (tp {manifest.tp} x ep {manifest.ep}) and shard.json to {args.output}")
    print(f"run them with: moe-onnx run {args.output} -n {manifest.world} --inputs IN.npz -o OUT.npz")
    return 0


def _run(args: argparse.Namespace) -> int:
    from .distributed.run import LaunchError, compare, launch

    if args.check and not args.reference:
        print("moe-onnx run: --check needs --reference MODEL (the unsharded model)", file=sys.stderr)
        return 2
    if args.check:  # before the ranks run: a reference that cannot be read is one line, as for every input
        try:
            read_complete(args.reference)
        except ModelFileError as error:
            print(f"moe-onnx run: --reference: {error}", file=sys.stderr)
            return 1
    try:
        status = launch(args.directory, args.ranks, args.inputs, args.output, backend=args.backend,
                        threads=args.threads, timeout=args.timeout)
    except (LaunchError, OutputPathError) as error:
        print(f"moe-onnx run: {error}", file=sys.stderr)
        return 2
    if status != 0:
        print(f"moe-onnx run: mpirun exited with status {status}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    if not args.check:
        return 0
    errors = compare(args.reference, args.inputs, args.output, backend=args.backend)
    worst = max(errors.values(), default=0.0)
    for name, error in errors.items():
        print(f"  {name}: max |sharded - unsharded| = {error:.3g}")
    print(f"check against {args.reference}: max error {worst:.3g} ({'ok' if worst <= args.tolerance else 'MISMATCH'}"
          f", tolerance {args.tolerance:g})")
    return 0 if worst <= args.tolerance else 1


def _generate(args: argparse.Namespace) -> int:
    """Exit 2 for settings generation cannot take (GenerateError), 1 for a folder, config, decoder or tokenizer that
    cannot be read and for a run onnxruntime fails."""
    from .generation import GenerateError, generate

    try:
        result = generate(args.folder, args.prompt, prompt_ids=args.prompt_ids, max_new_tokens=args.max_new_tokens,
                          threads=args.threads, sample=args.sample, seed=args.seed, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, backend=args.backend)
    except GenerateError as error:
        print(f"moe-onnx generate: {error}", file=sys.stderr)
        return 2
    except ModelFileError as error:
        print(f"moe-onnx generate: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # noqa: BLE001 -- onnxruntime's errors share no base class
        print(f"moe-onnx generate: {type(error).__name__}: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(token) for token in text.replace(",", " ").split()]
    except ValueError:
        ids = []
    if not ids:  # their range is the vocabulary's: generate checks it, as for the Python API
        raise argparse.ArgumentTypeError(f"{text!r} is not token ids like 5,9,17")
    return ids


def _sizes(text: str) -> tuple[tuple[int, ...], ...]:
    try:
        return parse_sizes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not sizes like 1x1,2x5") from None


def _positive_int(text: str) -> int:
    return _int_from(text, 1, "a positive integer")


def _seed(text: str) -> int:
    return _int_from(text, 0, "a seed (an integer >= 0)")


def _int_from(text: str, minimum: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} is not {expected}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-onnx", description="Fused Mixture-of-Experts ops for ONNX.")
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser(
        "check", help="validate models: onnx checker, strict shape inference and the moe_onnx op rules",
        description="Exit 0 when every model is valid; otherwise print each problem (node, input or "
                    "attribute, what was expected) and exit 1.")
    check.add_argument("models", nargs="+", metavar="MODEL", help="ONNX model file(s); external data is supported")
    check.set_defaults(run=_check)

    pack = commands.add_parser(
        "pack", help="pack the expert weights once into files that later sessions map instead of packing",
        description="Write one packed-weights file per MOE, QMOE and MoeRowParallelLinear node whose weights are "
                    "initializers (docs/building.md, 'Packed-weights files'); sessions on MODEL use them from "
                    "MODEL.packed/ by default. Exit 1 when the model cannot be read, a file cannot be written or "
                    "there is nothing to pack.")
    pack.add_argument("model", metavar="MODEL", help="ONNX model with moe_onnx ops (optimize's or quantize's output)")
    pack.add_argument("--dir", default=None, help="the folder of the files (default MODEL.packed; made if missing)")
    pack.add_argument("--threads", type=_positive_int, default=None,
                      help="threads that pack (default: the machine's)")
    pack.set_defaults(run=_pack)

    opt = commands.add_parser(
        "optimize", help="fuse the MoE blocks of an exported model into moe_onnx ops",
        description="Rewrite IN into OUT; prints per-rule counts, near-misses, nodes before and after and the "
                    "parameters kept. Models over 2 GB are read lazily and written with external data.")
    opt.add_argument("input", metavar="IN", help="the exported ONNX model")
    opt.add_argument("-o", "--output", metavar="OUT", required=True, help="where to write the optimized model")
    opt.add_argument("--target", choices=TARGETS, default="moe",
                     help="moe: one MOE node per block (default); grouped: MoeInitRouting -> MoeRowParallelLinear "
                          "-> activation -> MoeRowParallelLinear -> MoeFinalizeRouting; ort: onnxruntime's "
                          "com.microsoft::MoE, runs without our library (exit 1 when a block it cannot express "
                          "stays our op)")
    opt.add_argument("--keep-routers", action="store_true",
                     help="keep each block's router chain as exported (default: one MoeGatingTopK node where "
                          "the chain is a known one)")
    opt.add_argument("--portable", action="store_true",
                     help="also write each moe_onnx op's function body (standard ONNX ops) into the model, so it "
                          "runs on plain onnxruntime and onnx.reference without our library (slower, the same "
                          "numbers; with the library registered onnxruntime still runs our kernels)")
    opt.add_argument("--compute", choices=COMPUTES, default="fp32",
                     help="fp32: exact float32 expert GEMMs (default); bf16: record accuracy_level 3 on every MOE, "
                          "QMOE and MoeRowParallelLinear, so their GEMMs take bfloat16 operands with float32 "
                          "accumulation where the CPU has AMX-BF16 or AVX512-BF16 (--verify then allows bf16's error)")
    opt.add_argument("--verify", action="store_true",
                     help="run both models on random inputs and compare (exit 1 on a mismatch), and time them")
    opt.add_argument("--backend", choices=BACKENDS, default="cpp", help="kernels used by --verify")
    opt.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES,
                     help="values of the symbolic input dims (batch x sequence ...) for --verify "
                          f"(default {format_sizes(DEFAULT_SIZES)})")
    opt.add_argument("--threads", type=_positive_int, default=None, help="intra-op threads for --verify")
    opt.add_argument("--report", metavar="FILE.json", help="write the report (and verify results) as JSON")
    opt.set_defaults(run=_optimize)

    quant = commands.add_parser(
        "quantize", help="quantize the expert weights of a fused model (MOE -> QMOE; --linears: the other "
                         "linear layers too, -> MatMulNBits) and report the error",
        description="Turn every MOE node of MODEL (a model fused by `moe-onnx optimize`) into a QMOE node with "
                    "int8 or int4 expert weights, write OUT (weights quantized one expert at a time; external "
                    "data when large), then run both models on random inputs and print the error of every output "
                    "and every layer. MOE weights that are exactly MXFP4 (GPT-OSS) are repacked as mxfp4, "
                    "without error. With --linears, the other linear layers (attention projections, dense MLPs, "
                    "lm_head: MatMul/Gemm with a constant weight) become onnxruntime's com.microsoft::MatMulNBits "
                    "too (routers stay float).")
    quant.add_argument("input", metavar="MODEL", help="a model fused by `moe-onnx optimize` (target moe)")
    quant.add_argument("-o", "--output", metavar="OUT", required=True, help="where to write the quantized model")
    quant.add_argument("--bits", type=int, required=True, help="4 or 8")
    quant.add_argument("--block-size", type=int, default=0,
                       help="0: one scale per output column (default); else a power of two in [16, 256] dividing "
                            "every K: one scale per block of that many inputs")
    quant.add_argument("--zero-points", action="store_true", help="asymmetric: a zero point per scale "
                       "(default: symmetric, zero point 2^(bits-1))")
    quant.add_argument("--accuracy-level", type=int, default=None,
                       help="QMOE's accuracy_level: 0 (float activations), 3 (bf16 GEMM operands in prefill, float32 "
                            "accumulation) or 4 (int8 activations); default: 4 with --linears, else each MOE's own "
                            "(3 after `optimize --compute bf16`, else 0)")
    quant.add_argument("--linears", action="store_true",
                       help="also quantize every MatMul/Gemm with a constant float32/float16 weight matrix (not the "
                            "routers) to com.microsoft::MatMulNBits with the same bits, block size (required) and "
                            "zero points; accuracy_level: --accuracy-level, else 4 (int8 activations)")
    quant.add_argument("--embedding", action="store_true",
                       help="also quantize the token embedding (a Gather of the token ids from a constant table) to "
                            "onnxruntime's com.microsoft::GatherBlockQuantized with the same bits and block size "
                            "(required)")
    quant.add_argument("--no-mxfp4", action="store_true",
                       help="requantize MXFP4 weights too (default: repack them exactly as quant_type mxfp4)")
    quant.add_argument("--no-measure", action="store_true", help="skip running both models for the error")
    quant.add_argument("--backend", choices=BACKENDS, default="cpp", help="kernels used for the error")
    quant.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES,
                       help="values of the symbolic input dims (batch x sequence ...) for the error "
                            f"(default {format_sizes(DEFAULT_SIZES)})")
    quant.add_argument("--seed", type=_seed, default=0, help="seed of the random inputs (default 0)")
    quant.add_argument("--report", metavar="FILE.json", help="write the report (with the error) as JSON")
    quant.set_defaults(run=_quantize)

    export = commands.add_parser(
        "export", help="a Hugging Face checkpoint folder -> a decoder with a KV cache, fused, in an onnxruntime-genai "
                       "folder (needs torch and transformers: the export extra)",
        description="Trace CHECKPOINT's decoder (config.json, safetensors as shipped: unquantized, MXFP4 or FP8) "
                    "with a KV cache on torch's meta device and write it to OUT_DIR/model.onnx (inputs input_ids, "
                    "attention_mask, position_ids, past_key_values.N.key/value; outputs logits, present.N.key/value; "
                    "external data), fused as `moe-onnx optimize` does, each weight computed from the checkpoint as "
                    "it is written (the model is never held in memory); MXFP4 experts stay as stored (QMOE mxfp4); "
                    "genai_config.json and the tokenizer files beside it. Exit 2 for a model family, format or "
                    "setting it refuses, 1 when the checkpoint cannot be read or exported.")
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="a local Hugging Face checkpoint folder")
    export.add_argument("-o", "--output", metavar="OUT_DIR", required=True, help="the folder to write")
    export.add_argument("--dtype", default="fp32", help="the float weights' and activations' type: fp32 (default), "
                                                        "fp16 or bf16")
    export.add_argument("--no-optimize", action="store_true", help="write the export as it is, unfused")
    export.add_argument("--all-logits", action="store_true",
                        help="output every position's logits (default: the last position's only, [batch, 1, "
                             "vocabulary]: what generation reads, and a prompt's other positions skip the lm_head)")
    export.add_argument("--bits", type=int, choices=(4, 8), default=None,
                        help="quantize the experts (but MXFP4 ones, kept as stored) to int4 or int8 as they are "
                             "written, as `moe-onnx quantize` does")
    export.add_argument("--block-size", type=int, default=32,
                        help="with --bits: one scale per block of this many inputs (a power of two in [16, 256], "
                             "default 32), or 0 for one per output column (experts only)")
    export.add_argument("--zero-points", action="store_true", help="with --bits: asymmetric, a zero point per scale")
    export.add_argument("--accuracy-level", type=int, default=None,
                        help="with --bits: the accuracy_level of the quantized nodes (as `moe-onnx quantize`'s)")
    export.add_argument("--linears", action="store_true",
                        help="with --bits: the attention projections, dense MLPs and lm_head -> MatMulNBits too "
                             "(routers stay float)")
    export.add_argument("--embedding", action="store_true",
                        help="with --bits: the token embedding -> onnxruntime's GatherBlockQuantized too")
    export.set_defaults(run=_export)

    shard = commands.add_parser(
        "shard", help="split a model over tp x ep ranks (tensor and expert parallelism over MPI)",
        description="Write DIR/rank<g>.onnx for every rank g of tp * ep and DIR/shard.json (docs/distributed.md). "
                    "ep = 1: each MOE node gets its slice of the intermediate size; ep > 1: each MoE block becomes "
                    "MoeDistributeDispatch -> the rank's experts -> MoeDistributeCombine. A model with unfused "
                    "blocks is optimized first; weights are streamed (external data when large). Exit 2 for a "
                    "model or tp/ep that cannot be sharded.")
    shard.add_argument("input", metavar="MODEL", help="the model (exported, or fused by `moe-onnx optimize`)")
    shard.add_argument("-o", "--output", metavar="DIR", required=True, help="the directory to write")
    shard.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel ranks per expert group (default 1)")
    shard.add_argument("--ep", type=_positive_int, default=1, help="expert-parallel groups (default 1)")
    shard.set_defaults(run=_shard)

    run = commands.add_parser(
        "run", help="run a sharded model on this machine (starts mpirun -n P --oversubscribe)",
        description="Start `mpirun -n P python -m moe_onnx.distributed.run DIR ...`: every rank runs its model on "
                    "the same inputs, rank 0 writes the outputs. Exit 1 when a rank fails (its message is printed "
                    "as 'moe_onnx.distributed.run: rank G: ...'), 2 when mpirun is not found.")
    run.add_argument("directory", metavar="DIR", help="a directory written by `moe-onnx shard`")
    run.add_argument("-n", "--ranks", type=_positive_int, required=True, help="processes (the shard's tp * ep)")
    run.add_argument("--inputs", required=True, metavar="IN.npz", help="the model's inputs by name")
    run.add_argument("-o", "--output", required=True, metavar="OUT.npz", help="where to write the outputs")
    run.add_argument("--backend", choices=BACKENDS, default="cpp", help="the kernels (default cpp)")
    run.add_argument("--threads", type=_positive_int, default=1, help="intra-op threads per rank (default 1)")
    run.add_argument("--timeout", type=float, default=None,
                     help="seconds every collective may wait (MOE_ONNX_COMM_TIMEOUT_S, default 300)")
    run.add_argument("--check", action="store_true",
                     help="also run the unsharded --reference model on one process and print the max error")
    run.add_argument("--reference", metavar="MODEL", help="the unsharded model, for --check")
    run.add_argument("--tolerance", type=float, default=1e-5, help="--check fails above this max error (1e-5)")
    run.set_defaults(run=_run)

    gen = commands.add_parser(
        "generate", help="generate text from a model folder in onnxruntime-genai's format (KV cache, our ops)",
        description="Run DIR's decoder (genai_config.json names it and its caches) on our sessions: one run over "
                    "the prompt (prefill), then one run per new token with the cache fed back (decode), until an eos "
                    "token, -n tokens or the context length. Prints the text (when DIR has tokenizer.json and the "
                    "tokenizers package is installed), the token ids, and the prefill and decode tokens/s (timed "
                    "around session.run only). Greedy unless --sample.")
    gen.add_argument("folder", metavar="DIR", help="a folder in onnxruntime-genai's format (genai_config.json, the "
                                                   "decoder, tokenizer.json)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt as text (needs DIR/tokenizer.json and the "
                                                         "tokenizers package: pip install 'moe-onnx[generate]')")
    prompt.add_argument("--prompt-ids", type=_token_ids, metavar="IDS", help="the prompt as token ids: 5,9,17")
    gen.add_argument("-n", "--max-new-tokens", type=_positive_int, required=True, help="tokens to generate at most")
    gen.add_argument("--threads", type=_positive_int, default=None, help="intra-op threads (default: onnxruntime's)")
    gen.add_argument("--sample", action="store_true",
                     help="draw each token (temperature, then top-k, then top-p) instead of taking the largest "
                          "logit; the settings not given come from genai_config.json's search section")
    gen.add_argument("--seed", type=_seed, default=None, help="with --sample: the draw's seed (default 0)")
    gen.add_argument("--temperature", type=float, default=None, help="with --sample: divides the logits")
    gen.add_argument("--top-k", type=int, default=None, help="with --sample: keep the k largest logits (0: all)")
    gen.add_argument("--top-p", type=float, default=None,
                     help="with --sample: keep the fewest tokens whose probabilities sum to p (1: all)")
    gen.add_argument("--backend", choices=BACKENDS, default="cpp", help="the kernels of our ops (default cpp)")
    gen.set_defaults(run=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
