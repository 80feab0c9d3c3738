"""FL-FDMS: eq. (14)/(15) and substitution worked by hand, complexity reduction, FedAvg equivalence and
friend discovery in a clustered toy."""

import numpy as np
import pytest
import torch
from strategy_helpers import close, random_rounds, run, upd

from coordinator.strategies import FDMS, FedAvg

# 3 clients, 4-dim deltas, w0 = 0. Round 0: everyone; round 1: client 2 drops; round 2: client 0 drops.
ROUNDS = [
    {0: [1, 0, 0, 0], 1: [1, 1, 0, 0], 2: [1, 0, 1, 0]},
    {0: [2, 0, 0, 0], 1: [0, 2, 0, 0]},
    {1: [0, 1, 0, 1], 2: [0, 0, 0, 2]},
]
R_HALF = 0.5 * (2 ** -0.5 + 1)  # ½(1/√2 + 1) = 0.853553


def test_fdms_by_hand():
    ws, state = run(FDMS(), 3, ROUNDS)
    sim = state["sim"]
    # Round 0: cos(d0,d1) = cos(d0,d2) = 1/√2 -> r = 0.853553; cos(d1,d2) = 1/2 -> r = 0.75
    #   w1 = -mean = -[3,1,1,0]/3
    assert close(ws[0], [-1, -1 / 3, -1 / 3, 0])
    # Round 1, S = {0,1}: r01 = ½(0+1) = 0.5 -> R01 = (1·0.853553 + 0.5)/2 = 0.676777
    #   dropped 2: R20 = 0.853553 > R21 = 0.75 -> friend 0; Δ = (2·d0 + d1)/3 = [4/3,2/3,0,0]
    #   w2 = [-7/3,-1,-1/3,0]
    assert close(ws[1], [-7 / 3, -1, -1 / 3, 0])
    # Round 2, S = {1,2}: cos(d1,d2) = 2/(√2·2) = 1/√2 -> r = 0.853553; R12 = (0.75 + 0.853553)/2 = 0.801777
    #   dropped 0: R01 = 0.676777 < R02 = 0.853553 -> friend 2; Δ = (d1 + 2·d2)/3 = [0,1/3,0,5/3]
    #   w3 = [-7/3,-4/3,-1/3,-5/3]
    assert close(ws[2], [-7 / 3, -4 / 3, -1 / 3, -5 / 3])
    assert sim[0, 1] == pytest.approx((R_HALF + 0.5) / 2) and sim[1, 0] == sim[0, 1]
    assert sim[0, 2] == pytest.approx(R_HALF)
    assert sim[1, 2] == pytest.approx((0.75 + R_HALF) / 2)
    assert state["count"][0, 1] == 2 and state["count"][0, 2] == 1 and state["count"][1, 2] == 2
    assert state["friend"].tolist() == [2, -1, -1]
    assert state["pairs"] == 5  # 3 + 1 + 1 pairs


def test_fdms_server_lr_scales_the_step():
    ws, _ = run(FDMS(server_lr=0.1), 3, ROUNDS[:1])
    assert close(ws[0], [-0.1, -0.1 / 3, -0.1 / 3, 0])


def test_fdms_full_participation_equals_fedavg():
    rounds = random_rounds(n=5, m=6, rounds=5, seed=6, p_active=1.1)
    for a, b in zip(run(FDMS(), 5, rounds)[0], run(FedAvg(), 5, rounds)[0]):
        assert torch.allclose(a, b, atol=1e-5)


def test_theta_schedule_matches_the_digest_table():
    # fdms.md §2.4 (K = 20, p = 0.01, B_max = 3, β = 0.5, T = 500, δ_f = 0.01): Θ_1 = 8.636, Θ_100 = 0.873
    case1, case2 = FDMS(cr="case1"), FDMS(cr="case2")
    assert case1.theta(0, 20) == pytest.approx(8.636, abs=1e-3)
    assert case1.theta(99, 20) == pytest.approx(0.873, abs=1e-3)
    assert case1.theta(499, 20) == pytest.approx(0.396, abs=1e-3)
    assert case2.theta(0, 20) == pytest.approx(4.318, abs=1e-3)
    assert case2.theta(99, 20) == pytest.approx(0.436, abs=1e-3)


class FixedTheta(FDMS):
    def theta(self, t, n_clients):
        return 0.1


def test_complexity_reduction_by_hand():
    ws, state = run(FixedTheta(cr="case1"), 3, ROUNDS)
    # after round 0: row 1: best R10 = 0.853553, R12 = 0.75, gap 0.1036 >= 0.1 -> 2 leaves C^1; likewise 1 leaves C^2
    # after round 1: row 0: R02 = 0.853553, R01 = 0.676777, gap 0.177 -> 1 leaves C^0
    # round 2, S = {1,2}: 2 ∉ C^1 and 1 ∉ C^2 -> pair not computed, R12 stays 0.75 with count 1
    assert state["sim"][1, 2] == pytest.approx(0.75) and state["count"][1, 2] == 1
    assert state["pairs"] == 4  # 3 + 1 + 0
    assert state["cand"].tolist() == [[False, False, True], [True, False, False], [True, False, False]]
    # dropped 0 in round 2: C^0 ∩ S = {2} -> friend 2, the same model as without CR
    assert state["friend"].tolist() == [2, -1, -1]
    assert close(ws[2], [-7 / 3, -4 / 3, -1 / 3, -5 / 3])


def clustered_rounds(n_rounds: int, seed: int):
    """8 clients in 2 clusters {0..3}, {4..7}; an update = its cluster's direction + noise. Each round
    about half the clients drop, at least one per cluster stays (FDMS's friend presence)."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(2, 20))
    rounds = []
    for t in range(n_rounds):
        active = np.ones(8, bool) if t == 0 else rng.random(8) < 0.5
        for c in range(2):
            if not active[4 * c:4 * c + 4].any():
                active[4 * c + rng.integers(4)] = True
        rounds.append({int(i): (base[i // 4] + 0.5 * rng.normal(size=20)).tolist() for i in np.flatnonzero(active)})
    return rounds


def test_fdms_finds_the_true_friend_in_a_clustered_toy():
    s = FDMS()
    w = torch.zeros(20)
    state = s.init_state(8, w)
    substitutions = 0
    for t, deltas in enumerate(clustered_rounds(30, seed=8)):
        w, state = s.aggregate(state, t, w, {i: upd(i, d) for i, d in deltas.items()})
        for k, f in enumerate(state["friend"].tolist()):
            if f >= 0:
                assert f // 4 == k // 4, f"round {t}: client {k} substituted by {f} from the other cluster"
                substitutions += 1
    assert substitutions > 50
    sim = state["sim"].clone().fill_diagonal_(-1)
    assert [int(j) // 4 for j in sim.argmax(1)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_complexity_reduction_never_drops_a_true_friend_and_saves_pairs():
    s = FDMS(cr="case2")
    w = torch.zeros(20)
    state = s.init_state(8, w)
    pairs = []
    for t, deltas in enumerate(clustered_rounds(200, seed=9)):
        before = float(state["pairs"])
        w, state = s.aggregate(state, t, w, {i: upd(i, d) for i, d in deltas.items()})
        pairs.append(float(state["pairs"]) - before)
        same = torch.tensor([[i // 4 == j // 4 and i != j for j in range(8)] for i in range(8)])
        assert bool(state["cand"][same].all()), f"round {t}: a same-cluster candidate was eliminated"
    assert not state["cand"][~same].any()  # every cross-cluster candidate has been eliminated by round 200
    assert sum(pairs[-20:]) < sum(pairs[:20])
