"""A bundle fuzzer: truncations, bit flips and member swaps of a valid bundle never crash, hang or load invalid.

Whatever the mutation, the server's path (``read_bundle`` → ``ModelSet.load``) either raises
``BundleError`` or returns a model set that passed the golden self-test; any other exception,
or a load slower than the deadline, fails the test.
"""

from __future__ import annotations

import io
import zipfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.weights import hostile
from weights.bundle import BundleError, read_bundle
from weights.model_set import LoadOptions, ModelSet

VALID = hostile.rebuilt()
NAMES = sorted(zipfile.ZipFile(io.BytesIO(VALID)).namelist())
OPTIONS = LoadOptions(device="cpu", warmup_batch=1)
FUZZ = settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def load_or_refuse(data: bytes) -> None:
    try:
        model = ModelSet.load(read_bundle(data), OPTIONS)
    except BundleError as exc:
        assert exc.reason and str(exc)
        return
    assert model.ready  # it loaded: then it passed every check, self-test included


@FUZZ
@given(st.integers(min_value=0, max_value=len(VALID) - 1))
def test_truncations(cut: int) -> None:
    load_or_refuse(VALID[:cut])


@FUZZ
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=len(VALID) - 1), st.integers(min_value=0, max_value=7)),
                min_size=1, max_size=8))
def test_bit_flips(flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for position, bit in flips:
        data[position] ^= 1 << bit
    load_or_refuse(bytes(data))


@FUZZ
@given(st.permutations(NAMES))
def test_member_swaps(order: list[str]) -> None:
    """Each member's content moved under another member's name."""
    with zipfile.ZipFile(io.BytesIO(VALID)) as zf:
        contents = [zf.read(name) for name in NAMES]
    load_or_refuse(hostile.members(list(zip(order, contents, strict=True))))
