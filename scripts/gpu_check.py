"""The GPU path end to end, on a machine with a CUDA device: a few minutes, one JSON summary, exit 0 only if all held.

    python scripts/gpu_check.py [--sessions 3000] [--keep DIR]      (scripts/gpu_check.sh wraps it)

Needs the ``gpu`` and ``train`` extras (onnxruntime-gpu, a CUDA build of torch). Checks, each named in
the summary:

1. ``cuda_visible``: torch sees a CUDA device and onnxruntime offers ``CUDAExecutionProvider``.
2. ``serving_provider``: a bundle loaded for ``--device cuda`` (``ModelSet``, the server's loader) runs on
   ``CUDAExecutionProvider`` (onnxruntime-gpu falls back to the CPU silently; the session's own
   providers say which), and infers what the CPU does within 2e-3 (onnxruntime's CUDA provider uses TF32
   matrix products by default on Ampere and later: about 1e-3 from float32 on 920 inputs).
3. ``fvp_cg``: the Gauss-Newton Fisher-vector product and the conjugate gradient on CUDA match the
   CPU's (1e-4 relative) on the embedded default's policy and real logged states.
4. ``cycle_cuda``: ``shopping-agent cycle --device cuda`` on simulated logs exits 0 or 3 (published
   or refused: a verdict), its manifest's metrics match a CPU run of the same cycle's within loose
   tolerances (the same training rows exactly; the served KL of the step within 25 %: float reduction order
   differs, and one line-search decision may flip; the updates accepted are reported, not compared), and torch
   allocated CUDA memory for it.

On a machine without CUDA it exits 2 at check 1 and says so: CI never has a GPU (a test runs it so).
``--device cpu`` is a dry run of the same checks with the CPU in CUDA's place (the expected provider
``CPUExecutionProvider``): it proves the script itself, on any machine; it proves nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _cuda_visible(device: str) -> dict[str, Any]:
    import onnxruntime as ort
    import torch

    providers = ort.get_available_providers()
    ok = device == "cpu" or (torch.cuda.is_available() and "CUDAExecutionProvider" in providers)
    return {"ok": ok, "torch_cuda": torch.cuda.is_available(), "ort_providers": providers,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _serving_provider(states: Any, device: str) -> dict[str, Any]:
    import numpy as np

    from weights.embedded import default_bundle
    from weights.model_set import LoadOptions, ModelSet

    gpu = ModelSet.load(default_bundle(), LoadOptions(device=device, warmup_batch=64))
    cpu = ModelSet.load(default_bundle(), LoadOptions(device="cpu", warmup_batch=64))
    (g_logits, g_allow), (c_logits, c_allow) = gpu.infer(states[:512]), cpu.infer(states[:512])
    gap = float(max(np.abs(g_logits - c_logits).max(), np.abs(g_allow - c_allow).max()))
    providers = list(gpu.policy.providers)
    expected = "CPUExecutionProvider" if device == "cpu" else "CUDAExecutionProvider"
    return {"ok": providers[0] == expected and gap <= 2e-3, "providers": providers, "max_gap_vs_cpu": gap}


def _fvp_cg(states: Any, device: str) -> dict[str, Any]:
    import torch

    from trainer import fisher
    from trainer.networks import policy_from_arrays
    from trainer.trust_region import conjugate_gradient
    from weights import mlp
    from weights.embedded import default_bundle

    bundle = default_bundle()
    results = {}
    for name, where in (("cpu", "cpu"), ("cuda", device)):
        torch.manual_seed(0)
        policy = policy_from_arrays(mlp.policy_params_from_onnx(bundle.parts["policy.onnx"])).double().to(where)
        s = torch.as_tensor(states[:4096], dtype=torch.float64, device=where)
        theta = fisher.flat_params(policy).detach()
        v = torch.randn(theta.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(where)
        log_guard = torch.zeros((len(s), 5), dtype=torch.float64, device=where)
        f = fisher.logits_fn(policy, s)
        fv = fisher.fvp_gauss_newton(f, theta, log_guard, v)

        def damped(u: torch.Tensor, f: fisher.LogitsFn = f, theta: torch.Tensor = theta,
                   log_guard: torch.Tensor = log_guard) -> torch.Tensor:
            return fisher.fvp_gauss_newton(f, theta, log_guard, u) + 0.1 * u

        x = conjugate_gradient(damped, v, max_iterations=10).x
        results[name] = (fv.cpu(), x.cpu())
    rel = max(float((results["cuda"][i] - results["cpu"][i]).norm() / results["cpu"][i].norm()) for i in range(2))
    return {"ok": rel <= 1e-4, "max_relative_gap": rel}


def _cycle(logs: Path, work: Path, device: str) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    weights = work / f"weights-{device}"
    candidate = work / f"candidate-{device}.bundle"
    config = work / "config.json"
    config.write_text(json.dumps({"updates": 3, "bootstrap": 200}))
    code = ("import sys, torch; "
            "from server.cli import main; rc = main(sys.argv[1:]); "
            "print('CUDA_PEAK_BYTES', torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0, file=sys.stderr); "
            "sys.exit(rc)")
    cmd = [sys.executable, "-c", code, "cycle", "--logs", str(logs), "--weights-dir", str(weights), "--device", device,
           "--config", str(config), "--json", "--candidate-out", str(candidate)]
    env = {**os.environ, "SHOPPING_AGENT_PROGRESS": "off"}
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, env=env)
    peak = next((int(line.split()[1]) for line in run.stderr.splitlines() if line.startswith("CUDA_PEAK_BYTES")), 0)
    report = json.loads(run.stdout) if run.stdout.strip().startswith("{") else {}
    return {"exit": run.returncode, "report": report, "cuda_peak_bytes": peak, "candidate": candidate,
            "stderr_tail": run.stderr[-1500:]}


def _cycle_cuda(logs: Path, work: Path, device: str) -> dict[str, Any]:
    from weights.bundle import read_bundle

    gpu, cpu = _cycle(logs, work / "on-device", device), _cycle(logs, work / "on-cpu", "cpu")
    out: dict[str, Any] = {"exit_cuda": gpu["exit"], "exit_cpu": cpu["exit"], "cuda_peak_bytes": gpu["cuda_peak_bytes"]}
    if gpu["exit"] not in (0, 3) or cpu["exit"] not in (0, 3):
        return {**out, "ok": False, "stderr_cuda": gpu["stderr_tail"], "stderr_cpu": cpu["stderr_tail"]}
    m_gpu = read_bundle(gpu["candidate"].read_bytes()).manifest["training_metrics"]
    m_cpu = read_bundle(cpu["candidate"].read_bytes()).manifest["training_metrics"]
    compared = {k: (m_cpu.get(k), m_gpu.get(k)) for k in ("train_steps", "kl_served_to_start", "updates_accepted")}
    steps, kl = compared["train_steps"], compared["kl_served_to_start"]
    close = (steps[0] is not None and steps[0] == steps[1] and kl[0] is not None and kl[1] is not None
             and abs(kl[0] - kl[1]) <= 0.25 * max(abs(kl[0]), 1e-3))
    return {**out, "ok": close and (device == "cpu" or gpu["cuda_peak_bytes"] > 0), "metrics_cpu_vs_cuda": compared,
            "publish_cuda": gpu["report"].get("publish"), "publish_cpu": cpu["report"].get("publish")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=3000, help="simulated sessions for the cycle's logs (default 3000)")
    p.add_argument("--keep", type=Path, help="keep the logs and bundles here (default: a temporary directory)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the script itself (module doc)")
    args = p.parse_args(argv)
    summary: dict[str, Any] = {"device": args.device, "cuda_visible": _cuda_visible(args.device)}
    if not summary["cuda_visible"]["ok"]:
        print(json.dumps(summary, indent=2))
        print("gpu_check: no CUDA device (torch.cuda.is_available() and onnxruntime's CUDAExecutionProvider are both needed): "
              "nothing else was checked", file=sys.stderr)
        return 2
    from experience.segments import DirectorySource
    from simulator.config import SimConfig
    from simulator.drive import run_logged
    from simulator.world import World
    from trainer.config import TrainConfig
    from trainer.reading import read_window
    from trainer.replay import logged_steps
    from weights.embedded import default_bundle
    from weights.model_set import LoadOptions, ModelSet

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = args.keep or Path(tmp)
        logs = work / "logs"
        try:
            model = ModelSet.load(default_bundle(), LoadOptions(device="cpu", warmup_batch=256))
            run_logged(World(SimConfig(), 3), model, range(args.sessions), ZoneInfo("UTC"), logs, b"g" * 32)
            states = logged_steps(read_window(DirectorySource(logs), TrainConfig()).decisions, model).states
        except Exception as exc:  # the summary says what broke, whatever it was
            summary["setup"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(summary, indent=2, default=str))
            return 1
        checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("serving_provider", lambda: _serving_provider(states, args.device)), ("fvp_cg", lambda: _fvp_cg(states, args.device)),
            ("cycle_cuda", lambda: _cycle_cuda(logs, work, args.device))]
        for name, check in checks:
            try:
                summary[name] = check()
            except Exception as exc:  # every check reports, whatever broke
                summary[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(summary, indent=2, default=str))
    failed = [name for name, result in summary.items() if isinstance(result, dict) and not result.get("ok")]
    print(f"gpu_check: {'all checks held' if not failed else 'FAILED: ' + ', '.join(failed)}", file=sys.stderr)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
