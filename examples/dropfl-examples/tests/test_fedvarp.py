"""FedVARP (Jhunjhunwala et al. 2022): v = (1/|S|) Σ_S (Δ_i − y_i) + (1/N) Σ_j y_j, worked by hand."""

from __future__ import annotations

import dropfl
import pytest
import torch
from helpers import update, vec

from dropfl_examples.fedvarp import FedVARP


def test_three_rounds_by_hand():
    # N = 4, η_g = 1, w_0 = 0, y = 0.
    s = FedVARP()
    w = vec(0, 0)
    state = s.init_state(4, w)
    # round 0: clients 0, 1: (1/2)((4, 0) + (0, 4)) + 0 = (2, 2);  y_0 = (4, 0), y_1 = (0, 4)
    w, state = s.aggregate(state, 0, w, {0: update(0, [4, 0]), 1: update(1, [0, 4])})
    assert torch.equal(w, vec(-2, -2))
    # round 1: client 0: ((8, 8) − (4, 0)) + (1/4)((4, 0) + (0, 4)) = (4, 8) + (1, 1) = (5, 9);  y_0 = (8, 8)
    w, state = s.aggregate(state, 1, w, {0: update(0, [8, 8])})
    assert torch.equal(w, vec(-7, -11))
    # round 2: client 2 (y_2 = 0): (4, 4) + (1/4)((8, 8) + (0, 4)) = (4, 4) + (2, 3) = (6, 7)
    w, state = s.aggregate(state, 2, w, {2: update(2, [4, 4])})
    assert torch.equal(w, vec(-13, -18))
    assert torch.equal(state["y"][0:4], torch.tensor([[8, 8], [0, 4], [4, 4], [0, 0]], dtype=torch.float32))
    # round 3: nobody: w and y stay
    w3, state = s.aggregate(state, 3, w, {})
    assert torch.equal(w3, w)


def test_server_lr_and_full_participation_is_fedavg():
    # everyone, first round: v = mean Δ = (1, 1); η_g = 0.5: w = (1, 1) − 0.5·(1, 1)
    s = FedVARP(FedVARP.Options(server_lr=0.5))
    w = vec(1, 1)
    w, state = s.aggregate(s.init_state(2, w), 0, w, {0: update(0, [2, 0]), 1: update(1, [0, 2])})
    assert torch.equal(w, vec(0.5, 0.5))
    # second round, everyone again: the y terms cancel, v = mean Δ = (2, 2)
    w, state = s.aggregate(state, 1, w, {0: update(0, [4, 0]), 1: update(1, [0, 4])})
    assert torch.equal(w, vec(-0.5, -0.5))


def test_is_a_strategy_with_a_table():
    s = FedVARP()
    assert isinstance(s, dropfl.StrategyProtocol) and s.tables == ("y",)
    with pytest.raises(ValueError, match="server_lr"):
        FedVARP.Options(server_lr=0.0)
