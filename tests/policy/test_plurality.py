"""The sampled majority over any number of candidates: exact probabilities that agree with the enumerating decoder,
with the draws it serves, and with the rule engine's share; replayable from the decision id."""

from __future__ import annotations

import numpy as np
import pytest

from policy.decoder import MajorityDecoder, uniforms_batch
from policy.plurality import PluralityDecoder


def _cases(rng: np.random.Generator, n: int, count: int) -> list[np.ndarray]:
    cases = []
    for t in range(count):
        q = rng.dirichlet(np.ones(n) * rng.uniform(0.2, 3.0))
        if t % 3 == 0 and n > 1:
            q[rng.integers(n)] = 0.0  # a banned candidate
        if t % 5 == 0:
            q = np.round(q, 1) + (q.sum() == 0)  # ties in q, decided by the lower index
        cases.append(q / q.sum())
    return cases


@pytest.mark.parametrize(("samples", "min_votes", "epsilon"), [(10, 4, 0.05), (10, 1, 0.0), (7, 7, 0.2), (1, 1, 0.0)])
def test_five_candidates_give_exactly_the_enumerating_decoders_probabilities(samples: int, min_votes: int, epsilon: float) -> None:
    plurality = PluralityDecoder(samples, min_votes, epsilon, temperature=1.5)
    majority = MajorityDecoder(samples, min_votes, epsilon, temperature=1.5)
    rng = np.random.default_rng(samples * 100 + min_votes)
    for q in _cases(rng, 5, 120):
        fallback = int(rng.integers(5))
        np.testing.assert_allclose(plurality.served(q, fallback), majority.served_distribution(q, fallback), rtol=0, atol=1e-13)


@pytest.mark.parametrize("n", [1, 2, 12, 40])
def test_probabilities_sum_to_one_and_the_rule_engine_gets_the_undecided_share(n: int) -> None:
    decoder = PluralityDecoder(epsilon=0.0)
    for q in _cases(np.random.default_rng(n), n, 20):
        wins, low = decoder.decided(q)
        assert wins.sum() + low == pytest.approx(1.0, abs=1e-12) and (wins >= 0).all() and 0.0 <= low <= 1.0
        fallback = n - 1
        served = decoder.served(q, fallback)
        assert served[fallback] == pytest.approx(wins[fallback] + low, abs=1e-12)
        assert (served[q == 0] == 0).all() or q[fallback] == 0  # a banned candidate is served only as the rule's answer
    flat = PluralityDecoder(epsilon=0.0).decided(np.ones(40) / 40)[1]
    assert flat > 0.99  # 10 draws over 40 even candidates almost never give one 4 votes


def test_served_frequencies_match_the_exact_probabilities_for_twelve_candidates() -> None:
    """200,000 replayable draws (the uniforms of decision ids) against the exact distribution, by a chi-square bound."""
    decoder = PluralityDecoder()
    q = np.array([0.22, 0.18, 0.14, 0.1, 0.08, 0.08, 0.06, 0.05, 0.04, 0.03, 0.02, 0.0])
    q = q / q.sum()
    fallback = 11
    expected = decoder.served(q, fallback)
    n = 200_000
    u = uniforms_batch([f"plurality-{i}" for i in range(n)], decoder.samples + 2)
    counts = np.zeros(len(q))
    for start in range(0, n, 20_000):  # the batch procedure, one request's row at a time (``draw_with`` is one row of it)
        for draw in decoder.draw_batch(np.tile(q, (20_000, 1)), u[start:start + 20_000], [len(q)] * 20_000):
            counts[fallback if draw.index is None else draw.index] += 1
    seen = expected > 0
    chi2 = float((((counts - n * expected) ** 2)[seen] / (n * expected[seen])).sum())
    assert chi2 < 40.0, (chi2, counts / n, expected)  # 10 degrees of freedom: P(χ² > 40) ≈ 2e-5
    assert counts[~seen].sum() == 0


def test_a_draw_replays_from_its_decision_id_and_names_an_undecided_vote() -> None:
    decoder = PluralityDecoder(epsilon=0.0)
    q = np.ones(30) / 30
    first, again = decoder.draw(q, "d-1"), decoder.draw(q, "d-1")
    assert first.index == again.index and first.explored == again.explored and (first.counts == again.counts).all()
    assert first.index is None and first.counts.sum() == decoder.samples  # 10 votes over 30: no candidate reaches 4
    sure = decoder.draw(np.eye(1, 30, 7)[0], "d-2")
    assert sure.index == 7 and sure.counts[7] == 10


