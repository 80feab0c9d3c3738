"""FedLaAvg Algorithm 2: oldest-first selection and latest averaging worked by hand; Lemma 1's bound."""

import math

import numpy as np
import torch
from strategy_helpers import close, upd

from coordinator.strategies import FedLaAvg


def step(s, state, t, w, available, deltas):
    chosen = s.select(state, t, np.array(available, bool), np.random.default_rng(0))
    w, state = s.aggregate(state, t, w, {i: upd(i, deltas[i]) for i in chosen})
    return chosen, w, state


def test_fedlaavg_by_hand():
    s = FedLaAvg(beta=2 / 3)  # N = 3, K = round(2/3·3) = 2
    w = torch.zeros(4)
    state = s.init_state(3, w)
    # Round 0, all available, R = [-1,-1,-1]: ties by index -> {0,1}
    #   avg = (1/3)([3,0,0,0] + [0,3,0,0]) = [1,1,0,0]; w1 = [-1,-1,0,0]; R = [0,0,-1]
    chosen, w, state = step(s, state, 0, w, [1, 1, 1], {0: [3, 0, 0, 0], 1: [0, 3, 0, 0]})
    assert chosen == [0, 1] and close(w, [-1, -1, 0, 0])
    # Round 1, client 0 unavailable: 2 (R=-1) then 1 (R=0) -> {1,2}
    #   avg += (1/3)(([0,0,0,3] - [0,3,0,0]) + ([0,0,3,0] - 0)) = [1,1,0,0] + [0,-1,1,1] = [1,0,1,1]
    #   w2 = [-2,-1,-1,-1]; R = [0,1,1]
    chosen, w, state = step(s, state, 1, w, [0, 1, 1], {1: [0, 0, 0, 3], 2: [0, 0, 3, 0]})
    assert chosen == [1, 2] and close(w, [-2, -1, -1, -1])
    # Round 2, all available: 0 (R=0), then the tie 1, 2 (R=1) -> 1: {0,1}
    #   latest: U0 = [0,6,0,0], U1 = [3,3,0,0], U2 = [0,0,3,0]; avg = [3,9,3,0]/3 = [1,3,1,0]
    #   w3 = [-3,-4,-2,-1]; R = [2,2,1]
    chosen, w, state = step(s, state, 2, w, [1, 1, 1], {0: [0, 6, 0, 0], 1: [3, 3, 0, 0]})
    assert chosen == [0, 1] and close(w, [-3, -4, -2, -1])
    assert state["last"].tolist() == [2, 2, 1]
    assert close(state["avg"], state["latest"].mean(0).tolist())  # invariant (3): u = mean of latest
    # Round 3, nobody available: line 10 re-applies u: w4 = [-4,-7,-3,-1]
    chosen, w, state = step(s, state, 3, w, [0, 0, 0], {})
    assert chosen == [] and close(w, [-4, -7, -3, -1])


def test_fedlaavg_lost_update_keeps_the_client_oldest():
    s = FedLaAvg(beta=1 / 3)  # K = 1
    w = torch.zeros(2)
    state = s.init_state(3, w)
    assert s.select(state, 0, np.ones(3, bool), None) == [0]
    w, state = s.aggregate(state, 0, w, {})  # client 0's update never arrived
    assert s.select(state, 1, np.ones(3, bool), None) == [0]


def worst_staleness(n: int, beta: float, period: int, offset: np.ndarray, p_extra: float, seed: int) -> int:
    s = FedLaAvg(beta=beta)
    rng = np.random.default_rng(seed)
    w = torch.zeros(3)
    state = s.init_state(n, w)
    worst = 0
    for t in range(300):
        # Assumption 4: every client available at least once in any E successive rounds (plus random extras)
        available = ((t + offset) % period == 0) | (rng.random(n) < p_extra)
        chosen = s.select(state, t, available, rng)
        assert len(chosen) == min(s.k(n), int(available.sum()))
        w, state = s.aggregate(state, t, w, {i: upd(i, [0.0, 0.0, 0.0]) for i in chosen})
        worst = max(worst, int((t - state["last"]).max()))
    return worst


def test_fedlaavg_staleness_bound_lemma1():
    n, beta, period = 10, 0.2, 4  # K = 2
    bound = math.ceil(n / 2) * period - 1  # Lemma 1: t - T_i <= ⌈N/K⌉E - 1 = 19
    # worst case: everyone available together once every E rounds only; 2 of 10 served per window, so a
    # client waits 5 windows: the bound is reached exactly
    assert worst_staleness(n, beta, period, np.zeros(n, int), 0.0, seed=0) == bound
    # random phases and extra availability: below the bound
    offsets = np.random.default_rng(7).integers(0, period, size=n)
    assert period <= worst_staleness(n, beta, period, offsets, 0.15, seed=7) <= bound
