"""The seed papers' variants that a differential check against the authors' code found missing, each a named
option worked by hand (tiny tensors, 2–4 clients): FedLaAvg's lr-normalised storage, the lr schedules (MIFA's
lr_0/(t+1), step decay), MIFA's wait-for-everyone start, FedAvg with K random clients, the shards partition with
distinct classes, FL-FDMS's 80/20 split, and --period renamed --half-period (docs/strategies.md)."""

import argparse
import json
import logging

import numpy as np
import pytest
import torch
from strategy_helpers import close, run, upd

from coordinator import config
from coordinator.availability import models as av
from coordinator.cli import main
from coordinator.config import SimConfig, StrategyConfig
from coordinator.errors import UserError
from coordinator.loop import LoopConfig
from coordinator.runsetup import build_strategy, loop_config
from coordinator.strategies import MIFA, STRATEGIES, FedAvg, FedLaAvg, FedProx
from coordinator.strategies.schedule import lr_at
from edge_client import partition as P

# ---------------------------------------------------------------- lr schedules (TrainConfig.lr_schedule)


def test_exp_schedule_is_the_loops_former_rule():
    for lr, g, lo in [(0.01, 0.95, 1e-5), (0.1, 1.0, 1e-5), (1e-6, 1.0, 1e-5), (0.5, 0.5, 0.0)]:
        for t in (0, 1, 7, 200):
            old = max(lr * g ** t, lo) if g < 1 else lr  # LoopConfig.lr_at before the option existed
            assert lr_at(t, lr, decay=g, lr_min=lo) == old
            assert LoopConfig(rounds=1, n_clients=1, seed=0, lr=lr, lr_decay=g, lr_min=lo).lr_at(t) == old


def test_inv_t_and_step_by_hand():
    # MIFA code: lr_t = lr_0/(t+1): 0.1, 0.05, 0.1/3, 0.025
    assert [lr_at(t, 0.1, schedule="inv-t") for t in range(4)] == pytest.approx([0.1, 0.05, 0.1 / 3, 0.025])
    assert lr_at(99, 0.1, schedule="inv-t", lr_min=0.01) == 0.01                 # the floor: 0.001 → 0.01
    # step: lr·γ^⌊t/k⌋ with lr 0.8, γ 0.5, k 3: 0.8 ×3, 0.4 ×3, 0.2
    assert [lr_at(t, 0.8, schedule="step", decay=0.5, step_every=3) for t in range(7)] == \
        [0.8, 0.8, 0.8, 0.4, 0.4, 0.4, 0.2]
    assert all(lr_at(t, 0.3, schedule="step", decay=0.9, step_every=1) == lr_at(t, 0.3, decay=0.9)
               for t in range(20))  # k = 1 is exp
    cfg = LoopConfig(rounds=9, n_clients=1, seed=0, lr=0.8, lr_decay=0.5, lr_min=0.0, lr_schedule="step",
                     lr_step_every=3)
    assert [cfg.lr_at(t) for t in (2, 3, 8)] == [0.8, 0.4, 0.2]
    with pytest.raises(ValueError, match="schedule"):
        lr_at(0, 0.1, schedule="cosine")


def test_inv_t_schedule_reaches_the_tasks(tmp_path):
    out = tmp_path / "r"
    assert main(["sim", "--dataset", "fmnist", "--clients", "4", "--model", "logreg", "--steps", "1",
                 "--rounds", "3", "--lr", "0.1", "--lr-schedule", "inv-t", "--no-progress", "--out", str(out)]) == 0
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([0.1, 0.05, 0.1 / 3])
    saved = json.loads((out / "config.json").read_text())["train"]
    assert saved["lr_schedule"] == "inv-t" and saved["lr_step_every"] == 1


# ---------------------------------------------------------------- FedLaAvg storage


