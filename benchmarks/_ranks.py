"""What bench_distributed.py runs on every rank under mpirun: the layer's shapes and models, timing
synchronized over the ranks, and the plain MPI_Alltoallv the dispatch is compared with.

Every rank builds the same unsharded layer (seeded), takes its own shard of it and its own tokens,
checks its output against the unsharded layer's, then times its calls in interleaved rounds: each
call starts after a barrier and counts as the slowest rank's time (the layer is done when every rank
is). mpi4py is imported only here, and only by the worker (the launcher never loads MPI).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from _timing import Timer, call_ms

#: the layer's input and output names
X, Y = "x", "y"


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer: E experts, k per token, hidden H, intermediate I; GEMM2 (GPT-OSS: clamped SwiGLU,
    biases) or GEMM3 (Qwen3: SwiGLU)."""

    label: str
    E: int
    k: int
    H: int
    I: int
    gemm2: bool

    def describe(self) -> str:
        return (f"{self.label} (E={self.E}, k={self.k}, H={self.H}, I={self.I}, "
                f"{'GEMM2 + biases' if self.gemm2 else 'GEMM3'})")


#: scaled to a 2-core machine: GPT-OSS-20B (E=32, k=4, H=I=2880) and Qwen3-30B-A3B (E=128, k=8, H=2048,
#: I=768) with H and I divided by 5.6 and 4; every count of experts kept
SHAPES = {
    "gpt_oss": LayerShape("GPT-OSS-shaped", E=32, k=4, H=512, I=512, gemm2=True),
    "qwen3": LayerShape("Qwen3-MoE-shaped", E=128, k=8, H=512, I=192, gemm2=False),
}
GPT_OSS_SWIGLU = dict(expert_alpha=1.702, expert_beta=7.0)


def layer_model(shape: LayerShape, seed: int = 0) -> onnx.ModelProto:
    """The unsharded layer: router MatMul -> MoeGatingTopK (softmax, top k, renormalized) -> MOE."""
    rng = np.random.default_rng(seed)

    def weight(*dims: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * scale).astype(np.float32)

    E, H, I = shape.E, shape.H, shape.I
    inits = {"router": weight(H, E, scale=H ** -0.5)}
    if shape.gemm2:
        inits.update(w0=weight(E, H, 2 * I, scale=H ** -0.5), b0=weight(E, 2 * I, scale=0.1),
                     w1=weight(E, I, H, scale=I ** -0.5), b1=weight(E, H, scale=0.1))
        moe = helper.make_node("MOE", [X, "routing_weights", "experts", "w0", "b0", "w1", "b1"], [Y],
                               domain="moe_onnx", expert_type="GEMM2_BIAS_SWIGLU_CLAMP", **GPT_OSS_SWIGLU)
    else:
        inits.update(w0=weight(E, I, H, scale=H ** -0.5), w1=weight(E, I, H, scale=H ** -0.5),
                     w2=weight(E, H, I, scale=I ** -0.5))
        moe = helper.make_node("MOE", [X, "routing_weights", "experts", "w0", "", "w1", "", "w2"], [Y],
                               domain="moe_onnx", expert_type="GEMM3_SWIGLU")
    nodes = [helper.make_node("MatMul", [X, "router"], ["logits"]),
             helper.make_node("MoeGatingTopK", ["logits"], ["routing_weights", "experts"], domain="moe_onnx",
                              k=shape.k, renormalize=1),
             moe]
    graph = helper.make_graph(nodes, "moe_layer", [helper.make_tensor_value_info(X, TensorProto.FLOAT, ["T", H])],
                              [helper.make_tensor_value_info(Y, TensorProto.FLOAT, ["T", H])],
                              [numpy_helper.from_array(a, n) for n, a in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("moe_onnx", 1)],
                             ir_version=10)


def tokens(shape: LayerShape, count: int, seed: int = 1) -> np.ndarray:
    """The layer's input: `count` tokens, the same on every rank."""
    return np.random.default_rng(seed).standard_normal((count, shape.H), dtype=np.float32)


