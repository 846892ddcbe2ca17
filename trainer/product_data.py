"""``RecommendProduct``'s logged decisions as training rows: the shopper's state, each layer's candidates, and a reward.

A ``products`` record (``experience.schema.PRODUCTS``) keeps, per layer, every candidate's features as the heads read
them, what the guardrails permitted, the choice, its propensity (the behaviour's served probability given the layers
before) and the whole served distribution; with the shopper's columns the serving bundle's encoder rebuilds the state
(``trainer.replay``). Nothing is recomputed from ids: a record alone is a training row.

**The reward of a product decision** is what it earned the shop, from the outcomes reported against its decision id and
the session's orders: the price paid (the chosen SKU's list price × the chosen band's multiplier, from the logged band
features) when the shopper took the product (an ``ADD_TO_CART`` against the decision) and the session ordered at or
after it, minus the business objective's complaint cost per ``COMPLAINT`` against the decision. A session's offers earn
in all at most what it ordered (``ORDER_SLACK`` above it, for the float16 prices; honest sessions stay within 0.2 %): a
caller sent 377 ``ADD_TO_CART`` reports a session against offers of 900 and one order of 1.00, which credited every one
of them, and 20 such sessions moved the product gate's estimate from 28.7 to 6,120 a session (a review, 2026-12-05).
It is the per-offer part of the business objective (a taken product's value reaches the objective only through the
order that carries it), so each layer is a contextual bandit over its candidates; what an offer does to the rest of the
session (a complaint makes the shopper likelier to leave) is left to the complaint cost.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from core.domain import Outcome
from experience.objective import BusinessObjective
from experience.sessions import dedupe_outcomes
from trainer.replay import buckets_of, saturated, write_embeddings
from weights.model_set import ModelSet

F32 = npt.NDArray[np.float32]
LAYERS = ("category", "sku", "price_band")
HEAD_OF = {"category": "category", "sku": "sku", "price_band": "band"}
"""The log's layer names → ``weights.product_heads``' head names."""

PAID = 3
"""The band features' column of log(the price paid) (``policy.product_features.band_features``)."""


def parse_layers(text: str) -> tuple[str, ...]:
    """Comma-separated layer names (``price-band`` as the flags spell it is ``price_band``), distinct, at least one;
    ``ValueError`` otherwise."""
    layers = tuple(part.strip().replace("-", "_") for part in text.split(",") if part.strip())
    if not layers or len(set(layers)) != len(layers) or not set(layers) <= set(LAYERS):
        raise ValueError(f"expected distinct layers among {', '.join(LAYERS)}, got {text!r}")
    return layers


@dataclass(frozen=True)
class LayerRows:
    """One layer's candidates per decision, padded to the widest: shape (N, C, F) and (N, C)."""

    features: F32
    valid: npt.NDArray[np.bool_]
    """A real candidate (not padding)."""
    permitted: npt.NDArray[np.bool_]
    index: npt.NDArray[np.int64]
    propensity: npt.NDArray[np.float64]
    """The behaviour's probability of the logged choice (the served distribution's, given the layers before)."""
    served: npt.NDArray[np.float64]
    fallback: npt.NDArray[np.int64]
    """The layer's rule's choice (what the decoder serves on low consensus)."""
    guardrail: npt.NDArray[np.bool_]
    """What the guardrails alone permit (before the serving bundle's guard); ``permitted`` where the log has no column."""
    rule_rank: npt.NDArray[np.int64]
    """Each candidate's place in the rule's order (``policy.product_rules``); 0 where the log has no column."""
    guardrails_logged: npt.NDArray[np.bool_]
    """Per row: the log has ``guardrail`` and ``rule_rank``, so another bundle's guard can be replayed on it (shape (N,))."""

    def take(self, keep: npt.NDArray[np.bool_]) -> LayerRows:
        return LayerRows(*(getattr(self, f.name)[keep] for f in fields(self)))


@dataclass(frozen=True)
class ProductRows:
    states: F32
    layers: dict[str, LayerRows]
    rewards: npt.NDArray[np.float64]
    taken: npt.NDArray[np.bool_]
    complaints: npt.NDArray[np.int64]
    sessions: npt.NDArray[np.object_]
    model_versions: tuple[str, ...]
    versions: npt.NDArray[np.object_]
    """Per row, the model version that served it."""

    def __len__(self) -> int:
        return len(self.rewards)

    def take(self, keep: npt.NDArray[np.bool_]) -> ProductRows:
        """The rows where ``keep``."""
        layers = {name: d.take(keep) for name, d in self.layers.items()}
        return ProductRows(self.states[keep], layers, self.rewards[keep], self.taken[keep], self.complaints[keep],
                           self.sessions[keep], self.model_versions, self.versions[keep])


