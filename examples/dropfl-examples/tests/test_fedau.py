"""FedAU (Wang & Ji 2023): the online interval estimates and the weighted step, worked by hand."""

from __future__ import annotations

import pytest
import torch
from helpers import update, vec

from dropfl_examples.fedau import FedAU


def test_six_rounds_by_hand():
    # N = 4, K = 3, η = 1.  Client 0 takes part in rounds 0-4, client 1 in rounds 1 and 3, client 2 in round 4,
    # client 3 never; nobody in round 5.  Step: w ← w − (1/4) Σ_{n∈S_t} ω_n Δ_n, ω_n from the intervals that
    # ended before round t (1 before the first one).
    s = FedAU(FedAU.Options(cutoff=3))
    w = vec(0, 0)
    state = s.init_state(4, w)
    # round 0: ω_0 = 1 (no interval yet).  w = −(1/4)·(4, 0) = (−1, 0).  Then client 0's interval of 1 ends: Ω_0 = 1
    w, state = s.aggregate(state, 0, w, {0: update(0, [4, 0])})
    assert torch.equal(w, vec(-1, 0))
    # round 1: ω_0 = 1, ω_1 = 1 (no interval yet).  Σ = (4, 0) + (0, 4); w −= (1, 1).  Then Ω_1 = S_1 = 2
    w, state = s.aggregate(state, 1, w, {0: update(0, [4, 0]), 1: update(1, [0, 4])})
    assert torch.equal(w, vec(-2, -1))
    assert state["omega"].tolist() == [1.0, 2.0, 0.0, 0.0] and state["intervals"].tolist() == [2, 1, 0, 0]
    # round 2: client 0 alone, w −= (1/4)·(4, 4).  Then S_2 = S_3 = 3 = K: both cut off, Ω_2 = Ω_3 = 3
    w, state = s.aggregate(state, 2, w, {0: update(0, [4, 4])})
    assert torch.equal(w, vec(-3, -2))
    assert state["omega"].tolist() == [1.0, 2.0, 3.0, 3.0] and state["since"].tolist() == [0, 1, 0, 0]
    # round 3: ω_1 = 2.  Σ = 2·(2, 0) = (4, 0); w −= (1, 0).  Then client 1's interval of 2: Ω_1 = (1·2 + 2)/2 = 2
    w, state = s.aggregate(state, 3, w, {0: update(0, [0, 0]), 1: update(1, [2, 0])})
    assert torch.equal(w, vec(-4, -2))
    # round 4: ω_2 = 3 (its cut-off interval).  Σ = 3·(4, 4) = (12, 12); w −= (3, 3).  Then Ω_2 = (1·3 + 2)/2 = 2.5
    w, state = s.aggregate(state, 4, w, {0: update(0, [0, 0]), 2: update(2, [4, 4])})
    assert torch.equal(w, vec(-7, -5))
    # round 5: nobody: w stays; client 3's second interval is cut at K: Ω_3 = (1·3 + 3)/2 = 3
    w5, state = s.aggregate(state, 5, w, {})
    assert torch.equal(w5, w)
    assert state["omega"].tolist() == [1.0, 2.0, 2.5, 3.0]
    assert state["intervals"].tolist() == [5, 2, 2, 2]
    assert state["since"].tolist() == [1, 2, 1, 0]
    # the next round's weights: ω_2 = 2.5 now
    w6, _ = s.aggregate(state, 6, w, {2: update(2, [8, 0])})
    assert torch.equal(w6, w - vec(5, 0))   # (1/4)·2.5·(8, 0)


def test_everyone_every_round_is_fedavg():
    # ω_n = 1 for all: w ← w − (η/N)·Σ Δ_n = w − η·mean Δ; η = 0.5: (2, 2) − 0.5·(1, 1)
    s = FedAU(FedAU.Options(server_lr=0.5))
    w = vec(2, 2)
    state = s.init_state(2, w)
    w, state = s.aggregate(state, 0, w, {0: update(0, [2, 0]), 1: update(1, [0, 2])})
    assert torch.equal(w, vec(1.5, 1.5)) and state["omega"].tolist() == [1.0, 1.0]


def test_weights_never_exceed_the_cutoff():
    s = FedAU(FedAU.Options(cutoff=4))
    state = s.init_state(3, vec(0))
    w = vec(0)
    for t in range(40):   # client 0 every 10th round: its intervals are cut at K = 4, so Ω_0 stays ≤ 4
        w, state = s.aggregate(state, t, w, {0: update(0, [1])} if t % 10 == 9 else {})
    assert float(state["omega"].max()) <= 4.0
    assert state["omega"][1].item() == 4.0   # never seen: every interval is K long


def test_bad_options():
    with pytest.raises(ValueError, match="cutoff must be an integer"):
        FedAU.Options(cutoff=0)
    with pytest.raises(ValueError, match="server_lr"):
        FedAU.Options(server_lr=-1.0)
    assert FedAU().options.cutoff == 50
