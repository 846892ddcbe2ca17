"""``RecommendProduct``'s logged rows that no server writes, layer by layer: their sessions are left out of a run whole.

The counterpart of ``trainer.log_checks`` for the product records (``policy.product_policy`` writes them). A server
logs the shopper as for a decision (``log_checks.shopper_rows``) and, per layer, no more candidates than a request may
offer (``core.product``), one entry per candidate in every per-candidate list (features, permitted, served
probabilities, and the guardrail mask and rule ranks when the row has them), a choice and a rule's choice among the
candidates, both permitted, a served distribution that puts no mass on a candidate it does not permit, the propensity
of the choice under it, features that are numbers, and a rule order that places every candidate once. Two reviews found
single rows outside that which stopped ``train-products`` (a choice outside its candidates, an hour of 99, lists of
another length), took it to 7.6 GB (300 SKU candidates), or moved the product gate's estimate (a NaN propensity, a
candidate served that was not permitted, NaN features or embedding).

Given the bundle they are read for, a row it cannot rebuild (written for another feature spec, or by no server) is left
out the same way: ``usable_products``' ``spec`` and ``widths``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from core.product import MAX_CATEGORIES, MAX_MULTIPLIER, MAX_PRICE, MAX_PRICE_BANDS, MAX_SKUS_PER_CATEGORY
from experience.schema import PRODUCT_LAYERS
from policy.features import FeatureSpec
from trainer.log_checks import (
    DEFAULT_LIMITS,
    PROPENSITY_TOLERANCE,
    SUM_TOLERANCE,
    Dropped,
    Lists,
    SessionLimits,
    any_per_row,
    ints,
    owners,
    rows_with_nan,
    shopper_rows,
    spec_rows,
    unnamed_versions,
    without_bad_sessions,
)
from trainer.product_data import PAID  # a price band's feature: the log of the price it asks

BoolArray = npt.NDArray[np.bool_]

MOST_CANDIDATES = {"category": MAX_CATEGORIES, "sku": MAX_SKUS_PER_CATEGORY, "price_band": MAX_PRICE_BANDS}
PAID_MOST = math.log(MAX_PRICE * MAX_MULTIPLIER) + 0.02  # float16's rounding. No floor: servers before 2026-12-03
# took prices below a cent, and a small price earns a small reward


def usable_products(products: pa.Table, outcomes: pa.Table, spec: FeatureSpec | None = None,
                    widths: Mapping[str, int] | None = None, limits: SessionLimits = DEFAULT_LIMITS
                    ) -> tuple[pa.Table, pa.Table, Dropped]:
    """``products`` and ``outcomes`` without the sessions holding a product row no server writes (module doc) or an
    outcome row no server writes, or more than the session ``limits`` allow (``log_checks.SessionLimits``: its decision
    count counts product rows), and, given the bundle's feature ``spec`` and its heads' feature ``widths`` (by layer),
    a row it cannot rebuild (``log_checks.spec_rows``, a feature width of another); ``Dropped.decisions`` counts product
    rows."""
    found = bad_products(products)
    if spec is not None:
        found.update(spec_rows(products, spec))
    for layer, width in (widths or {}).items():
        features = products.column(f"{layer}_features")
        candidates = ints(pc.list_value_length(features))
        found[f"{layer}_features of another width than the bundle's {width}"] = any_per_row(
            owners(candidates), len(candidates), ints(pc.list_value_length(pc.list_flatten(features))) != width)
    return without_bad_sessions(products, found, outcomes, limits)


def bad_products(products: pa.Table) -> dict[str, BoolArray]:
    """Per reason, the product rows no server writes (module doc)."""
    out = {**shopper_rows(products), **unnamed_versions(products)}
    for layer in PRODUCT_LAYERS:
        out.update(_bad_layer(products, layer))
    out["price_band_features: a price no request can ask"] = _unaskable_prices(products.column("price_band_features"))
    return out


def _unaskable_prices(features: pa.ChunkedArray) -> BoolArray:
    """Rows with a band whose logged price (``PAID``, a log) is above what a request's price and multiplier limits
    allow: its reward is that price, and one of 65,504 (float16's largest: the log of an infinite price) made the reward
    infinite, the product gate's estimate NaN, and the gate publish (a review, 2026-12-07). A band too short to hold the
    feature is another width's (``usable_products``' ``widths``)."""
    bands = pc.list_flatten(features)  # one per candidate band: its features
    widths = ints(pc.list_value_length(bands))
    values = np.asarray(pc.list_flatten(bands).to_numpy(zero_copy_only=False), dtype=np.float64)
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
    held = widths > PAID
    paid = np.full(len(widths), np.nan)
    paid[held] = values[starts[held] + PAID]
    with np.errstate(invalid="ignore"):
        outside = held & ~(paid <= PAID_MOST)
    return any_per_row(owners(ints(pc.list_value_length(features))), len(features), outside)


def _bad_layer(products: pa.Table, layer: str) -> dict[str, BoolArray]:
    counts = ints(pc.list_value_length(products.column(f"{layer}_ids")))
    offered = counts <= MOST_CANDIDATES[layer]  # a request's limit: one row of 300 SKUs took train-products to 7.6 GB
    index, fallback = ints(products.column(f"{layer}_index")), ints(products.column(f"{layer}_fallback"))
    chosen, ruled = (index >= 0) & (index < counts), (fallback >= 0) & (fallback < counts)
    served = Lists(products.column(f"{layer}_served_probs"), np.float64)
    permitted = Lists(products.column(f"{layer}_permitted"), np.bool_)
    features = products.column(f"{layer}_features")
    lists = (served.lengths == counts) & (permitted.lengths == counts) & \
        (ints(pc.list_value_length(features)) == counts)
    for optional in (f"{layer}_guardrail", f"{layer}_rule_rank"):  # null in rows written before the column was
        column = products.column(optional)
        lists &= ~_present(column) | (ints(pc.list_value_length(column).fill_null(0)) == counts)
    with np.errstate(invalid="ignore"):
        in_range = np.isfinite(served.values) & (served.values >= 0) & (served.values <= 1)
        sums = np.bincount(served.owner, weights=np.where(in_range, served.values, 0.0), minlength=len(counts))
        aligned = lists & ~served.any(~in_range)
        off_permitted = served.any((served.values > 0) & ~served.beside(permitted, aligned).astype(np.bool_))
        distribution = aligned & (np.abs(sums - 1.0) <= SUM_TOLERANCE) & ~off_permitted
        propensity = np.asarray(products.column(f"{layer}_propensity").to_numpy(zero_copy_only=False), dtype=np.float64)
        judged = chosen & distribution
        consistent = ~judged | (np.abs(propensity - served.at(index, judged)) <= PROPENSITY_TOLERANCE)
        in_unit = np.isfinite(propensity) & (propensity > 0) & (propensity <= 1)
    return {
        f"{layer}: a per-candidate list of another length than its candidates": ~lists,
        f"{layer}_index outside its candidates, or not permitted": ~(chosen & lists & permitted.at(index, chosen & lists)),
        f"{layer}: more candidates than a request may offer": ~offered,
        f"{layer}_fallback outside its candidates, or not permitted":
            ~(ruled & lists & permitted.at(fallback, ruled & lists)),
        f"{layer}_served_probs not a distribution over its permitted candidates": ~distribution,
        f"{layer}_propensity outside (0, 1]": ~in_unit,
        f"{layer}_propensity not the served probability of the choice": ~consistent,
        f"{layer}_features NaN": rows_with_nan(features),
        **_bad_order(products, layer, lists, permitted),
    }


def _bad_order(products: pa.Table, layer: str, lists: BoolArray, permitted: Lists) -> dict[str, BoolArray]:
    """Rows with a guardrail mask and rule ranks whose ranks do not place each candidate once, or whose permitted
    candidates the guardrails ban."""
    guardrail = Lists(products.column(f"{layer}_guardrail"), np.bool_)
    rank = Lists(products.column(f"{layer}_rule_rank"), np.int64)
    logged = lists & _present(products.column(f"{layer}_guardrail")) & _present(products.column(f"{layer}_rule_rank"))
    order = np.lexsort((rank.values, rank.owner))  # each row's ranks in order: 0 .. its count − 1 once each
    misplaced_values = np.zeros(len(order), dtype=np.bool_)
    misplaced_values[order] = rank.values[order] != np.arange(len(order)) - rank.starts[rank.owner[order]]
    misplaced = logged & rank.any(misplaced_values)
    banned = logged & permitted.any(permitted.values & ~permitted.beside(guardrail, logged).astype(np.bool_))
    return {f"{layer}_rule_rank not each candidate once": misplaced,
            f"{layer}_permitted where {layer}_guardrail bans": banned}


def _present(column: pa.ChunkedArray) -> BoolArray:
    """Per row, whether the (nullable) column holds a value."""
    return np.asarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=np.bool_)
