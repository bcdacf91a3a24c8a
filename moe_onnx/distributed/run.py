"""Run a sharded model (``moe-onnx shard``'s directory) with one process per rank under MPI::

    mpirun -n P python -m moe_onnx.distributed.run DIR --inputs in.npz -o out.npz [--backend cpp|python]
        [--threads N] [--timeout S]

or ``moe-onnx run DIR -n P ...``, which starts that mpirun itself (:func:`launch`). Every rank runs its
``rankG.onnx`` on the same inputs; rank 0 writes the outputs. Before running, every rank checks that the
MPI world has the shard's size, that its model file matches shard.json's fingerprint, and, through an
all-gather, that all ranks hold models of one shard that fit together (:func:`open_rank`). An error on any
rank prints ``moe_onnx.distributed.run: rank G: <message>`` and aborts the whole job (MPI_Abort), so no rank
waits for one that is gone; every collective waits at most MOE_ONNX_COMM_TIMEOUT_S seconds (``--timeout``).

Only this module's ``main`` and ``open_rank`` touch MPI (mpi4py); ``launch`` and ``compare`` do not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .._ir import model_files
from ..compare import OutputMismatch, compare_arrays
from ..ops.layout import Layout
from ..runtime import BACKENDS, run, session
from .comm import DEFAULT_TIMEOUT_S, TIMEOUT_VARIABLE, groups
from .manifest import Manifest, mismatches, nodes_fingerprint, rank_record

_SESSION_START = "moe_onnx.distributed.run session start"  # how comm errors of the checks name their op


class RankError(RuntimeError):
    """A session-start check failed: the shard, the world or the ranks' models do not fit together."""


def all_gather_json(world, document) -> list:
    """Every rank's JSON ``document``, in rank order, over the world ``Group`` (moe_onnx.distributed.comm:
    each collective waits at most MOE_ONNX_COMM_TIMEOUT_S)."""
    data = np.frombuffer(json.dumps(document).encode(), np.uint8)
    sizes = world.all_gather(np.array([data.size], np.int64), _SESSION_START, "the sizes of the model checks")
    gathered = world.all_gather_v(data, sizes.reshape(-1), _SESSION_START, "the model checks")
    edges = np.concatenate([[0], np.cumsum(sizes.reshape(-1))])
    return [json.loads(gathered[edges[g]:edges[g + 1]].tobytes()) for g in range(len(edges) - 1)]


def check_rank(directory: str | os.PathLike, rank: int, world: int) -> tuple[Manifest, Path, dict, str]:
    """This rank's own checks: the manifest, the world size, its model file and fingerprint. Returns the
    manifest, the model path, this rank's record for the others and its problem ('' when none)."""
    manifest = Manifest.read(directory)
    if world != manifest.world:
        raise RankError(f"the MPI world has {world} ranks; {directory} is a shard for {manifest.world} ranks "
                        f"(tp {manifest.tp} x ep {manifest.ep}): run it with -n {manifest.world}")
    path = Path(directory) / manifest.files[rank]
    proto = model_files.read_proto(path)
    fingerprint = nodes_fingerprint(proto)
    problem = ""
    if fingerprint != manifest.fingerprints[rank]:
        problem = (f"{path} does not match {directory}/shard.json: the fingerprint of its distributed nodes is "
                   f"{fingerprint[:12]}, the manifest says {manifest.fingerprints[rank][:12]} (a file of another "
                   "shard or rank, or changed since `moe-onnx shard`)")
    return manifest, path, rank_record(proto, rank), problem


def open_rank(directory: str | os.PathLike, comm, backend: str = "cpp", threads: int = 1):
    """This rank's onnxruntime session on its model of the shard in ``directory``, after the session-start
    checks on every rank: the manifest, the world size, this rank's file against its fingerprint, then an
    all-gather of every rank's record, which detects models of other shards, layouts of other ranks and
    distributed nodes that differ. Raises RankError (the same text on every rank for a problem of any rank),
    ManifestError or ModelFileError."""
    rank = comm.Get_rank()
    manifest, path, record, problem = check_rank(directory, rank, comm.Get_size())
    layout = Layout(ep_size=manifest.ep, tp_size=manifest.tp).of_rank(rank)
    gathered = all_gather_json(groups(layout, _SESSION_START).world, {"record": record, "problem": problem})
    problems = [f"rank {g}: {entry['problem']}" for g, entry in enumerate(gathered) if entry["problem"]]
    problems += mismatches([entry["record"] for entry in gathered], manifest.tp)
    if problems:
        raise RankError("the ranks' models do not fit together: " + "; ".join(problems))
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return session(str(path), backend, sess_options=options)


