"""Every relative link in the repository's Markdown points at a file that exists, and at a heading it has.

Anchors are GitHub's: the heading lowercased, everything but letters, digits, spaces, ``-`` and ``_`` dropped, spaces
made ``-``, and a repeated heading numbered ``-1``, ``-2``...
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from tests.harness import ROOT

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), not an image's ![alt](src)
_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    """The repository's Markdown: git's list, or outside a work tree (an exported tarball) every .md but the venvs'."""
    try:
        out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for p in ROOT.rglob("*.md") if not any(part.startswith(".") or part.endswith(".egg-info")
                                                                 for part in p.relative_to(ROOT).parts))
    return [ROOT / name for name in out.stdout.split()]


def _prose(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts by its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def broken_links(path: Path) -> list[str]:
    problems = []
    for line in _prose(path):
        for target in _LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check here
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                problems.append(f"{target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{target}: {linked.name} has no heading with the anchor #{anchor}")
    return problems


def test_slugs_follow_githubs_rules() -> None:
    assert slug("Gate calibration (`bench.gate_calibration`)") == "gate-calibration-benchgate_calibration"
    assert slug("On a GPU: an H200, 2026-12-04") == "on-a-gpu-an-h200-2026-12-04"
    assert slug("The CronJob's command at 1 M, 3 M and 10 M decisions (`bench.cycle`)") == (
        "the-cronjobs-command-at-1-m-3-m-and-10-m-decisions-benchcycle")


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## Gate calibration (`x`)\n\n[ok](#gate-calibration-x) [bad](#gate-calibration)"
                                   " [gone](b.md) [fine](a.md#top) [web](https://example.com/#x)\n\n"
                                   "```\n[in a fence](nowhere.md)\n```\n")
    assert broken_links(tmp_path / "a.md") == ["#gate-calibration: a.md has no heading with the anchor #gate-calibration",
                                               "b.md: no such file"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []
