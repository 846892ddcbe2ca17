"""The sampled-majority decoder against a brute-force reference and against its own draws."""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest

from policy.decoder import MajorityDecoder, compositions, uniforms


@functools.cache
def _all_count_vectors(total: int, parts: int) -> tuple[tuple[int, ...], ...]:
    """Every vector of ``parts`` non-negative integers summing to ``total``, by plain enumeration."""
    return tuple(c for c in itertools.product(range(total + 1), repeat=parts) if sum(c) == total)


def _multinomial(counts: tuple[int, ...], q: list[float]) -> float:
    coef = math.factorial(sum(counts))
    for c in counts:
        coef //= math.factorial(c)
    p = float(coef)
    for c, qi in zip(counts, q, strict=True):
        p *= qi**c  # 0.0 ** 0 == 1.0
    return p


def _reference_served(q: list[float], samples: int, min_votes: int, epsilon: float, temperature: float,
                      fallback: int) -> list[float]:
    """The documented procedure, written out: most votes; ties → larger q; exact q tie → lower index;
    fewer than ``min_votes`` votes → ``fallback``; with probability ε serve q^(1/T) normalised."""
    n = len(q)
    decided = [0.0] * n
    for counts in _all_count_vectors(samples, n):
        p = _multinomial(counts, q)
        if p == 0.0:
            continue
        win = max(range(n), key=lambda i: (counts[i], q[i], -i))
        decided[win if counts[win] >= min_votes else fallback] += p
    powered = [qi ** (1.0 / temperature) if qi > 0 else 0.0 for qi in q]
    z = sum(powered)
    return [(1 - epsilon) * d + epsilon * t / z for d, t in zip(decided, powered, strict=True)]


# --- compositions and uniforms -----------------------------------------------------------------


def test_compositions_of_ten_into_five_parts_are_all_1001_count_vectors() -> None:
    rows = compositions(10, 5)
    assert rows.shape == (1001, 5) == (math.comb(14, 4), 5)
    assert (rows >= 0).all()
    assert (rows.sum(axis=1) == 10).all()
    as_tuples = {tuple(int(x) for x in r) for r in rows}
    assert len(as_tuples) == 1001
    assert as_tuples == set(_all_count_vectors(10, 5))


@pytest.mark.parametrize("q", [[0.4, 0.3, 0.2, 0.1, 0.0], [0.2] * 5, [0.9, 0.05, 0.03, 0.01, 0.01]])
def test_multinomial_probabilities_over_the_compositions_sum_to_one(q: list[float]) -> None:
    total = sum(_multinomial(tuple(int(x) for x in row), q) for row in compositions(10, 5))
    assert total == pytest.approx(1.0, abs=1e-12)


def test_compositions_edge_cases() -> None:
    assert compositions(0, 3).tolist() == [[0, 0, 0]]
    assert compositions(3, 1).tolist() == [[3]]
    assert sorted(compositions(2, 2).tolist()) == [[0, 2], [1, 1], [2, 0]]


def test_uniforms_replay_and_prefix_property() -> None:
    a = uniforms("decision-1", 20)
    assert np.array_equal(a, uniforms("decision-1", 20))
    assert np.array_equal(uniforms("decision-1", 5), a[:5])
    assert not np.array_equal(a, uniforms("decision-2", 20))
    assert uniforms("x", 0).shape == (0,)


def test_uniforms_lie_in_the_unit_interval_and_look_uniform() -> None:
    n = 100_000
    u = uniforms("a long stream", n)
    assert u.shape == (n,)
    assert u.dtype == np.float64
    assert (u >= 0.0).all() and (u < 1.0).all()
    # mean 1/2 and variance 1/12, each within 5 standard errors
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    # every tenth of the interval gets about a tenth of the draws
    hist = np.bincount((u * 10).astype(int), minlength=10)
    assert np.abs(hist - n / 10).max() < 5 * math.sqrt(n * 0.1 * 0.9)


