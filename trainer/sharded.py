"""What ranks on disjoint shards of the sessions agree on before they train: flags, the newest time, the window's record.

Under torchrun every rank reads only its shard of the window's sessions (``trainer.reading``);
a decision one rank took alone (to raise, to skip a step) would leave the others waiting in a
collective until the group's timeout, so every such decision is taken on reduced values, and
the manifest's record of what was read is the union's, with each rank's share beside it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from trainer.distributed import Reducer
from trainer.session_index import SessionIndex
from trainer.window import Window


def any_rank(flag: bool, reducer: Reducer) -> bool:
    """Whether ``flag`` holds on any rank (the same answer on every rank)."""
    return bool(reducer.maximum(torch.tensor([1.0 if flag else 0.0], dtype=torch.float64))[0] > 0)


def newest_time(decisions: pa.Table, reducer: Reducer) -> float | None:
    """The newest ``time_s`` of every rank's decisions (None: no rank has any)."""
    local = float(pc.max(decisions.column("time_s")).as_py()) if decisions.num_rows else -math.inf
    top = float(reducer.maximum(torch.tensor([local], dtype=torch.float64))[0])
    return top if math.isfinite(top) else None


def describe_window(window: Window, reducer: Reducer) -> dict[str, Any]:
    """``Window.describe`` of the union of the ranks' windows; with more than one rank, ``shard_decisions`` lists what
    each rank read. Raises on every rank if the ranks chose different sessions (``Window.chosen``: each ran its own
    narrow pass, and logs still being written can change between two)."""
    record = window.describe()
    if reducer.world_size == 1:
        return record
    if window.chosen is not None:
        mine = torch.tensor([float(window.chosen[0]), float(window.chosen[1])], dtype=torch.float64)
        if bool((reducer.maximum(mine) != -reducer.maximum(-mine)).any()):
            raise ValueError("the ranks chose different windows or samples: the logs changed between their narrow passes "
                             "(a segment finalised meanwhile); rerun, every rank must read the same logs")
    counts = np.array([record["decisions"], record["sessions"]], dtype=np.int64)
    shares = reducer.gather(counts).reshape(-1, 2)
    return {**record, "decisions": int(shares[:, 0].sum()), "sessions": int(shares[:, 1].sum()),
            "model_versions": _union_versions(window.decisions, reducer), "newest_time_s": newest_time(window.decisions, reducer),
            "shard_decisions": [int(v) for v in shares[:, 0]]}


def _union_versions(decisions: pa.Table, reducer: Reducer) -> list[str]:
    """The model versions of every rank's decisions by the first time each was logged on any rank (ties: by name), as
    ``SessionIndex.versions_by_first_time`` orders one table's. Names travel as UTF-8 bytes, NUL-separated."""
    versions = SessionIndex.of([decisions]).versions
    names = [str(v) for v in versions.column("model_version").to_pylist()]
    times = reducer.gather(np.asarray(versions.column("time_s").to_numpy(), dtype=np.float64))
    blob = reducer.gather(np.frombuffer("\0".join(names).encode() + b"\0" if names else b"", dtype=np.uint8))
    everyone = bytes(blob).decode().split("\0")[:-1] if len(blob) else []
    first: dict[str, float] = {}
    for name, t in zip(everyone, times.tolist(), strict=True):
        first[name] = min(t, first.get(name, math.inf))
    return sorted(first, key=lambda name: (first[name], name))
