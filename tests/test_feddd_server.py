"""FedDD server side (eq. 4, eqs. 5-6 scheduling, allocation plumbing), FedCS selection, virtual clock."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from coordinator.availability.models import AlwaysOn
from coordinator.errors import UserError
from coordinator.loop import LoopConfig, run_rounds
from coordinator.rundir import RunDir, read_metrics
from coordinator.sim.clock import Profile, load_profile, table4_profile
from coordinator.sim.transport import SimTransport
from coordinator.strategies import STRATEGIES, ClientUpdate
from coordinator.strategies.fedcs import FedCS
from coordinator.strategies.feddd import FedDD, masked_mean_delta
from edge_client.models import get_flat
from edge_client.report import ClientReport
from edge_client.trainer import TrainTask


def upd(i: int, delta: list[float], m: int, mask: list[int] | None = None, report: ClientReport | None = None,
        loss: float = float("nan")) -> ClientUpdate:
    return ClientUpdate(i, torch.tensor(delta, dtype=torch.float32), m, 1, 0.1, loss,
                        mask=None if mask is None else torch.tensor(mask, dtype=torch.bool), report=report)


def three_masked_updates() -> dict[int, ClientUpdate]:
    """c0: m=1, δ=[1,2,3,4], M=[1,1,0,0]; c1: m=2, δ=[4,4,4,4], M=[1,0,1,0]; c2: m=1, δ=[0,8,0,0], M=[0,1,0,0].
    Eq. (4): coord 0 = (1·1 + 2·4)/3 = 3; coord 1 = (1·2 + 1·8)/2 = 5; coord 2 = 2·4/2 = 4 (c0's 3 is off
    its mask and ignored); coord 3: nobody -> 0, the global value stays."""
    return {0: upd(0, [1, 2, 3, 4], 1, [1, 1, 0, 0]), 1: upd(1, [4, 4, 4, 4], 2, [1, 0, 1, 0]),
            2: upd(2, [0, 8, 0, 0], 1, [0, 1, 0, 0])}


def test_eq4_per_coordinate_weighted_mean():
    torch.testing.assert_close(masked_mean_delta(three_masked_updates()), torch.tensor([3.0, 5.0, 4.0, 0.0]))


def test_feddd_aggregate_keeps_uncovered_coordinates():
    s = FedDD()
    w = torch.full((4,), 10.0)
    new_w, state = s.aggregate(s.init_state(3, w), 0, w, three_masked_updates())
    torch.testing.assert_close(new_w, torch.tensor([7.0, 5.0, 6.0, 10.0]))
    # no rates reported: the uniform rule D_n = 1 − A_server
    torch.testing.assert_close(state["dropout"], torch.full((3,), 0.4, dtype=torch.float64))


def test_unmasked_update_counts_everywhere():
    """A full upload (mask None) with m = 3 and a masked one with m = 1: coord 0 = (3·2 + 1·6)/4 = 3, coord 1 = 2."""
    ups = {0: upd(0, [2, 2], 3), 1: upd(1, [6, 6], 1, [1, 0])}
    torch.testing.assert_close(masked_mean_delta(ups), torch.tensor([3.0, 2.0]))


def test_configure_schedule_full_every_h():
    s = FedDD(full_every=5)
    state = s.init_state(2, torch.zeros(3))
    state["dropout"] = torch.tensor([0.25, 0.5], dtype=torch.float64)
    tasks = [s.configure(state, t, TrainTask(client=1, round=t, lr=0.1, batch_size=4)) for t in range(7)]
    assert [task.sparse_download for task in tasks] == [False, True, True, True, True, False, True]  # eq. 6 / eq. 5
    assert {task.dropout_rate for task in tasks} == {0.5}
    assert not FedDD().configure(state, 3, tasks[0]).sparse_download  # h = 1: always the full model


def test_allocation_from_reports_matches_hand_worked_lp():
    """The cvx test's 3-client example through the strategy: w has 4 floats, U = 16 B; r = 8 B/s each way
    gives a_n = 16/8 + 16/8 = 4 s; t^cmp = 1 s; m equal; q = [1, 2, 3]; loss = [0.3, 1, 1]; δ = 3;
    A = 2/3 -> D = [0.8, 0.1, 0.1] with a modelled round time of 4.6 s."""
    s = FedDD(d_max=0.8, a_server=2 / 3, delta=3.0)
    w = torch.zeros(4)
    ups = {i: upd(i, [0, 0, 0, 0], 10, report=ClientReport(compute_s=1.0, up_Bps=8.0, down_Bps=8.0, label_score=q),
                  loss=loss) for i, (q, loss) in enumerate([(1.0, 0.3), (2.0, 1.0), (3.0, 1.0)])}
    _, state = s.aggregate(s.init_state(3, w), 0, w, ups)
    np.testing.assert_allclose(state["dropout"].numpy(), [0.8, 0.1, 0.1], atol=1e-6)
    assert float(state["modelled_round_s"]) == pytest.approx(4.6, abs=1e-6)


def test_feddd_rejects_infeasible_budget():
    with pytest.raises(ValueError, match="infeasible"):
        FedDD(d_max=0.5, a_server=0.4)

    class Cfg:
        feddd_d_max, feddd_a_server, feddd_delta, feddd_full_every, rate_smoothing = 0.5, 0.4, 0.0, 1, 0.5
    with pytest.raises(UserError, match="A_server"):
        FedDD.from_config(Cfg)


def fedcs_state(s: FedCS, up: list[float]) -> dict:
    """5 clients, w of 4 floats (U = 16 B), t^cmp = 1 s, r^d = 16 B/s (1 s): estimate = 2 + 16/r^u."""
    state = s.init_state(5, torch.zeros(4))
    state["compute_s"] = torch.ones(5, dtype=torch.float64)
    state["down_Bps"] = torch.full((5,), 16.0, dtype=torch.float64)
    state["up_Bps"] = torch.tensor(up, dtype=torch.float64)
    return state


def test_fedcs_selects_fastest_within_budget_and_deadline():
    """r^u = [16, 8, 4, 2, 1] -> estimates [3, 4, 6, 10, 18] s; budget 0.6 of 5 clients -> at most 3."""
    rng = np.random.default_rng(0)
    s = FedCS(budget=0.6)
    state = fedcs_state(s, [16, 8, 4, 2, 1])
    assert s.select(state, 1, np.ones(5, bool), rng) == [0, 1, 2]
    assert s.select(state, 1, np.array([1, 0, 1, 1, 1], bool), rng) == [0, 2, 3]
    assert FedCS(budget=0.6, deadline_s=5.0).select(state, 1, np.ones(5, bool), rng) == [0, 1]
    unknown = fedcs_state(s, [float("nan"), 8, 4, 2, 1])   # never measured: ranked last, never under a deadline
    assert s.select(unknown, 1, np.ones(5, bool), rng) == [1, 2, 3]
    assert FedCS(budget=1.0, deadline_s=12.0).select(unknown, 1, np.ones(5, bool), rng) == [1, 2, 3]
    assert s.select(s.init_state(5, torch.zeros(4)), 0, np.ones(5, bool), rng) == [0, 1, 2, 3, 4]


def test_fedcs_aggregates_and_smooths_rates():
    s = FedCS(smoothing=0.5)
    state = s.init_state(2, torch.zeros(2))
    w, state = s.aggregate(state, 0, torch.zeros(2), {0: upd(0, [2, 4], 1, report=ClientReport(up_Bps=100.0))})
    torch.testing.assert_close(w, torch.tensor([-2.0, -4.0]))
    _, state = s.aggregate(state, 1, w, {0: upd(0, [0, 0], 1, report=ClientReport(up_Bps=300.0))})
    assert float(state["up_Bps"][0]) == 200.0 and state["up_Bps"][1].isnan()  # (1 − 0.5)·100 + 0.5·300


def test_registered():
    assert STRATEGIES["feddd"] is FedDD and STRATEGIES["fedcs"] is FedCS


def tiny_federation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))   # 17 parameters, 68 dense bytes
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 2, generator=g), torch.tensor([0, 1] * 4)) for _ in range(2)]
    return model, data


def test_virtual_round_time_eq12():
    """2 clients, 8 samples, batch 4 -> 2 steps. Profile: s/step [0.5, 1], r^u [68, 34] B/s, r^d 68 B/s.
    Dense: t = 68/68 + 2·s/step + 68/r^u = [1 + 1 + 1, 1 + 2 + 2] = [3, 5] -> eq. (12): 5 s.
    FedDD, D = 0.5: the upload is 12 + 1 + 4·10 = 53 B, so client 1 takes 1 + 2 + 53/34 s."""
    model, data = tiny_federation()
    prof = Profile(np.array([0.5, 1.0]), np.array([68.0, 34.0]), np.array([68.0, 68.0]))
    tr = SimTransport(model, data, profile=prof, num_classes=2)
    w = get_flat(model)
    dense = [TrainTask(client=i, round=0, lr=0.1, batch_size=4) for i in range(2)]
    ups, _ = tr.run_round(0, w, dense)
    assert tr.round_stats() == {"upload_bytes": 136.0, "download_bytes": 136.0, "virtual_s": 5.0}
    assert ups[1].report.compute_s == 2.0 and ups[1].report.label_score == 2.0 and ups[1].mask is None
    sparse = [TrainTask(client=i, round=1, lr=0.1, batch_size=4, dropout_rate=0.5) for i in range(2)]
    ups, _ = tr.run_round(1, w, sparse)
    assert tr.round_stats()["upload_bytes"] == 106.0
    assert tr.round_stats()["virtual_s"] == pytest.approx(3 + 53 / 34)
    assert all(int(u.mask.sum()) == 10 for u in ups.values())


def test_profile_files(tmp_path):
    prof = table4_profile(3, seed=0, batch_size=10)
    assert ((prof.up_Bps >= 125) & (prof.up_Bps <= 625)).all()
    assert ((prof.compute_s_per_step >= 1e-3) & (prof.compute_s_per_step <= 0.1)).all()  # 10·[0.1, 10] ms
    (tmp_path / "p.json").write_text(json.dumps(prof.to_json()))
    back = load_profile(tmp_path / "p.json", 3)
    np.testing.assert_array_equal(back.down_Bps, prof.down_Bps)
    (tmp_path / "p.csv").write_text("client,compute_s_per_step,up_Bps,down_Bps\n0,0.1,100,1000\n1,0.2,0,1000\n")
    with pytest.raises(UserError, match="> 0"):
        load_profile(tmp_path / "p.csv", 2)
    with pytest.raises(UserError, match=r"no row for clients \[2\]"):
        load_profile(tmp_path / "p.csv", 3)


def test_feddd_run_allocates_and_records_virtual_time(tmp_path):
    """3 rounds of FedDD in the round loop: round 0 uploads everything (D = 0), then the allocation meets
    A_server = 0.6 exactly (equal U_n: mean kept fraction 0.6); the metrics carry the virtual clock."""
    model, data = tiny_federation()
    data = data + data[:1]
    prof = Profile(np.array([0.5, 1.0, 0.1]), np.array([68.0, 34.0, 17.0]), np.array([68.0, 68.0, 68.0]))
    tr = SimTransport(model, data, profile=prof, num_classes=2)
    s = FedDD(a_server=0.6, d_max=0.8)
    cfg = LoopConfig(rounds=3, n_clients=3, seed=0, lr=0.1, batch_size=4)
    run_rounds(cfg, s, AlwaysOn(3), tr, lambda w: (0.0, 0.0), RunDir(tmp_path), get_flat(model), progress=False)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0]["upload_bytes"] > 3 * 68    # D = 0: every unit, plus the 13-byte header and bitmap
    assert rows[1]["upload_bytes"] < rows[0]["upload_bytes"]
    assert rows[2]["virtual_s_total"] == pytest.approx(sum(r["virtual_s"] for r in rows))
    assert rows[1]["virtual_s"] < rows[0]["virtual_s"]
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["state"]
    assert float((1 - state["dropout"]).mean()) == pytest.approx(0.6, abs=1e-6)
