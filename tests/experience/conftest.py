from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.small_disk import SmallDisk, mounted


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    """A real 1 MiB tmpfs (skipped where it cannot be mounted)."""
    yield from mounted(tmp_path)
