"""Natural-gradient benchmark: Fisher-vector products and the whole update, double backward against Gauss-Newton.

    .venv/bin/python -m bench.fvp                    # 65,536 states, 2.5-3.5 minutes on 2 cores
    .venv/bin/python -m bench.fvp --threads 1        # steadier when other work shares the cores
    .venv/bin/python -m bench.fvp --quick            # 8,192 states, a smoke run of 10-45 s
    .venv/bin/python -m bench.fvp --json             # also write bench/results/fvp.json
    .venv/bin/python -m bench.fvp --device cuda      # on a GPU

The problem: ``--states`` random states (920 features, standard normal), a freshly
initialised ``PolicyNet`` 920 → 128 → 128 → 5 in float32, log guardrail weights with
``--blocked`` of the entries ``−inf`` (never a whole row, never the logged action) and 10 %
soft (``log 0.5``), random logged actions, standard-normal advantages, and the surrogate
``L(θ) = mean_i A_i log q_θ(a_i | s_i)`` with ``q = softmax(z + g)``. The trust region is
``mean_i KL(q_old ‖ q_θ) ≤ δ``.

In one run, with ``torch.set_num_threads(--threads)`` (default: every core):

1. **Per FVP** (best of ``--repeats`` calls; the ``setup`` is what an operator costs once per
   update, timed apart): the double-backward FVP as Spinning Up computes it (forward, backward
   with ``create_graph``, backward again, every call: the baseline); the same with the first
   backward's graph kept across calls (SB3-contrib); the plain Gauss-Newton FVP (a fresh
   linearisation per call); ``GaussNewtonFisher`` with the forward pass reused; and on a
   ``--subsample`` fraction of the states.
2. **The whole update** (best of ``--update-repeats``): the surrogate's gradient, CG with
   ``--cg-iterations`` damped products (``--damping``), ``sᵀ F s`` undamped and the step
   ``β s``, ``β = sqrt(2δ / sᵀ F s)``; then the line search (one forward pass per trial for
   the KL and the surrogate), refitting the step to the measured KL up to ``--kl-fits``
   times while it is more than 10 % off ``δ``: at ``δ = 0.05`` the quadratic model of the
   KL is off by tens of per cent here. For the double-backward baseline (and its kept-graph
   variant) and for ours: Gauss-Newton on the full batch (the gradient from the same forward
   pass), and CG on the subsample with ``sᵀ F s`` from the full batch (one ``J s``).
3. **Step quality**, not timed: the cosine of each accepted step with the baseline's (full
   batch, double backward), and its measured KL over ``δ`` (must be within 10 %), and that of
   ``β s`` (the quadratic model alone). Also the KL the baseline step would have
   with the damped ``sᵀ (F + λI) s`` in the step size, as Spinning Up and SB3-contrib do.

Every loop is bounded by the flags' limits.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``policy`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import Tensor

from bench.procs import machine_busy_cores
from bench.report import add_json_flag, header, write_results
from trainer.fisher import (
    GaussNewtonFisher,
    Linearization,
    flat_params,
    fvp_double_backward,
    fvp_gauss_newton,
    logits_fn,
    masked_log_probs,
    mean_kl,
    set_flat_params,
)
from trainer.networks import PolicyNet
from trainer.trust_region import (
    Evaluation,
    LineSearchResult,
    NaturalStep,
    backtracking_line_search,
    natural_gradient_step,
    scale_step,
)

REPO = Path(__file__).resolve().parent.parent
STATE_DIM, HIDDEN, N_ACTIONS = 920, 128, 5
TARGET_SPEEDUP = 3.0
TARGET_COSINE = 0.95
TARGET_KL_REL = 0.10
BUSY_MACHINE_CORES = 0.25  # more than this busy before the run: warn that figures will be noisy
T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    """What one run measures; built once from the flags."""

    states: int
    """Logged states in the batch."""
    subsample: float
    """Fraction of the states in the subsampled Fisher."""
    cg_iterations: int
    """Conjugate-gradient iterations (Fisher-vector products) per update."""
    damping: float
    """λ in the CG's ``(F + λI)``; not in the step size."""
    delta: float
    """The KL target δ."""
    kl_fits: int
    """Line-search trials refitted to the measured KL (``backtracking_line_search(kl_fits=…)``)."""
    blocked: float
    """Fraction of guardrail entries that are ``−inf``."""
    repeats: int
    """Each per-FVP timing is the best of this many calls (round-robin over the variants)."""
    update_repeats: int
    """Each whole-update timing is the best of this many updates (round-robin over the variants)."""
    seed: int
    device: str
    threads: int


