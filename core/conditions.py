"""Declarative conditions over request features, shared by guardrail rules and fallback rules.

A condition is a JSON object; every key present must hold (an empty object always holds):

- ``page_type``: list of page keys (``"search"``, ``"cart"`` …)
- ``cart_item_count_min`` / ``cart_item_count_max``: inclusive bounds
- ``hour_min`` / ``hour_max``: inclusive bounds on the local hour (0–23); ``hour_min >
  hour_max`` wraps midnight (22 → 5 means 22:00–05:59)
- ``has_recent_behavior``: whether the request carried any behaviour id
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from core.domain import Context, PageType

_KEYS = frozenset(
    {"page_type", "cart_item_count_min", "cart_item_count_max", "hour_min", "hour_max", "has_recent_behavior"}
)


class SchemaError(ValueError):
    """A bundle's rule or guardrail data is malformed; the message names the path."""


MAX_NAME = 100


def rule_name(value: object, at: str, taken: Collection[str] | None = None) -> str:
    """``value`` as a rule's name, which answers, log records and metric labels carry: 1-100 printable characters (no
    control character, no lone surrogate, which no answer could encode), and not in ``taken`` when given; else a
    ``SchemaError`` naming ``{at}.name``."""
    if not (isinstance(value, str) and 0 < len(value) <= MAX_NAME and value.isprintable()) or (taken is not None and value in taken):
        unique = "unique " if taken is not None else ""
        raise SchemaError(f"{at}.name: expected a {unique}non-empty string of at most {MAX_NAME} printable characters, "
                          f"got {ascii(value)[:60]}")
    return value


def _int(spec: dict[str, Any], key: str, where: str, lo: int, hi: int) -> int | None:
    value = spec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SchemaError(f"{where}.{key}: expected an integer in [{lo}, {hi}], got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Condition:
    page_types: frozenset[PageType] | None = None
    cart_min: int | None = None
    cart_max: int | None = None
    hour_min: int | None = None
    hour_max: int | None = None
    has_recent_behavior: bool | None = None

    @classmethod
    def parse(cls, spec: Any, where: str) -> Condition:
        """Build from JSON data; raise ``SchemaError`` naming ``where`` on anything unexpected."""
        if spec is None:
            return cls()
        if not isinstance(spec, dict):
            raise SchemaError(f"{where}: expected an object, got {type(spec).__name__}")
        unknown = sorted(set(spec) - _KEYS)
        if unknown:
            raise SchemaError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_KEYS)}")
        pages = spec.get("page_type")
        page_types = None
        if pages is not None:
            if not isinstance(pages, list) or not pages:
                raise SchemaError(f"{where}.page_type: expected a non-empty list of page types")
            try:
                page_types = frozenset(PageType[str(p).upper()] for p in pages)
            except KeyError as exc:
                raise SchemaError(f"{where}.page_type: unknown page type {exc.args[0].lower()!r}") from None
        has_recent = spec.get("has_recent_behavior")
        if has_recent is not None and not isinstance(has_recent, bool):
            raise SchemaError(f"{where}.has_recent_behavior: expected true or false")
        cond = cls(
            page_types=page_types,
            cart_min=_int(spec, "cart_item_count_min", where, 0, 2**32 - 1),
            cart_max=_int(spec, "cart_item_count_max", where, 0, 2**32 - 1),
            hour_min=_int(spec, "hour_min", where, 0, 23),
            hour_max=_int(spec, "hour_max", where, 0, 23),
            has_recent_behavior=has_recent,
        )
        if (cond.hour_min is None) != (cond.hour_max is None):
            raise SchemaError(f"{where}: hour_min and hour_max go together")
        if cond.cart_min is not None and cond.cart_max is not None and cond.cart_min > cond.cart_max:
            raise SchemaError(f"{where}: cart_item_count_min > cart_item_count_max")
        return cond

    def to_json(self) -> dict[str, Any]:
        """The JSON form ``parse`` accepts."""
        out: dict[str, Any] = {}
        if self.page_types is not None:
            out["page_type"] = sorted(p.key for p in self.page_types)
        for key, value in (("cart_item_count_min", self.cart_min), ("cart_item_count_max", self.cart_max),
                           ("hour_min", self.hour_min), ("hour_max", self.hour_max),
                           ("has_recent_behavior", self.has_recent_behavior)):
            if value is not None:
                out[key] = value
        return out

    def matches(self, ctx: Context) -> bool:
        if self.page_types is not None and ctx.page_type not in self.page_types:
            return False
        if self.cart_min is not None and ctx.cart_item_count < self.cart_min:
            return False
        if self.cart_max is not None and ctx.cart_item_count > self.cart_max:
            return False
        if self.hour_min is not None and self.hour_max is not None:
            if self.hour_min <= self.hour_max:
                if not self.hour_min <= ctx.hour <= self.hour_max:
                    return False
            elif self.hour_max < ctx.hour < self.hour_min:
                return False
        if self.has_recent_behavior is not None and (ctx.n_recent_behaviors > 0) != self.has_recent_behavior:
            return False
        return True
