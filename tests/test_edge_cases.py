"""Edge cases at the limits of four components: MIFA's rounded weights at large N, FL-FDMS elimination of
never-observed pairs, cluster-dropout settings that rejection sampling cannot meet, FedDD resume."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from coordinator.availability import models as av
from coordinator.availability.models import _n_compositions
from coordinator.cli import main
from coordinator.errors import UserError
from coordinator.loop import LoopConfig, run_rounds
from coordinator.rundir import RunDir, read_metrics
from coordinator.sim.clock import table4_profile
from coordinator.strategies import FDMS, MIFA, ClientUpdate, FedAvg


def _upd(i: int, delta: list[float]) -> ClientUpdate:
    return ClientUpdate(i, torch.tensor(delta, dtype=torch.float32), 1, 1, 0.1)


# ---------------------------------------------------------------- 1. MIFA weights at N = 50 000

def test_mifa_round_weights_fall_back_to_exact_mean_at_large_n(caplog):
    """N = 50 000, M = 3. round(1/N, 4) = 0, so the released code's weights would freeze the model; the
    default falls back to 1/N. Table: every row [1, −2, 0.5]; client 7 uploads [50 001, −2, 50 000.5].
    ΣG = [49 999 + 50 001, −100 000, 0.5·49 999 + 50 000.5] = [100 000, −100 000, 75 000] (exact in
    float32), so v = ΣG/N = [2, −2, 1.5] and w1 = w0 − v = −[2, −2, 1.5]."""
    n = 50_000
    assert round(1 / n, 4) == 0.0
    s = MIFA()  # round_weights=True, the default
    state = s.init_state(n, torch.zeros(3))
    state["latest"][:] = torch.tensor([1.0, -2.0, 0.5])
    with caplog.at_level(logging.WARNING, logger="dropfl.strategy"):
        w1, state = s.aggregate(state, 0, torch.zeros(3), {7: _upd(7, [50_001.0, -2.0, 50_000.5])})
        w2, _ = s.aggregate(state, 1, w1, {})  # nobody uploads: the same v is applied again
    assert torch.allclose(w1, torch.tensor([-2.0, 2.0, -1.5]), rtol=1e-6, atol=0)
    assert torch.allclose(w2, torch.tensor([-4.0, 4.0, -3.0]), rtol=1e-6, atol=0)
    warnings = [r for r in caplog.records if r.name == "dropfl.strategy"]
    assert len(warnings) == 1 and "N = 50000" in warnings[0].getMessage()


def test_mifa_round_weights_kept_where_meaningful():
    s = MIFA()
    assert s.weight(3) == 0.3333 and s.weight(30) == 0.0333      # released code: sums 0.9999, 0.999
    assert s.weight(200) == 0.005                                # exact anyway
    assert s.weight(3000) == 1 / 3000                            # 0.0003·3000 = 0.9: 10 % off -> exact
    assert s.weight(15_000) == 1 / 15_000                        # 0.0001·15 000 = 1.5
    assert MIFA(round_weights=False).weight(30) == 1 / 30


# ---------------------------------------------------------------- 2. FL-FDMS elimination (fdms.md §2.4)

def test_fdms_never_coactive_pair_stays_candidate():
    """4 clients, t = 10 000 (Θ_t ≈ 0.088 < 1, so elimination is live). Round A: S = {0, 1, 2} with
    Δ0 = Δ1 = [1, 0], Δ2 = [−1, 0]: R^{01} = ½(1 + 1) = 1, R^{02} = ½(−1 + 1) = 0, N = 1; client 3 never
    active, R^{03} = 0 with N^{03} = 0. Elimination for k = 0: best 1; gap to 2 is 1 ≥ Θ -> 2 leaves C^0;
    gap to 3 is also 1 but the pair was never observed -> 3 stays."""
    s = FDMS(cr="case1")
    t = 10_000
    assert s.theta(t, 4) < 0.1
    state = s.init_state(4, torch.zeros(2))
    _, state = s.aggregate(state, t, torch.zeros(2), {0: _upd(0, [1, 0]), 1: _upd(1, [1, 0]), 2: _upd(2, [-1, 0])})
    assert state["sim"][0, 1] == 1.0 and state["sim"][0, 2] == 0.0 and state["count"][0, 3] == 0
    assert state["cand"][0].tolist() == [False, True, False, True]
    assert state["cand"][3].tolist() == [True, True, True, False]   # never active: nothing observed, nothing lost
    # Round B: S = {2, 3}, client 0 dropped: φ(0) from C^0 ∩ S = {3} (before the fix C^0 ∩ S was empty and the
    # fallback over all of S picked client 2, the first of the tied zeros).
    _, state = s.aggregate(state, t + 1, torch.zeros(2), {2: _upd(2, [-1, 0]), 3: _upd(3, [0, 1])})
    assert int(state["friend"][0]) == 3


# ---------------------------------------------------------------- 3. cluster-dropout availability

def test_cluster_dropout_unmeetable_setting_is_a_user_error():
    # N = 10, 5 clusters of 2; int((1 − 0.9)·10) = int(0.999…) = 0 active clients, fewer than the 5 clusters
    with pytest.raises(UserError, match=r"--alpha 0\.9 with 5 clusters of 2 clients: .*0 active clients"):
        av.ClusterDropout(10, seed=0, alpha=0.9)
    with pytest.raises(UserError, match=r"--alpha 0\.85 with 5 clusters of 4 clients: .*3 active"):
        av.ClusterDropout(20, seed=0, alpha=0.85)
    with pytest.raises(UserError, match="--clients 3"):
        av.ClusterDropout(3, seed=0, alpha=0.5)


def _old_draw(m: av.ClusterDropout, t: int) -> np.ndarray:
    """The unbounded rejection loop as it was before, for the bit-identity check."""
    rng = m.rng(t)
    while True:
        counts = rng.integers(1, m.size + 1, m.n_clusters)
        if counts.sum() == m.n_active:
            break
    out = np.zeros(m.n, bool)
    for c, k in enumerate(counts):
        out[c * m.size + rng.choice(m.size, k, replace=False)] = True
    return out


@pytest.mark.parametrize("n, alpha", [(20, 0.7), (20, 0.5), (30, 0.5), (10, 0.0)])
def test_cluster_dropout_feasible_settings_unchanged(n, alpha):
    m = av.ClusterDropout(n, seed=3, alpha=alpha)
    assert m.max_tries == av.ClusterDropout.REJECT_MAX_TRIES  # rejection still used: p ≥ 1e-4
    for t in range(1, 8):
        assert np.array_equal(m.round(t).available, _old_draw(m, t))


def test_cluster_dropout_low_acceptance_is_drawn_directly():
    """N = 100, α = 0.05: 95 active in 5 clusters of 20, i.e. 5 absent with ≤ 19 per cluster: C(9, 4) = 126
    count vectors out of 20⁵ = 3.2e6 (p = 3.9e-5: ~25 600 rejected draws per round before); α = 0 with
    N = 100 has p = 20⁻⁵. Both are drawn directly, with exactly the right number per cluster."""
    assert _n_compositions(95, 5, 20) == 126
    m = av.ClusterDropout(100, seed=0, alpha=0.05)
    assert m.accept_p == pytest.approx(126 / 20 ** 5) and m.max_tries == 0
    for t in range(1, 6):
        a = m.round(t).available
        per = a.reshape(5, 20).sum(1)
        assert a.sum() == 95 and per.min() >= 1
    assert av.ClusterDropout(100, seed=0, alpha=0.0).round(1).available.all()


def test_cluster_dropout_direct_draw_has_the_rejection_distribution():
    """N = 20, α = 0.7: 6 active in 5 clusters of 4, so exactly one cluster has 2: 5 equally likely count
    vectors. With the rejection loop switched off, each cluster must get the 2 in 1/5 of the rounds."""
    m = av.ClusterDropout(20, seed=0, alpha=0.7)
    m.max_tries = 0
    twos = np.zeros(5)
    rounds = 4000
    for t in range(1, rounds + 1):
        per = m.round(t).available.reshape(5, 4).sum(1)
        assert per.sum() == 6 and per.min() == 1
        twos[int(np.argmax(per))] += 1
    assert np.abs(twos / rounds - 0.2).max() < 0.03  # binomial sd 0.0063: > 4.5 sd


# ---------------------------------------------------------------- 4. FedDD resume

def test_feddd_resume_equals_uninterrupted(tmp_path):
    """FedDD with h = 3 (--feddd-full-every 3): rounds 1 and 2 download sparsely and start from the client's
    eq. (5) memory of the previous round. 4 rounds straight vs 2 rounds, then --resume to 4: the resumed
    round 2 needs round 1's memory, which now travels in the checkpoint."""
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(table4_profile(4, seed=0, batch_size=8).to_json()))
    args = ["--dataset", "fmnist", "--clients", "4", "--model", "logreg", "--steps", "1", "--batch-size", "8",
            "--lr", "0.05", "--no-progress", "--algo", "feddd", "--clock-profile", str(prof),
            "--feddd-full-every", "3", "--checkpoint-every", "1"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["sim", *args, "--rounds", "4", "--out", str(full)]) == 0
    assert main(["sim", *args, "--rounds", "2", "--out", str(part)]) == 0
    ck = torch.load(part / "checkpoint.pt", weights_only=False)
    assert sorted(ck["transport"]["clients"]["memory"]) == [0, 1, 2, 3]
    assert main(["sim", *args, "--rounds", "4", "--out", str(part), "--resume"]) == 0
    rows = read_metrics(full / "metrics.jsonl")
    assert rows[2]["download_bytes"] < rows[0]["download_bytes"]  # round 2 really is a sparse download
    a = torch.load(full / "model.pt", weights_only=True)
    b = torch.load(part / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Clients:
    """A transport whose clients keep state (a counter) and record what was restored."""

    def __init__(self):
        self.calls, self.loaded = 0, []

    def run_round(self, t, w, tasks):
        self.calls += 1
        return {}, {}

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.loaded.append(state)


def test_transport_state_in_checkpoint_and_older_checkpoints_load(tmp_path):
    cfg = LoopConfig(rounds=2, n_clients=2, seed=0, lr=0.1)
    w0 = torch.zeros(3)
    tr = _Clients()
    run_rounds(cfg, FedAvg(), av.AlwaysOn(2), tr, lambda w: (0.0, 0.0), RunDir(tmp_path), w0, progress=False)
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ck["transport"] == {"calls": 2}
    # resume from it: the state goes back to the transport
    tr2 = _Clients()
    run_rounds(LoopConfig(rounds=3, n_clients=2, seed=0, lr=0.1), FedAvg(), av.AlwaysOn(2), tr2,
               lambda w: (0.0, 0.0), RunDir(tmp_path), w0, resume=True, progress=False)
    assert tr2.loaded == [{"calls": 2}] and tr2.calls == 1
    # a checkpoint written before the hook (no "transport" key) still resumes, restoring nothing
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    del ck["transport"]
    torch.save(ck, tmp_path / "checkpoint.pt")
    tr3 = _Clients()
    run_rounds(LoopConfig(rounds=4, n_clients=2, seed=0, lr=0.1), FedAvg(), av.AlwaysOn(2), tr3,
               lambda w: (0.0, 0.0), RunDir(tmp_path), w0, resume=True, progress=False)
    assert tr3.loaded == [] and tr3.calls == 1
