"""Logs → the trainer's arrays: a session split, episodes in order, states, returns, guard labels."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from experience.attribution import AttributionConfig
from experience.engagement import step_weights
from experience.returns import discounted_returns, fit_reward_scale
from experience.schema import ENGAGEMENTS
from experience.sessions import EpisodeConfig, Episodes, build_episodes, split_by_session
from trainer.config import TrainConfig
from trainer.guard_labels import harmful_labels
from trainer.replay import LoggedSteps, logged_steps
from weights.model_set import ModelSet

FloatArray = npt.NDArray[np.float64]


GATE_SPLIT_SALT = b"gate-split"  # independent of the guard's own threshold split inside the training side


def heldout_sessions(session_ids: pa.ChunkedArray | pa.Array, fraction: float, seed: int) -> npt.NDArray[np.bool_]:
    """Per row: whether its session is held out for the gate (``split_by_session``, salted for the gate)."""
    return split_by_session(session_ids.to_numpy(zero_copy_only=False), fraction, seed, GATE_SPLIT_SALT)


Tables = tuple[pa.Table, pa.Table]


def split(decisions: pa.Table, outcomes: pa.Table, fraction: float, seed: int) -> tuple[Tables, Tables]:
    """(train decisions, train outcomes), (held-out decisions, held-out outcomes), by session."""
    return side(decisions, outcomes, fraction, seed, heldout=False), side(decisions, outcomes, fraction, seed, heldout=True)


def side(decisions: pa.Table, outcomes: pa.Table, fraction: float, seed: int, *, heldout: bool) -> Tables:
    """One side of ``split``, without copying the other (the gate reads only the held-out side)."""
    d_held = heldout_sessions(decisions.column("session_id"), fraction, seed)
    o_held = heldout_sessions(outcomes.column("session_id"), fraction, seed)
    return decisions.filter(pa.array(d_held == heldout)), outcomes.filter(pa.array(o_held == heldout))


def training_rows(decisions: pa.Table, outcomes: pa.Table, fraction: float, seed: int) -> tuple[npt.NDArray[np.int64], pa.Table]:
    """The training side as row indices of ``decisions`` (no copy of the table) and its outcomes."""
    d_held = heldout_sessions(decisions.column("session_id"), fraction, seed)
    return np.flatnonzero(~d_held).astype(np.int64), training_reports(outcomes, fraction, seed)


def training_reports(reports: pa.Table, fraction: float, seed: int) -> pa.Table:
    """The rows of ``reports`` (outcomes, engagement reports: a kind with a ``session_id``) whose sessions are on the
    training side."""
    if reports.num_rows == 0:
        return reports
    return reports.filter(pa.array(~heldout_sessions(reports.column("session_id"), fraction, seed)))


def episode_config(config: TrainConfig) -> EpisodeConfig:
    return EpisodeConfig(horizon_s=config.horizon_hours * 3600.0, open_terminal_reward=config.open_terminal_reward,
                         attribution=AttributionConfig())


@dataclass(slots=True)
class Experience:
    """One side of the split, every per-step array in episode order."""

    decisions: pa.Table  # the logged rows, in episode order, without their item embeddings (in ``steps.states``)
    episodes: Episodes  # rows re-indexed: row i of ``decisions`` is step i
    steps: LoggedSteps  # states, contexts, actions, propensities (for the model's feature spec)
    returns: FloatArray  # (N,) discounted returns of the (normalised) rewards
    harmful: npt.NDArray[np.bool_]  # (N,) guard labels
    reward_scale: dict[str, Any]
    engagement: dict[str, Any] | None = None  # what the engagement weights' join used and left out (None: weights off)


def experience(decisions: pa.Table, outcomes: pa.Table, model: ModelSet, config: TrainConfig,
               rows: npt.NDArray[np.int64] | None = None, gather: Callable[[FloatArray], FloatArray] | None = None,
               engagements: pa.Table | None = None) -> Experience:
    """The experience of ``decisions`` (only its ``rows``, when given: the training side of a window, which is then
    never copied whole; the item embeddings go from the window's column straight into the states, in episode order).
    On ranks that each hold a shard of the sessions, ``gather`` (``Reducer.gather``) collects every rank's non-zero
    rewards, so that the reward scale is the union's. With ``config.engagement_weights`` each step's reward is
    multiplied by its confidence weight from ``engagements`` (the same sessions' reports) before the returns."""
    narrow = decisions.drop_columns(["item_embedding"])
    if rows is not None:
        narrow = narrow.take(pa.array(rows))
    episodes = build_episodes(narrow, outcomes, episode_config(config))
    ordered = narrow.take(pa.array(episodes.rows))
    del narrow
    harmful = harmful_labels(ordered, outcomes, config.guard)
    rewards = episodes.rewards
    joined: dict[str, Any] | None = None
    if config.engagement_weights is not None:
        reports = engagements if engagements is not None else ENGAGEMENTS.empty_table()
        weights, join = step_weights(ordered, episodes, reports, config.engagement_weights, config.horizon_hours * 3600.0)
        rewards, joined = rewards * weights, join.to_dict()
    scale: dict[str, Any] = {}
    if config.normalize_rewards:
        nonzero = rewards[rewards != 0.0]
        everyone = nonzero if gather is None else gather(nonzero)  # all ranks take part, with or without rewards
        fitted = fit_reward_scale(everyone)  # the quantiles are of the non-zero rewards: the same as of all
        rewards, scale = fitted.apply(rewards), fitted.to_dict()
    returns = discounted_returns(rewards, episodes.starts, episodes.lengths, config.gamma)
    reindexed = dataclasses.replace(episodes, rows=np.arange(len(ordered), dtype=np.int64))
    order = episodes.rows if rows is None else rows[episodes.rows]
    return Experience(ordered, reindexed, logged_steps(decisions, model, order, ordered), returns, harmful, scale, joined)
