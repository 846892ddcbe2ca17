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

from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import numpy.typing as npt


def one_blas_thread() -> AbstractContextManager[Any]:
    """Compute golden outputs inside this: numpy's BLAS on one thread, its previous count restored after. OpenBLAS may
    sum a product differently by its thread count (an AMD EPYC without AVX-512, 2026-12-06: ``weights init --seed 3``
    wrote other golden outputs on one thread than on two), and a bundle's bytes must not depend on it. One thread is
    what the embedded default's build pins (``OPENBLAS_NUM_THREADS=1``), so its bytes are unchanged. threadpoolctl
    (scikit-learn's) finds the BLAS numpy loaded and sets its limit; only the bundle builders need it, not the server."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(1, user_api="blas")


def golden_error(got: npt.NDArray[np.floating], expected: npt.NDArray[np.floating]) -> float:
    """``max |got − expected| / max(1, |expected|)`` over the entries (NaN if any entry is NaN: never within a bound)."""
    got64, expected64 = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if got64.size == 0:
        return 0.0
    return float(np.max(np.abs(got64 - expected64) / np.maximum(1.0, np.abs(expected64))))
