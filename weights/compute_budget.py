"""How much CPU one request's inference takes in a bundle's graphs, measured in the validating child, and its limit.

The operator allowlist (``weights.onnx_check``) bounds what a graph may do and the child's address-space limit what it
may allocate, but nothing bounded how long it computes: an attack review (2026-12-07) served a policy of 120 MatMul and
Tanh layers sharing one 2048² weight (times 0, so its outputs were the real ones), which passed ``weights verify`` in
2.6 s and took a lone caller's p50 from 1.1 ms to 35 ms, 16 callers from 2,100 to 70 calls a second.

So the validating child times one request's inference: the policy and guard graphs on one state, and for a bundle with
product heads the encoder and every head and guard on one request's largest candidate lists; and what one request costs
in the largest runs the server gives the graphs (``largest_run_cpu_s``: a batch of ``--max-batch`` states, 1,024
candidate rows), where a graph whose work grows faster than its rows would show. It reads CPU time
(``time.process_time``), not the clock: the child runs niced beside a serving process, so its wall time says more about
the node's load than about the graphs, while the CPU it spends is the graphs' own. The median of ``REPEATS`` runs after
one to warm up. The default bundle spends about 0.07 ms, one with product heads about 0.26 ms (an AMD EPYC, 2 cores);
``MAX_INFERENCE_CPU_S`` is 20 times the latter, and the review's graph took 33 ms. A bundle over it is refused as
``limits`` (retried with back-off, and refused again).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import numpy as np

from weights.bundle import BundleError
from weights.model_set import ModelSet
from weights.product_heads import LARGEST_ROWS, RUN_ROWS, golden_features

# The graphs are timed through their sessions, not ``ModelSet.infer``: the time is the question here, and what their
# outputs are worth is the load's own checks' (a bundle the servers accept may give Inf on states they never see).

MAX_INFERENCE_CPU_S = 0.005
REPEATS = 5


def inference_cpu_s(model: ModelSet) -> float:
    """The median CPU seconds of one request's inference in ``model``'s graphs (module doc)."""
    state = model.random_states(1, np.random.default_rng(0))
    steps: list[Callable[[], object]] = [functools.partial(model.policy.run, state), functools.partial(model.guard_model.run, state)]
    if model.product is not None:
        heads, guard = model.product.heads, model.product.guard
        h = heads.encode(state)
        rows = {head: golden_features(heads.widths[head], n) for head, n in LARGEST_ROWS.items()}
        steps.append(functools.partial(heads.encode, state))
        steps += [functools.partial(heads.score, head, h, rows[head]) for head in LARGEST_ROWS]
        if guard is not None:
            steps += [functools.partial(guard.logits, head, h, rows[head]) for head in LARGEST_ROWS]
    return _median_cpu_s(steps)


def largest_run_cpu_s(model: ModelSet, batch: int) -> float:
    """What one request costs, in CPU seconds, in the largest runs the server gives the graphs: the policy and guard on
    ``batch`` states (``--max-batch``), the product encoder on ``RUN_ROWS`` states and each head and guard on
    ``RUN_ROWS`` candidate rows, each run's time shared out over the requests it serves. A graph whose work grows faster
    than its rows (an N × N intermediate) costs little on one request and much in a batch (a review, 2026-12-07)."""
    states = model.random_states(batch, np.random.default_rng(1))
    parts: list[tuple[Callable[[], object], float]] = [(functools.partial(model.policy.run, states), 1.0 / batch),
                                                       (functools.partial(model.guard_model.run, states), 1.0 / batch)]
    if model.product is not None:
        heads, guard = model.product.heads, model.product.guard
        many = model.random_states(RUN_ROWS, np.random.default_rng(2))
        h = heads.encode(many)
        parts.append((functools.partial(heads.encode, many), 1.0 / RUN_ROWS))
        for head, n in LARGEST_ROWS.items():
            rows = golden_features(heads.widths[head], RUN_ROWS)
            parts.append((functools.partial(heads.score, head, h, rows), n / RUN_ROWS))
            if guard is not None:
                parts.append((functools.partial(guard.logits, head, h, rows), n / RUN_ROWS))
    return sum(_median_cpu_s([run]) * share for run, share in parts)


def _median_cpu_s(steps: list[Callable[[], object]]) -> float:
    def once() -> float:
        started = time.process_time()
        for step in steps:
            step()
        return time.process_time() - started

    once()
    return statistics.median(once() for _ in range(REPEATS))


def check_compute(model: ModelSet, batch: int = 64, limit_s: float = MAX_INFERENCE_CPU_S) -> float:
    """The larger of ``inference_cpu_s(model)`` and ``largest_run_cpu_s(model, batch)``, or ``BundleError``
    (``limits``) when it is over ``limit_s``."""
    spent = []
    for measure, how in ((inference_cpu_s, "alone"), (functools.partial(largest_run_cpu_s, batch=max(1, batch)),
                                                     f"in the largest runs ({batch} states, {RUN_ROWS} candidate rows)")):
        try:
            spent.append(measure(model))  # in order: a graph too heavy alone is not timed on a whole batch
        except BundleError:
            raise
        except Exception as exc:  # onnxruntime's own types; in the child, an escape would read as a death for memory
            raise BundleError("shape", f"the graphs do not run at the sizes a server gives them ({how}): "
                                       f"{str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}") from None
        if spent[-1] > limit_s:
            raise BundleError("limits", f"one request's inference takes {spent[-1] * 1000:.1f} ms of CPU in the bundle's "
                                        f"graphs {how}, over the {limit_s * 1000:g} ms a bundle may take (a graph this "
                                        "heavy would slow every call)")
    return max(spent)
