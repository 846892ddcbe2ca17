"""The torch decoder serves what the server's decoder serves, and its gradient is the true one."""

from __future__ import annotations

import numpy as np
import torch

from policy.decoder import MajorityDecoder
from trainer.served import TorchDecoder, distinct_rows


def _rows(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    logits = rng.standard_normal((n, 5)) * 2
    log_w = np.log(rng.choice([1.0, 0.8, 0.5, 0.3], size=(n, 5)))
    allowed = rng.random((n, 5)) > 0.25
    allowed[:, 4] = False  # exit banned, as in the default guardrails
    allowed[: n // 10] = False  # some rows: everything vetoed, the rules answer
    logits[n // 10 : n // 5, :2] = 1.0  # exact ties in q: the tie rule decides
    log_w[n // 10 : n // 5, :2] = 0.0
    fallback = rng.integers(0, 4, size=n)
    return logits, log_w, allowed, fallback


def test_served_matches_the_numpy_decoder_with_ties_vetoes_and_fallbacks() -> None:
    rng = np.random.default_rng(3)
    logits, log_w, allowed, fallback = _rows(rng, 400)
    for decoder in (MajorityDecoder(), MajorityDecoder(samples=7, min_votes=3, epsilon=0.0), MajorityDecoder(epsilon=0.3, temperature=2.0)):
        td = TorchDecoder(decoder)
        q = td.masked_q(torch.tensor(logits), torch.tensor(log_w), torch.tensor(allowed))
        ok = q.sum(dim=1) > 0
        got = td.served(q, torch.tensor(fallback), ok).numpy()
        expected = np.zeros((len(q), 5))
        okn = ok.numpy()
        expected[okn] = decoder.served_batch(q.numpy()[okn], fallback[okn])
        expected[~okn, fallback[~okn]] = 1.0
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
        np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-12)


def test_gradient_matches_finite_differences() -> None:
    rng = np.random.default_rng(5)
    logits, log_w, allowed, fallback = _rows(rng, 40)
    logits = logits[8:]  # rows the decoder decides
    td = TorchDecoder(MajorityDecoder())
    lw, al, fb = torch.tensor(log_w[8:]), torch.tensor(allowed[8:]), torch.tensor(fallback[8:])
    keep = al.any(dim=1)
    z = torch.tensor(logits, requires_grad=True)
    weights = torch.tensor(rng.standard_normal((len(z), 5)))

    def objective(x: torch.Tensor) -> torch.Tensor:
        return (td.served_of(x, lw, al, fb, keep) * weights).sum()

    objective(z).backward()
    assert z.grad is not None
    eps = 1e-6
    for i, a in [(0, 0), (3, 1), (7, 2), (20, 3)]:
        bump = torch.zeros_like(z)
        bump[i, a] = eps
        with torch.no_grad():
            numeric = (objective(z + bump) - objective(z - bump)) / (2 * eps)
        assert abs(float(numeric) - float(z.grad[i, a])) < 1e-6


def test_distinct_rows_groups_rows_as_numpys_unique_does() -> None:
    rng = np.random.default_rng(3)
    q = rng.random((2000, 5))
    q[q < 0.3] = 0.0
    for rows, base in ((q > 0, 2), (np.argsort(-q, axis=1, kind="stable"), 5), (np.zeros((0, 5), dtype=np.int64), 5)):
        keys, inverse = distinct_rows(rows, base)
        reference, _ = np.unique(rows, axis=0, return_inverse=True)
        assert sorted(map(tuple, keys.tolist())) == sorted(map(tuple, reference.tolist()))  # the same distinct rows, once each
        assert inverse.shape == (len(rows),) and (keys[inverse] == rows).all()  # and each row mapped to its own
