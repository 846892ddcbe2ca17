"""The Action Guard's threshold and its held-out figures (numpy kernels, no torch).

**Threshold** (``choose_threshold``). The guard vetoes ``(s, a)`` iff ``allow_prob < threshold``
(``guard.action_guard.ActionGuard``). On the held-out harmless pairs ``p_1 ≤ … ≤ p_n`` (the
served actions of the held-out rows that did no harm), the false-block rate of ``t`` is
``FBR(t) = #{i : p_i < t} / n``. The threshold is the largest ``t`` with ``FBR(t) ≤ r``
(``max_false_block_rate``): with ``k`` the largest integer such that ``k / n ≤ r``, that is
``t = p_(k+1)``, the ``r``-quantile of the harmless allow-probabilities. Pairs tied with it are
allowed, so ties only lower the rate reached; any larger ``t`` blocks ``p_(k+1)`` too and
exceeds the cap. With no held-out harmless pair nothing bounds the rate: the threshold is 0
(no veto).

**Metrics** (``guard_metrics``), on the held-out pairs at the chosen threshold, "blocked" meaning
vetoed and "positive" meaning harmful: accuracy (blocked ⇔ harmful), false-block rate, recall
(share of harmful pairs blocked), precision (share of blocked pairs that were harmful), AUC of
``1 − allow_prob`` as a harm score (rank-based, ties count one half), base rate and counts. A
rate with an empty denominator is reported as 0 and an AUC with one class empty as 0.5; the
counts tell these cases apart.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]


def choose_threshold(harmless_allow: FloatArray, max_false_block_rate: float) -> float:
    """The largest ``t`` with ``#{p_i < t} / n ≤ r``: ``p_(k+1)`` of the sorted harmless allow-probabilities,
    ``k = max{k : k / n ≤ r}`` (see the module doc); 0 (no veto) when there is no harmless pair."""
    if not 0.0 <= max_false_block_rate < 1.0:
        raise ValueError(f"max_false_block_rate: expected in [0, 1), got {max_false_block_rate!r}")
    p = np.sort(np.asarray(harmless_allow, dtype=np.float64))
    n = len(p)
    if n == 0:
        return 0.0
    k = math.floor(max_false_block_rate * n)
    while k > 0 and k / n > max_false_block_rate:  # guard against rounding in r·n
        k -= 1
    while k + 1 < n and (k + 1) / n <= max_false_block_rate:
        k += 1
    return float(p[k])


def rank_auc(harm_score: FloatArray, harmful: BoolArray) -> float:
    """P(score of a harmful pair > score of a harmless one) + ½ P(tie), from average ranks
    (Mann–Whitney U / (n₊ n₋)); 0.5 when either class is empty."""
    score = np.asarray(harm_score, dtype=np.float64)
    pos = np.asarray(harmful, dtype=np.bool_)
    n_pos, n = int(pos.sum()), len(score)
    if n_pos == 0 or n_pos == n:
        return 0.5
    order = np.argsort(score, kind="stable")
    s = score[order]
    new = np.concatenate([[True], s[1:] != s[:-1]])
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], n)
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = ((starts + 1 + ends) / 2.0)[np.cumsum(new) - 1]  # 1-based ranks, ties averaged
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * (n - n_pos)))


def _rate(num: int, den: int) -> float:
    return num / den if den else 0.0


def guard_metrics(allow: FloatArray, harmful: BoolArray, threshold: float) -> dict[str, float]:
    """Held-out figures at ``threshold`` (vetoed iff ``allow < threshold``); keys ``guard_*`` (see the module doc)."""
    allow = np.asarray(allow, dtype=np.float64)
    harmful = np.asarray(harmful, dtype=np.bool_)
    blocked = allow < threshold
    n, n_harm = len(allow), int(harmful.sum())
    n_false_blocks, n_caught = int((blocked & ~harmful).sum()), int((blocked & harmful).sum())
    return {
        "guard_threshold": float(threshold),
        "guard_accuracy": _rate(int((blocked == harmful).sum()), n),
        "guard_false_block_rate": _rate(n_false_blocks, n - n_harm),
        "guard_recall": _rate(n_caught, n_harm),
        "guard_precision": _rate(n_caught, int(blocked.sum())),
        "guard_auc": rank_auc(1.0 - allow, harmful),
        "guard_base_rate": _rate(n_harm, n),
        "guard_n_heldout": float(n),
        "guard_n_heldout_harmful": float(n_harm),
    }