@dataclass
class Problem:
    net: PolicyNet
    states: Tensor
    log_guard: Tensor
    actions: Tensor
    advantages: Tensor
    theta: Tensor
    f: Callable[[Tensor], Tensor]
    log_q_old: Tensor

    def surrogate(self, logits: Tensor) -> Tensor:
        """``L = mean_i A_i log q(a_i | s_i)``."""
        log_q = masked_log_probs(logits, self.log_guard)
        return (self.advantages * log_q.gather(1, self.actions[:, None])[:, 0]).mean()

    def kl(self, theta: Tensor) -> Tensor:
        return mean_kl(self.log_q_old, self.f(theta), self.log_guard)


def build_problem(settings: Settings) -> Problem:
    gen = torch.Generator().manual_seed(settings.seed)
    torch.manual_seed(settings.seed)
    device = torch.device(settings.device)
    n = settings.states
    net = PolicyNet(STATE_DIM, HIDDEN, N_ACTIONS).to(device)
    states = torch.randn(n, STATE_DIM, generator=gen)
    log_guard = torch.where(torch.rand(n, N_ACTIONS, generator=gen) < 0.1, math.log(0.5), 0.0)
    log_guard[torch.rand(n, N_ACTIONS, generator=gen) < settings.blocked] = float("-inf")
    actions = torch.randint(0, N_ACTIONS, (n,), generator=gen)
    log_guard[torch.arange(n), actions] = 0.0  # the logged action was allowed
    advantages = torch.randn(n, generator=gen)
    states, log_guard, actions, advantages = (t.to(device) for t in (states, log_guard, actions, advantages))
    f = logits_fn(net, states)
    theta = flat_params(net)
    with torch.no_grad():
        log_q_old = masked_log_probs(f(theta), log_guard)
    return Problem(net, states, log_guard, actions, advantages, theta, f, log_q_old)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds of one run of ``fn`` (device synchronised) and its result."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def best_of_interleaved(repeats: int, device: str, fns: dict[str, Callable[[], T]]) -> dict[str, tuple[float, T]]:
    """For each name, the fastest of ``repeats`` runs and the last result; the runs go round-robin.

    Round-robin, so a burst of other work on a shared machine slows one round of every
    variant rather than every run of one variant.
    """
    best: dict[str, tuple[float, T]] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            seconds, result = timed(device, fn)
            best[name] = (min(seconds, best[name][0]) if name in best else seconds, result)
    return best


# --- the updates ---------------------------------------------------------------------------
# Each returns the natural step and L(θ_old), the latter from the forward pass of its gradient.


def surrogate_gradient(p: Problem) -> tuple[Tensor, float]:
    theta = p.theta.clone().requires_grad_(True)
    value = p.surrogate(p.f(theta))
    (g,) = torch.autograd.grad(value, theta)
    return g, float(value.detach())


def update_double_backward(p: Problem, s: Settings) -> tuple[NaturalStep, float]:
    """The baseline: every product is a fresh double backward of the KL (Spinning Up)."""
    g, before = surrogate_gradient(p)

    def damped(v: Tensor) -> Tensor:
        return fvp_double_backward(p.kl, p.theta, v) + s.damping * v

    def curvature(x: Tensor) -> Tensor:
        return x @ fvp_double_backward(p.kl, p.theta, x)

    return natural_gradient_step(damped, curvature, g, delta=s.delta, cg_iterations=s.cg_iterations), before


