"""FedProx's μ and SCAFFOLD's control variates (option II), worked by hand."""

import torch
from strategy_helpers import close, upd

from coordinator.strategies import FedProx, Scaffold
from edge_client.trainer import TrainTask


def task(client: int) -> TrainTask:
    return TrainTask(client=client, round=0, lr=0.5, batch_size=4, steps=2)


def test_fedprox_sets_mu_and_averages_like_fedavg():
    s = FedProx(mu=0.25)
    t0 = task(1)
    t1 = s.configure({}, 0, t0)
    assert t1.prox_mu == 0.25 and t0.prox_mu == 0.0  # the given task is not modified
    w, _ = s.aggregate({}, 0, torch.zeros(2), {0: upd(0, [1, 0]), 2: upd(2, [0, 3])})
    assert close(w, [-0.5, -1.5])


def test_scaffold_by_hand():
    s = Scaffold()
    assert s.uploads_per_round == 2
    w = torch.zeros(4)
    state = s.init_state(3, w)
    # lr 0.5 and K = 2 steps, so K·lr = 1 and c_i⁺ = c_i − c + d_i
    rounds = [{0: [1, 0, 0, 0], 1: [0, 2, 0, 0], 2: [0, 0, 3, 0]},
              {0: [0, 0, 0, 3], 1: [3, 0, 0, 0]},
              {2: [0, 3, 0, 0]}]
    corrections = []
    for t, deltas in enumerate(rounds):
        corrections.append({i: s.configure(state, t, task(i)).grad_correction.clone() for i in deltas})
        w, state = s.aggregate(state, t, w, {i: upd(i, d, lr=0.5, steps=2) for i, d in deltas.items()})
        if t == 0:
            # c_i = d_i; c = (1/3)Σ Δc_i = [1/3,2/3,1,0]; w1 = -mean(d) = [-1/3,-2/3,-1,0]
            assert all(close(c, [0, 0, 0, 0]) for c in corrections[0].values())
            assert close(state["c"], [1 / 3, 2 / 3, 1, 0]) and close(w, [-1 / 3, -2 / 3, -1, 0])
        if t == 1:
            # corrections sent: c − c0 = [-2/3,2/3,1,0], c − c1 = [1/3,-4/3,1,0]
            assert close(corrections[1][0], [-2 / 3, 2 / 3, 1, 0]) and close(corrections[1][1], [1 / 3, -4 / 3, 1, 0])
            # c0⁺ = [1,0,0,0] − c + [0,0,0,3] = [2/3,-2/3,-1,3]; c1⁺ = [0,2,0,0] − c + [3,0,0,0] = [8/3,4/3,-1,0]
            # Σ Δc = [-1/3,-2/3,-1,3] + [8/3,-2/3,-1,0] = [7/3,-4/3,-2,3]; c = c + Σ/3 = [10/9,2/9,1/3,1]
            # w2 = w1 − [1.5,0,0,1.5] = [-11/6,-2/3,-1,-3/2]
            assert close(state["c_clients"][0], [2 / 3, -2 / 3, -1, 3])
            assert close(state["c_clients"][1], [8 / 3, 4 / 3, -1, 0])
            assert close(state["c"], [10 / 9, 2 / 9, 1 / 3, 1]) and close(w, [-11 / 6, -2 / 3, -1, -1.5])
    # Round 2, S = {2}: correction c − c2 = [10/9,2/9,-8/3,1]
    #   c2⁺ = [0,0,3,0] − c + [0,3,0,0] = [-10/9,25/9,8/3,-1]; Δc2 = [-10/9,25/9,-1/3,-1]
    #   c = [10/9 − 10/27, 2/9 + 25/27, 1/3 − 1/9, 1 − 1/3] = [20/27,31/27,2/9,2/3]; w3 = w2 − [0,3,0,0]
    assert close(corrections[2][2], [10 / 9, 2 / 9, -8 / 3, 1])
    assert close(state["c_clients"][2], [-10 / 9, 25 / 9, 8 / 3, -1])
    assert close(state["c"], [20 / 27, 31 / 27, 2 / 9, 2 / 3])
    assert close(w, [-11 / 6, -11 / 3, -1, -1.5])
    assert close(state["c"], state["c_clients"].mean(0).tolist())  # c = (1/N) Σ c_i throughout


def test_scaffold_fixed_correction_lr():
    s = Scaffold(correction_lr=0.25)
    state = s.init_state(2, torch.zeros(2))
    _, state = s.aggregate(state, 0, torch.zeros(2), {0: upd(0, [1, 2], lr=0.5, steps=2)})
    # c0⁺ = 0 − 0 + [1,2]/(2·0.25) = [2,4]; c = [2,4]/2 = [1,2]
    assert close(state["c_clients"][0], [2, 4]) and close(state["c"], [1, 2])
