"""MimiC (Algorithm 1, server-side) and its client-side "practical implementation": rules worked by hand,
the invariants of mimic.md §2.3, and the equality of both forms."""

import torch
from strategy_helpers import close, random_rounds, run, upd

from coordinator.strategies import FedAvg, MimiC, MimiCClient

# 3 clients, 4-dim deltas, w0 = 0. Round 0: everyone; round 1: client 2 drops; round 2: client 0 drops.
ROUNDS = [
    {0: [3, 0, 0, 0], 1: [0, 3, 0, 0], 2: [0, 0, 3, 0]},
    {0: [1, 1, 0, 0], 1: [0, 2, 0, 2]},
    {1: [2, 0, 0, 0], 2: [0, 0, 0, 6]},
]


def test_mimic_by_hand_three_rounds_with_dropouts():
    ws, state = run(MimiC(), 3, ROUNDS)
    # Round 0: c = 0, D0 = mean(d) = [1,1,1,0]; w1 = [-1,-1,-1,0]
    #   c0 = D0 - d0 = [-2,1,1,0], c1 = [1,-2,1,0], c2 = [1,1,-2,0]
    assert close(ws[0], [-1, -1, -1, 0])
    # Round 1, S = {0,1}: v0 = [1,1,0,0] + [-2,1,1,0] = [-1,2,1,0]; v1 = [0,2,0,2] + [1,-2,1,0] = [1,0,1,2]
    #   D1 = [0,1,1,1]; w2 = [-1,-2,-2,-1]; c0 = D1 - d0 = [-1,0,1,1], c1 = [0,-1,1,-1], c2 kept [1,1,-2,0]
    assert close(ws[1], [-1, -2, -2, -1])
    # Round 2, S = {1,2}: v1 = [2,0,0,0] + [0,-1,1,-1] = [2,-1,1,-1]; v2 = [0,0,0,6] + [1,1,-2,0] = [1,1,-2,6]
    #   D2 = [1.5,0,-0.5,2.5]; w3 = [-2.5,-2,-1.5,-3.5]
    #   c1 = D2 - d1 = [-0.5,0,-0.5,2.5], c2 = D2 - d2 = [1.5,0,-0.5,-3.5], c0 kept [-1,0,1,1]
    assert close(ws[2], [-2.5, -2, -1.5, -3.5])
    assert close(state["corr"][0], [-1, 0, 1, 1])
    assert close(state["corr"][1], [-0.5, 0, -0.5, 2.5])
    assert close(state["corr"][2], [1.5, 0, -0.5, -3.5])
    # the same rounds under FedAvg end elsewhere: w3 = [-2.5,-2.5,-1,-4]
    assert close(run(FedAvg(), 3, ROUNDS)[0][2], [-2.5, -2.5, -1, -4])


def test_mimic_gradient_units_by_hand():
    # lr 0.5, K = 2 steps: ĝ = d / (0.5·2) = d; η_t = 0.1 · 0.5^t
    s = MimiC(units="gradient", global_lr=0.1, global_lr_decay=0.5)
    ws, state = run(s, 3, ROUNDS[:2], lr=0.5, steps=2)
    # Round 0: v0 = [1,1,1,0], w1 = -0.1·v0 = [-0.1,-0.1,-0.1,0]
    # Round 1: v1 = [0,1,1,1] (as in delta units), w2 = w1 - 0.05·v1 = [-0.1,-0.15,-0.15,-0.05]
    assert close(ws[0], [-0.1, -0.1, -0.1, 0])
    assert close(ws[1], [-0.1, -0.15, -0.15, -0.05])
    assert close(state["corr"][1], [0, -1, 1, -1])


def test_mimic_corrections_sum_to_zero_after_round_one():
    rounds = random_rounds(n=6, m=5, rounds=8, seed=1)
    s = MimiC()
    w = torch.zeros(5)
    state = s.init_state(6, w)
    for t, deltas in enumerate(rounds):
        w, state = s.aggregate(state, t, w, {i: upd(i, d) for i, d in deltas.items()})
        assert torch.allclose(state["corr"].sum(0), torch.zeros(5), atol=1e-5)  # Σ_i c_i = 0 from round 1 on
    assert state["corr"].abs().sum() > 1  # ... while the corrections themselves are not zero


def test_mimic_full_participation_equals_fedavg():
    rounds = random_rounds(n=5, m=4, rounds=6, seed=2, p_active=1.1)  # everyone, every round
    mimic, fedavg = run(MimiC(), 5, rounds)[0], run(FedAvg(), 5, rounds)[0]
    for a, b in zip(mimic, fedavg):
        assert torch.allclose(a, b, atol=1e-5)


def test_mimic_empty_round_keeps_model():
    ws, _ = run(MimiC(), 3, [ROUNDS[0], {}])
    assert torch.equal(ws[0], ws[1])


def test_client_side_variant_gives_the_same_model_and_corrections():
    rounds = random_rounds(n=7, m=6, rounds=12, seed=3, p_active=0.4)
    ws_server, st_server = run(MimiC(), 7, rounds)
    ws_client, st_client = run(MimiCClient(), 7, rounds)
    for a, b in zip(ws_server, ws_client):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.allclose(st_server["corr"], st_client["device_corr"], atol=1e-6)
    assert not torch.allclose(ws_server[-1], run(FedAvg(), 7, rounds)[0][-1], atol=1e-3)  # the test is not vacuous