def token_range(count: int, ranks: int, rank: int) -> slice:
    """The tokens an EP-sharded layer gives `rank` of `ranks` (`moe-onnx shard`: [T*g//W, T*(g+1)//W))."""
    return slice(count * rank // ranks, count * (rank + 1) // ranks)


class RankTimer(Timer):
    """Interleaved rounds on every rank at once: each call starts after a barrier and is recorded as
    the slowest rank's time; the calls per round are agreed (the slowest rank's first call sets them)."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm

    def first_ms(self, call) -> float:
        self.comm.Barrier()
        return self.comm.allreduce(call_ms(call), op=_mpi().MAX)

    def measure(self, name: str, fn, reps: int) -> None:
        times = np.empty(reps)
        for i in range(reps):
            self.comm.Barrier()
            times[i] = call_ms(fn)
        self.comm.Allreduce(_mpi().IN_PLACE, times, op=_mpi().MAX)
        self.rounds.setdefault(name, []).append(times.tolist())


def alltoallv(comm, send_rows: np.ndarray, recv_rows: np.ndarray, H: int):
    """A call of a plain MPI_Alltoallv (mpi4py) of float32 rows of H values: `send_rows[p]` rows to rank p,
    `recv_rows[p]` from it (the buffers made once)."""
    MPI = _mpi()

    def layout(rows: np.ndarray) -> tuple[np.ndarray, tuple[list[int], list[int]]]:
        counts = [int(r) * H for r in rows]
        return np.zeros(sum(counts), np.float32), (counts, np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist())

    send, send_layout = layout(send_rows)
    recv, recv_layout = layout(recv_rows)
    send[:] = 1.0
    return lambda: comm.Alltoallv([send, send_layout, MPI.FLOAT], [recv, recv_layout, MPI.FLOAT])


def allreduce(comm, rows: int, H: int):
    """A call of a plain MPI_Allreduce (sum) of [rows, H] float32, what a TP layer sums over its group."""
    MPI = _mpi()
    data = np.ones((rows, H), np.float32)
    return lambda: comm.Allreduce(MPI.IN_PLACE, data, op=MPI.SUM)


def _mpi():
    from mpi4py import MPI  # the worker only: the launcher and one process never load MPI

    return MPI


# ----------------------------------------------------------------------------- the models of one rank

def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
           outputs: list[tuple[str, int]]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "exchange", inputs, [helper.make_tensor_value_info(n, t, None) for n, t in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("moe_onnx", 1)],
                             ir_version=10)


def exchange_models(shape: LayerShape, ranks: int, rank: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """EP over `ranks` ranks, rank `rank`: MoeDistributeDispatch alone (x, experts -> expand_x, assist_info) and
    dispatch -> MoeDistributeCombine(gather_tokens=1) with the expert outputs taken as their inputs, the
    exchanges of the sharded layer without its experts' work."""
    layout = dict(num_experts=shape.E, ep_world_size=ranks, ep_rank_id=rank)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["Bs", shape.H]),
              helper.make_tensor_value_info("experts", TensorProto.INT64, ["Bs", shape.k])]
    dispatch = helper.make_node("MoeDistributeDispatch", ["x", "experts"], ["expand_x", "expert_offset", "assist_info"],
                                domain="moe_onnx", **layout)
    combine = helper.make_node("MoeDistributeCombine", ["expand_x", "assist_info", "scales"], ["out"],
                               domain="moe_onnx", gather_tokens=1, **layout)
    scales = helper.make_tensor_value_info("scales", TensorProto.FLOAT, ["Bs", shape.k])
    return (_model([dispatch], inputs, [("expand_x", TensorProto.FLOAT), ("assist_info", TensorProto.INT64)]),
            _model([dispatch, combine], inputs + [scales], [("out", TensorProto.FLOAT)]))


def routing(model: onnx.ModelProto, shape: LayerShape, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The layer's routing weights and experts for `x`, in numpy: MoeGatingTopK's softmax -> top k (ties to
    the lower index) -> renormalized, which is the softmax of the k best logits."""
    router = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "router")
    logits = x @ router
    experts = np.argsort(-logits, axis=1, kind="stable")[:, :shape.k]
    best = np.take_along_axis(logits, experts, axis=1)
    weights = np.exp(best - best[:, :1])
    return (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32), experts.astype(np.int64)


def exchanged_rows(assist_info: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows sent to each EP rank, rows received from each) of a dispatch, from its assist_info
    (docs/distributed.md: header, tokens_per_rank, tp_blocks, recv_counts, send_counts, ...)."""
    ep, tp = int(assist_info[0]), int(assist_info[1])
    recv_at = 8 + ep * tp + tp
    return assist_info[recv_at + ep:recv_at + 2 * ep], assist_info[recv_at:recv_at + ep]
