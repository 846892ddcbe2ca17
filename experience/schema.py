"""The decision and outcome log records, as Arrow schemas: the contract between writer and readers.

One row per decision the server answered (sampled by session, see ``sample_rate``) and one
row per outcome the frontend reported. ``schema_version`` says which columns a segment has
and what they hold; ``experience.upgrade`` reads older versions as this one. Enumerations
are stored as their proto numbers (``Action``, ``Source``, ``PageType``, ``Outcome`` in
``core.domain``). Times are seconds since the Unix epoch (float64). Per-action vectors are
in ``ACTIONS`` order (add_to_cart … exit).

No raw identifier and no free text reaches the disk: every id a caller sends is stored as a
keyed hash (``experience.records``: BLAKE2b-128 keyed with the log salt, hex, one domain tag
per column, so equal ids give equal hashes within a column and nothing else), and the
behaviour ids only as the hashing-trick buckets the feature encoder reads.

Decision columns:

- ``decision_id``: the id the server generated and returned (128 random bits, hex); seeds
  the decision's sampling (replay).
- ``time_s``: server wall clock when the decision was made; ``event_time_s``: the request's
  ``event_time`` (the server time when absent): joins and attribution use event times.
- ``session_id``, ``item_id``, ``request_id``: keyed hashes of the ids sent (an empty
  ``request_id`` stays empty). ``user_hash``: keyed BLAKE2b-128 of the user id (no domain tag,
  as in version 1, so user hashes of both versions agree).
- ``item_embedding`` (float16), ``behavior_bucket_indices``, ``page_type``,
  ``cart_item_count``: the inputs from which the trainer rebuilds the state;
  ``behavior_bucket_indices`` are ``policy.features.behavior_buckets`` of the request's
  behaviour ids (the first ``behavior_window``, most recent first) under the served bundle's
  feature spec, whose bucket count is ``behavior_bucket_count``; ``n_recent_behaviors`` is
  how many behaviour ids the request had (a rule input); ``hour`` is the local hour the
  server computed from ``event_time_s``.
- ``action``, ``source``, ``propensity``, ``votes``, ``samples``, ``rule``: what was served.
- ``served_probs``: the probability of each action under the whole decision procedure (the
  behaviour policy); ``policy_probs``: after guardrails, before the veto; ``allow_probs``: the
  Action Guard's allow probability; ``blocked``: banned by a guardrail or vetoed;
  ``vetoed``: vetoed by the guard; ``guardrail_hits``: request rules that fired.
- ``model_version``; ``sample_rate``: the logging sample rate in force (a session is kept
  whole or not at all).

Outcome columns: ``outcome_id`` (keyed hash; the de-duplication key), ``decision_id`` (as
sent when it has the form of an id the server issues, 32 hex digits, else a keyed hash; may
name a decision not, or not yet, in the logs), ``session_id`` (keyed hash, the same as the
decisions' for the same session: the join key), ``outcome``, ``value`` (order GMV),
``coupon_discount``, ``event_time_s`` (when it happened, frontend clock), ``received_s``
(server clock), ``sample_rate``.

Engagement columns (one row per ReportEngagement, a training aid: ``experience.engagement``):
``engagement_id`` (keyed hash; the de-duplication key), ``decision_id`` (as an outcome's),
``session_id`` (keyed hash, the join key), ``dwell_s`` (active seconds on the page),
``scroll_depth`` (0–1), ``bounced``: each null when the frontend did not measure it;
``event_time_s``, ``received_s``, ``sample_rate`` as for outcomes. The kind is new in version 2
(its directory, ``engagements/``, is simply absent from older logs and from servers that never
received a report); readers that predate it never open that directory.

Product columns (one row per ``RecommendProduct`` decision, a kind new in version 2 whose directory, ``products/``, is
absent from older logs): the shopper's columns as a decision row has them (ids hashed the same way), ``visit_count``,
then per layer (``category``, ``sku``, ``price_band``, in decision order): ``<layer>_ids`` (the layer's candidates' ids,
keyed hashes; the SKUs and bands are those the layer chose among: the chosen category's SKUs, every band),
``<layer>_features`` (each candidate's features as the product heads read them, ``policy.product_features``, float16),
``<layer>_index`` (the choice's position), ``<layer>_propensity``, ``<layer>_source``, ``<layer>_votes``,
``<layer>_rule``, ``<layer>_served_probs`` (the probability of serving each candidate, given the layers before:
the behaviour policy), ``<layer>_permitted`` (what its guardrails and the bundle's learned guard let through) and
``<layer>_fallback`` (its rule's choice): with the features, what a replay of the serving bundle's heads needs;
``<layer>_guardrail`` (what the guardrails alone let through) and ``<layer>_rule_rank`` (each candidate's place in the
rule's order, ``policy.product_rules``): with them a replay applies *another* bundle's guard, whose vetoes and rule
choice differ, and so computes any bundle's served distribution (up to the features' float16 rounding, which can flip
a guard's veto of a candidate within it of the threshold). These two came later within version 2 (``ADDED_IN_V2``) and
are null in the rows written before them (a reader then falls back on ``permitted`` and ``fallback``);
``joint_propensity``, ``model_version``, ``sample_rate``.

Versions: 1 stored ``session_id``, ``item_id``, ``request_id``, ``outcome_id`` and every
outcome ``decision_id`` as sent, and ``recent_behavior_ids`` (the raw ids) instead of
``behavior_bucket_indices``, ``behavior_bucket_count`` and ``n_recent_behaviors``. 2 is this.
"""

