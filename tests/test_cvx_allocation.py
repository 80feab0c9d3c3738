"""FedDD allocation (eqs. 13-17): hand-worked optima, an independent LP solution, errors, fallback."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
from scipy.optimize import linprog

from cvx.allocation import AllocationError, AllocationInputs, DropoutAllocator, regulariser


def three_clients() -> AllocationInputs:
    """Worked by hand: U_n = U = 1000 B, r^u = r^d = 500 B/s, so a_n = U(1/r^u + 1/r^d) = 4 s; t^cmp = 1 s;
    m_n equal, q = [1, 2, 3], loss = [0.3, 1, 1] -> re = [0.1, 2/3, 1]; δ = 3 -> δ·re = [0.3, 2, 3];
    A_server = 2/3 -> Σ D_n = 1; D_max = 0.8.
    With m = min D: T = 1 + 4(1 − m); the rest of the budget goes to the cheapest client (δ·re = 0.3).
    For m >= 0.1: f(m) = 5 + 0.3 + 0.4 m (increasing); for m <= 0.1 (client 1 capped at 0.8):
    f(m) = 5.64 − 3m (decreasing). So m = 0.1: D = [0.8, 0.1, 0.1], T = 4.6, objective = 5.34."""
    return AllocationInputs(compute_s=np.ones(3), up_rate=np.full(3, 500.0), down_rate=np.full(3, 500.0),
                            model_bytes=np.full(3, 1000.0), global_bytes=1000.0, num_samples=np.full(3, 10.0),
                            label_score=np.array([1.0, 2.0, 3.0]), loss=np.array([0.3, 1.0, 1.0]),
                            delta=3.0, d_max=0.8, a_server=2 / 3)


def test_three_clients_hand_worked():
    inp = three_clients()
    np.testing.assert_allclose(regulariser(inp), [0.1, 2 / 3, 1.0])
    res = DropoutAllocator(3).solve(inp)
    assert res.status == "optimal" and res.fallback is None
    np.testing.assert_allclose(res.dropout, [0.8, 0.1, 0.1], atol=1e-6)
    assert res.round_time == pytest.approx(4.6, abs=1e-6)
    assert res.objective == pytest.approx(5.34, abs=1e-6)


def test_two_clients_d_max_binds():
    """δ = 0, a = [10, 2] s, t^cmp = 0, A = 0.5 -> D_1 + D_2 = 1. Equal times would need
    10(1 − D_1) = 2 D_1, D_1 = 5/6 > D_max = 0.8, so D = [0.8, 0.2], T = max(2, 1.6) = 2."""
    inp = AllocationInputs(compute_s=np.zeros(2), up_rate=np.array([200.0, 1000.0]),
                           down_rate=np.array([200.0, 1000.0]), model_bytes=np.full(2, 1000.0),
                           global_bytes=1000.0, num_samples=np.ones(2), label_score=np.ones(2),
                           loss=np.ones(2), delta=0.0, d_max=0.8, a_server=0.5)
    res = DropoutAllocator(2).solve(inp)
    np.testing.assert_allclose(res.dropout, [0.8, 0.2], atol=1e-6)
    assert res.round_time == pytest.approx(2.0, abs=1e-6)


def linprog_epigraph(inp: AllocationInputs) -> tuple[float, np.ndarray]:
    """The same eq. (16)-(17) LP in unscaled units, over x = [D_1..D_N, T], solved by HiGHS via scipy."""
    n = len(inp.compute_s)
    a = inp.model_bytes * (1 / inp.up_rate + 1 / inp.down_rate)
    c = np.append(inp.delta * regulariser(inp), 1.0)
    # t_n + a_n (1 − D_n) <= T  <=>  −a_n D_n − T <= −t_n − a_n
    A_ub = np.hstack([-np.diag(a), -np.ones((n, 1))])
    b_ub = -(inp.compute_s + a)
    # Σ U_n (1 − D_n) = A Σ U_n  <=>  Σ U_n D_n = (1 − A) Σ U_n
    A_eq = np.append(inp.model_bytes, 0.0)[None, :]
    b_eq = [(1 - inp.a_server) * inp.model_bytes.sum()]
    bounds = [(0, inp.d_max)] * n + [(None, None)]
    r = linprog(c, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=b_eq, bounds=bounds, method="highs")
    assert r.status == 0, r.message
    return float(r.fun), r.x


def random_inputs(rng: np.random.Generator, n: int, delta: float) -> AllocationInputs:
    """Table 4-like magnitudes (bytes, bytes/s), heterogeneous model sizes."""
    U = rng.choice([2.0e6, 1.2e6, 0.8e6], n)
    return AllocationInputs(compute_s=rng.uniform(5, 150, n), up_rate=rng.uniform(125, 625, n),
                            down_rate=rng.uniform(5e3, 2.5e4, n), model_bytes=U, global_bytes=2.0e6,
                            num_samples=rng.integers(100, 1000, n).astype(float), label_score=rng.uniform(1, 10, n),
                            loss=rng.uniform(0.5, 2.3, n), delta=delta, d_max=0.8, a_server=0.6)


@pytest.mark.parametrize("delta", [0.0, 1e3, 1e5])
def test_matches_linprog(delta):
    rng = np.random.default_rng(7)
    alloc = DropoutAllocator(20)
    for _ in range(3):  # re-solves of the same DPP problem with new parameter values
        inp = random_inputs(rng, 20, delta)
        res = alloc.solve(inp)
        ref_obj, ref_x = linprog_epigraph(inp)
        assert res.status == "optimal"
        assert res.objective == pytest.approx(ref_obj, rel=1e-6)
        assert float(inp.model_bytes @ (1 - res.dropout)) == pytest.approx(0.6 * inp.model_bytes.sum(), rel=1e-6)
        assert res.dropout.min() >= 0 and res.dropout.max() <= 0.8
        if delta == 0.0:  # the optimal round time is unique even when D is not
            assert res.round_time == pytest.approx(ref_x[-1], rel=1e-6)


def test_resolve_equals_fresh_problem():
    rng = np.random.default_rng(1)
    first, second = random_inputs(rng, 8, 1e4), random_inputs(rng, 8, 1e4)
    reused = DropoutAllocator(8)
    reused.solve(first)
    assert reused.problem.is_dpp()
    a, b = reused.solve(second), DropoutAllocator(8).solve(second)
    assert a.objective == pytest.approx(b.objective, rel=1e-7)


@pytest.mark.parametrize("field,value,name", [
    ("a_server", 0.1, "a_server"),                   # < 1 − D_max = 0.2: infeasible
    ("up_rate", np.array([500.0, 0.0, 500.0]), "up_rate"),
    ("down_rate", np.array([500.0, -1.0, 500.0]), "down_rate"),
    ("loss", np.array([0.3, np.nan, 1.0]), "loss"),
    ("compute_s", np.ones(2), "compute_s"),          # wrong length
    ("delta", -1.0, "delta"),
    ("global_bytes", 10.0, "global_bytes"),          # U < U_n
])
def test_invalid_inputs_name_the_input(field, value, name):
    inp = replace(three_clients(), **{field: value})
    with pytest.raises(AllocationError, match=name) as e:
        DropoutAllocator(3).solve(inp)
    assert isinstance(e.value, ValueError) and e.value.input == name


def test_solver_failure_falls_back_to_uniform_rule(caplog):
    """Clarabel stopped after one iteration ("user_limit") -> D_n = 1 − A_server = 1/3 for all, logged."""
    alloc = DropoutAllocator(3, solver_opts={"max_iter": 1})
    with caplog.at_level(logging.WARNING, logger="cvx.allocation"), pytest.warns(UserWarning):
        res = alloc.solve(three_clients())
    assert res.status == "fallback" and "user_limit" in res.fallback
    np.testing.assert_allclose(res.dropout, [1 / 3] * 3)
    assert res.round_time == pytest.approx(1 + 4 * 2 / 3)
    assert any("uniform rule" in r.message for r in caplog.records)
