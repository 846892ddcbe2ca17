"""The layered product decision with a model: category, then SKU within it, then price band, each sampled.

Each layer scores its candidates (``weights.product_heads``: the shared encoder's h beside each candidate's features,
``policy.product_features``), removes what its guardrails ban (``policy.product_rules``) and, when the bundle has
them, what its learned guard vetoes (``weights.product_guard``: a candidate too likely to draw a complaint), and serves by the same
seeded, replayable majority vote as ``RecommendAction`` over any number of candidates (``policy.plurality``): with
probability ε an exploration draw from q^(1/T), else the most-voted of K draws, or the layer's rule when fewer than
``min_votes`` agree (``FALLBACK_LOW_CONSENSUS``). Each layer's uniforms come from the decision id and the layer's name,
so a logged decision replays exactly; each layer's propensity is the exact probability of its choice given the layers
before it, and the joint propensity is their product. When the guard vetoes every candidate the guardrails permit, the
layer's rule answers among those with ``FALLBACK_GUARD`` and certainty, as ``RecommendAction`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from core.domain import Source
from core.product import Layer, LayerChoice, ProductDecision, ProductRequest
from policy import product_rules as rules
from policy.decoder import uniforms_batch
from policy.plurality import PluralityDecoder
from policy.product_features import band_features, category_features, sku_features

F32 = npt.NDArray[np.float32]


class Heads(Protocol):
    def encode(self, states: F32) -> F32: ...

    def score(self, head: str, h: F32, features: F32) -> F32: ...


class Guard(Protocol):
    def vetoed(self, head: str, h: F32, features: F32) -> npt.NDArray[np.bool_]: ...


def masked_softmax(logits: F32, permitted: npt.NDArray[np.bool_]) -> npt.NDArray[np.float64]:
    """The softmax of ``logits`` over the permitted candidates (0 elsewhere); ``FloatingPointError`` on a non-finite logit."""
    return masked_softmax_rows(logits, [permitted], [len(logits)])[0]


def masked_softmax_rows(logits: F32, permitted: Sequence[npt.NDArray[np.bool_]], sizes: Sequence[int]) -> npt.NDArray[np.float64]:
    """``masked_softmax`` of consecutive runs of ``logits`` (``sizes[b]`` each), one row each, padded with 0 to the
    longest; ``FloatingPointError`` on any non-finite logit (the micro-batcher then decides request by request)."""
    width = max(sizes)
    at = np.arange(width) < np.asarray(sizes)[:, None]
    rows = np.zeros((len(sizes), width), dtype=np.float64)
    mask = np.zeros((len(sizes), width), dtype=np.bool_)
    rows[at] = logits
    mask[at] = np.concatenate(permitted)
    return masked_softmax_padded(rows, mask)


def masked_softmax_padded(logits: npt.NDArray[np.floating], permitted: npt.NDArray[np.bool_]) -> npt.NDArray[np.float64]:
    """Row by row, the softmax of ``logits`` (B, n) over each row's permitted candidates, 0 elsewhere (padding is simply
    not permitted); ``FloatingPointError`` on a non-finite logit anywhere."""
    z = np.asarray(logits, dtype=np.float64)
    if not np.isfinite(z).all():
        raise FloatingPointError("a product head produced NaN or Inf for this input")
    z = np.where(permitted, z - np.where(permitted, z, -np.inf).max(axis=1, keepdims=True), -np.inf)
    q = np.exp(z)
    return q / q.sum(axis=1, keepdims=True)  # type: ignore[no-any-return]


def _layer(decoder: PluralityDecoder, heads: Heads, guard: Guard | None, head: str, h: F32, features: Sequence[F32],
           permitted: Sequence[npt.NDArray[np.bool_]], ranks: Sequence[rules.Rank], rule: str,
           streams: Sequence[str]) -> list[LayerChoice]:
    """One layer's draws for a batch of requests, each with its own candidates: one head call (and one guard call) over
    every request's rows (each beside its request's h), the guard's vetoes taken from what the guardrails permit, one
    exact served distribution per request (``served_batch``, shorter candidate lists padded with 0), and each request's
    draw from its own stream (the decision id and the layer). ``ranks[b]``: request b's candidates' places in the rule's
    order (its choice: the first one allowed)."""
    sizes = [len(f) for f in features]
    rows_h, rows = np.repeat(h, sizes, axis=0), np.concatenate(features)
    logits = heads.score(head, rows_h, rows)
    bounds = np.cumsum(sizes)[:-1]
    allowed, vetoes = list(permitted), [0] * len(sizes)
    if guard is not None:
        for i, (ok, veto) in enumerate(zip(permitted, np.split(guard.vetoed(head, rows_h, rows), bounds), strict=True)):
            vetoes[i] = int((ok & veto).sum())
            allowed[i] = ok & ~veto
    choices: list[LayerChoice | None] = [None] * len(sizes)
    guardrails, orders = [tuple(m.tolist()) for m in permitted], [tuple(r.tolist()) for r in ranks]  # as logged
    for i, ok in enumerate(allowed):
        if not ok.any():  # the guard vetoed every candidate the guardrails permit: the rule among those, with certainty
            index = rules.first_permitted(ranks[i], permitted[i])
            # logged as permitting the rule's candidate alone: what this layer could serve, and a replay of it (the
            # vote over one candidate) gives the logged certainty
            only = tuple(k == index for k in range(sizes[i]))
            choices[i] = LayerChoice(index, 1.0, Source.FALLBACK_GUARD, rule=rule, served=tuple(map(float, only)),
                                     permitted=only, fallback=index, vetoed=vetoes[i], guardrail=guardrails[i],
                                     rule_rank=orders[i])
    live = [i for i, c in enumerate(choices) if c is None]
    if live:
        live_sizes = [sizes[i] for i in live]
        if len(live) < len(sizes):  # some requests answered by their rule: their rows leave the batch
            split = np.split(logits, bounds)
            logits = np.concatenate([split[i] for i in live])
        q = masked_softmax_rows(logits, [allowed[i] for i in live], live_sizes)
        fallbacks = [rules.first_permitted(ranks[i], allowed[i]) for i in live]
        served, draws = decoder.served_and_drawn(q, fallbacks, uniforms_batch([streams[i] for i in live], decoder.samples + 2),
                                                 live_sizes)
        for row, (i, draw) in enumerate(zip(live, draws, strict=True)):
            n, fallback = sizes[i], fallbacks[row]
            distribution, mask = tuple(served[row, :n].tolist()), tuple(allowed[i].tolist())
            if draw.index is None:
                choices[i] = LayerChoice(fallback, distribution[fallback], Source.FALLBACK_LOW_CONSENSUS, rule=rule,
                                         served=distribution, permitted=mask, fallback=fallback, vetoed=vetoes[i],
                                         guardrail=guardrails[i], rule_rank=orders[i])
            else:
                source = Source.EXPLORATION if draw.explored else Source.POLICY
                choices[i] = LayerChoice(draw.index, distribution[draw.index], source, votes=int(draw.counts[draw.index]),
                                         served=distribution, permitted=mask, fallback=fallback, vetoed=vetoes[i],
                                         guardrail=guardrails[i], rule_rank=orders[i])
    return [c for c in choices if c is not None]


def decide_batch(heads: Heads, decoder: PluralityDecoder, states: F32, requests: Sequence[ProductRequest],
                 decision_ids: Sequence[str], model_version: str, guard: Guard | None = None) -> list[ProductDecision]:
    """The three layers in order for a batch of requests (``states``: the shoppers' encoded states, shape (B, S)): one
    encoder call and one call per head (and per guard) for the whole batch. Each decision is the one its request gets
    alone (tested)."""
    h = heads.encode(states)
    categories = _layer(decoder, heads, guard, "category", h, [category_features(r.categories) for r in requests],
                        [rules.category_permitted(r) for r in requests], [rules.category_rank(r) for r in requests],
                        rules.RULE_CATEGORY, [f"{d}/{Layer.CATEGORY.value}" for d in decision_ids])
    chosen = [r.categories[c.index] for r, c in zip(requests, categories, strict=True)]
    skus = _layer(decoder, heads, guard, "sku", h, [sku_features(c.skus) for c in chosen],
                  [rules.sku_permitted(c) for c in chosen], [rules.sku_rank(c) for c in chosen], rules.RULE_SKU,
                  [f"{d}/{Layer.SKU.value}" for d in decision_ids])
    features = [band_features(r.price_bands, c.skus[s.index], r.visit_count == 1)
                for r, c, s in zip(requests, chosen, skus, strict=True)]
    bands = _layer(decoder, heads, guard, "band", h, features, [rules.band_permitted(r) for r in requests],
                   [rules.band_rank(r.price_bands) for r in requests], rules.RULE_PRICE_BAND,
                   [f"{d}/{Layer.PRICE_BAND.value}" for d in decision_ids])
    return [ProductDecision(c, s, b, model_version) for c, s, b in zip(categories, skus, bands, strict=True)]
