"""One mpirun launch for many sharded-model runs (an mpirun start costs about a second):

    mpirun -n P python tests/distributed_driver.py PLAN.json

PLAN.json: ``{"runs": [{"dir": shard dir, "backend": "cpp"|"python", "inputs": [in.npz...],
"outputs": [out.npz...]}...], "fault": null | {"kind": ..., "rank": g}}``. Every rank opens each shard
(moe_onnx.distributed.run.open_rank: the session-start checks), runs every input, and rank 0 writes the outputs;
an error on any rank aborts the job as ``python -m moe_onnx.distributed.run`` does (``guarded``).

Faults, injected on rank ``fault["rank"]`` after its session started, before its first run:
``raise``: it runs a hidden state of the wrong width (onnxruntime raises); ``kill``: it SIGKILLs itself;
``hang``: it sleeps (outside any collective) for a minute; ``hang_at_start``: it sleeps a minute before
opening its session (the others wait in the session-start all-gather).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe_onnx.distributed.run import guarded, open_rank, read_inputs, run_session  # noqa: E402


def inject(fault: dict | None, rank: int, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs this rank runs, after the plan's fault (if it is this rank's)."""
    if not fault or fault["rank"] != rank:
        return inputs
    if fault["kind"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault["kind"] == "hang":
        time.sleep(60)
    if fault["kind"] == "raise":
        hidden = inputs["hidden"]
        return {**inputs, "hidden": np.zeros((*hidden.shape[:-1], hidden.shape[-1] + 1), hidden.dtype)}
    return inputs


def main(plan_path: str) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    plan = json.loads(open(plan_path).read())

    def work() -> int:
        fault = plan.get("fault")
        if fault and fault["kind"] == "hang_at_start" and fault["rank"] == comm.Get_rank():
            time.sleep(60)
        for run in plan["runs"]:
            sess = open_rank(run["dir"], comm, run["backend"], threads=1)
            for inputs, output in zip(run["inputs"], run["outputs"]):
                outputs = run_session(sess, inject(plan.get("fault"), comm.Get_rank(), read_inputs(inputs)))
                if comm.Get_rank() == 0:
                    np.savez(output, **outputs)
        return 0

    return guarded(comm, work)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
