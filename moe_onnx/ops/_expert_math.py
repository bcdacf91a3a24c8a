"""The experts' activations (moe.py's meaning) as standard ONNX ops, for any op builder.

The pieces of ``moe.expert_layer``, which the grouped chain (``rewrite/grouped.py``, in the model's
float type) and the MOE and QMOE function bodies (in float32) share: ``op`` is anything with one
method per ONNX op (``op.Mul(a, b)`` -> a value), ``const(v)`` makes a scalar constant of the
computation's float type. NaN propagates as through the numpy references (``Where`` rather than
``Relu``/``Min``/``Clip``, whose NaN handling onnxruntime does not promise).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

Const = Callable[[float], Any]


def swish(op, z, alpha: float, const: Const):
    """z * sigmoid(alpha * z)."""
    return op.Mul(z, op.Sigmoid(z if alpha == 1.0 else op.Mul(z, const(alpha))))


def clamped_swiglu(op, gate, up, alpha: float, beta: float, const: Const):
    """GPT-OSS: (clamp(up, -beta, beta) + 1) * swish(min(gate, beta), alpha); beta may be inf."""
    if math.isfinite(beta):
        bound, low = const(beta), const(-beta)
        gate = op.Where(op.Greater(gate, bound), bound, gate)
        up = op.Where(op.Greater(up, bound), bound, op.Where(op.Less(up, low), low, up))
    return op.Mul(op.Add(up, const(1.0)), swish(op, gate, alpha, const))


def _relu(op, z, const: Const):
    zero = const(0.0)
    return op.Where(op.LessOrEqual(z, zero), zero, z)


def _gelu(op, z, const: Const):
    cdf = op.Add(op.Erf(op.Mul(z, const(1.0 / math.sqrt(2.0)))), const(1.0))
    return op.Mul(op.Mul(z, const(0.5)), cdf)


def _gelu_tanh(op, z, const: Const):
    cubic = op.Add(z, op.Mul(op.Mul(op.Mul(z, z), z), const(0.044715)))
    cdf = op.Add(op.Tanh(op.Mul(cubic, const(math.sqrt(2.0 / math.pi)))), const(1.0))
    return op.Mul(op.Mul(z, const(0.5)), cdf)


def _relu2(op, z, const: Const):
    r = _relu(op, z, const)
    return op.Mul(r, r)


#: GEMM2_ACT's activations (moe.ACTIVATIONS), by the ``activation`` attribute: ``f(op, z, const)``.
ACTIVATIONS: dict[str, Callable[..., Any]] = {
    "relu": _relu,
    "relu2": _relu2,
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": lambda op, z, const: swish(op, z, 1.0, const),
    "identity": lambda op, z, const: z,
}