def _slots(counts: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Where each flattened candidate goes in an (N, max count) padding: its row and its position in the row."""
    rows = np.repeat(np.arange(len(counts)), counts)
    return rows, np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)


def _padded(flat: npt.NDArray[Any], counts: npt.NDArray[np.int64], fill: object, width: int | None = None) -> npt.NDArray[Any]:
    """``flat`` (one entry per candidate, in row order) as (N, ``width`` or the max count, ...), ``fill`` where there is
    no candidate."""
    width = (int(counts.max()) if len(counts) else 0) if width is None else width
    out: npt.NDArray[Any] = np.full((len(counts), width, *flat.shape[1:]), fill, dtype=flat.dtype)
    out[_slots(counts)] = flat
    return out


def _features(column: pa.ChunkedArray, width: int, counts: npt.NDArray[np.int64], name: str) -> F32:
    """A list<list<float16>> column as (N, max count, width) float32, zero-padded (±inf ``saturated``); another width
    is named."""
    inner = pc.list_value_length(pc.list_flatten(column)).to_numpy(zero_copy_only=False)
    if len(inner) and (inner != width).any():
        raise ValueError(f"{name}: candidates of {sorted(set(inner.tolist()))[:3]} features where the bundle's "
                         f"head reads {width}: these logs were written for another feature spec")
    flat = pc.list_flatten(pc.list_flatten(column)).to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, width)
    out: F32 = _padded(saturated(flat), counts, 0.0)
    return out


def _lists(column: pa.ChunkedArray, counts: npt.NDArray[np.int64], dtype: type, fill: object, width: int | None = None
           ) -> npt.NDArray[Any]:
    return _padded(pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(dtype), counts, fill, width)


def _optional_lists(table: pa.Table, name: str, counts: npt.NDArray[np.int64], dtype: type
                    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
    """A per-candidate column that older rows lack (null), padded as ``_lists`` (zero in a null row), and which rows
    have it; a row whose list is not one entry per candidate is a ``ValueError`` naming the column."""
    column = table.column(name)
    present = np.asarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=np.bool_)
    lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if (lengths[present] != counts[present]).any():
        raise ValueError(f"{name}: a row whose list is not one entry per candidate")
    return _lists(column, np.where(present, counts, 0), dtype, 0, int(counts.max()) if len(counts) else 0), present


def layer_rows(table: pa.Table, layer: str, width: int) -> LayerRows:
    counts = pc.list_value_length(table.column(f"{layer}_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    valid = np.arange(int(counts.max()) if len(counts) else 0)[None, :] < counts[:, None]
    features = _features(table.column(f"{layer}_features"), width, counts, f"{layer}_features")
    index = np.asarray(table.column(f"{layer}_index").to_numpy(), dtype=np.int64)
    if ((index < 0) | (index >= counts)).any():
        raise ValueError(f"{layer}_index: a choice outside its candidates")
    permitted = _lists(table.column(f"{layer}_permitted"), counts, np.bool_, False) & valid
    guardrail, with_guardrail = _optional_lists(table, f"{layer}_guardrail", counts, np.bool_)
    rank, with_rank = _optional_lists(table, f"{layer}_rule_rank", counts, np.int64)
    logged = with_guardrail & with_rank
    ordered = np.sort(np.where(valid, rank, np.iinfo(np.int64).max), axis=1)  # each row's places: 0..n−1, then padding
    if (logged[:, None] & valid & (ordered != np.arange(valid.shape[1]))).any():
        raise ValueError(f"{layer}_rule_rank: a row whose places are not 0 to its candidates' count − 1, once each")
    if (logged[:, None] & permitted & ~guardrail).any():
        raise ValueError(f"{layer}_permitted: a candidate permitted that the row's {layer}_guardrail bans")
    return LayerRows(features, valid, permitted, index, np.asarray(table.column(f"{layer}_propensity").to_numpy(), dtype=np.float64),
                     _lists(table.column(f"{layer}_served_probs"), counts, np.float64, 0.0),
                     np.asarray(table.column(f"{layer}_fallback").to_numpy(), dtype=np.int64),
                     np.where(logged[:, None], guardrail & valid, permitted), np.where(logged[:, None], rank, 0), logged)


ORDER_SLACK = 1.01
"""How far a session's credited offers may exceed its orders' value before they are scaled down to it (``rewards``)."""


def rewards(products: pa.Table, outcomes: pa.Table, paid: npt.NDArray[np.float64], complaint_cost: float,
            slack: float = ORDER_SLACK) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
    """Per product decision: the reward (module doc), whether it was taken, its complaints. A retried report counts
    once (``experience.sessions.dedupe_outcomes``, as the objective counts it). A report counts for the decision of its
    id in its own session only: a row copied into another session under the same id takes nothing from the real one.
    A session's credited offers are scaled down to at most ``slack`` times the value of its orders (``ORDER_SLACK``)."""
    outcomes = outcomes.take(pa.array(dedupe_outcomes(outcomes)))
    keys = zip(products.column("session_id").to_pylist(), products.column("decision_id").to_pylist(), strict=True)
    row_of = {key: i for i, key in enumerate(keys)}
    taken = np.zeros(products.num_rows, dtype=np.bool_)
    complaints = np.zeros(products.num_rows, dtype=np.int64)
    kinds = np.asarray(outcomes.column("outcome").to_numpy(), dtype=np.int64)
    reported = zip(outcomes.column("session_id").to_pylist(), outcomes.column("decision_id").to_pylist(), strict=True)
    for key, kind in zip(reported, kinds.tolist(), strict=True):
        i = row_of.get(key)
        if i is None:
            continue
        if kind == Outcome.ADD_TO_CART:
            taken[i] = True
        elif kind == Outcome.COMPLAINT:
            complaints[i] += 1
    orders = kinds == Outcome.ORDER
    last_order: dict[str, float] = {}
    order_value: dict[str, float] = {}
    for s, t, v in zip(np.asarray(outcomes.column("session_id").to_pylist(), dtype=object)[orders].tolist(),
                       np.asarray(outcomes.column("event_time_s").to_numpy())[orders].tolist(),
                       np.asarray(outcomes.column("value").to_numpy(), dtype=np.float64)[orders].tolist(), strict=True):
        last_order[s] = max(t, last_order.get(s, -np.inf))
        order_value[s] = order_value.get(s, 0.0) + v
    times = np.asarray(products.column("event_time_s").to_numpy(), dtype=np.float64)
    sessions = products.column("session_id").to_pylist()
    ordered = np.array([last_order.get(s, -np.inf) >= t for s, t in zip(sessions, times.tolist(), strict=True)], dtype=np.bool_)
    earned = np.where(taken & ordered, paid, 0.0)
    credited: dict[str, float] = {}
    for s, e in zip(sessions, earned.tolist(), strict=True):
        credited[s] = credited.get(s, 0.0) + e
    scale = {s: min(1.0, slack * order_value.get(s, 0.0) / c) for s, c in credited.items() if c > 0}
    earned *= np.array([scale.get(s, 1.0) for s in sessions], dtype=np.float64)  # a taken product reaches the shop only in an order
    return earned - complaint_cost * complaints, taken, complaints


def layer_widths(model: ModelSet) -> dict[str, int]:
    """Per layer, the width of a candidate's features as the bundle's heads read them; ``ValueError`` for a bundle
    without product heads."""
    if model.product is None:
        raise ValueError("the bundle has no product heads to train (weights init --product-heads)")
    return {layer: model.product.heads.widths[HEAD_OF[layer]] for layer in LAYERS}


def product_rows(products: pa.Table, outcomes: pa.Table, model: ModelSet, objective: BusinessObjective | None = None,
                 slack: float = ORDER_SLACK) -> ProductRows:
    """The training rows of ``products`` records (states rebuilt by ``model``'s encoder), rewarded from ``outcomes``
    (``rewards``, with its ``slack``)."""
    spec, widths = model.encoder.spec, layer_widths(model)
    states = model.encoder.encode_columns(buckets_of(products, spec), np.asarray(products.column("hour").to_numpy(), dtype=np.int64))
    write_embeddings(states[:, : spec.item_dim], products.column("item_embedding"), spec.item_dim)
    layers = {layer: layer_rows(products, layer, widths[layer]) for layer in LAYERS}
    band = layers["price_band"]
    paid = np.exp(band.features[np.arange(len(band.index)), band.index, PAID].astype(np.float64))
    reward, taken, complaints = rewards(products, outcomes, paid, (objective or BusinessObjective()).complaint_cost, slack)
    return ProductRows(states.astype(np.float32), layers, reward, taken, complaints,
                       np.asarray(products.column("session_id").to_pylist(), dtype=object),
                       tuple(sorted(set(products.column("model_version").to_pylist()))),
                       np.asarray(products.column("model_version").to_pylist(), dtype=object))
