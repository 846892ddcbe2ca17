"""A bundle's bytes do not depend on how many threads numpy's BLAS runs: its golden outputs are computed on one.

On an AMD EPYC without AVX-512 (2026-12-06) OpenBLAS summed a product differently on one thread and on two, so
``weights init --seed 3`` in a process with ``OMP_NUM_THREADS=1`` (a test worker's subprocess) and in one with two
threads wrote different golden outputs. On CPUs where OpenBLAS's sums do not depend on the thread count these tests
pass either way; there they check nothing a CPU could break.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from policy.features import FeatureSpec
from weights import product_guard as pg
from weights.bundle import read_bundle
from weights.initial import make_bundle
from weights.product_heads import feature_widths

CREATED = "2026-12-06T00:00:00Z"


def on_threads(threads: int, build: Callable[[], bytes]) -> bytes:
    with threadpool_limits(threads, user_api="blas"):
        return build()


def guarded_bundle() -> bytes:
    bundle = read_bundle(make_bundle(4, "threads", CREATED, product_heads=True))
    widths = feature_widths(FeatureSpec.parse(bundle.manifest["feature_spec"]))
    return pg.with_guard(bundle, pg.init_params(np.random.default_rng(1), widths))


@pytest.mark.parametrize("build", [lambda: make_bundle(3, "boot-3", CREATED), lambda: make_bundle(4, "heads", CREATED, product_heads=True),
                                   guarded_bundle], ids=["initial", "product-heads", "product-guard"])
def test_the_same_bytes_on_one_blas_thread_and_on_two(build: Callable[[], bytes]) -> None:
    assert on_threads(1, build) == on_threads(2, build)
