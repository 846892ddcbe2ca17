"""η-spike auto-labels for the guard, in closed form: which updates spike, which rows of theirs are labelled."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer.guard_spikes import SpikeLog, SpikeRule, eta_spikes, spike_labels

NAN = math.nan


def test_spikes_against_the_mean_of_the_earlier_multipliers() -> None:
    # t=0, 1: fewer than two earlier; t=2: 2.5 > 2·mean(1, 1); t=3: 1 < 2·1.5; t=4: aborted;
    # t=5: 10 > 2·mean(1, 1, 2.5, 1) = 2.75 (the aborted one is in no mean)
    assert eta_spikes([1.0, 1.0, 2.5, 1.0, NAN, 10.0]).tolist() == [False, False, True, False, False, True]
    assert eta_spikes([1.0, 1.0, 2.0]).tolist() == [False, False, False]  # exactly k times the mean is no spike
    assert eta_spikes([1.0, 3.0], SpikeRule(min_history=1)).tolist() == [False, True]
    assert eta_spikes([1.0, 3.0]).tolist() == [False, False]  # one earlier value is too little history by default
    assert eta_spikes([NAN, 1.0, NAN, 1.0, 2.1]).tolist() == [False, False, False, False, True]
    assert eta_spikes([2.0, 2.0, 5.0], SpikeRule(factor=3.0)).tolist() == [False, False, False]
    assert eta_spikes([]).tolist() == []


def test_labels_are_the_lowest_negative_advantages_of_spiking_batches() -> None:
    advantages = np.zeros(40)
    advantages[0:10] = np.arange(-5.0, 5.0)  # batch A: −5 … 4
    advantages[10:20] = np.arange(-5.0, 5.0)  # batch B: the same values, but its update does not spike
    advantages[20:30] = np.arange(1.0, 11.0)  # batch C: all positive
    advantages[30:40] = [-1.0, -1.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # batch D: ties at the cut
    a, b, c, d = (np.arange(lo, lo + 10) for lo in (0, 10, 20, 30))
    etas = [1.0, 1.0, 5.0, 1.0, 9.0, 20.0]
    batches = [b, b, a, b, c, d]  # spikes: updates 2 (A), 4 (C), 5 (D)
    out = spike_labels(etas, batches, advantages, SpikeRule(quantile=0.2))
    assert out.spiked.tolist() == [False, False, True, False, True, True]
    # A: the 0.2-quantile of ten values (inverted CDF) is the 2nd smallest, −4: rows 0, 1.
    # C: its two lowest are positive: the step pushes towards them, nothing labelled.
    # D: the 2nd smallest is −1, tied three times: all three.
    assert np.flatnonzero(out.harmful).tolist() == [0, 1, 30, 31, 32]
    assert out.metrics() == {"guard_eta_spike_updates": 3.0, "guard_eta_spike_rows": 5.0, "guard_eta_spike_factor": 2.0,
                             "guard_eta_spike_quantile": 0.2}


def test_rows_in_several_spiking_batches_are_labelled_once_and_order_does_not_matter() -> None:
    advantages = np.array([-3.0, -2.0, -1.0, 1.0, 2.0, 3.0])
    batches = [np.array([3, 4, 5]), np.array([4, 5, 3]), np.array([2, 0, 5]), np.array([5, 0, 1])]
    out = spike_labels([1.0, 1.0, 4.0, 9.0], batches, advantages, SpikeRule(quantile=0.34))  # ⌈0.34·3⌉ = 2 rows a batch
    assert np.flatnonzero(out.harmful).tolist() == [0, 1, 2]  # {0, 2} ∪ {0, 1}
    assert spike_labels([1.0, 1.0, 4.0], batches[:3], advantages, SpikeRule(quantile=1.0)).harmful.tolist() == [
        True, False, True, False, False, False]  # q = 1: every negative row of the batch


def test_log_records_the_loop_and_rejects_bad_input() -> None:
    log = SpikeLog()
    for eta, rows in ((1.0, [0, 1]), (1.0, [2, 3]), (NAN, [0, 2]), (7.0, [1, 3])):
        log.record(eta, np.array(rows))
    advantages = np.array([0.5, -0.5, 1.0, -2.0])
    out = log.labels(advantages, SpikeRule(quantile=0.5))
    assert out.spiked.tolist() == [False, False, False, True] and out.harmful.tolist() == [False, False, False, True]
    with pytest.raises(ValueError, match="one per update"):
        spike_labels([1.0], [], advantages)
    with pytest.raises(ValueError, match="outside"):
        spike_labels([1.0, 1.0, 5.0], [[0], [0], [4]], advantages)
    with pytest.raises(ValueError, match="NaN"):
        spike_labels([], [], np.array([0.0, NAN]))
    with pytest.raises(ValueError, match="factor"):
        SpikeRule(factor=1.0)
    with pytest.raises(ValueError, match="quantile"):
        SpikeRule(quantile=0.0)
    with pytest.raises(ValueError, match="min_history"):
        SpikeRule(min_history=0)