# --- tie rule ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("counts", "q", "expected"),
    [
        ([6, 1, 1, 1, 1], [0.1, 0.3, 0.3, 0.2, 0.1], 0),  # clear majority wins even with the smallest q
        ([3, 3, 2, 2, 0], [0.2, 0.3, 0.2, 0.2, 0.1], 1),  # vote tie → larger q
        ([3, 3, 2, 2, 0], [0.25, 0.25, 0.25, 0.25, 0.0], 0),  # vote tie and exact q tie → lower index
        ([2, 4, 4, 0, 0], [0.1, 0.2, 0.2, 0.5, 0.0], 1),  # tie among 1 and 2 only; 3 has the larger q but no votes
        ([0, 3, 0, 3, 4], [0.2, 0.3, 0.1, 0.3, 0.1], 4),
        ([0, 0, 5, 0, 5], [0.1, 0.1, 0.3, 0.1, 0.4], 4),
    ],
)
def test_winner_tie_rule(counts: list[int], q: list[float], expected: int) -> None:
    decoder = MajorityDecoder()
    assert decoder.winner(np.array(counts), np.array(q)) == expected


# --- constructor -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"samples": 0}, "samples"),
        ({"samples": 10, "min_votes": 0}, "min_votes"),
        ({"samples": 10, "min_votes": 11}, "min_votes"),
        ({"epsilon": -0.01}, "exploration_epsilon"),
        ({"epsilon": 1.5}, "exploration_epsilon"),
        ({"epsilon": float("nan")}, "exploration_epsilon"),
        ({"temperature": 0.0}, "exploration_temperature"),
        ({"temperature": -1.0}, "exploration_temperature"),
        ({"temperature": float("inf")}, "exploration_temperature"),
        ({"temperature": float("nan")}, "exploration_temperature"),
    ],
)
def test_constructor_rejects_bad_settings_naming_the_parameter(kwargs: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}:"):
        MajorityDecoder(**kwargs)  # type: ignore[arg-type]


# --- exact served distribution -----------------------------------------------------------------

Q_CASES = [
    [0.4, 0.3, 0.2, 0.1, 0.0],
    [0.3, 0.3, 0.2, 0.2, 0.0],  # ties in q
    [0.25, 0.25, 0.25, 0.25, 0.0],  # all supported actions tied
    [0.2, 0.2, 0.2, 0.2, 0.2],
    [0.5, 0.0, 0.5, 0.0, 0.0],  # zeros inside the vector
    [0.0, 0.0, 1.0, 0.0, 0.0],  # a certain action
    [0.05, 0.6, 0.05, 0.15, 0.15],
    [0.1, 0.15, 0.35, 0.0, 0.4],
]


@pytest.mark.parametrize("q", Q_CASES)
@pytest.mark.parametrize("min_votes", [1, 4, 10])
@pytest.mark.parametrize(("epsilon", "temperature"), [(0.0, 1.2), (0.05, 1.2), (0.3, 0.7)])
def test_served_distribution_matches_brute_force(q: list[float], min_votes: int, epsilon: float,
                                                 temperature: float) -> None:
    decoder = MajorityDecoder(samples=10, min_votes=min_votes, epsilon=epsilon, temperature=temperature)
    for fallback in {next(i for i, x in enumerate(q) if x > 0), 4}:
        got = decoder.served_distribution(np.array(q), fallback)
        expected = _reference_served(q, 10, min_votes, epsilon, temperature, fallback)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
        assert got.sum() == pytest.approx(1.0, abs=1e-12)
        if q[fallback] > 0:
            assert all(got[i] == 0.0 for i, x in enumerate(q) if x == 0)


def test_served_distribution_with_few_samples_matches_brute_force() -> None:
    q = [0.35, 0.35, 0.1, 0.2, 0.0]
    for samples, min_votes in [(1, 1), (3, 2), (5, 3)]:
        decoder = MajorityDecoder(samples=samples, min_votes=min_votes, epsilon=0.1, temperature=2.0)
        got = decoder.served_distribution(np.array(q), 3)
        np.testing.assert_allclose(got, _reference_served(q, samples, min_votes, 0.1, 2.0, 3), rtol=0, atol=1e-12)


def test_served_distribution_is_stable_across_cached_tables() -> None:
    """The winner table is cached by support and order; a second q with the same order reuses it."""
    decoder = MajorityDecoder(samples=10, min_votes=4, epsilon=0.0)
    first = [0.4, 0.3, 0.2, 0.1, 0.0]
    second = [0.7, 0.1, 0.1 - 1e-9, 0.1 - 2e-9, 0.0]  # same support, same order, different values
    second = [x / sum(second) for x in second]
    decoder.served_distribution(np.array(first), 0)
    got = decoder.served_distribution(np.array(second), 0)
    np.testing.assert_allclose(got, _reference_served(second, 10, 4, 0.0, 1.2, 0), rtol=0, atol=1e-12)


