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
counts tell these cases apart. ``auc_lower_bound`` is its one-sided lower confidence bound
(Hanley & McNeil's standard error), reported beside it, not used to decide.

**Never blocking** (``never_block_metrics``) is the baseline a guard must beat, on the same
held-out pairs: accuracy ``1 − base rate``, false-block rate 0, recall 0, precision 0 (nothing
blocked), AUC 0.5 (a constant score).

**Does the guard earn its place?** (``decide_veto``, ``VetoCriterion``). Let a harmful pair
that passes cost the shop ``c_h`` and a harmless pair that is blocked ``c_f`` (the decoder then
serves its next choice: a lost nudge, not a lost shopper), ``r = c_h / c_f``
(``harm_cost_ratio``). Against never blocking, a veto at ``t`` saves ``c_h`` per harmful pair it
blocks (TP) and costs ``c_f`` per harmless one (FP), so per held-out pair its net benefit is::

    B(t) = (c_h · TP − c_f · FP) / n = (blocked / n) · (c_h · precision − c_f · (1 − precision))

and it beats never blocking iff its **precision exceeds the break-even** ``p₀ = 1 / (1 + r)``.
With ``r = 1`` (the default) that is ``TP > FP``, i.e. accuracy above never blocking's: the
accuracy the manifest reports and the verdict always agree. A shop that prices a complaint at
``r`` false blocks sets ``r``; the false-block cap stays a hard limit on top.

With a positive rate of a few per cent a guard blocks a few dozen held-out pairs, so the
verdict must survive noise: given the blocked pairs, the harmful count is
``TP ~ Binomial(m, precision)``, ``m = TP + FP``, and the guard earns its veto iff the exact
one-sided test of ``precision ≤ p₀`` rejects at ``1 − confidence``::

    p-value = P(X ≥ TP | X ~ Binomial(m, p₀)) < α = 1 − confidence

equivalently iff the Clopper–Pearson lower bound ``L`` of the precision (the ``p`` with
``P(X ≥ TP | m, p) = α``) exceeds ``p₀``. The edges are closed forms: ``TP = m`` gives the
p-value ``p₀^m`` and ``L = α^{1/m}`` (at ``p₀ = ½``, 95 %: five of five blocked pairs
harmful earn the veto, four of four do not); ``TP = 0`` or ``m = 0`` never earns it. A guard
with no signal has the base rate (a few per cent) as its precision, far below ``½``.

The threshold is chosen from the held-out *harmless* pairs alone (the cap quantile above), so
the harmful pairs the test counts played no part in choosing it and TP is an honest count at a
fixed ``t``; the FP side is the cap by construction (on fresh data its expectation is
``(k+1)/(n+1)`` against the ``k/n`` seen, negligible at the held-out sizes in use). Choosing
``t`` to maximise ``B`` on the same pairs would bias the test, which is why it is not done.
Pairs of one session are treated as independent given their states; the session split keeps
the test's pairs out of training. A threshold *kept* from an earlier run is judged the same way
on new held-out pairs, and must also not break the cap beyond noise (``decide_veto``).

``heldout_report`` gathers all of it, with ``guard_threshold`` as shipped: the candidate with a
veto, 0.0 without (the server vetoes iff allow-probability < threshold: never).

**Guard table** (``guard_table``): the held-out figures of the guard at its threshold, of never
blocking, and of what ships (the guard if it earned its veto, else never blocking), as text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist

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


def auc_lower_bound(auc: float, n_pos: int, n_neg: int, confidence: float) -> float:
    """One-sided lower confidence bound ``A − z SE`` of an AUC ``A`` (clipped to [0, 1]), with Hanley & McNeil's
    ``SE² = (A(1−A) + (n₊−1)(Q₁−A²) + (n₋−1)(Q₂−A²)) / (n₊ n₋)``, ``Q₁ = A/(2−A)``, ``Q₂ = 2A²/(1+A)``;
    0 when either class is empty."""
    if n_pos == 0 or n_neg == 0:
        return 0.0
    q1, q2 = auc / (2.0 - auc), 2.0 * auc * auc / (1.0 + auc)
    var = (auc * (1.0 - auc) + (n_pos - 1) * (q1 - auc * auc) + (n_neg - 1) * (q2 - auc * auc)) / (n_pos * n_neg)
    return float(min(1.0, max(0.0, auc - NormalDist().inv_cdf(confidence) * math.sqrt(max(var, 0.0)))))


def never_block_metrics(harmful: BoolArray) -> dict[str, float]:
    """Never blocking's figures on the same held-out pairs: accuracy ``1 − base rate``, false-block rate,
    recall and precision 0, AUC 0.5; keys ``guard_never_block_*``."""
    harmful = np.asarray(harmful, dtype=np.bool_)
    return {
        "guard_never_block_accuracy": _rate(int((~harmful).sum()), len(harmful)),
        "guard_never_block_false_block_rate": 0.0,
        "guard_never_block_recall": 0.0,
        "guard_never_block_precision": 0.0,
        "guard_never_block_auc": 0.5,
    }


def binomial_tail(k: int, m: int, p: float) -> float:
    """``P(X ≥ k)`` for ``X ~ Binomial(m, p)``, summed exactly in log space (1 for ``k ≤ 0``, 0 for ``k > m``)."""
    if k <= 0:
        return 1.0
    if k > m:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    i = np.arange(1, m + 1, dtype=np.float64)
    log_choose = np.concatenate([[0.0], np.cumsum(np.log(m - i + 1) - np.log(i))])  # log C(m, j), j = 0 … m
    j = np.arange(k, m + 1)
    log_terms = log_choose[j] + j * math.log(p) + (m - j) * math.log1p(-p)
    top = float(log_terms.max())
    return float(min(1.0, math.exp(top) * np.exp(log_terms - top).sum()))


def precision_lower_bound(k: int, m: int, confidence: float) -> float:
    """Clopper–Pearson one-sided lower bound of a proportion, ``k`` successes in ``m``: the ``p`` with
    ``P(X ≥ k | m, p) = 1 − confidence`` (bisection; ``α^{1/m}`` when ``k = m``); 0 when ``k = 0``."""
    if k <= 0 or m <= 0:
        return 0.0
    alpha = 1.0 - confidence
    lo, hi = 0.0, 1.0
    for _ in range(60):  # the tail is increasing in p: 2⁻⁶⁰ is far below any rate reported
        mid = 0.5 * (lo + hi)
        if binomial_tail(k, m, mid) < alpha:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True, slots=True)
