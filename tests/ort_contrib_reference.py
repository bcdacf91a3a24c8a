"""numpy reference of onnxruntime's contrib ops com.microsoft::MoE and QMoE, written from their schema
docs (onnxruntime 1.31.1, docs/ContribOperators.md) and checked against the CPU kernel where it runs.

For the configurations onnxruntime's CPU kernel refuses (SwiGLU not interleaved, fc3, the sparse
mixer, MXFP4 weights), this is what the import (moe_onnx/rewrite/ort_import.py) is compared with;
tests/test_ort_import.py checks it equals the CPU kernel on the configurations that kernel takes.
Independent of moe_onnx: the expert math is written out here, not taken from moe_onnx/ops.

- routing: ``p = softmax(router_probs)`` over the experts (float32); the k largest (ties: lower index
  first); their weights ``p[idx]`` (or, QMoE with ``router_weights``, ``router_weights[idx]``),
  divided by their sum when ``normalize_routing_weights``. ``use_sparse_mixer`` (k = 2): PhiMoE's
  sparsemixer with jitter_eps 0.01 (see :func:`sparse_mixer`).
- experts: ``fc1`` [E, N, H] (SwiGLU fused: N = 2I, gate and linear interleaved (swiglu_fusion 1) or
  concatenated (2); not fused: fc1 the gate, fc3 the linear), ``fc2`` [E, H, I], biases [E, N].
  SwiGLU: ``G = min(g, limit); L = clamp(l, -limit, limit); G * sigmoid(alpha * G) * (L + beta)``.
  The pointwise activations: relu, gelu (tanh approximation, as the CPU kernel), silu, identity;
  with fc3 given, the activation of fc1 is multiplied by fc3's output (gated).
- QMoE: each weight dequantized first (:func:`dequantize`), then as MoE.
"""

from __future__ import annotations

import math

import numpy as np

JITTER_EPS = 0.01  # onnxruntime's sparse mixer (PhiMoE's router_jitter_noise)

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float32)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The k largest per row, largest first, ties to the lower index."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def sparse_mixer(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PhiMoE's two picks: each the maximum of the logits left, weighted by the softmax over the
    logits within 2 * jitter_eps (relative) of that maximum."""
    logits = logits.astype(np.float32)
    rows = np.arange(logits.shape[0])
    weights, picks, left = [], [], logits.copy()
    for _ in range(2):
        pick = np.argmax(left, axis=-1)
        top = left[rows, pick][:, None]
        far = (top - logits) / np.maximum(np.abs(logits), top) > 2 * JITTER_EPS
        weights.append(softmax(np.where(far, -np.inf, left))[rows, pick])
        picks.append(pick)
        left = left.copy()
        left[rows, pick] = -np.inf
    return np.stack(weights, -1), np.stack(picks, -1)


def route(router_probs: np.ndarray, k: int, normalize: int, use_sparse_mixer: int = 0,
          router_weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(weights [T, k] float32, indices [T, k])."""
    logits = router_probs.reshape(-1, router_probs.shape[-1]).astype(np.float32)
    if use_sparse_mixer:
        return sparse_mixer(logits)
    idx = top_k(softmax(logits), k)
    source = softmax(logits) if router_weights is None else router_weights.reshape(logits.shape).astype(np.float32)
    w = np.take_along_axis(source, idx, axis=-1)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return w, idx


def _sigmoid(z):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-z))


POINTWISE = {
    "relu": lambda z: np.maximum(z, 0),
    "gelu": lambda z: 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3))),
    "silu": lambda z: z * _sigmoid(z),
    "identity": lambda z: z,
}


def _split_fused(h: np.ndarray, fusion: int) -> tuple[np.ndarray, np.ndarray]:
    """(g, l) of fc1's fused output [rows, 2I]."""
    if fusion == 1:
        return h[:, 0::2], h[:, 1::2]
    half = h.shape[1] // 2
    return h[:, :half], h[:, half:]


def _linear(x, w, b):
    y = x @ w.astype(np.float32).T
    return y if b is None else y + b.astype(np.float32)


