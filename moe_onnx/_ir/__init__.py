"""What every pass over a model shares, knowing nothing of our ops: walking a graph and its subgraphs
(``graph``), reading nodes (``nodes``), building and replacing nodes (``builder``), streaming weights
one expert at a time (``weights``), reading and writing model files of any size (``model_files``), and the
one protocol every pass speaks (``passes``: onnx_ir's in-place pass and its result).

Importing this package imports none of them: ``moe_onnx._ir.graph`` needs only onnx, ``builder``
alone imports onnxscript.
"""
