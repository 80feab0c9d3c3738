"""Markov on/off availability: the chain's rule, its reproducibility, its stationary rate, its reasons."""

from __future__ import annotations

import dropfl
import numpy as np
import pytest

from dropfl_examples.markov import MarkovOnOff


def chain(**options) -> MarkovOnOff:
    return MarkovOnOff(8, seed=3, first_round_all=False, options=MarkovOnOff.Options(**options))


def test_one_transition_by_hand():
    m = chain(p_drop=0.25, p_return=0.5)
    before, after = m.state(4), m.state(5)
    u = np.random.default_rng([3, 5, 0x3A4C]).random(8)   # round 5's draws (MarkovOnOff.chain_rng)
    for i in range(8):   # on stays on iff u ≥ p_drop; off comes back iff u < p_return
        assert after[i] == (u[i] >= 0.25 if before[i] else u[i] < 0.5)


def test_deterministic_chains():
    assert all(chain(p_drop=0.0, p_return=1.0).round(t).available.all() for t in range(6))        # always on
    off = chain(p_drop=1.0, p_return=0.0)                                                          # P(on) = 0
    assert not any(off.round(t).available.any() for t in range(6))
    flip = chain(p_drop=1.0, p_return=1.0)                                                         # flips
    first = flip.state(0)
    for t in range(1, 6):
        assert np.array_equal(flip.state(t), first ^ bool(t % 2))


def test_any_order_same_answer_and_reasons():
    a, b = chain(), chain()
    forward = [a.round(t) for t in range(12)]
    for t in (11, 3, 7, 0):   # a fresh instance asked out of order (a resume, a replay)
        r = b.round(t)
        assert np.array_equal(r.available, forward[t].available) and r.reasons == forward[t].reasons
    for r in forward:         # every absent client has its reason, every present one none
        assert set(r.reasons) == set(np.flatnonzero(~r.available).tolist())
        assert set(r.reasons.values()) <= {"model_draw"} and "model_draw" in dropfl.REASONS
    assert isinstance(a, dropfl.AvailabilitySource)


def test_first_round_all_and_min_active():
    m = MarkovOnOff(8, seed=3, first_round_all=True, min_active=3, options=MarkovOnOff.Options(1.0, 0.0))
    assert m.round(0).available.all()                      # --first-round-all
    assert [int(m.round(t).available.sum()) for t in range(1, 4)] == [3, 3, 3]   # everyone off: 3 drawn instead


def test_stationary_rate_and_mean_absence():
    # 4 000 clients × 200 rounds, p_drop = 0.2, p_return = 0.3: P(on) = 0.3 / 0.5 = 0.6; absences last
    # 1 / 0.3 rounds on average. Bounds: 5 standard errors of the pooled estimates (seeded, so exact anyway).
    m = MarkovOnOff(4000, seed=1, first_round_all=False, options=MarkovOnOff.Options(p_drop=0.2, p_return=0.3))
    states = np.stack([m.state(t) for t in range(200)])
    assert abs(states.mean() - 0.6) < 0.01
    was_off = ~states[:-1]
    returned = states[1:][was_off].mean()                  # P(on at t | off at t − 1)
    assert abs(returned - 0.3) < 5 * np.sqrt(0.3 * 0.7 / was_off.sum())


def test_bad_options():
    with pytest.raises(ValueError, match="p_drop must be in"):
        MarkovOnOff.Options(p_drop=1.2)
    with pytest.raises(ValueError, match="cannot both be 0"):
        MarkovOnOff.Options(p_drop=0.0, p_return=0.0)
    assert MarkovOnOff(4).options == MarkovOnOff.Options(0.2, 0.5)
