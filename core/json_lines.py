"""The one-line JSON a command prints (``--json``): strict JSON, whatever numbers the report holds.

A float that is not finite (an interval of too few sessions, a canary look with nothing to judge) is ``null``:
``json.dumps`` writes it as a bare ``NaN``, which ``JSON.parse``, jq and strict parsers reject. numpy's scalars are
written as the Python numbers they hold.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float as None and numpy's scalars as Python's, through dicts, lists and tuples."""
    if isinstance(value, bool | str | None):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def json_line(value: Any) -> str:
    """``value`` as strict JSON on one line (``finite``; anything else that is not JSON is an error, not a guess)."""
    return json.dumps(finite(value), allow_nan=False)
