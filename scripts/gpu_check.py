"""The GPU path end to end, on a machine with a CUDA device: a few minutes, one JSON summary, exit 0 only if all held.

    python scripts/gpu_check.py [--sessions 3000] [--keep DIR]      (scripts/gpu_check.sh wraps it)

Needs the ``gpu`` and ``train`` extras (onnxruntime-gpu, a CUDA build of torch). Checks, each named in
the summary:

1. ``cuda_visible``: torch sees a CUDA device and onnxruntime offers ``CUDAExecutionProvider``. Each
   later check needs only its own half (the trainer's torch, the server's onnxruntime): a check whose
   half is missing fails as skipped and the rest still run, so one run on a lent machine says all it can.
2. ``serving_provider``: a bundle loaded for ``--device cuda`` (``ModelSet``, the server's loader) runs on
   ``CUDAExecutionProvider`` (onnxruntime-gpu falls back to the CPU silently; the session's own
   providers say which), and infers what the CPU does within 1e-4, the golden self-test's tolerance
   (``policy.onnx_model`` turns the CUDA provider's TF32 off: with it an H200 missed that by 2 %).
3. ``fvp_cg``: the Gauss-Newton Fisher-vector product and the conjugate gradient on CUDA match the
   CPU's (1e-4 relative) on the embedded default's policy and real logged states.
4. ``cycle_cuda``: ``shopping-agent cycle --device cuda`` on simulated logs exits 0 or 3 (published
   or refused: a verdict), its manifest's metrics match a CPU run of the same cycle's within loose
   tolerances (the same training rows exactly; the served KL of the step within 25 %: float reduction order
   differs, and one line-search decision may flip; the updates accepted are reported, not compared), and torch
   allocated CUDA memory for it.
5. ``server_on_cuda``: ``shopping-agent serve --device cuda`` in its own process, which never imports
   torch (so nothing but onnxruntime itself has loaded CUDA's libraries), reaches SERVING, answers a
   ``RecommendAction`` with a model decision, and logged the CUDA provider for its bundle.

On a machine without CUDA (neither half) it exits 2 at check 1 and says so: CI never has a GPU (a test runs it so).
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

    try:
        import torch
    except ImportError:  # a serving image: no trainer half to check
        torch = None
    available = torch is not None and torch.cuda.is_available()
    providers = ort.get_available_providers()
    trainer_half = torch is not None and (device == "cpu" or available)
    ort_cuda = device == "cpu" or "CUDAExecutionProvider" in providers
    return {"ok": trainer_half and ort_cuda, "torch_cuda": available, "ort_cuda": ort_cuda,
            "trainer_half": trainer_half, "ort_providers": providers, "ort_version": ort.__version__,
            "torch_version": None if torch is None else torch.__version__,
            "device": torch.cuda.get_device_name(0) if available else None}


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
    tf32 = gpu.policy.session.get_provider_options().get("CUDAExecutionProvider", {}).get("use_tf32")
    ok = providers[0] == expected and gap <= 1e-4 and (device == "cpu" or tf32 == "0")  # the session really got the option
    return {"ok": ok, "providers": providers, "max_gap_vs_cpu": gap, "cuda_use_tf32": tf32}


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


def _server_on_cuda(device: str) -> dict[str, Any]:
    import grpc

    from bench.payload import build_request
    from bench.procs import ServerProcess
    from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
    from server._gen.shopping_agent.v1 import shopping_agent_pb2_grpc as pb_grpc

    argv = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", "0", "--metrics-host", "127.0.0.1",
            "--metrics-port", "0", "--device", device, "--log-format", "json"]
    server = ServerProcess("cuda", argv)
    server.spawn()
    try:
        serving_s = server.wait_serving(120.0)
        with grpc.insecure_channel(server.target) as channel:
            reply = pb_grpc.ShoppingAgentStub(channel).RecommendAction(build_request(), timeout=30.0)
    finally:
        code = server.stop()
    loaded = [line for line in server.log_tail if '"providers"' in line]
    expected = "CPUExecutionProvider" if device == "cpu" else "CUDAExecutionProvider"
    on_expected = bool(loaded) and json.loads(loaded[-1]).get("providers", [None])[0] == expected
    model_answer = reply.source not in (pb.DECISION_SOURCE_UNSPECIFIED, pb.DECISION_SOURCE_FALLBACK_NO_MODEL,
                                        pb.DECISION_SOURCE_FALLBACK_DEGRADED)
    return {"ok": on_expected and model_answer, "serving_after_s": round(serving_s, 2), "exit": code,
            "source": pb.DecisionSource.Name(reply.source), "action": pb.Action.Name(reply.action),
            "load_log": loaded[-1][:400] if loaded else None,
            "log_tail": None if on_expected and model_answer else list(server.log_tail)[-12:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=3000, help="simulated sessions for the cycle's logs (default 3000)")
    p.add_argument("--keep", type=Path, help="keep the logs and bundles here (default: a temporary directory)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the script itself (module doc)")
    args = p.parse_args(argv)
    summary: dict[str, Any] = {"device": args.device, "cuda_visible": _cuda_visible(args.device)}
    visible = summary["cuda_visible"]
    if not visible["trainer_half"] and not visible["ort_cuda"]:
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
        checks: list[tuple[str, str, Callable[[], dict[str, Any]]]] = [
            ("serving_provider", "ort_cuda", lambda: _serving_provider(states, args.device)),
            ("fvp_cg", "trainer_half", lambda: _fvp_cg(states, args.device)),
            ("cycle_cuda", "trainer_half", lambda: _cycle_cuda(logs, work, args.device)),
            ("server_on_cuda", "ort_cuda", lambda: _server_on_cuda(args.device))]
        for name, needs, check in checks:
            if not visible[needs]:
                summary[name] = {"ok": False, "skipped": f"needs {needs}, which this machine lacks (cuda_visible)"}
                continue
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