def test_served_distribution_with_more_than_eight_actions() -> None:
    """``n_actions`` is a constructor parameter; the table cache must tell apart supports beyond index 7.

    Two q vectors with the same order (ties → lower index) whose supports differ only at
    index 8 must not share a cached winner table.
    """
    decoder = MajorityDecoder(samples=2, min_votes=1, epsilon=0.0, n_actions=10)
    wide = [0.1] * 10
    narrow = [0.125] * 8 + [0.0, 0.0]
    decoder.served_distribution(np.array(wide), 0)
    got = decoder.served_distribution(np.array(narrow), 0)
    np.testing.assert_allclose(got, _reference_served(narrow, 2, 1, 0.0, 1.2, 0), rtol=0, atol=1e-12)


def test_a_batch_mixing_supports_orders_and_fallbacks_matches_brute_force_row_by_row() -> None:
    """One call over rows of several supports, several orders within a support (its tied count vectors are placed by
    each row's own order) and rows alike in order (one product): every row as the written-out procedure says."""
    rows = [q for q in Q_CASES for _ in (0, 1)] + [[0.1, 0.4, 0.3, 0.2, 0.0], [0.2, 0.3, 0.4, 0.1, 0.0]]
    fallbacks = [i % 5 for i in range(len(rows))]
    decoder = MajorityDecoder(samples=10, min_votes=4, epsilon=0.05, temperature=1.2)
    got = decoder.served_batch(np.array(rows), np.array(fallbacks))
    for q, fallback, row in zip(rows, fallbacks, got, strict=True):
        np.testing.assert_allclose(row, _reference_served(q, 10, 4, 0.05, 1.2, fallback), rtol=0, atol=1e-12)
    alike = [[0.4, 0.3, 0.2, 0.1, 0.0], [0.5, 0.25, 0.15, 0.1, 0.0], [0.7, 0.2, 0.06, 0.04, 0.0]]  # one order
    got = decoder.served_batch(np.array(alike), np.array([3, 3, 3]))
    for q, row in zip(alike, got, strict=True):
        np.testing.assert_allclose(row, _reference_served(q, 10, 4, 0.05, 1.2, 3), rtol=0, atol=1e-12)


def test_a_batch_draws_what_each_row_draws_alone() -> None:
    """Votes are counted for the whole batch at once; each row's draw is the one it gets alone (same uniforms), votes
    landing exactly on a step of the CDF, or past its last step by rounding, included."""
    decoder = MajorityDecoder(samples=10, min_votes=4, epsilon=0.2, temperature=1.2)
    rng = np.random.default_rng(5)
    q = np.array(Q_CASES * 4, dtype=np.float64)
    u = rng.random((len(q), 12))
    u[::5, 2:] = 1.0 - 1e-17  # at the top of the CDF
    u[1::5, 2:7] = np.cumsum(q[1::5], axis=1)[:, :5] / np.cumsum(q[1::5], axis=1)[:, -1:]  # on its steps
    batch = decoder.draw_batch(q, u)
    for i in range(len(q)):
        alone = decoder.draw_batch(q[i : i + 1], u[i : i + 1])
        assert (batch.index[i], batch.explored[i], batch.decisive[i]) == (alone.index[0], alone.explored[0], alone.decisive[0])
        assert batch.counts[i].tolist() == alone.counts[0].tolist()
        if not batch.explored[i]:
            cdf = np.cumsum(q[i])
            picks = np.minimum((u[i, 2:, None] * cdf[-1] >= cdf[None, :]).sum(axis=1), 4)  # the inverse-CDF lookup
            assert batch.counts[i].tolist() == np.bincount(picks, minlength=5).tolist()


def test_served_batch_and_draws_refuse_arguments_of_the_wrong_shape_or_range() -> None:
    decoder = MajorityDecoder(samples=10, min_votes=4, epsilon=0.05)
    q = np.array([[0.4, 0.3, 0.2, 0.1, 0.0]])
    for fallback in ([5], [-1], [0, 1]):
        with pytest.raises(ValueError, match="fallback"):
            decoder.served_batch(q, np.array(fallback))
    for width in (11, 13):  # exploration, its draw, then exactly ``samples`` votes
        with pytest.raises(ValueError, match="u: expected"):
            decoder.draw_batch(q, np.full((1, width), 0.5))
    for wrong in (q[:, :1], q[:, :4], q[None]):  # a q of another width or rank would be counted without complaint
        with pytest.raises(ValueError, match=r"q: expected \(N, 5\)"):
            decoder.draw_batch(wrong, np.full((len(wrong), 12), 0.5))
    with pytest.raises(ValueError, match=r"q: expected \(N, 5\)"):
        decoder.draw([1.0], "x")