def test_fedlaavg_lr_normalised_by_hand():
    """N = 2, K = 1, lr_t = 0.5·0.5^t (0.5, 0.25, 0.125), w0 = 0.
    r0: client 0, d = [1,2] at lr 0.5 → u_0 = [2,4]; avg = [1,2];        w1 = −0.5·[1,2]  = [−0.5, −1]
    r1: client 1, d = [0.5,0] at 0.25 → u_1 = [2,0]; avg = [2,2];        w2 = w1 − 0.25·[2,2] = [−1, −1.5]
    r2: nobody;                                     avg = [2,2];        w3 = w2 − 0.125·[2,2] = [−1.25, −1.75]
    raw storage instead: avg [0.5,1], [0.75,1], [0.75,1] → w = [−0.5,−1], [−1.25,−2], [−2,−3]."""
    sched = LoopConfig(rounds=3, n_clients=2, seed=0, lr=0.5, lr_decay=0.5, lr_min=0.0).lr_at
    rounds = [({0: [1.0, 2.0]}, 0.5), ({1: [0.5, 0.0]}, 0.25), ({}, 0.125)]
    for storage, want in [("lr-normalised", [[-0.5, -1], [-1, -1.5], [-1.25, -1.75]]),
                          ("raw", [[-0.5, -1], [-1.25, -2], [-2, -3]])]:
        s = FedLaAvg(beta=0.5, storage=storage, lr_at=sched)
        w = torch.zeros(2)
        state = s.init_state(2, w)
        for t, (deltas, lr) in enumerate(rounds):
            w, state = s.aggregate(state, t, w, {i: upd(i, d, lr) for i, d in deltas.items()})
            assert close(w, want[t]), (storage, t, w)
        assert close(state["avg"], state["latest"].mean(0).tolist())  # invariant (3) in either unit
    assert close(state["latest"][0], [1, 2]) and close(s.init_state(2, w)["avg"], [0, 0])


def test_fedlaavg_storages_agree_at_a_constant_lr():
    """The paper's runs (constant γ = 0.01): both storages give the same models."""
    rng = np.random.default_rng(0)
    rounds = [{int(i): rng.normal(size=3).tolist() for i in rng.choice(4, 2, replace=False)} for _ in range(6)]
    raw, _ = run(FedLaAvg(beta=0.5), 4, rounds, lr=0.01)
    norm, _ = run(FedLaAvg(beta=0.5, storage="lr-normalised", lr_at=lambda t: 0.01), 4, rounds, lr=0.01)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(raw, norm))


def test_fedlaavg_lr_normalised_without_a_schedule_uses_the_updates_lr():
    s = FedLaAvg(beta=1.0, storage="lr-normalised")
    w = torch.zeros(1)
    state = s.init_state(1, w)
    w, state = s.aggregate(state, 0, w, {0: upd(0, [1.0], lr=0.5)})    # u = 2, step 0.5·2 = 1
    w, state = s.aggregate(state, 1, w, {})                             # last lr 0.5 again
    assert close(w, [-2.0]) and float(state["lr"][0]) == 0.5


def test_fedlaavg_storage_from_config_and_the_bound_schedule():
    cfg = SimConfig()
    cfg.strategy.algo, cfg.strategy.fedlaavg_storage = "fedlaavg", "lr-normalised"
    cfg.train.lr, cfg.train.lr_schedule = 0.2, "inv-t"
    s = build_strategy(cfg)
    assert s.storage == "lr-normalised" and s.lr_at(3) == loop_config(cfg).lr_at(3) == pytest.approx(0.05)
    assert FedLaAvg.from_config(StrategyConfig()).storage == "raw"  # default: existing runs unchanged
    with pytest.raises(ValueError, match="storage"):
        FedLaAvg(storage="scaled")


# ---------------------------------------------------------------- MIFA lr-normalised storage


def test_mifa_lr_normalised_by_hand():
    """N = 2, exact 1/N, w0 = 0, schedule η = 0.5, 0.25, 0.25.
    lr-normalised: G_i = d_i/η_i, w ← w − η_t·mean(G)
      r0: G0 = [1,0]/0.5 = [2,0], G1 = [0,1]/0.5 = [0,2]; v = [1,1], step 0.5   w = [−0.5, −0.5]
      r1: nobody; v = [1,1], step 0.25                                           w = [−0.75, −0.75]
      r2: G0 = [0.5,0.5]/0.25 = [2,2]; v = [1,2], step 0.25                      w = [−1, −1.25]
    raw (MimiC's code): v = [0.5,0.5], [0.5,0.5], [0.25,0.75] → [−0.5,−0.5], [−1,−1], [−1.25,−1.75]:
    the stale delta of client 1, trained at η 0.5, keeps its full size after the lr halves."""
    sched = [0.5, 0.25, 0.25]
    rounds = [({0: [1.0, 0.0], 1: [0.0, 1.0]}, 0.5), ({}, 0.25), ({0: [0.5, 0.5]}, 0.25)]
    for storage, want in [("lr-normalised", [[-0.5, -0.5], [-0.75, -0.75], [-1.0, -1.25]]),
                          ("raw", [[-0.5, -0.5], [-1.0, -1.0], [-1.25, -1.75]])]:
        s = MIFA(round_weights=False, storage=storage, lr_at=lambda t: sched[t])
        w = torch.zeros(2)
        state = s.init_state(2, w)
        for t, ((ups, lr), expect) in enumerate(zip(rounds, want)):
            w, state = s.aggregate(state, t, w, {i: upd(i, d, lr=lr) for i, d in ups.items()})
            assert close(w, expect), (storage, t, w)
        assert ("lr" in state) == (storage == "lr-normalised")   # the raw default's state is as before
        if storage == "lr-normalised":
            assert float(state["lr"][0]) == 0.25                    # the last η_t applied


