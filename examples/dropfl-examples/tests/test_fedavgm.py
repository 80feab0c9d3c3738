"""FedAvgM (Hsu et al. 2019): rounds worked by hand on two-coordinate vectors."""

from __future__ import annotations

import pytest
import torch
from helpers import update, vec

from dropfl_examples.fedavgm import FedAvgM


def test_two_rounds_by_hand():
    # β = 0.5, η_s = 2.  w_0 = (1, 2), v = 0.
    s = FedAvgM(FedAvgM.Options(momentum=0.5, server_lr=2.0))
    w = vec(1, 2)
    state = s.init_state(2, w)
    # round 0: Δ̄ = ((1, 0) + (0, 2)) / 2 = (0.5, 1);  v = (0.5, 1);  w = (1, 2) − 2·(0.5, 1) = (0, 0)
    w, state = s.aggregate(state, 0, w, {0: update(0, [1, 0]), 1: update(1, [0, 2])})
    assert torch.equal(state["v"], vec(0.5, 1))
    assert torch.equal(w, vec(0, 0))
    # round 1: only client 0, Δ̄ = (1, 1);  v = 0.5·(0.5, 1) + (1, 1) = (1.25, 1.5);  w = −2·(1.25, 1.5) = (−2.5, −3)
    w, state = s.aggregate(state, 1, w, {0: update(0, [1, 1])})
    assert torch.equal(state["v"], vec(1.25, 1.5))
    assert torch.equal(w, vec(-2.5, -3))
    # round 2: no update arrived: w and v stay
    w2, state2 = s.aggregate(state, 2, w, {})
    assert torch.equal(w2, w) and torch.equal(state2["v"], vec(1.25, 1.5))


def test_samples_weighting_by_hand():
    # n_0 = 1, n_1 = 3: Δ̄ = 0.25·(4, 0) + 0.75·(0, 4) = (1, 3); defaults β = 0.9, η_s = 1: w = (1, 3) − (1, 3) = 0
    s = FedAvgM(FedAvgM.Options(weighting="samples"))
    w = vec(1, 3)
    w, state = s.aggregate(s.init_state(2, w), 0, w, {0: update(0, [4, 0], 1), 1: update(1, [0, 4], 3)})
    assert torch.equal(w, vec(0, 0)) and torch.equal(state["v"], vec(1, 3))


def test_zero_momentum_is_fedavg():
    s = FedAvgM(FedAvgM.Options(momentum=0.0))
    w = vec(3, 3)
    state = s.init_state(2, w)
    for t in range(3):   # every round the plain average: (2, 0) and (0, 2) → (1, 1)
        w, state = s.aggregate(state, t, w, {0: update(0, [2, 0]), 1: update(1, [0, 2])})
    assert torch.equal(w, vec(0, 0))


def test_defaults_and_bad_options():
    assert FedAvgM().options == FedAvgM.Options(momentum=0.9, server_lr=1.0, weighting="uniform")
    with pytest.raises(ValueError, match="momentum must be in"):
        FedAvgM.Options(momentum=1.5)
    with pytest.raises(ValueError, match="server_lr must be a number > 0"):
        FedAvgM.Options(server_lr=0)
    with pytest.raises(ValueError, match="weighting must be one of uniform, samples"):
        FedAvgM.Options(weighting="by-size")
