"""Logging, configured once at the entry point: JSON lines (or text) on stderr.

Modules use ``logging.getLogger(__name__)`` with lazy ``%`` arguments and put structured
fields in ``extra={"fields": {...}}``. Per-call context (``request_id``, ``decision_id``)
comes from ``log_context`` contextvars and is added to every record logged inside the call.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

log_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("log_context", default=None)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        context = log_context.get()
        if context:
            entry.update(context)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def visible(text: str) -> str:
    """``text`` with every unprintable character escaped (a newline as ``\\n``): a caller's id with a line break in it
    cannot start a line of its own in a text log. Printable text is returned as it is."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class TextFormatter(logging.Formatter):
    """One line a record (a traceback, the formatter's own, follows on its lines): the message and the fields with
    their unprintable characters escaped, as JSON lines escape them."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return visible(super().formatMessage(record))

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = {**(log_context.get() or {}), **(getattr(record, "fields", None) or {})}
        return text + ("  " + " ".join(f"{k}={visible(str(v))}" for k, v in fields.items()) if fields else "")


def configure(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