def update_double_backward_kept(p: Problem, s: Settings) -> tuple[NaturalStep, float]:
    """The baseline with one forward pass and ``∇KL``'s graph kept across the products (SB3-contrib)."""
    theta = p.theta.clone().requires_grad_(True)
    z = p.f(theta)
    value = p.surrogate(z)
    (g,) = torch.autograd.grad(value, theta, retain_graph=True)
    (grad_kl,) = torch.autograd.grad(mean_kl(p.log_q_old, z, p.log_guard), theta, create_graph=True)

    def fvp(v: Tensor) -> Tensor:
        (hv,) = torch.autograd.grad(grad_kl @ v, theta, retain_graph=True)
        return hv.detach()

    def damped(v: Tensor) -> Tensor:
        return fvp(v) + s.damping * v

    step = natural_gradient_step(damped, lambda x: x @ fvp(x), g.detach(), delta=s.delta, cg_iterations=s.cg_iterations)
    return step, float(value.detach())


def linearized_gradient(p: Problem) -> tuple[Linearization, Tensor, float]:
    """One forward pass for the surrogate's gradient ``Jᵀ ∂L/∂z`` and the Fisher's ``J v``."""
    lin = Linearization(p.f, p.theta)
    z = lin.logits.clone().requires_grad_(True)
    value = p.surrogate(z)
    (dl_dz,) = torch.autograd.grad(value, z)
    return lin, lin.vjp(dl_dz), float(value.detach())


def update_gauss_newton(p: Problem, s: Settings) -> tuple[NaturalStep, float]:
    """Ours, full batch: ``GaussNewtonFisher`` on the gradient's own linearisation."""
    lin, g, before = linearized_gradient(p)
    fisher = GaussNewtonFisher(lin, p.log_guard, damping=s.damping)
    return natural_gradient_step(fisher, fisher.curvature, g, delta=s.delta, cg_iterations=s.cg_iterations), before


def update_gauss_newton_subsampled(p: Problem, s: Settings) -> tuple[NaturalStep, float]:
    """Ours: CG on the subsampled Fisher; the gradient and ``sᵀ F s`` on the full batch."""
    lin, g, before = linearized_gradient(p)
    gen = torch.Generator().manual_seed(s.seed + 1)
    sub = GaussNewtonFisher.from_module(p.net, p.states, p.log_guard, damping=s.damping, subsample=s.subsample, generator=gen)
    full = GaussNewtonFisher(lin, p.log_guard)
    return natural_gradient_step(sub, full.curvature, g, delta=s.delta, cg_iterations=s.cg_iterations), before


@dataclass(frozen=True)
class Update:
    natural: NaturalStep
    search: LineSearchResult
    step: Tensor
    """``θ_new − θ_old``: the line search's accepted step."""


def timed_update(p: Problem, s: Settings, natural_step: Callable[[Problem, Settings], tuple[NaturalStep, float]]) -> Update:
    """The natural step, then the line search (refitting to the measured KL up to twice); parameters restored after."""
    natural, before = natural_step(p, s)
    if natural.scaled.step is None:
        raise RuntimeError(f"{natural_step.__name__}: {natural.scaled.aborted}")

    def evaluate() -> Evaluation:  # one forward pass: the KL and the surrogate
        with torch.no_grad():
            z = p.net(p.states)
            return Evaluation(float(mean_kl(p.log_q_old, z, p.log_guard)), float(p.surrogate(z)))

    search = backtracking_line_search(
        p.net, natural.scaled.step, evaluate, surrogate_before=before, delta=s.delta, kl_fits=s.kl_fits, kl_fit_rtol=TARGET_KL_REL
    )
    step = flat_params(p.net) - p.theta
    set_flat_params(p.net, p.theta)
    if not search.accepted:
        raise RuntimeError(f"{natural_step.__name__}: line search: {search.reason}")
    return Update(natural, search, step)


# --- measurements ----------------------------------------------------------------------------


