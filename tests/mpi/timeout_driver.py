"""The bounded wait of a collective (tests/test_comm_mpi.py): under

    MOE_ONNX_COMM_TIMEOUT_S=3 mpirun -n 2 python tests/mpi/timeout_driver.py OUT_DIR [moe|combine]

both ranks run a 2-rank node once, then rank 1 sleeps instead of running it again: rank 0's collective
never completes and its run must fail after the timeout with the op's error. The node is a tensor-parallel
MOE (its all-reduce, a staged collective) or an expert-parallel MoeDistributeCombine whose rows cross
(its all-to-all-v, filled and read in place). Rank 0 writes OUT_DIR/rank0.json ({"error", "seconds"})
and aborts the job, as the runner does.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the case tables

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from cases import Case  # noqa: E402
from cases import moe as moe_cases  # noqa: E402
from mpi4py import MPI  # noqa: E402

from moe_onnx.ops.distribute import dispatch_all_ranks  # noqa: E402
from moe_onnx.runtime import run, session  # noqa: E402


def moe_case(rank: int) -> Case:
    """Rank `rank`'s half of a 2-rank tensor-parallel MOE."""
    inputs = moe_cases.make_inputs(tokens=3, inter=4, expert_type=moe_cases.GEMM3)
    mine = inputs[:3] + [inputs[3][:, 2 * rank:2 * rank + 2], None, inputs[5][:, 2 * rank:2 * rank + 2], None,
                         inputs[7][:, :, 2 * rank:2 * rank + 2]]
    return Case(op="MOE", name="timeout", inputs=mine, constant=(3, 5, 7),
                attrs={"expert_type": moe_cases.GEMM3, "tp_world_size": 2, "tp_rank_id": rank})


def combine_case(rank: int) -> Case:
    """Rank `rank`'s MoeDistributeCombine over 2 EP ranks, each rank's token routed to the other's expert."""
    ids = [np.array([[2]]), np.array([[0]])]
    xs = [np.full((1, 4), g + 1, np.float32) for g in range(2)]
    expand_x, _, assist_info = dispatch_all_ranks(xs, ids, num_experts=4, ep_world_size=2)[rank]
    return Case(op="MoeDistributeCombine", name="timeout", inputs=[expand_x, assist_info, np.ones((1, 1), np.float32)],
                attrs={"num_experts": 4, "ep_world_size": 2, "ep_rank_id": rank})


def main() -> None:
    out_dir = Path(sys.argv[1])
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    case = (combine_case if sys.argv[2:] == ["combine"] else moe_case)(rank)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = session(case.model(), backend="cpp", sess_options=opts)
    run(sess, case.feeds())  # both ranks: the groups are made at the first run
    if rank == 1:
        time.sleep(120)  # never reaches the all-reduce; mpirun ends it when rank 0 aborts
        return
    start = time.monotonic()
    try:
        run(sess, case.feeds())
        result = {"error": None}
    except Exception as error:  # noqa: BLE001 - the error is the result
        result = {"error": str(error)}
    result["seconds"] = time.monotonic() - start
    (out_dir / "rank0.json").write_text(json.dumps(result))
    world.Abort(3)


if __name__ == "__main__":
    main()
