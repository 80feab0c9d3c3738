"""MIFA and Stale substitution: rules worked by hand and the full-participation invariant."""

import torch
from strategy_helpers import close, random_rounds, run

from coordinator.strategies import MIFA, FedAvg, Stale

# 3 clients, 4-dim deltas, w0 = 0. Round 0: everyone; round 1: client 2 drops; round 2: client 0 drops.
ROUNDS = [
    {0: [3, 0, 0, 0], 1: [0, 3, 0, 0], 2: [0, 0, 3, 0]},
    {0: [1, 1, 0, 0], 1: [0, 2, 0, 2]},
    {1: [2, 0, 0, 0], 2: [0, 0, 0, 6]},
]


def test_mifa_by_hand_exact_weights():
    ws, state = run(MIFA(round_weights=False), 3, ROUNDS)
    # Round 0: G = d; v = [1,1,1,0]; w1 = [-1,-1,-1,0]
    assert close(ws[0], [-1, -1, -1, 0])
    # Round 1: G0 = [1,1,0,0], G1 = [0,2,0,2], G2 kept [0,0,3,0]; ΣG = [1,3,3,2]; v = [1/3,1,1,2/3]
    #   w2 = [-4/3,-2,-2,-2/3]
    assert close(ws[1], [-4 / 3, -2, -2, -2 / 3])
    # Round 2: G0 kept [1,1,0,0], G1 = [2,0,0,0], G2 = [0,0,0,6]; ΣG = [3,1,0,6]; v = [1,1/3,0,2]
    #   w3 = [-7/3,-7/3,-2,-8/3]
    assert close(ws[2], [-7 / 3, -7 / 3, -2, -8 / 3])
    assert close(state["latest"][0], [1, 1, 0, 0])


def test_mifa_default_uses_the_released_codes_rounded_weights():
    ws, _ = run(MIFA(), 3, ROUNDS[:1])
    # round(1/3, 4) = 0.3333 per client: v = 0.3333·[3,3,3,0] = [0.9999,0.9999,0.9999,0]
    assert close(ws[0], [-0.9999, -0.9999, -0.9999, 0], tol=1e-6)


def test_mifa_applies_the_table_even_when_nobody_uploads():
    ws, _ = run(MIFA(round_weights=False), 3, [ROUNDS[0], {}])
    # round 1: table unchanged, v = [1,1,1,0] again: w2 = [-2,-2,-2,0]
    assert close(ws[1], [-2, -2, -2, 0])


def test_mifa_gradient_units():
    # lr 0.5, K = 2: ĝ = d/(0.5·2) = d; η_0 = 0.1: w1 = -0.1·[1,1,1,0]
    ws, _ = run(MIFA(units="gradient", round_weights=False, global_lr=0.1), 3, ROUNDS[:1], lr=0.5, steps=2)
    assert close(ws[0], [-0.1, -0.1, -0.1, 0])


def test_mifa_with_everyone_active_equals_fedavg():
    rounds = random_rounds(n=5, m=4, rounds=6, seed=4, p_active=1.1)
    for a, b in zip(run(MIFA(round_weights=False), 5, rounds)[0], run(FedAvg(), 5, rounds)[0]):
        assert torch.allclose(a, b, atol=1e-5)


def test_mifa_table_is_one_compact_tensor():
    # one float32 [N, M] tensor and nothing else: N = 10 000 clients of the 7,850-parameter logistic model
    # would hold 4·10 000·7 850 B = 314 MB (a smaller M here, to keep the test light)
    state = MIFA().init_state(10_000, torch.zeros(100))
    assert list(state) == ["latest"] and state["latest"].shape == (10_000, 100)
    assert state["latest"].dtype == torch.float32 and state["latest"].nbytes == 4 * 10_000 * 100


def test_stale_weights_by_hand():
    ws, state = run(Stale(), 3, ROUNDS)
    # stored local models start at w0 = 0. Round 0: W_i = -d_i; w1 = mean = [-1,-1,-1,0]
    assert close(ws[0], [-1, -1, -1, 0])
    # Round 1: W0 = w1 - d0 = [-2,-2,-1,0], W1 = w1 - d1 = [-1,-3,-1,-2], W2 kept [0,0,-3,0]
    #   w2 = [-3,-5,-5,-2]/3
    assert close(ws[1], [-1, -5 / 3, -5 / 3, -2 / 3])
    # Round 2: W1 = w2 - [2,0,0,0] = [-3,-5/3,-5/3,-2/3], W2 = w2 - [0,0,0,6] = [-1,-5/3,-5/3,-20/3],
    #   W0 kept [-2,-2,-1,0]; sum = [-6,-16/3,-13/3,-22/3]; w3 = [-2,-16/9,-13/9,-22/9]
    assert close(ws[2], [-2, -16 / 9, -13 / 9, -22 / 9])
    assert close(state["models"][0], [-2, -2, -1, 0])


def test_stale_update_variant_is_mifa_with_exact_weights():
    ws, _ = run(Stale(variant="update"), 3, ROUNDS)
    # as test_mifa_by_hand_exact_weights: w3 = [-7/3,-7/3,-2,-8/3]
    assert close(ws[2], [-7 / 3, -7 / 3, -2, -8 / 3])
    rounds = random_rounds(n=6, m=3, rounds=7, seed=5)
    for a, b in zip(run(Stale(variant="update"), 6, rounds)[0], run(MIFA(round_weights=False), 6, rounds)[0]):
        assert torch.allclose(a, b, atol=1e-5)


def test_stale_skips_a_round_without_uploads():
    ws, _ = run(Stale(), 3, [ROUNDS[0], {}])
    assert torch.equal(ws[0], ws[1])