def bench_fvp(p: Problem, s: Settings) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(s.seed + 2)
    v = torch.randn(p.theta.numel(), generator=gen).to(p.theta.device)
    def kept_setup() -> Callable[[Tensor], Tensor]:
        theta = p.theta.clone().requires_grad_(True)
        (grad_kl,) = torch.autograd.grad(p.kl(theta), theta, create_graph=True)
        return lambda x: torch.autograd.grad(grad_kl @ x, theta, retain_graph=True)[0]

    def reused_setup(fraction: float | None) -> Callable[[Tensor], Tensor]:
        gen = torch.Generator().manual_seed(s.seed + 1)
        op = GaussNewtonFisher.from_module(p.net, p.states, p.log_guard, subsample=fraction, generator=gen)
        op.curvature(v)  # builds J v's closure: part of the set-up
        return op

    setup_s: dict[str, float] = {"double_backward": 0.0, "gauss_newton_plain": 0.0}
    setup_s["double_backward_kept"], kept = timed(s.device, kept_setup)
    setup_s["gauss_newton_reused"], reused = timed(s.device, lambda: reused_setup(None))
    setup_s["gauss_newton_subsampled"], sub = timed(s.device, lambda: reused_setup(s.subsample))
    fns: dict[str, Callable[[], Tensor]] = {
        "double_backward": lambda: fvp_double_backward(p.kl, p.theta, v),
        "double_backward_kept": lambda: kept(v),
        "gauss_newton_plain": lambda: fvp_gauss_newton(p.f, p.theta, p.log_guard, v),
        "gauss_newton_reused": lambda: reused(v),
        "gauss_newton_subsampled": lambda: sub(v),
    }
    results = best_of_interleaved(s.repeats, s.device, fns)
    rows: dict[str, Any] = {name: {"setup_s": setup_s[name], "fvp_s": results[name][0]} for name in fns}
    ref = results["double_backward"][1]
    base = rows["double_backward"]["fvp_s"]
    for row in rows.values():
        row["speedup"] = base / row["fvp_s"]
    for name, (_, out) in results.items():  # rounding, except for the subsample's sampling error
        if name != "double_backward":
            rows[name]["rel_error"] = float((out - ref).norm()) / float(ref.norm())
    return rows


def measured_kl(p: Problem, step: Tensor) -> float:
    with torch.no_grad():
        return float(p.kl(p.theta + step))


def bench_updates(p: Problem, s: Settings) -> dict[str, Any]:
    variants: dict[str, Callable[[Problem, Settings], tuple[NaturalStep, float]]] = {
        "double_backward": update_double_backward,
        "double_backward_kept": update_double_backward_kept,
        "gauss_newton": update_gauss_newton,
        "gauss_newton_subsampled": update_gauss_newton_subsampled,
    }
    rows: dict[str, Any] = {}
    fns: dict[str, Callable[[], Update]] = {name: partial(timed_update, p, s, natural_step) for name, natural_step in variants.items()}
    results = best_of_interleaved(s.update_repeats, s.device, fns)
    updates = {name: update for name, (_, update) in results.items()}
    for name, (seconds, u) in results.items():
        assert u.natural.scaled.step is not None
        rows[name] = {
            "update_s": seconds,
            "cg_iterations": u.natural.cg.iterations,
            "cg_residual": u.natural.cg.residual_norm,
            "curvature": u.natural.scaled.curvature,
            "eta": u.natural.scaled.multiplier,
            "model_kl_over_delta": measured_kl(p, u.natural.scaled.step) / s.delta,
            "line_search_tries": u.search.tries,
            "kl_fits": u.search.kl_fits,
            "fraction": u.search.fraction,
            "kl_over_delta": u.search.kl / s.delta,
            "improvement": u.search.improvement,
        }
    ref = updates["double_backward"].step
    for name, row in rows.items():
        row["speedup"] = rows["double_backward"]["update_s"] / row["update_s"]
        row["speedup_vs_kept"] = rows["double_backward_kept"]["update_s"] / row["update_s"]
        row["cosine"] = float(torch.nn.functional.cosine_similarity(updates[name].step, ref, dim=0))
    # the note: the baseline direction sized with the damped curvature sᵀ(F + λI)s
    x, (g, _) = updates["double_backward"].natural.cg.x, surrogate_gradient(p)
    damped = scale_step(x, rows["double_backward"]["curvature"] + s.damping * float(x @ x), g, s.delta)
    assert damped.step is not None
    return {
        "variants": rows,
        "damped_step_kl_over_delta": measured_kl(p, damped.step) / s.delta,
        "rayleigh_gradient": float(g @ fvp_double_backward(p.kl, p.theta, g)) / float(g @ g),  # gᵀFg/gᵀg: the Fisher's scale along g
    }