def test_mifa_storages_agree_at_a_constant_lr_and_the_option_is_checked():
    rng = np.random.default_rng(2)
    rounds = [{int(i): rng.normal(size=3).tolist() for i in rng.choice(4, 2, replace=False)} for _ in range(6)]
    raw, _ = run(MIFA(), 4, rounds)   # strategy_helpers.upd: lr 0.1 for every update
    norm, _ = run(MIFA(storage="lr-normalised", lr_at=lambda t: 0.1), 4, rounds)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(raw, norm))
    # without a schedule: this round's updates' lr, else the last one used
    s = MIFA(round_weights=False, storage="lr-normalised")
    w = torch.zeros(1)
    state = s.init_state(1, w)
    w, state = s.aggregate(state, 0, w, {0: upd(0, [1.0], lr=0.5)})   # G = 2, step 0.5·2 = 1
    w, state = s.aggregate(state, 1, w, {})                            # last lr 0.5 again
    assert close(w, [-2.0])
    with pytest.raises(ValueError, match="storage"):
        MIFA(storage="scaled")
    with pytest.raises(ValueError, match="units 'delta'"):
        MIFA(units="gradient", storage="lr-normalised")
    cfg = SimConfig()
    cfg.strategy.algo, cfg.strategy.mifa_storage = "mifa", "lr-normalised"
    cfg.train.lr, cfg.train.lr_decay = 0.2, 0.5
    s = build_strategy(cfg)
    assert s.storage == "lr-normalised" and s.lr_at(2) == loop_config(cfg).lr_at(2) == pytest.approx(0.05)
    assert MIFA.from_config(StrategyConfig()).storage == "raw"   # default: MimiC's released code, runs unchanged


