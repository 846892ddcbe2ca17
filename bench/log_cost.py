"""What decision and outcome logging costs: the real server with --log-dir against the same server without.

Same loader, payload and run, alternating (``bench.ab_cost``); every request is logged
(sample rate 1) into a fresh directory per round. Target (issue 16): logging on costs at most 5 % of
RecommendAction throughput (an earlier issue's 10 % was this bench's bar until 2026-12-04).

Run: ``.venv/bin/python -m bench.log_cost [--rounds 3] [--duration 8]``
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench.ab_cost import run_ab


def main(argv: Sequence[str] | None = None) -> int:
    return run_ab(argv, "python -m bench.log_cost", __doc__ or "", "logging", 0.05,
                  lambda tmp: {"on": ["--log-dir", str(tmp / "logs")], "off": []}, "log_cost.json")


if __name__ == "__main__":
    sys.exit(main())
