"""What metrics cost: the real server with metrics on against the same server with --no-metrics.

Same loader, payload and run, alternating (``bench.ab_cost``). Target: metrics on costs at
most 5 % of RecommendAction throughput.

Run: ``.venv/bin/python -m bench.metrics_cost [--rounds 2] [--duration 8]``
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench.ab_cost import run_ab


def main(argv: Sequence[str] | None = None) -> int:
    return run_ab(argv, "python -m bench.metrics_cost", __doc__ or "", "metrics", 0.05,
                  lambda _tmp: {"on": [], "off": ["--no-metrics"]}, "metrics_cost.json")


if __name__ == "__main__":
    sys.exit(main())