def test_mifa_lr_normalised_with_gradient_units_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["sim", "--algo", "mifa", "--units", "gradient", "--mifa-storage", "lr-normalised",
                 "--out", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dropfl: error: strategy.mifa_storage lr-normalised needs strategy.units delta")
    assert not out.exists()


# ---------------------------------------------------------------- MIFA wait-all


def test_mifa_wait_all_by_hand():
    """N = 3, exact 1/N, delta units, w0 = 0. Nobody has everyone before round 2:
    r0: G0 = [3,0]          seen {0}      no update                 w = [0, 0]
    r1: G1 = [0,3]          seen {0,1}    no update                 w = [0, 0]
    r2: G2 = [3,3]          seen all      v = [6,6]/3 = [2,2]       w = [−2, −2]
    r3: nobody                            v = [2,2]                 w = [−4, −4]
    r4: G0 = [0,0]                        v = [3,6]/3 = [1,2]       w = [−5, −6]
    Without waiting: v = [1,0], [1,1], [2,2], [2,2], [1,2] → [−1,0], [−2,−1], [−4,−3], [−6,−5], [−7,−7]."""
    rounds = [{0: [3.0, 0.0]}, {1: [0.0, 3.0]}, {2: [3.0, 3.0]}, {}, {0: [0.0, 0.0]}]
    ws, state = run(MIFA(round_weights=False, wait_all=True), 3, rounds, w0=[0.0, 0.0])
    for w, want in zip(ws, [[0, 0], [0, 0], [-2, -2], [-4, -4], [-5, -6]]):
        assert close(w, want)
    assert state["seen"].tolist() == [True, True, True]
    ws, state = run(MIFA(round_weights=False), 3, rounds, w0=[0.0, 0.0])
    for w, want in zip(ws, [[-1, 0], [-2, -1], [-4, -3], [-6, -5], [-7, -7]]):
        assert close(w, want)
    assert "seen" not in state  # the default's state (and its checkpoints) are as before


def test_mifa_wait_all_is_a_no_op_when_round_0_has_everyone():
    rng = np.random.default_rng(1)
    rounds = [{i: rng.normal(size=2).tolist() for i in range(3)}] + [{1: rng.normal(size=2).tolist()}, {}]
    a, _ = run(MIFA(wait_all=True), 3, rounds)
    b, _ = run(MIFA(), 3, rounds)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert MIFA.from_config(StrategyConfig(mifa_wait_all=True)).wait_all
    assert not MIFA.from_config(StrategyConfig()).wait_all


# ---------------------------------------------------------------- FedAvg with K random clients


def test_fedavg_k_selects_k_uniformly_among_the_available():
    s = FedAvg(k=2)
    avail = np.array([1, 0, 1, 1], bool)  # clients 0, 2, 3
    rng = np.random.default_rng([0, 5, 0x5E1])  # the loop's per-round rng (seed 0, round 5)
    want = sorted(int(i) for i in np.random.default_rng([0, 5, 0x5E1]).choice([0, 2, 3], 2, replace=False))
    assert s.select({}, 5, avail, rng) == want  # the reference draw
    assert FedAvg().select({}, 5, avail, rng) == [0, 2, 3]  # default: everyone available
    assert s.select({}, 0, np.array([0, 0, 1, 0], bool), rng) == [2]  # fewer than K: all of them
    counts = np.zeros(4)
    draw = np.random.default_rng(7)
    for _ in range(3000):
        picked = s.select({}, 0, avail, draw)
        assert len(picked) == 2 and set(picked) <= {0, 2, 3}
        counts[picked] += 1
    assert counts[1] == 0 and np.allclose(counts[[0, 2, 3]] / 3000, 2 / 3, atol=0.04)  # P = K/|A| each


def test_fedavg_k_averages_what_arrived_by_hand():
    # K = 2 selected {0, 3}; only 3 arrives: w = [1,1] − [2,−2] = [−1, 3]; both: − ([0,4]+[2,−2])/2 = [0, 0]
    s = FedAvg.from_config(StrategyConfig(fedavg_k=2))
    assert s.k == 2
    w, _ = s.aggregate({}, 0, torch.tensor([1.0, 1.0]), {3: upd(3, [2.0, -2.0])})
    assert close(w, [-1, 3])
    w, _ = s.aggregate({}, 0, torch.tensor([1.0, 1.0]), {0: upd(0, [0.0, 4.0]), 3: upd(3, [2.0, -2.0])})
    assert close(w, [0, 0])
    p = FedProx.from_config(StrategyConfig(fedavg_k=3, mu=1.0))  # FedLaAvg's FedProx baseline: random K too
    assert p.k == 3 and p.mu == 1.0
    assert FedAvg.from_config(StrategyConfig()).k is None
    assert STRATEGIES["full"].from_config(StrategyConfig(fedavg_k=1)).select({}, 0, np.zeros(3, bool), None) == \
        [0, 1, 2]


# ---------------------------------------------------------------- partitions


def _labels(per_class=6000, classes=10):
    return np.random.default_rng(1).permutation(np.repeat(np.arange(classes), per_class))


@pytest.mark.parametrize("clients,spc,tries", [(30, 2, 1000), (30, 2, 0), (12, 5, 1000), (12, 5, 0), (10, 1, 1000)])
def test_shards_distinct_no_repeated_class_every_sample_once(clients, spc, tries):
    y = _labels()
    parts = P.shards_distinct(y, clients, 0, shards_per_client=spc, tries=tries)  # tries=0: the construction
    allidx = np.concatenate(parts)
    assert len(allidx) == len(np.unique(allidx)) == len(y)  # every sample used, once
    size = len(y) // (clients * spc)
    for p in parts:
        counts = np.bincount(y[p], minlength=10)
        assert sorted(counts[counts > 0].tolist()) == [size] * spc  # spc whole shards of spc distinct classes
    again = P.shards_distinct(y, clients, 0, shards_per_client=spc, tries=tries)
    assert all((a == b).all() for a, b in zip(parts, again))  # deterministic by seed
    other = P.shards_distinct(y, clients, 1, shards_per_client=spc, tries=tries)
    assert any((a != b).any() for a, b in zip(parts, other))


def test_shards_distinct_through_the_partition_option():
    y = _labels()
    parts = P.partition("shards-distinct", y, 30, seed=2, shards_per_client=2)
    assert all(len(np.unique(y[p])) == 2 for p in parts)
    plain = P.partition("shards", y, 30, seed=2)  # the old option is unchanged, and here repeats a class
    assert any(len(np.unique(y[p])) == 1 for p in plain)
    # where the shards draw already has distinct classes (seed 0), it is the first draw tried: the same split
    assert all((a == b).all() for a, b in zip(P.partition("shards", y, 30, seed=0),
                                              P.partition("shards-distinct", y, 30, seed=0)))
    with pytest.raises(P.PartitionError, match="distinct"):
        P.shards_distinct(np.repeat(np.arange(2), 30), 3, 0, shards_per_client=3, tries=0)  # 2 classes < 3


def test_fdms_clustered_80_20_keeps_80_percent_of_each_label():
    y = np.repeat(np.arange(10), 6000)
    full = P.partition("fdms-clustered", y, 20, seed=3)
    split = P.partition("fdms-clustered-80-20", y, 20, seed=3)
    for a, b in zip(full, split):
        assert len(b) == 160 and set(b) <= set(a)  # the same draw, 20 % of it held out
        labs = np.unique(y[a])
        assert np.bincount(y[b], minlength=10)[labs].tolist() == [80, 80]


# ---------------------------------------------------------------- --period → --half-period


def _resolve(argv):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, list(STRATEGIES))
    return config.resolve(parser.parse_args(argv), list(STRATEGIES))