def read_inputs(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of an .npz file by name; RankError naming the file when it cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as error:
        raise RankError(f"{path}: cannot read the inputs ({error}); expected an .npz of the model's inputs") from None


def run_session(sess, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of ``sess`` on ``inputs`` (those the model takes; RankError naming a missing one)."""
    names = [i.name for i in sess.get_inputs()]
    missing = [name for name in names if name not in inputs]
    if missing:
        raise RankError(f"the inputs lack {', '.join(missing)} (the model takes {', '.join(names)})")
    outputs = [o.name for o in sess.get_outputs()]
    return dict(zip(outputs, run(sess, {name: inputs[name] for name in names}, outputs)))


def guarded(comm, work: Callable[[], int]) -> int:
    """``work()`` on this rank; any exception prints ``moe_onnx.distributed.run: rank G: <message>`` and aborts
    the job."""
    try:
        return work()
    except BaseException as error:  # noqa: BLE001 -- whatever ends this rank must end the job
        text = str(error).strip() or type(error).__name__
        sys.stderr.flush()
        # one write: the whole message before the abort
        os.write(2, f"moe_onnx.distributed.run: rank {comm.Get_rank()}: {text}\n".encode())
        comm.Abort(1)
        raise  # not reached: Abort ends the process


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moe_onnx.distributed.run",
                                     description="Run one rank of a sharded model; start it with mpirun -n P.")
    parser.add_argument("directory", metavar="DIR", help="a directory written by `moe-onnx shard`")
    parser.add_argument("--inputs", required=True, metavar="IN.npz", help="the model's inputs (the same on every rank)")
    parser.add_argument("-o", "--output", required=True, metavar="OUT.npz", help="where rank 0 writes the outputs")
    parser.add_argument("--backend", choices=BACKENDS, default="cpp", help="the kernels (default cpp)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds every collective may wait ({TIMEOUT_VARIABLE}, default {DEFAULT_TIMEOUT_S:g})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.timeout is not None:
        os.environ[TIMEOUT_VARIABLE] = str(args.timeout)
    try:
        from mpi4py import MPI
    except ImportError as error:
        print(f"moe_onnx.distributed.run: needs mpi4py and an MPI library ({error}); see docs/distributed.md",
              file=sys.stderr)
        return 2

    comm = MPI.COMM_WORLD

    def work() -> int:
        sess = open_rank(args.directory, comm, args.backend, args.threads)
        outputs = run_session(sess, read_inputs(args.inputs))
        if comm.Get_rank() == 0:
            with model_files.replacing(args.output) as staged, open(staged, "wb") as handle:
                np.savez(handle, **outputs)
        return 0

    return guarded(comm, work)


# ----------------------------------------------------------------------------- moe-onnx run (no MPI here)

class LaunchError(RuntimeError):
    """mpirun cannot be started (not installed)."""


def mpirun_command(ranks: int, command: Sequence[str]) -> list[str]:
    """The mpirun command line that runs ``command`` on ``ranks`` processes of this machine
    (--oversubscribe; --allow-run-as-root for root); LaunchError when mpirun is not found."""
    program = shutil.which("mpirun")
    if program is None:
        raise LaunchError("mpirun was not found on PATH: install Open MPI (Debian: apt-get install openmpi-bin "
                          "libopenmpi-dev) or start `python -m moe_onnx.distributed.run` with your MPI's launcher")
    launcher = [program, "--oversubscribe"]
    if hasattr(os, "getuid") and os.getuid() == 0:
        launcher.append("--allow-run-as-root")
    return [*launcher, "-n", str(ranks), *command]


def package_environment() -> dict[str, str]:
    """This process's environment with this package's root first on PYTHONPATH (for the ranks)."""
    environment = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, environment.get("PYTHONPATH")]))
    return environment


def launch(directory: str | os.PathLike, ranks: int, inputs: str | os.PathLike, output: str | os.PathLike, *,
           backend: str = "cpp", threads: int = 1, timeout: float | None = None) -> int:
    """Run the shard in ``directory`` on ``ranks`` local processes (mpirun --oversubscribe); returns mpirun's
    exit status (0: ``output`` written). Raises LaunchError when mpirun is not found,
    :class:`moe_onnx._ir.model_files.OutputPathError` when ``output`` is not a regular file (a device, a FIFO,
    a directory; a symbolic link is written through)."""
    model_files.output_file(output)
    arguments = [os.fspath(directory), "--inputs", os.fspath(inputs), "-o", os.fspath(output), "--backend", backend,
                 "--threads", str(threads)]
    if timeout is not None:
        arguments += ["--timeout", str(timeout)]
    command = mpirun_command(ranks, [sys.executable, "-m", "moe_onnx.distributed.run", *arguments])
    return subprocess.run(command, env=package_environment()).returncode


def compare(reference: str | os.PathLike, inputs: str | os.PathLike, output: str | os.PathLike,
            backend: str = "cpp") -> dict[str, float]:
    """The max absolute difference of every output in ``output`` from the unsharded model ``reference`` run
    on one process on ``inputs`` (:func:`moe_onnx.compare.compare_arrays`: NaN against NaN is equal, a NaN or
    an infinity against another value an infinite difference; inf too for a missing output or another shape)."""
    expected = run_session(session(os.fspath(reference), backend), read_inputs(inputs))
    got = read_inputs(output)
    return {name: _max_difference(name, value, got) for name, value in expected.items()}


def _max_difference(name: str, expected: np.ndarray, outputs: dict[str, np.ndarray]) -> float:
    try:
        return compare_arrays(expected, outputs[name], name=name).max_abs
    except (KeyError, OutputMismatch):
        return math.inf


if __name__ == "__main__":
    sys.exit(main())
