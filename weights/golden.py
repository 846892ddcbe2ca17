"""How far a graph's outputs are from their golden values: absolute up to magnitude 1, relative beyond.

A bundle's self-test (and the trainer's export check) runs its graphs on stored inputs and compares the outputs with
stored ones. float32 arithmetic rounds relative to a value's size, and two CPUs (or onnxruntime and torch) may order a
dot product's additions differently, so logits in the hundreds legitimately differ by about 1e-4 between them (1.2e-4
measured, onnxruntime against torch, on a policy the lifted-limits loop trained), where float32 resolves 1e-7 near 1.
An absolute bound would refuse a sound bundle whose policy has grown confident; a purely relative one would let an
output near 0 drift unchecked. So each entry is scaled by ``max(1, |expected|)``, the usual mixed bound:
for the guard's probabilities and logits below 1 in size the test is as absolute as before.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def golden_error(got: npt.NDArray[np.floating], expected: npt.NDArray[np.floating]) -> float:
    """``max |got − expected| / max(1, |expected|)`` over the entries (NaN if any entry is NaN: never within a bound)."""
    got64, expected64 = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if got64.size == 0:
        return 0.0
    return float(np.max(np.abs(got64 - expected64) / np.maximum(1.0, np.abs(expected64))))