@pytest.mark.parametrize(("q", "message"), [([], "q"), ([0.0, 0.0], "q"), ([0.5, float("nan")], "q"), ([-0.1, 1.1], "q")])
def test_bad_distributions_are_refused(q: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PluralityDecoder().served(q, 0)


def test_a_fallback_outside_the_candidates_is_refused() -> None:
    with pytest.raises(ValueError, match="fallback"):
        PluralityDecoder().served([0.5, 0.5], 2)


def test_a_batch_of_rows_of_any_widths_padded_with_zeros_gives_each_rows_own_probabilities() -> None:
    """RecommendProduct's micro-batch decides many requests' layers at once, each with its own number of candidates: a
    row padded with zeros must get exactly what it gets alone, and the padding nothing."""
    decoder = PluralityDecoder(10, 4, 0.05, 1.2)
    rng = np.random.default_rng(11)
    widths = [1, 2, 5, 12, 3, 7, 64, 1, 9]
    rows = [q for n in widths for q in _cases(rng, n, 3)]
    fallback = np.array([int(rng.integers(len(q))) for q in rows])
    padded = np.zeros((len(rows), max(widths)))
    for i, q in enumerate(rows):
        padded[i, :len(q)] = q
    batch = decoder.served_batch(padded, fallback)
    for i, q in enumerate(rows):
        np.testing.assert_allclose(batch[i, :len(q)], decoder.served(q, int(fallback[i])), rtol=0, atol=1e-13)
        assert (batch[i, len(q):] == 0).all()
        assert batch[i].sum() == pytest.approx(1.0, abs=1e-12)


def test_a_batch_of_draws_padded_with_zeros_draws_each_row_as_alone() -> None:
    """Each row's draw (explored or voted, winner or rule, counts) is the one it gets alone with the same uniforms, the
    padding never drawn; uniforms a hair below 1 (whose lookup rounding can carry past the last step) included."""
    decoder = PluralityDecoder(10, 4, 0.3, 1.2)
    rng = np.random.default_rng(12)
    rows = [q for n in (1, 2, 5, 12, 3, 7, 9) for q in _cases(rng, n, 12)] + list(rng.dirichlet(np.ones(64) * 0.3, size=6))
    widths = [len(q) for q in rows]
    u = uniforms_batch([f"row-{i}" for i in range(len(rows))], decoder.samples + 2)
    u[::5, 1:] = 1.0 - 2.0 ** -53
    padded = np.zeros((len(rows), max(widths)))
    for i, q in enumerate(rows):
        padded[i, :len(q)] = q
    draws = decoder.draw_batch(padded, u, [len(q) for q in rows])
    for i, q in enumerate(rows):
        alone = decoder.draw_with(q, u[i])
        assert (draws[i].index, draws[i].explored) == (alone.index, alone.explored)
        np.testing.assert_array_equal(draws[i].counts, alone.counts)
        assert draws[i].index is None or draws[i].index < len(q)
    assert {d.explored for d in draws} == {True, False} and any(d.index is None for d in draws)


@pytest.mark.parametrize(("fallback", "shape"), [([0, 3], (2, 3)), ([0], (2, 3)), ([-1, 0], (2, 3))])
def test_a_batchs_fallbacks_must_be_one_candidate_per_row(fallback: list[int], shape: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="fallback"):
        PluralityDecoder().served_batch(np.full(shape, 1.0 / shape[1]), fallback)


def test_a_batch_row_without_probability_is_refused() -> None:
    with pytest.raises(ValueError, match="q"):
        PluralityDecoder().served_batch([[0.5, 0.5], [0.0, 0.0]], [0, 0])


@pytest.mark.parametrize("temperature", [0.002, 1e-6])
def test_a_tiny_exploration_temperature_explores_the_best_candidate_never_a_banned_one(temperature: float) -> None:
    """q^(1/T) in linear space underflows to 0/0 at a small T (NaN propensities, and an exploration draw past the mask);
    in log space it is the argmax. Both decoders share it."""
    q = np.full(64, 1.0 / 63)
    q[0] = 0.0  # banned
    q[5] *= 1.5
    q = q / q.sum()
    plurality = PluralityDecoder(epsilon=1.0, temperature=temperature)
    served = plurality.served(q, 3)
    assert np.isfinite(served).all() and served[5] == pytest.approx(1.0) and served[0] == 0.0
    assert all(plurality.draw(q, f"t-{i}").index == 5 for i in range(50))
    five = np.array([0.0, 0.2, 0.2, 0.3, 0.0])
    five = five / five.sum()
    majority = MajorityDecoder(epsilon=1.0, temperature=temperature).served_distribution(five, 1)
    assert np.isfinite(majority).all() and majority[3] == pytest.approx(1.0) and majority[[0, 4]].sum() == 0.0
