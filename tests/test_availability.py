import numpy as np
import pytest

from coordinator.availability import models as av
from coordinator.errors import UserError


def test_round0_all_and_reasons():
    m = av.Static(10, seed=1, p=0.1)
    assert m.round(0).available.all()
    r = m.round(1)
    absent = np.flatnonzero(~r.available)
    assert len(absent) > 0 and set(r.reasons) == set(absent.tolist())
    assert set(r.reasons.values()) == {"model_draw"}


def test_same_seed_same_participation_any_order():
    a, b = av.Bounded(30, seed=4, tau_max=20), av.Bounded(30, seed=4, tau_max=20)
    forward = [a.round(t).available.copy() for t in range(50)]
    backward = [b.round(t).available.copy() for t in reversed(range(50))][::-1]
    assert all((x == y).all() for x, y in zip(forward, backward))


def test_bounded_uniform_periods_respect_tau_max():
    m = av.Bounded(30, seed=0, tau_max=20)
    assert m.tau.min() >= 0 and m.tau.max() <= 20
    seen_gap = np.zeros(30, int)
    last = np.zeros(30, int)
    for t in range(1, 200):
        act = m.round(t).available
        gap = t - last
        seen_gap = np.maximum(seen_gap, np.where(act, gap, 0))
        last[act] = t
    assert (seen_gap <= np.maximum(m.tau, 1)).all()  # τ(t, i) ≤ τ_i ≤ τmax
    # client with period τ_i ≥ 2 is active exactly at multiples of τ_i
    i = int(np.flatnonzero(m.tau >= 2)[0])
    act_rounds = [t for t in range(1, 100) if m.round(t).available[i]]
    assert act_rounds == [t for t in range(1, 100) if t % m.tau[i] == 0]


def test_bounded_expected_active_matches_digest():
    # MimiC digest §1.3: paper-uniform τmax=20 gives ≈6.8 active clients per round (with the ≥2 rule).
    counts = []
    for seed in range(20):
        m = av.Bounded(30, seed=seed, tau_max=20, min_active=2)
        counts.append(np.mean([m.round(t).available.sum() for t in range(200)]))
    assert 5.0 < np.mean(counts) < 9.0
    hn = av.Bounded(30, seed=0, tau_max=20, tau_dist="halfnormal", min_active=2)
    assert np.mean([hn.round(t).available.sum() for t in range(200)]) > 12  # ≈17.7 in the digest


def test_static_probability_and_levels():
    m = av.Static(1000, seed=0, p=0.3, first_round_all=False)
    rate = np.mean([m.round(t).available.mean() for t in range(50)])
    assert abs(rate - 0.3) < 0.02
    m5 = av.Static(10, seed=0, p=0.1, levels=5)
    assert m5.p.tolist() == pytest.approx([0.1, 0.325, 0.55, 0.775, 1.0] * 2)


def test_min_active():
    m = av.Static(30, seed=0, p=0.001, min_active=2)
    assert all(m.round(t).available.sum() == 2 for t in range(1, 20))


def test_timevarying_exact_count():
    m = av.TimeVarying(30, seed=0, fraction=0.3)
    assert all(m.round(t).available.sum() == 9 for t in range(1, 20))


def test_diurnal_fedlaavg():
    m = av.Diurnal(100, seed=0, period=3, groups_d=1)
    assert m.round(0).available[:10].all() and not m.round(0).available[10:].any()
    assert not m.round(3).available[:10].any() and m.round(3).available[10:].all()
    assert m.round(6).available[:10].all()
    assert m.round(3).reasons[0] == "offline"


def test_cluster_dropout_one_per_cluster():
    m = av.ClusterDropout(20, seed=0, alpha=0.7)
    for t in range(1, 30):
        a = m.round(t).available
        assert a.sum() == 6
        assert all(a[4 * c:4 * c + 4].sum() >= 1 for c in range(5))


@pytest.mark.parametrize("ctor,kw,match", [
    (av.Bounded, {"tau_max": -1}, "--tau-max"),
    (av.Static, {"p": 0.0}, "--p"),
    (av.Static, {"p": 1.5}, "--p"),
    (av.TimeVarying, {"fraction": 0}, "--fraction"),
    (av.ClusterDropout, {"alpha": 1.0}, "--alpha"),
])
def test_bad_parameters(ctor, kw, match):
    with pytest.raises(UserError, match=match):
        ctor(20, 0, **kw)
