"""The decision and outcome log records, as Arrow schemas: the contract between writer and readers.

One row per decision the server answered (sampled by session, see ``sample_rate``) and one
row per outcome the frontend reported. Columns are only ever added; ``schema_version`` says
which columns a segment has. Enumerations are stored as their proto numbers (``Action``,
``Source``, ``PageType``, ``Outcome`` in ``core.domain``). Times are seconds since the Unix
epoch (float64). Per-action vectors are in ``ACTIONS`` order (add_to_cart … exit).

Decision columns:

- ``decision_id``: the id returned to the caller; seeds the decision's sampling (replay).
- ``time_s``: server wall clock when the decision was made; ``event_time_s``: the request's
  ``event_time`` (the server time when absent): joins and attribution use event times.
- ``session_id``, ``item_id``, ``request_id``: as sent. ``user_hash``: keyed BLAKE2b-128 of
  the user id with the configured salt, hex; raw user ids never reach the disk.
- ``item_embedding`` (float16), ``recent_behavior_ids``, ``page_type``, ``cart_item_count``:
  the raw inputs from which the trainer rebuilds the state; ``hour`` is the local hour the
  server computed from ``event_time_s``.
- ``action``, ``source``, ``propensity``, ``votes``, ``samples``, ``rule``: what was served.
- ``served_probs``: the probability of each action under the whole decision procedure (the
  behaviour policy); ``policy_probs``: after guardrails, before the veto; ``allow_probs``: the
  Action Guard's allow probability; ``blocked``: banned by a guardrail or vetoed;
  ``vetoed``: vetoed by the guard; ``guardrail_hits``: request rules that fired.
- ``model_version``; ``sample_rate``: the logging sample rate in force (a session is kept
  whole or not at all).

Outcome columns: ``outcome_id`` (de-duplication key), ``decision_id`` (may name a decision
not, or not yet, in the logs), ``session_id``, ``outcome``, ``value`` (order GMV),
``coupon_discount``, ``event_time_s`` (when it happened, frontend clock), ``received_s``
(server clock), ``sample_rate``.
"""

from __future__ import annotations

import pyarrow as pa

from core.domain import N_ACTIONS
from experience.kinds import DECISIONS_KIND, KINDS, OUTCOMES_KIND

SCHEMA_VERSION = 1

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
        pa.field("recent_behavior_ids", pa.list_(pa.string()), nullable=False),
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

SCHEMAS = {DECISIONS_KIND: DECISIONS, OUTCOMES_KIND: OUTCOMES}
assert tuple(SCHEMAS) == KINDS