class VetoCriterion:
    """When a guard earns its veto (module doc): its held-out precision beats ``1 / (1 + harm_cost_ratio)`` at ``confidence``."""

    harm_cost_ratio: float = 1.0
    """``c_h / c_f``: what a harmful pair let through costs, in false blocks. 1: the accuracy criterion."""
    confidence: float = 0.95
    """One-sided confidence of the exact binomial test (and of the reported lower bounds), in (0, 1)."""

    def __post_init__(self) -> None:
        if not (self.harm_cost_ratio > 0 and math.isfinite(self.harm_cost_ratio)):
            raise ValueError(f"harm_cost_ratio: expected > 0, got {self.harm_cost_ratio!r}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence: expected in (0, 1), got {self.confidence!r}")

    @property
    def break_even_precision(self) -> float:
        """``p₀ = c_f / (c_f + c_h) = 1 / (1 + r)``: the precision at which a veto's net benefit is zero."""
        return 1.0 / (1.0 + self.harm_cost_ratio)


@dataclass(frozen=True, slots=True)
class VetoDecision:
    """Whether a guard at its threshold earns its veto against never blocking, and why."""

    veto: bool
    reason: str
    """One line for the manifest and the log."""
    p_value: float
    """``P(X ≥ TP | Binomial(m, p₀))``; the veto is earned iff it is below ``1 − confidence``."""
    precision_lower: float
    """Clopper–Pearson lower bound of the blocked pairs' precision."""
    net_benefit: float
    """``(r · TP − FP) / n``: saved cost per held-out pair against never blocking, in false blocks."""

    def metrics(self, criterion: VetoCriterion) -> dict[str, float]:
        return {
            "guard_veto_enabled": float(self.veto),
            "guard_veto_p_value": self.p_value,
            "guard_precision_lower": self.precision_lower,
            "guard_net_benefit": self.net_benefit,
            "guard_break_even_precision": criterion.break_even_precision,
            "guard_harm_cost_ratio": criterion.harm_cost_ratio,
            "guard_veto_confidence": criterion.confidence,
        }


