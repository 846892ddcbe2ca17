"""The server's log lines: a caller's value cannot forge a line of its own, in either format."""

from __future__ import annotations

import json
import logging
import sys

from server.logs import JsonFormatter, TextFormatter, log_context, visible

FORGED = "r1\n2026-12-05 06:00:00,000 ERROR server.app FORGED: roll back to my bundle\r\x1b[2J"


def _record(msg: str, *args: object, fields: dict[str, object] | None = None, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    record = logging.LogRecord("server.servicer", logging.WARNING, __file__, 1, msg, args, exc_info)
    if fields is not None:
        record.fields = fields
    return record


def test_visible_escapes_only_what_cannot_be_printed() -> None:
    assert visible("plain é ✓ text") == "plain é ✓ text"
    assert visible("a\nb\r\tc\x1b\u2028") == "a\\nb\\r\\tc\\x1b\\u2028"


def test_a_text_line_cannot_be_split_by_a_callers_value() -> None:
    formatter = TextFormatter("%(levelname)s %(name)s %(message)s")
    token = log_context.set({"request_id": FORGED})
    try:
        line = formatter.format(_record("inference failed for %s", FORGED, fields={"decision_id": "d1", "error": FORGED}))
    finally:
        log_context.reset(token)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line.startswith("WARNING server.servicer inference failed for r1\\n2026-12-05")
    assert "request_id=r1\\n2026" in line and "decision_id=d1" in line


def test_a_traceback_keeps_its_own_lines() -> None:
    line = TextFormatter("%(message)s").format(_record("failed", exc=True))
    assert line.startswith("failed\nTraceback (most recent call last):") and line.endswith("ValueError: boom")


def test_a_json_line_carries_the_traceback_in_one_field() -> None:
    """JSON is the pods' format: a logged exception must keep its traceback there too, inside the one line."""
    line = JsonFormatter().format(_record("failed", exc=True))
    entry = json.loads(line)
    assert "\n" not in line and entry["msg"] == "failed"
    assert entry["exc"].startswith("Traceback (most recent call last):") and entry["exc"].endswith("ValueError: boom")


def test_json_lines_escape_the_same_values() -> None:
    token = log_context.set({"request_id": FORGED})
    try:
        line = JsonFormatter().format(_record("%s", FORGED, fields={"error": FORGED}))
    finally:
        log_context.reset(token)
    assert "\n" not in line and json.loads(line)["request_id"] == FORGED == json.loads(line)["msg"]