def verdict(updates: dict[str, Any]) -> dict[str, Any]:
    ours = updates["variants"]["gauss_newton_subsampled"]
    return {
        "speedup": ours["speedup"],
        "speedup_ok": ours["speedup"] >= TARGET_SPEEDUP,
        "cosine_ok": ours["cosine"] >= TARGET_COSINE,
        "kl_ok": abs(ours["kl_over_delta"] - 1.0) <= TARGET_KL_REL,
    }


def print_report(
    s: Settings, n_params: int, device_name: str, busy: float, fvp: dict[str, Any], updates: dict[str, Any], result: dict[str, Any]
) -> None:
    print(f"\nFisher-vector products: {s.states:,} states, PolicyNet {STATE_DIM}→{HIDDEN}→{HIDDEN}→{N_ACTIONS} ({n_params:,} parameters)")
    print(f"  {device_name}, {s.threads} threads ({busy:.1f} cores busy before), float32;", end=" ")
    print(f"λ = {s.damping}, δ = {s.delta}, subsample {s.subsample:.0%}")
    print(f"  {'per FVP':40} {'setup s':>9} {'FVP s':>9} {'vs DB':>7} {'rel err':>9}")
    labels = {
        "double_backward": "double backward (Spinning Up): baseline",
        "double_backward_kept": "double backward, graph kept (SB3)",
        "gauss_newton_plain": "Gauss-Newton, plain",
        "gauss_newton_reused": "Gauss-Newton, forward reused",
        "gauss_newton_subsampled": f"Gauss-Newton, reused, {s.subsample:.0%} subsample",
    }
    for key, label in labels.items():
        row = fvp[key]
        err = f"{row['rel_error']:.1e}" if "rel_error" in row else "-"
        print(f"  {label:40} {row['setup_s']:>9.3f} {row['fvp_s']:>9.3f} {row['speedup']:>6.1f}x {err:>9}")
    print(f"\n  whole update: gradient, CG {s.cg_iterations}, sᵀFs, β, line search (up to {s.kl_fits} refits to the measured KL)")
    print(f"  {'':40} {'s':>9} {'vs DB':>7} {'vs kept':>8} {'cos':>7} {'KL/δ':>7} {'model':>7} {'tries':>6}")
    labels = {
        "double_backward": "double backward: baseline",
        "double_backward_kept": "double backward, graph kept (SB3)",
        "gauss_newton": "Gauss-Newton, full batch",
        "gauss_newton_subsampled": f"Gauss-Newton, CG on {s.subsample:.0%}, sᵀFs on all",
    }
    for key, label in labels.items():
        row = updates["variants"][key]
        print(
            f"  {label:40} {row['update_s']:>9.3f} {row['speedup']:>6.1f}x {row['speedup_vs_kept']:>7.1f}x"
            f" {row['cosine']:>7.4f} {row['kl_over_delta']:>7.3f} {row['model_kl_over_delta']:>7.3f} {row['line_search_tries']:>6}"
        )
    print("  (cos: with the baseline's accepted step; KL/δ: of the accepted step; model: of β s, the quadratic model's step)")
    print(
        f"\n  baseline step sized with the damped sᵀ(F+λI)s instead: KL/δ = {updates['damped_step_kl_over_delta']:.3f};"
        f" gᵀFg/gᵀg = {updates['rayleigh_gradient']:.2e} (λ = {s.damping})"
    )
    ok = "yes" if result["speedup_ok"] and result["cosine_ok"] and result["kl_ok"] else "NO"
    print(
        f"  target: ≥ {TARGET_SPEEDUP:.0f}x at cos ≥ {TARGET_COSINE} and |KL/δ − 1| ≤ {TARGET_KL_REL}:"
        f" {result['speedup']:.1f}x, cos {result['cosine_ok']}, KL {result['kl_ok']} → {ok}"
    )


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, Path | None]:
    p = argparse.ArgumentParser(prog="python -m bench.fvp", description="Fisher-vector products and the natural-gradient update, timed.")
    p.add_argument("--states", type=int, default=65_536, help="logged states (default 65,536)")
    p.add_argument("--subsample", type=float, default=0.1, help="fraction of the states in the subsampled Fisher (default 0.1)")
    p.add_argument("--cg-iterations", type=int, default=10, help="CG iterations per update (default 10)")
    p.add_argument("--damping", type=float, default=0.1, help="CG damping λ (default 0.1)")
    p.add_argument("--delta", type=float, default=0.05, help="KL target δ (default 0.05)")
    p.add_argument("--kl-fits", type=int, default=2, help="line-search refits of the step to the measured KL (default 2)")
    p.add_argument("--blocked", type=float, default=0.2, help="fraction of guardrail entries blocked (default 0.2)")
    p.add_argument("--repeats", type=int, default=3, help="best of this many calls per FVP timing (default 3)")
    p.add_argument("--update-repeats", type=int, default=2, help="best of this many whole updates (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads (default: every core)")
    p.add_argument("--quick", action="store_true", help="smoke run: 8,192 states, 2 repeats, 1 update each")
    add_json_flag(p, "fvp.json")
    args = p.parse_args(argv)
    if args.quick:
        args.states, args.repeats, args.update_repeats = 8_192, 2, 1
    if not (256 <= args.states <= 1_048_576 and 0.0 < args.subsample <= 1.0 and 1 <= args.cg_iterations <= 100):
        p.error("--states must be in [256, 2^20], --subsample in (0, 1], --cg-iterations in [1, 100]")
    if not (args.damping >= 0 and 0 < args.delta <= 1 and 0 <= args.blocked < 0.8 and 0 <= args.kl_fits <= 5):
        p.error("--damping must be ≥ 0, --delta in (0, 1], --blocked in [0, 0.8), --kl-fits in [0, 5]")
    if not (1 <= args.repeats <= 20 and 1 <= args.update_repeats <= 10 and 1 <= args.threads <= 256):
        p.error("--repeats must be in [1, 20], --update-repeats in [1, 10], --threads in [1, 256]")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    settings = Settings(
        args.states,
        args.subsample,
        args.cg_iterations,
        args.damping,
        args.delta,
        args.kl_fits,
        args.blocked,
        args.repeats,
        args.update_repeats,
        args.seed,
        args.device,
        args.threads,
    )
    return settings, args.json


