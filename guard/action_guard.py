"""The Action Guard: a learned veto over candidate actions.

The guard network scores ``(state, one-hot(action))`` for every action at once and outputs
an allow-probability per action; actions below the bundle's threshold are vetoed. The
network itself runs on onnxruntime (``policy.onnx_model``); this module holds the decision
rule, so the server and the trainer veto the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from core.domain import FloatArray


@dataclass(frozen=True, slots=True)
class ActionGuard:
    threshold: float

    def __post_init__(self) -> None:
        if not (0.0 <= self.threshold <= 1.0 and math.isfinite(self.threshold)):
            raise ValueError(f"guard threshold: expected 0..1, got {self.threshold}")

    def vetoed(self, allow_probs: FloatArray) -> npt.NDArray[np.bool_]:
        """True where the guard judges the action too risky to serve."""
        return allow_probs < self.threshold
