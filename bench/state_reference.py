"""How much of the intent policy a policy of the served state can reach: imitation with the oracle's labels.

    .venv/bin/python -m bench.state_reference [--sessions 10000] [--rounds 4] [--seed 7] [--json]

The loop bench's 80 % target is a share of the intent policy (``simulator.reference``), which reads each shopper's
hidden intent and what the session has done so far (a coupon claimed, a share made, detail pages opened). The trained
policy sees neither: only its state (the bundle's feature encoder: item embedding, behaviour buckets, hour). This bench
asks what a policy of that state can reach when it is *told* the intent policy's action on every page it visits:
DAgger (Ross, Gordon & Bagnell 2011). Round 0 plays the intent policy and records (state, its action); each later
round plays the latest learner on fresh sessions, records the intent policy's action on the pages the learner
reaches, and refits on everything so far. The learner is a softmax classifier (one hidden layer, torch) of the state;
it is played two ways: its most likely action (``argmax``) and a draw from its probabilities (``sampled``: a hedge
where the state cannot tell whether the prompt was already made). With ``--context`` the state also gets the page type
and the cart count (what the guardrails see, but the policy network does not).

It is a reference, not a bound: a learner with the same state and reward feedback could in principle do better than
imitating a decider that sees more. But the loop's learner has far less to go on: bandit feedback on 20,000 sessions
a cycle, where this one gets the oracle's answer on every page. Truth on the loop bench's sessions (world 7, from
1,000,000), so its figures sit next to the loop's; always add_to_cart and the intent policy are scored on the same
sessions, and each learner's difference from them is paired.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np

from bench.loop import TRUTH_FIRST, constant, paired, play, public, scored
from bench.report import add_json_flag, header, write_results
from core.domain import ACTIONS, Action, PageType
from policy.features import FeatureEncoder, local_hour
from simulator.config import SimConfig
from simulator.reference import intent_policy
from simulator.world import PageView, ShopperSession, World
from weights.embedded import default_bundle
from weights.model_set import ModelSet

FIRST = 4_000_000  # the imitation's own sessions: a range no other bench plays
UTC = ZoneInfo("UTC")
CART_CAP = 4  # cart counts above this share one bucket in the --context features
Choose = Callable[[ShopperSession, PageView], Action]
Act = Callable[[np.ndarray, ShopperSession, PageView], Action]  # a decider given the page's state too


class StateFeatures:
    """A page as the policy network sees it (the bundle's encoder), optionally with page type and cart count."""

    def __init__(self, encoder: FeatureEncoder, context: bool) -> None:
        self.encoder, self.context = encoder, context
        self.dim = encoder.spec.state_dim + (len(PageType) + CART_CAP + 1 if context else 0)

    def of(self, session: ShopperSession, page: PageView) -> np.ndarray:
        request = session.request(page)
        state = self.encoder.encode_batch([request], [local_hour(request.event_time_s, UTC)])[0]
        if not self.context:
            return state
        extra = np.zeros(len(PageType) + CART_CAP + 1, dtype=np.float32)
        extra[list(PageType).index(page.page_type)] = 1.0
        extra[len(PageType) + min(page.cart_item_count, CART_CAP)] = 1.0
        return np.concatenate([state, extra])


class Imitator:
    """P(intent policy's action | state): one hidden layer, fitted by cross-entropy (torch), played in numpy."""

    def __init__(self, dim: int, hidden: int = 128, seed: int = 0) -> None:
        self.dim, self.hidden, self.seed = dim, hidden, seed
        self.weights: list[np.ndarray] = []

    def fit(self, x: np.ndarray, y: np.ndarray, epochs: int = 8, batch: int = 512, lr: float = 1e-3) -> float:
        """Fit on (x, y) from scratch; the training accuracy at the end."""
        import torch  # a bench dependency through the trainer's extra; the server never imports it

        torch.manual_seed(self.seed)
        net = torch.nn.Sequential(torch.nn.Linear(self.dim, self.hidden), torch.nn.ReLU(),
                                  torch.nn.Linear(self.hidden, len(ACTIONS)))
        opt = torch.optim.Adam(net.parameters(), lr=lr)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        order = torch.Generator().manual_seed(self.seed)
        for _ in range(epochs):
            for idx in torch.randperm(len(xt), generator=order).split(batch):  # type: ignore[no-untyped-call]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(xt[idx]), yt[idx]).backward()  # type: ignore[no-untyped-call]
                opt.step()
        with torch.no_grad():
            accuracy = float((net(xt).argmax(dim=1) == yt).float().mean())
        self.weights = [p.detach().numpy().copy() for p in net.parameters()]
        return accuracy

    def probabilities(self, state: np.ndarray) -> np.ndarray:
        w1, b1, w2, b2 = self.weights
        z = np.maximum(w1 @ state + b1, 0.0) @ w2.T + b2
        p = np.exp(z - z.max())
        return p / p.sum()  # type: ignore[no-any-return]


def recording(features: StateFeatures, act: Act, states: list[np.ndarray], labels: list[int]) -> Choose:
    """A decider that plays ``act`` and records each page's state with the intent policy's action there."""

    def choose(session: ShopperSession, page: PageView) -> Action:
        state = features.of(session, page)
        states.append(state)
        labels.append(ACTIONS.index(intent_policy(session, page)))  # read before the shopper responds
        return act(state, session, page)

    return choose


def playing(features: StateFeatures, act: Act) -> Choose:
    """``act`` as a decider of the loop bench's ``play``: each page's state computed for it."""
    return lambda session, page: act(features.of(session, page), session, page)


def the_intent_policy(state: np.ndarray, session: ShopperSession, page: PageView) -> Action:
    return intent_policy(session, page)  # what round 0 plays: it reads the session, not the state


def learner(model: Imitator, sampled: bool, seed: int) -> Act:
    """The imitation: its most likely action, or a draw from its probabilities."""
    rng = np.random.default_rng(seed)

    def act(state: np.ndarray, session: ShopperSession, page: PageView) -> Action:
        p = model.probabilities(state)
        return ACTIONS[int(rng.choice(len(p), p=p)) if sampled else int(np.argmax(p))]

    return act


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.state_reference", description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=10_000, help="sessions played per round (default 10,000)")
    p.add_argument("--rounds", type=int, default=4, help="DAgger rounds after the intent policy's own (default 4)")
    p.add_argument("--eval-sessions", type=int, default=20_000, help="truth sessions (default 20,000, the loop's)")
    p.add_argument("--seed", type=int, default=7, help="the world (default 7, the loop's)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--context", action="store_true", help="add page type and cart count to the state")
    add_json_flag(p, "state-reference.json")
    args = p.parse_args(argv)
    if not (200 <= args.sessions <= 100_000 and 0 <= args.rounds <= 10 and 200 <= args.eval_sessions <= 200_000):
        p.error("--sessions 200..100,000, --rounds 0..10, --eval-sessions 200..200,000")
    started = time.time()
    world = World(SimConfig(), args.seed)
    truth = range(TRUTH_FIRST, TRUTH_FIRST + args.eval_sessions)
    features = StateFeatures(ModelSet.load(default_bundle()).encoder, args.context)
    atc = scored("always add_to_cart", play(world, truth, constant(Action.ADD_TO_CART)), world, truth)
    oracle = scored("intent policy", play(world, truth, intent_policy), world, truth)
    print(f"always add_to_cart {atc['objective']['mean']:.2f}; intent policy {oracle['objective']['mean']:.2f}", flush=True)

    states: list[np.ndarray] = []
    labels: list[int] = []
    model = Imitator(features.dim, seed=args.seed)
    rounds: list[dict[str, Any]] = []
    act: Act = the_intent_policy
    for r in range(args.rounds + 1):
        sessions = range(FIRST + r * args.sessions, FIRST + (r + 1) * args.sessions)
        play(world, sessions, recording(features, act, states, labels))
        accuracy = model.fit(np.stack(states), np.asarray(labels, dtype=np.int64), epochs=args.epochs)
        entry: dict[str, Any] = {"round": r, "pages": len(labels), "train_accuracy": accuracy}
        for how in ("argmax", "sampled"):
            imitation = playing(features, learner(model, how == "sampled", args.seed + r))
            got = scored(f"imitation {how}", play(world, truth, imitation), world, truth)
            share = got["objective"]["mean"] / oracle["objective"]["mean"]
            entry[how] = {**public(got), "share_of_intent_policy": share,
                          "minus_always_add_to_cart": paired(got, atc), "minus_intent_policy": paired(got, oracle)}
            print(f"round {r} ({len(labels):,} pages, train accuracy {accuracy:.3f}) {how}: "
                  f"{got['objective']['mean']:.2f} [{got['objective']['ci_low']:.2f}, {got['objective']['ci_high']:.2f}], "
                  f"{share:.0%} of the intent policy", flush=True)
        rounds.append(entry)
        act = learner(model, sampled=True, seed=10_000 + r)  # the next round visits where this learner goes

    best = max((e[h] for e in rounds for h in ("argmax", "sampled")), key=lambda g: g["objective"]["mean"])
    last = rounds[-1]["sampled"]  # a fixed choice; the best of all is picked on the same sessions it is scored on
    print(f"last round, drawn: {last['objective']['mean']:.2f}, {last['share_of_intent_policy']:.0%} of the intent policy; "
          f"best of {2 * len(rounds)} (selected on these sessions, so optimistic): {best['name']} "
          f"{best['objective']['mean']:.2f}, {best['share_of_intent_policy']:.0%}")
    if args.json is not None:
        write_results(args.json, {**header("bench.state_reference", started, argv), "seed": args.seed,
                                  "context": args.context, "truth_sessions": [truth.start, truth.stop],
                                  "always_add_to_cart": public(atc), "intent_policy": public(oracle), "rounds": rounds,
                                  "last_round_drawn_share_of_intent_policy": last["share_of_intent_policy"],
                                  "best_share_of_intent_policy_selected": best["share_of_intent_policy"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