def main(argv: Sequence[str] | None = None) -> int:
    settings, json_path = parse_args(argv)
    torch.set_num_threads(settings.threads)
    started = time.time()
    busy = machine_busy_cores(1.0)
    if busy > BUSY_MACHINE_CORES:
        print(f"warning: {busy:.1f} cores were busy before the run: times are noisy; with as many threads as cores, very")
    cuda = settings.device.startswith("cuda")
    device_name = torch.cuda.get_device_name(torch.device(settings.device)) if cuda else f"cpu ({platform.processor() or 'unknown'})"
    problem = build_problem(settings)
    n_params = problem.theta.numel()
    timed(settings.device, lambda: update_gauss_newton(problem, settings))  # warm-up: lazy imports, allocator
    fvp = bench_fvp(problem, settings)
    updates = bench_updates(problem, settings)
    result = verdict(updates)
    print_report(settings, n_params, device_name, busy, fvp, updates, result)
    if json_path is not None:
        machine = {"busy_cores_before": round(busy, 2), "device": settings.device, "device_name": device_name,
                   "torch": torch.__version__}
        write_results(json_path, {
            **header("bench.fvp", started, argv, **machine),
            "settings": asdict(settings),
            "parameters": n_params,
            "fvp": fvp,
            "update": updates,
            "verdict": result,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