def decide_veto(
    allow: FloatArray, harmful: BoolArray, threshold: float, criterion: VetoCriterion | None = None,
    max_false_block_rate: float | None = None,
) -> VetoDecision:
    """Does the guard, vetoing ``allow < threshold`` on the held-out pairs, beat never blocking? (module doc).

    With ``max_false_block_rate`` ``c``, a threshold whose false-block rate exceeds ``c`` beyond noise never
    earns the veto: ``P(X ≥ FP | X ~ Binomial(n₋, c)) < 1 − confidence`` over the ``n₋`` held-out harmless
    pairs. ``choose_threshold``'s never does (``FP ≤ c n₋``); a threshold kept from an earlier run, judged on
    new pairs, lands on either side of ``c`` by sampling alone, and a point check would drop its veto by
    chance about half the time."""
    criterion = criterion or VetoCriterion()
    allow = np.asarray(allow, dtype=np.float64)
    harmful = np.asarray(harmful, dtype=np.bool_)
    blocked = allow < threshold
    m, tp = int(blocked.sum()), int((blocked & harmful).sum())
    fp, n, p0 = m - tp, len(allow), criterion.break_even_precision
    p_value = binomial_tail(tp, m, p0) if m else 1.0
    lower = precision_lower_bound(tp, m, criterion.confidence)
    benefit = (criterion.harm_cost_ratio * tp - fp) / n if n else 0.0
    n_harmless = n - int(harmful.sum())
    fbr = fp / n_harmless if n_harmless else 0.0
    over_cap = max_false_block_rate is not None and binomial_tail(fp, n_harmless, max_false_block_rate) < 1.0 - criterion.confidence
    veto = m > 0 and p_value < 1.0 - criterion.confidence and not over_cap
    conf = f"{criterion.confidence:.0%}"
    if m == 0:
        reason = "no veto: the guard blocks no held-out pair at its threshold"
    elif over_cap:
        reason = f"no veto: held-out false-block rate {fbr:.4f} ({fp} of {n_harmless}) above the cap {max_false_block_rate} beyond noise"
    elif veto:
        reason = (f"veto: {tp} of {m} blocked held-out pairs harmful, precision ≥ {lower:.3f} ({conf} lower bound) "
                  f"> break-even {p0:.3f} (p = {p_value:.2g})")
    else:
        reason = (f"no veto: {tp} of {m} blocked held-out pairs harmful, precision lower bound {lower:.3f} ({conf}) "
                  f"≤ break-even {p0:.3f} (p = {p_value:.2g}): not better than never blocking")
    return VetoDecision(veto, reason, p_value, lower, benefit)


def heldout_report(
    allow: FloatArray, harmful: BoolArray, threshold: float, criterion: VetoCriterion | None = None,
    max_false_block_rate: float | None = None,
) -> tuple[VetoDecision, dict[str, float]]:
    """The verdict and every held-out figure: ``guard_metrics`` at the candidate ``threshold``, never blocking's,
    the verdict's, ``guard_auc_lower``, ``guard_candidate_threshold``, and ``guard_threshold`` as shipped
    (the candidate with a veto, else 0.0: nothing is ever vetoed). All floats, for the manifest."""
    criterion = criterion or VetoCriterion()
    decision = decide_veto(allow, harmful, threshold, criterion, max_false_block_rate)
    metrics = guard_metrics(allow, harmful, threshold)
    n_pos = int(metrics["guard_n_heldout_harmful"])
    metrics |= never_block_metrics(harmful) | decision.metrics(criterion)
    metrics |= {
        "guard_auc_lower": auc_lower_bound(metrics["guard_auc"], n_pos, int(metrics["guard_n_heldout"]) - n_pos, criterion.confidence),
        "guard_candidate_threshold": float(threshold),
        "guard_threshold": float(threshold) if decision.veto else 0.0,
    }
    return decision, metrics


_TABLE_FIGURES = (("accuracy", "accuracy"), ("false_block_rate", "false-block"), ("recall", "recall"),
                  ("precision", "precision"), ("auc", "AUC"))


def guard_table(metrics: Mapping[str, float]) -> str:
    """The held-out figures of the guard at its threshold, of never blocking and of what ships, as a text table.

    Reads the ``guard_*`` keys of ``train_guard``'s metrics (as in a manifest's ``training_metrics``)."""
    guard = [metrics[f"guard_{key}"] for key, _ in _TABLE_FIGURES]
    never = [metrics[f"guard_never_block_{key}"] for key, _ in _TABLE_FIGURES]
    veto = metrics["guard_veto_enabled"] == 1.0
    shipped = ("shipped: guard", guard) if veto else ("shipped: no veto", never)
    rows = [("guard at its threshold", guard), ("never blocking", never), shipped]
    width = max(len(name) for name, _ in rows)
    lines = [" ".join([" " * width, *(f"{head:>11}" for _, head in _TABLE_FIGURES)])]
    lines += [" ".join([name.ljust(width), *(f"{v:>11.4f}" for v in values)]) for name, values in rows]
    lines.append(f"held-out pairs {metrics['guard_n_heldout']:.0f} ({metrics['guard_n_heldout_harmful']:.0f} harmful); "
                 f"AUC ≥ {metrics['guard_auc_lower']:.3f}; threshold shipped {metrics['guard_threshold']:.4g} "
                 f"(candidate {metrics['guard_candidate_threshold']:.4g})")
    return "\n".join(lines)