from __future__ import annotations

import pyarrow as pa

from core.domain import N_ACTIONS
from experience.kinds import DECISIONS_KIND, ENGAGEMENTS_KIND, KINDS, OUTCOMES_KIND, PRODUCTS_KIND

SCHEMA_VERSION = 2

DECISIONS = pa.schema(
    [
        pa.field("schema_version", pa.int16(), nullable=False),
        pa.field("decision_id", pa.string(), nullable=False),
        pa.field("time_s", pa.float64(), nullable=False),
        pa.field("event_time_s", pa.float64(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("user_hash", pa.string(), nullable=False),
        pa.field("item_id", pa.string(), nullable=False),
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("item_embedding", pa.list_(pa.float16()), nullable=False),
        pa.field("behavior_bucket_indices", pa.list_(pa.int32()), nullable=False),
        pa.field("behavior_bucket_count", pa.int32(), nullable=False),
        pa.field("n_recent_behaviors", pa.int32(), nullable=False),
        pa.field("page_type", pa.int8(), nullable=False),
        pa.field("cart_item_count", pa.int32(), nullable=False),
        pa.field("hour", pa.int8(), nullable=False),
        pa.field("action", pa.int8(), nullable=False),
        pa.field("source", pa.int8(), nullable=False),
        pa.field("propensity", pa.float64(), nullable=False),
        pa.field("votes", pa.int16(), nullable=False),
        pa.field("samples", pa.int16(), nullable=False),
        pa.field("served_probs", pa.list_(pa.float64(), N_ACTIONS), nullable=False),
        pa.field("policy_probs", pa.list_(pa.float64(), N_ACTIONS), nullable=False),
        pa.field("allow_probs", pa.list_(pa.float64(), N_ACTIONS), nullable=False),
        pa.field("blocked", pa.list_(pa.bool_(), N_ACTIONS), nullable=False),
        pa.field("vetoed", pa.list_(pa.bool_(), N_ACTIONS), nullable=False),
        pa.field("guardrail_hits", pa.list_(pa.string()), nullable=False),
        pa.field("rule", pa.string(), nullable=False),
        pa.field("model_version", pa.string(), nullable=False),
        pa.field("sample_rate", pa.float64(), nullable=False),
    ],
    metadata={"kind": "decisions", "schema_version": str(SCHEMA_VERSION)},
)

OUTCOMES = pa.schema(
    [
        pa.field("schema_version", pa.int16(), nullable=False),
        pa.field("outcome_id", pa.string(), nullable=False),
        pa.field("decision_id", pa.string(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("outcome", pa.int8(), nullable=False),
        pa.field("value", pa.float64(), nullable=False),
        pa.field("coupon_discount", pa.float64(), nullable=False),
        pa.field("event_time_s", pa.float64(), nullable=False),
        pa.field("received_s", pa.float64(), nullable=False),
        pa.field("sample_rate", pa.float64(), nullable=False),
    ],
    metadata={"kind": "outcomes", "schema_version": str(SCHEMA_VERSION)},
)

ENGAGEMENTS = pa.schema(
    [
        pa.field("schema_version", pa.int16(), nullable=False),
        pa.field("engagement_id", pa.string(), nullable=False),
        pa.field("decision_id", pa.string(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("dwell_s", pa.float64(), nullable=True),
        pa.field("scroll_depth", pa.float64(), nullable=True),
        pa.field("bounced", pa.bool_(), nullable=True),
        pa.field("event_time_s", pa.float64(), nullable=False),
        pa.field("received_s", pa.float64(), nullable=False),
        pa.field("sample_rate", pa.float64(), nullable=False),
    ],
    metadata={"kind": "engagements", "schema_version": str(SCHEMA_VERSION)},
)

_SHOPPER_FIELDS = [f for f in DECISIONS if f.name in (
    "schema_version", "decision_id", "time_s", "event_time_s", "session_id", "user_hash", "item_id", "request_id",
    "item_embedding", "behavior_bucket_indices", "behavior_bucket_count", "n_recent_behaviors", "page_type",
    "cart_item_count", "hour")]
PRODUCT_LAYERS = ("category", "sku", "price_band")


def _layer_fields(layer: str) -> list[pa.Field]:
    return [
        pa.field(f"{layer}_ids", pa.list_(pa.string()), nullable=False),
        pa.field(f"{layer}_features", pa.list_(pa.list_(pa.float16())), nullable=False),
        pa.field(f"{layer}_index", pa.int16(), nullable=False),
        pa.field(f"{layer}_propensity", pa.float64(), nullable=False),
        pa.field(f"{layer}_source", pa.int8(), nullable=False),
        pa.field(f"{layer}_votes", pa.int16(), nullable=False),
        pa.field(f"{layer}_rule", pa.string(), nullable=False),
        pa.field(f"{layer}_served_probs", pa.list_(pa.float64()), nullable=False),
        pa.field(f"{layer}_permitted", pa.list_(pa.bool_()), nullable=False),
        pa.field(f"{layer}_fallback", pa.int16(), nullable=False),
        pa.field(f"{layer}_guardrail", pa.list_(pa.bool_()), nullable=True),  # null: written before the column was
        pa.field(f"{layer}_rule_rank", pa.list_(pa.int16()), nullable=True),
    ]


PRODUCTS = pa.schema(
    [*_SHOPPER_FIELDS, pa.field("visit_count", pa.int32(), nullable=False),
     *(f for layer in PRODUCT_LAYERS for f in _layer_fields(layer)),
     pa.field("joint_propensity", pa.float64(), nullable=False),
     pa.field("model_version", pa.string(), nullable=False),
     pa.field("sample_rate", pa.float64(), nullable=False)],
    metadata={"kind": "products", "schema_version": str(SCHEMA_VERSION)},
)

ADDED_IN_V2 = {PRODUCTS_KIND: frozenset(f"{layer}_{name}" for layer in PRODUCT_LAYERS for name in ("guardrail", "rule_rank"))}
"""Columns added to a kind after its first segments of version 2 were written: a segment or a columnar part without
them reads them as null (``experience.segments._conform``). A columnar part missing any other column is refused by name
(``experience.columnar.read_part``)."""

SCHEMAS = {DECISIONS_KIND: DECISIONS, OUTCOMES_KIND: OUTCOMES, ENGAGEMENTS_KIND: ENGAGEMENTS, PRODUCTS_KIND: PRODUCTS}
assert tuple(SCHEMAS) == KINDS
