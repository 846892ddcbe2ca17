"""The install's shape: import names, the dependency fence, generated code, proto/ as .proto only."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from tests.harness import ROOT

OUR_PACKAGES = ("core", "guard", "policy", "weights", "experience", "simulator", "trainer", "server")


@pytest.mark.parametrize("name", OUR_PACKAGES)
def test_top_level_names_resolve_to_our_install(name: str) -> None:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve() == (ROOT / name / "__init__.py").resolve()


def test_the_distribution_provides_our_packages_and_the_cli() -> None:
    dist = metadata.distribution("shopping-agent")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts == {"shopping-agent": "server.cli:main"}
    requires = " ".join(dist.requires or [])
    assert "torch" not in " ".join(r for r in (dist.requires or []) if "extra ==" not in r)
    assert "onnxruntime" not in " ".join(r for r in (dist.requires or []) if "extra ==" not in r)
    assert 'extra == "cpu"' in requires and 'extra == "gpu"' in requires and 'extra == "train"' in requires


def test_proto_dir_holds_only_proto_files() -> None:
    files = [p for p in (ROOT / "proto").rglob("*") if p.is_file()]
    assert files and all(p.suffix == ".proto" for p in files)
    spec = importlib.util.find_spec("proto")
    assert spec is None or ROOT / "proto" not in Path(spec.origin or "/").parents


def test_generated_code_is_up_to_date() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_serving_never_imports_torch_or_onnx() -> None:
    """Start the real server, answer a call, and check what the process imported."""
    code = textwrap.dedent("""
        import sys
        import grpc
        from tests.harness import running_server, request, stub
        with running_server() as live, grpc.insecure_channel(live.target) as ch:
            stub(ch).RecommendAction(request(), timeout=10)
        from server import cli  # the entry point too
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "onnx", "pickle5", "cloudpickle", "joblib"))
        print(",".join(leaked))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_a_missing_onnxruntime_is_a_clear_error_at_start() -> None:
    """Hide onnxruntime from the interpreter (as on an install without the [cpu]/[gpu] extra)."""
    code = textwrap.dedent("""
        import sys
        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "onnxruntime":
                    raise ImportError("hidden for the test")
        sys.meta_path.insert(0, Hide())
        from server.cli import main
        sys.exit(main(["serve", "--host", "127.0.0.1", "--port", "0"]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2
    assert "onnxruntime is not installed" in out.stderr and "shopping-agent[cpu]" in out.stderr


_HIDING = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {package!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hide())
from server.cli import main
sys.exit(main({argv!r}))
"""


def test_a_command_without_its_extra_names_what_to_install(tmp_path: Path) -> None:
    """``simulate`` and ``weights verify`` without the serving runtime, ``train`` without torch: one line naming the
    install, exit 2 (a set-up problem, which the CronJob does not retry), no traceback."""
    logs = tmp_path / "logs"
    made = subprocess.run([sys.executable, "-m", "server", "simulate", "--sessions", "40", "--log-dir", str(logs)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert made.returncode == 0, made.stderr
    for package, argv, says in [
        ("onnxruntime", ["simulate", "--sessions", "5"], "onnxruntime is not installed"),
        ("onnxruntime", ["weights", "verify", "--validate-memory-mb", "0", str(ROOT / "weights" / "data" / "default.bundle")],
         "onnxruntime is not installed"),
        ("torch", ["train", "--logs", str(logs), "--out", str(tmp_path / "new.bundle")],
         "needs torch, which the train extra installs: .venv/bin/pip install -e '.[cpu,train]'"),
    ]:
        out = subprocess.run([sys.executable, "-c", _HIDING.format(package=package, argv=argv)], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 2, out.stderr
        assert says in out.stderr and "Traceback" not in out.stderr, out.stderr


def _locked(name: str) -> dict[str, str]:
    """package → version pinned in requirements/NAME.txt, each with at least one sha256."""
    text = (ROOT / "requirements" / f"{name}.txt").read_text()
    pins = {}
    for block in text.split("\n") :
        if block and not block.startswith((" ", "#")) and "==" in block:
            package, version = block.split(" ")[0].split("==")
            pins[package.lower()] = version
    entries = [e for e in text.replace("\\\n", " ").split("\n") if e and not e.startswith(("#", " "))]
    assert all("--hash=sha256:" in e for e in entries), f"{name}: a pin without a hash"
    return pins


def test_the_images_build_the_project_with_the_locked_backend_fetching_nothing() -> None:
    """With build isolation pip fetches the build backend (setuptools) from the index at build time, unpinned and
    unchecked (a security review, 2026-12-06): each stage installs it from requirements/build.txt, then the project
    without isolation."""
    import re
    import tomllib

    from packaging.requirements import Requirement

    backend = Requirement(tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"][0])
    assert backend.name == "setuptools" and backend.specifier.contains(_locked("build")["setuptools"])
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    project_installs = [line for line in dockerfile.splitlines() if '"/src[' in line]
    assert len(project_installs) == 2  # the serving and the trainer stage
    for line in project_installs:
        steps = [s.strip() for s in line.split("&&")]
        built = next(i for i, s in enumerate(steps) if '"/src[' in s)
        assert "--no-build-isolation" in steps[built] and "--no-deps" in steps[built], steps[built]
        assert any(re.search(r"--require-hashes -r /src/requirements/build\.txt", s) for s in steps[:built]), line


def test_the_image_lock_files_pin_every_dependency_with_hashes() -> None:
    """The images install from requirements/*.txt with --require-hashes (scripts/lock.sh writes them)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {r.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower() for r in requirements}

    base = names(project["dependencies"])
    cpu, gpu, trainer = _locked("serve-cpu"), _locked("serve-gpu"), _locked("trainer")
    assert base <= set(cpu) and base <= set(gpu) and base <= set(trainer)
    assert "onnxruntime" in cpu and "onnxruntime-gpu" not in cpu
    assert "onnxruntime-gpu" in gpu and "onnxruntime" not in gpu
    # The slim base has no CUDA: the gpu extra's [cuda,cudnn] brings it as wheels (policy.onnx_model preloads them).
    assert {"nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cudnn-cu13"} <= set(gpu)
    assert "onnx" in trainer and "torch" not in trainer  # torch comes from its own index (Dockerfile)
    train = names(project["optional-dependencies"]["train"]) - {"torch"}
    assert train <= set(trainer), f"train extra not in requirements/trainer.txt (scripts/lock.sh): {train - set(trainer)}"
    assert not {p for p in trainer if p.startswith(("nvidia-", "cuda-", "triton"))}
    assert "torch" not in cpu and "torch" not in gpu
