"""How far one model's outputs are from another's: the one comparison behind ``moe-onnx optimize --verify``
(:mod:`moe_onnx.verify`), the error ``moe-onnx quantize`` reports (:mod:`moe_onnx.pipeline.quantize`) and
``moe-onnx run --check`` (:mod:`moe_onnx.distributed.run`).

The rule, element by element, for the difference of ``got`` from ``expected``:

* both finite: ``|got - expected|``;
* both NaN (whatever the sign or payload), or the same infinity on both sides: 0, the model computes what
  the other does;
* otherwise (a NaN or an infinity on one side only, or opposite infinities): ``inf``.

So a NaN or an infinity is an infinite error unless the other model gives the same non-finite value at the
same place, and no NaN ever reaches a maximum (Python's ``max(0.0, nan)`` is ``0.0``: an output of NaN must
not read as no error).

From the differences: ``max_abs``, their largest; ``max_rel``, the largest difference over
``max(|expected|, 1e-12)`` (an infinite difference is infinitely relative); ``reference_peak``, the largest
finite ``|expected|``; and ``within_tolerance``, every element's difference at most
``atol + rtol * |expected|`` (numpy.isclose's test, with the non-finite cases above: a difference of 0
always passes, an infinite one never does).

Arrays of different shapes are not compared: :class:`OutputMismatch` names the output and both shapes.
Numbers of any dtype (bool, integers, float16/32/64, ml_dtypes' bfloat16 and float8) are compared as
float64; other arrays (strings) element by element for equality, a difference of 0 or inf.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["Difference", "OutputMismatch", "compare_arrays", "compare_outputs", "worst"]

#: the smallest |expected| a difference is divided by for ``max_rel``
RELATIVE_FLOOR = 1e-12


class OutputMismatch(ValueError):
    """Outputs that cannot be compared: another shape, or another number of outputs."""


@dataclasses.dataclass(frozen=True)
class Difference:
    """How far ``got`` is from ``expected`` under the module's rule (an empty array differs by 0)."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    reference_peak: float = 0.0
    within_tolerance: bool = True

    @property
    def relative_to_peak(self) -> float:
        """``max_abs / reference_peak``; against a reference of zeros: 0 for no difference, 1 for a finite one,
        inf for an infinite one."""
        if self.reference_peak:
            return self.max_abs / self.reference_peak
        return self.max_abs if self.max_abs in (0.0, math.inf) else 1.0


def worst(differences: Iterable[Difference]) -> Difference:
    """The largest of each measure over ``differences`` (several outputs, or one output at several sizes),
    within tolerance when every one is; no differences: :class:`Difference`'s zeros."""
    differences = list(differences)
    if not differences:
        return Difference()
    return Difference(max(d.max_abs for d in differences), max(d.max_rel for d in differences),
                      max(d.reference_peak for d in differences), all(d.within_tolerance for d in differences))


def compare_arrays(expected, got, *, name: str = "output", rtol: float = 0.0, atol: float = 0.0) -> Difference:
    """``got`` against ``expected`` (arrays, or what numpy makes arrays of); ``rtol`` and ``atol`` decide
    ``within_tolerance``. Raises :class:`OutputMismatch` naming output ``name`` when the shapes differ."""
    expected, got = np.asarray(expected), np.asarray(got)
    if expected.shape != got.shape:
        raise OutputMismatch(f"output '{name}' has shape {list(got.shape)}; expected {list(expected.shape)}")
    if not expected.size:
        return Difference()
    difference, magnitude = _differences(expected, got)
    finite_magnitude = np.where(np.isfinite(magnitude), magnitude, 0.0)
    relative = difference / np.where(np.isfinite(magnitude), np.maximum(magnitude, RELATIVE_FLOOR), 1.0)
    return Difference(float(difference.max()), float(relative.max()), float(finite_magnitude.max()),
                      bool((difference <= atol + rtol * finite_magnitude).all()))


def compare_outputs(names: Sequence[str], expected: Sequence, got: Sequence, *, rtol: float = 0.0,
                    atol: float = 0.0) -> dict[str, Difference]:
    """Each output of ``got`` against the one of ``expected`` at its place (:func:`compare_arrays`), by the
    name of ``expected``'s output there. Raises :class:`OutputMismatch` when ``got`` has another number of
    outputs or an output another shape."""
    if len(expected) != len(names):
        raise ValueError(f"compare_outputs: {len(expected)} expected outputs, {len(names)} names")
    if len(got) != len(names):
        raise OutputMismatch(f"{len(got)} outputs; expected {len(names)} ({', '.join(names)})")
    return {name: compare_arrays(e, g, name=name, rtol=rtol, atol=atol) for name, e, g in zip(names, expected, got)}


def _differences(expected: np.ndarray, got: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The elements' differences under the module's rule, and ``|expected|`` (float64 arrays; for arrays that
    are not numbers: 0 or inf by equality, and ones)."""
    if not (_is_number(expected.dtype) and _is_number(got.dtype)):
        return np.where(expected == got, 0.0, math.inf), np.ones(expected.shape)
    e, g = expected.astype(np.float64), got.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf and NaN: replaced below
        difference = np.where((e == g) | (np.isnan(e) & np.isnan(g)), 0.0, np.abs(g - e))
    return np.where(np.isnan(difference), math.inf, difference), np.abs(e)


def _is_number(dtype: np.dtype) -> bool:
    """bool, an integer, a float, or one of ml_dtypes' floats (numpy kind 'V', which converts to float64)."""
    if dtype.kind in "biuf":
        return True
    if dtype.kind != "V":
        return False
    try:
        np.zeros(1, dtype).astype(np.float64)
    except (TypeError, ValueError):
        return False
    return True