# --- draws against the exact distribution ------------------------------------------------------


@pytest.mark.parametrize(
    ("q", "min_votes", "epsilon", "fallback"),
    [
        ([0.3, 0.25, 0.25, 0.2, 0.0], 4, 0.05, 3),  # q tie, frequent low consensus, exploration
        ([0.05, 0.6, 0.0, 0.15, 0.2], 5, 0.2, 0),  # a zero inside, fallback on a weak action
    ],
)
def test_draw_frequencies_match_the_exact_propensities(q: list[float], min_votes: int, epsilon: float,
                                                       fallback: int) -> None:
    decoder = MajorityDecoder(samples=10, min_votes=min_votes, epsilon=epsilon, temperature=1.2)
    qa = np.array(q)
    n = 40_000
    served = np.zeros(5)
    explored = undecided = 0
    for i in range(n):
        draw = decoder.draw(qa, f"freq-{i}")
        if draw.explored:
            explored += 1
            assert draw.counts.tolist() == [0] * 5
        else:
            assert draw.counts.sum() == 10
            assert all(draw.counts[j] == 0 for j in range(5) if q[j] == 0)
        if draw.index is None:
            undecided += 1
        served[fallback if draw.index is None else draw.index] += 1
    p = decoder.served_distribution(qa, fallback)
    freq = served / n
    bound = 5 * np.sqrt(p * (1 - p) / n)
    assert (np.abs(freq - p) <= bound).all(), (freq, p, bound)
    assert all(served[j] == 0 for j in range(5) if q[j] == 0)
    # the two branches themselves: exploration rate ε, and the no-majority mass
    assert abs(explored / n - epsilon) <= 5 * math.sqrt(epsilon * (1 - epsilon) / n)
    no_majority = (1 - epsilon) * sum(
        _multinomial(c, q) for c in _all_count_vectors(10, 5) if max(c) < min_votes
    )
    assert no_majority > 0.01  # the fallback path is really exercised
    assert abs(undecided / n - no_majority) <= 5 * math.sqrt(no_majority * (1 - no_majority) / n)


def test_draw_replays_for_a_decision_id_and_varies_across_ids() -> None:
    decoder = MajorityDecoder(samples=10, min_votes=4, epsilon=0.05)
    q = np.array([0.3, 0.25, 0.25, 0.2, 0.0])
    for i in range(20):
        a, b = decoder.draw(q, f"replay-{i}"), decoder.draw(q, f"replay-{i}")
        assert (a.index, a.explored, a.counts.tolist()) == (b.index, b.explored, b.counts.tolist())
    assert len({tuple(decoder.draw(q, f"vary-{i}").counts.tolist()) for i in range(50)}) > 10
    # a fresh decoder with the same settings replays the same decision
    again = MajorityDecoder(samples=10, min_votes=4, epsilon=0.05)
    assert again.draw(q, "replay-3").counts.tolist() == decoder.draw(q, "replay-3").counts.tolist()


def test_draw_with_epsilon_one_always_explores_and_never_serves_a_zero_q_action() -> None:
    decoder = MajorityDecoder(samples=10, min_votes=4, epsilon=1.0, temperature=1.2)
    q = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    draws = [decoder.draw(q, f"explore-{i}") for i in range(200)]
    assert all(d.explored for d in draws)
    assert {d.index for d in draws} == {1, 3}


def test_draw_with_min_votes_equal_to_samples_needs_unanimity() -> None:
    decoder = MajorityDecoder(samples=10, min_votes=10, epsilon=0.0)
    certain = decoder.draw(np.array([0.0, 0.0, 1.0, 0.0, 0.0]), "unanimous")
    assert certain.index == 2 and certain.counts.tolist() == [0, 0, 10, 0, 0]
    split = [decoder.draw(np.array([0.5, 0.5, 0.0, 0.0, 0.0]), f"split-{i}") for i in range(50)]
    assert all(d.index is None for d in split if max(d.counts) < 10)
    assert sum(d.index is None for d in split) >= 45  # P(unanimous) = 2 / 1024 per draw
