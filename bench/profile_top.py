"""Hot functions from a py-spy ``--format raw`` profile (collapsed stacks).

Each line of the file is ``frame;frame;...;frame COUNT`` (root first), a frame being
``function (file:line)``. Self time goes to a stack's last frame; inclusive time to every
distinct function on the stack. Line numbers are dropped so a function counts once.

    python -m bench.profile_top bench/results/profile-real.txt [-n 15] [--inclusive]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_LINE = re.compile(r":\d+\)$")


def function_of(frame: str) -> str:
    """``encode (policy/features.py:41)`` -> ``encode (policy/features.py)``."""
    return _LINE.sub(")", frame.strip())


def read_raw(path: Path) -> collections.Counter[tuple[str, ...]]:
    stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(function_of(f) for f in stack.split(";"))] += int(count)
    return stacks


TRUNK_SHARE = 0.99


def top(stacks: collections.Counter[tuple[str, ...]], n: int, inclusive: bool) -> list[dict[str, Any]]:
    """The ``n`` functions with the most samples, self or inclusive.

    The inclusive list leaves out the trunk, the frames on nearly every stack
    (``main``, ``run_forever``...), which say nothing about where the time goes.
    """
    total = sum(stacks.values())
    per_function: collections.Counter[str] = collections.Counter()
    for stack, count in stacks.items():
        if inclusive:
            for function in set(stack):
                per_function[function] += count
        elif stack:
            per_function[stack[-1]] += count
    ranked = [(f, c) for f, c in per_function.most_common() if not (inclusive and c > TRUNK_SHARE * total)]
    return [{"function": f, "samples": c, "share": c / total if total else 0.0} for f, c in ranked[:n]]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("file", type=Path)
    p.add_argument("-n", type=int, default=15)
    p.add_argument("--inclusive", action="store_true", help="time on the stack, not only at its top")
    args = p.parse_args(argv)
    stacks = read_raw(args.file)
    print(f"{sum(stacks.values())} samples, {'inclusive' if args.inclusive else 'self'} time")
    for entry in top(stacks, args.n, args.inclusive):
        print(f"{entry['share']:6.1%} {entry['samples']:7d}  {entry['function']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