def test_old_period_flag_gives_the_same_config_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="dropfl.config"):
        new = _resolve(["--availability", "diurnal", "--half-period", "7"])
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="dropfl.config"):
        old = _resolve(["--availability", "diurnal", "--period", "7"])
    assert old.to_dict() == new.to_dict() and old.availability.half_period == 7
    (rec,) = [r for r in caplog.records if r.name == "dropfl.config"]
    assert rec.levelno == logging.WARNING
    assert "--period is deprecated" in rec.getMessage() and "--half-period" in rec.getMessage()
    assert "7 is used" in rec.getMessage()
    assert _resolve(["--period", "7", "--half-period", "7"]).availability.half_period == 7
    with pytest.raises(UserError, match="--half-period"):
        _resolve(["--period", "7", "--half-period", "8"])
    with pytest.raises(UserError, match=r"availability.half_period must be an integer ≥ 1 \(got 0 from --period\)"):
        _resolve(["--period", "0"])


@pytest.mark.parametrize("name,old,new", [
    ("run.toml", '[availability]\nkind = "diurnal"\nperiod = 9\n',
     '[availability]\nkind = "diurnal"\nhalf_period = 9\n'),
    ("run.json", '{"availability": {"kind": "diurnal", "period": 9}}',
     '{"availability": {"kind": "diurnal", "half_period": 9}}'),
])
def test_old_period_key_gives_the_same_config_with_a_warning(tmp_path, caplog, name, old, new):
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    fnew, fold = tmp_path / "new" / name, tmp_path / "old" / name
    fnew.write_text(new)
    fold.write_text(old)
    with caplog.at_level(logging.WARNING, logger="dropfl.config"):
        a = _resolve(["--config", str(fnew)])
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="dropfl.config"):
        b = _resolve(["--config", str(fold)])
    assert a.to_dict() == b.to_dict() and b.availability.half_period == 9
    (rec,) = [r for r in caplog.records if r.name == "dropfl.config"]
    msg = rec.getMessage()
    assert rec.levelno == logging.WARNING and "availability.period" in msg and "deprecated" in msg
    assert "availability.half_period" in msg and "9 is used" in msg and str(fold) in msg
    assert _resolve(["--config", str(fold), "--half-period", "4"]).availability.half_period == 4  # flag wins
    fold.write_text(old.replace("period = 9", "period = 9\nhalf_period = 3")
                    if name.endswith("toml") else '{"availability": {"period": 9, "half_period": 3}}')
    with pytest.raises(UserError, match="deprecated name of availability.half_period"):
        _resolve(["--config", str(fold)])


def test_diurnal_takes_the_half_period():
    a, b = av.Diurnal(20, half_period=3), av.Diurnal(20, period=3)  # the former keyword still works
    rounds = [a.round(t).available.tolist() for t in range(7)]
    assert rounds == [b.round(t).available.tolist() for t in range(7)]
    assert [r[0] for r in rounds] == [True, True, True, False, False, False, True]  # 3 on, 3 off
    with pytest.raises(UserError, match="--half-period"):
        av.Diurnal(20, half_period=0)
    assert config.upgrade_renamed({"availability": {"period": 5}}, warn=False) == {"availability": {"half_period": 5}}
