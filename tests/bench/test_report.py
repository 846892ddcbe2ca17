"""The results header every bench writes: which machine a run's figures come from."""

from __future__ import annotations

import platform
from pathlib import Path

from bench.report import cpu_model, header


def test_the_cpu_model_comes_from_cpuinfos_first_model_name(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n\n"
                    "processor\t: 1\nmodel name\t: another\n")
    assert cpu_model(info) == "AMD EPYC 9R14"


def test_without_cpuinfo_the_platforms_processor_names_it(tmp_path: Path) -> None:
    assert cpu_model(tmp_path / "missing") == (platform.processor() or "unknown")
    (tmp_path / "no-model").write_text("processor\t: 0\n")
    assert cpu_model(tmp_path / "no-model") == (platform.processor() or "unknown")


def test_the_header_names_the_cpu() -> None:
    machine = header("bench.x", 0.0, ["--a"], extra=1)["machine"]
    assert machine["cpu"] == cpu_model() and machine["extra"] == 1 and machine["cpus"] >= 1