def moe(x, router_probs, fc1, fc1_bias, fc2, fc2_bias, fc3=None, fc3_bias=None, *, k, activation_type="relu",
        swiglu_fusion=0, activation_alpha=1.0, activation_beta=0.0, swiglu_limit=None, normalize_routing_weights=0,
        use_sparse_mixer=0, router_weights=None):
    """com.microsoft::MoE; float32 weights and biases (any float type in), output in x's type."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    weights, idx = route(router_probs, k, normalize_routing_weights, use_sparse_mixer, router_weights)
    limit = math.inf if swiglu_limit is None else swiglu_limit
    out = np.zeros_like(rows)
    for t in range(rows.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            h = _linear(rows[t:t + 1], fc1[e], None if fc1_bias is None else fc1_bias[e])
            if activation_type == "swiglu":
                if fc3 is not None:
                    g, lin = h, _linear(rows[t:t + 1], fc3[e], None if fc3_bias is None else fc3_bias[e])
                else:
                    g, lin = _split_fused(h, swiglu_fusion)
                g = np.minimum(g, limit)
                lin = np.clip(lin, -limit, limit)
                a = g * _sigmoid(activation_alpha * g) * (lin + activation_beta)
            else:
                a = POINTWISE[activation_type](h)
                if fc3 is not None:
                    a = a * _linear(rows[t:t + 1], fc3[e], None if fc3_bias is None else fc3_bias[e])
            out[t] += weights[t, j] * _linear(a, fc2[e], None if fc2_bias is None else fc2_bias[e])[0]
    return out.astype(x.dtype).reshape(x.shape)


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first ``count`` codes along the last axis of a packed uint8 array (8 // bits per byte, the first in
    the lowest bits: bits 4, low nibble first)."""
    lanes = [(packed >> shift) & ((1 << bits) - 1) for shift in range(0, 8, bits)]
    return np.stack(lanes, axis=-1).reshape(*packed.shape[:-1], -1)[..., :count].astype(np.int32)


def dequantize(weight: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, *, bits: int,
               block_size: int, quant_type: str = "int") -> np.ndarray:
    """QMoE's [E, N, K * bits / 8] weight as float32 [E, N, K]."""
    experts, n = weight.shape[:2]
    k = weight.shape[2] * 8 // bits
    q = _unpack(weight, bits, k)
    if quant_type == "fp4":
        exponents = scales.view(np.uint8).astype(np.int32) - 127
        return E2M1[q] * np.repeat(np.ldexp(np.float32(1), exponents), 32, axis=-1).astype(np.float32)
    blocks = 1 if not block_size else k // block_size
    s = scales.astype(np.float32).reshape(experts, n, blocks)
    if zero_points is None:
        zp = np.full((experts, n, blocks), 2 ** (bits - 1), np.int32)
    elif block_size:
        zp = _unpack(zero_points, bits, blocks)
    else:
        zp = _unpack(zero_points, bits, n).reshape(experts, n, 1)
    width = k // blocks
    return ((q - np.repeat(zp, width, axis=-1)) * np.repeat(s, width, axis=-1)).astype(np.float32)


def qmoe(x, router_probs, fc1, fc1_scales, fc1_bias, fc2, fc2_scales, fc2_bias, fc3=None, fc3_scales=None,
         fc3_bias=None, fc1_zero_points=None, fc2_zero_points=None, fc3_zero_points=None, router_weights=None, *,
         expert_weight_bits=4, block_size=0, quant_type="int", fc1_bits=None, fc2_bits=None, fc3_bits=None,
         **moe_attributes):
    """com.microsoft::QMoE: each projection dequantized, then :func:`moe`."""
    def weights(w, s, zp, bits):
        if w is None:
            return None
        return dequantize(w, s, zp, bits=bits or expert_weight_bits, block_size=block_size, quant_type=quant_type)
    return moe(x, router_probs, weights(fc1, fc1_scales, fc1_zero_points, fc1_bits), fc1_bias,
               weights(fc2, fc2_scales, fc2_zero_points, fc2_bits), fc2_bias,
               weights(fc3, fc3_scales, fc3_zero_points, fc3_bits), fc3_bias, router_weights=router_weights,
               **moe_attributes)
