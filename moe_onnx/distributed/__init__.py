"""Running one model over several processes (docs/distributed.md).

The MPI groups and collectives are in :mod:`moe_onnx.distributed.comm`, the Python backend's per-rank
kernels in :mod:`moe_onnx.distributed.kernels`, splitting a model over ranks in
:mod:`moe_onnx.distributed.shard` (its manifest in :mod:`moe_onnx.distributed.manifest`), running the
ranks in :mod:`moe_onnx.distributed.run`. What a rank layout means for a node is the op layer's
(:mod:`moe_onnx.ops.layout`). Importing this package loads neither MPI nor mpi4py.
"""
