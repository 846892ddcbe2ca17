"""A command's --json line is strict JSON whatever numbers its report holds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from core.json_lines import finite, json_line
from tests.harness import strict_json


def test_non_finite_numbers_are_null_and_numpy_scalars_plain_numbers() -> None:
    report = {"estimate": math.nan, "ci": (np.float32("nan"), math.inf, -math.inf), "n": np.int64(7), "ok": True,
              "value": np.float64(1.5), "nested": [{"level": float("nan")}], "reason": "too few sessions", "none": None}
    line = json_line(report)
    assert strict_json(line) == {"estimate": None, "ci": [None, None, None], "n": 7, "ok": True, "value": 1.5,
                                 "nested": [{"level": None}], "reason": "too few sessions", "none": None}
    assert isinstance(finite(np.int64(7)), int) and finite(True) is True  # a bool stays a bool, not 1
    with pytest.raises(ValueError, match="NaN"):
        strict_json(json.dumps({"estimate": math.nan}))  # what the commands printed before


def test_what_is_not_json_is_an_error_not_a_guess() -> None:
    with pytest.raises(TypeError):
        json_line({"array": np.zeros(2)})
