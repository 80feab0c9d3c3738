"""Sweeps (coordinator/sim/sweep.py): the lockstep executor gives every run the serial executor's files.

Lockstep trains the clients of many runs in one computation of the batched engine
(coordinator/sim/lockstep.py); that is exact because, on the paths it merges, a client's result does
not depend on the other clients of its computation. Both are checked here: the engine alone, then
whole sweeps (model.pt, metrics without their timing fields, participation.csv: bit for bit).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from strategy_helpers import cache_dataset_loads

from coordinator.config import SimConfig
from coordinator.sim import kernels
from coordinator.sim.batched import BatchedEngine
from coordinator.sim.sweep import EXECUTORS, Job, plan, run_sweep
from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask

TIMING = ("seconds", "elapsed")
METHODS = ("mimic", "mifa", "fedprox", "scaffold")   # plain, FedProx and SCAFFOLD clients: merged computations


def config(algo: str, seed: int, rounds: int = 3, model: str = "mimic-cnn") -> SimConfig:
    cfg = SimConfig()
    cfg.data.dataset, cfg.data.partition, cfg.data.clients, cfg.data.shards_per_client = "fmnist", "shards", 6, 2
    cfg.model.model = model
    cfg.train.lr, cfg.train.lr_decay, cfg.train.batch_size, cfg.train.epochs, cfg.train.steps = 0.05, 0.9, 8, None, 3
    a = cfg.availability
    a.kind, a.tau_max, a.min_active, a.first_round_all = "bounded", 3, 2, True
    cfg.strategy.algo = algo
    cfg.run.rounds, cfg.run.seed, cfg.run.eval_every, cfg.run.threads = rounds, seed, rounds, 1
    return cfg


def files(run) -> dict:
    """A run's results. Its metrics' `engine` without the native parts that ran (`batched+native(avx512: conv+fc)`
    → `batched+native(avx512)`): a lockstep group may run a part that a run alone does not (plain clients beside
    FedProx ones take the fused update), with the same bits, and each records what it ran."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["engine"] = re.sub(r": [a-z+|]+\)", ")", r["engine"])
    return {"model": (run / "model.pt").read_bytes(),
            "metrics": [{k: v for k, v in r.items() if k not in TIMING} for r in rows],
            "participation": (run / "participation.csv").read_text()}


@pytest.fixture
def cpu_only(monkeypatch):
    """The lockstep executor merges runs on the CPU only (on CUDA, `plan` runs each on its own and says why):
    the tests of merged sweeps run as on a machine without a GPU, also where one is present (the LeNets would train
    on the CPU there anyway, --sim-device auto; mlp would not)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def cached():
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        yield


def test_a_clients_result_does_not_depend_on_the_other_clients_of_its_computation(fmnist):
    """What lockstep relies on: alone, or beside other clients that start from other weights and read
    other data, a client gets the same bits (the native LeNet layers and the batched matmuls)."""
    x, y = fmnist.train.x[:400], fmnist.train.y[:400]
    data = [(x[i * 50:(i + 1) * 50], y[i * 50:(i + 1) * 50]) for i in range(8)]
    names = ["mlp", "logreg"] + (["mimic-cnn"] if kernels.available() else [])
    for name in names:
        model = build_model(name, (1, 28, 28), 10, seed=0)
        engine = BatchedEngine(model, data, workers=0, device="cpu")   # (on CUDA lockstep merges nothing)
        starts = torch.stack([get_flat(build_model(name, (1, 28, 28), 10, seed=s)) for s in (0, 1, 2)])
        tasks = [TrainTask(client=c % 4, round=1, lr=0.05, batch_size=16, epochs=1 if c % 2 else None,
                           steps=None if c % 2 else 2 + c, seed=c // 4) for c in range(8)]
        alone = [engine.run_parts([(starts, [t], [c], [c % 3])])[0][0] for c, t in enumerate(tasks)]
        for order in (list(range(8)), [7, 2, 5, 0, 3], [1, 6]):
            (merged,) = engine.run_parts([(starts, [tasks[c] for c in order], order, [c % 3 for c in order])])
            for c, r in zip(order, merged):
                assert torch.equal(r.delta, alone[c].delta) and r.loss == alone[c].loss, (name, c)
                assert r.steps == alone[c].steps and r.num_samples == 50
        # and a task with its own start row is the task trained from that w (the serial path)
        own = engine.run(starts[1], [tasks[1]])[0]
        assert torch.equal(own.delta, alone[1].delta)
        assert float(alone[0].delta.abs().max()) > 0


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="lockstep merges LeNet runs only with the native kernels")
def test_lockstep_sweep_equals_serial_bit_for_bit(tmp_path, cpu_only, cached):
    jobs = {ex: [Job(config(m, s), tmp_path / ex / f"{m}-s{s}", label=f"{m} seed {s}") for m in METHODS
                 for s in (0, 1)] for ex in ("serial", "lockstep")}
    lines: list[str] = []
    assert plan(jobs["lockstep"]) == [(list(range(8)), None)]     # one group: same data, model, local work
    for ex in ("serial", "lockstep"):
        assert run_sweep(jobs[ex], executor=ex, progress=True, log=lines.append) == [j.out for j in jobs[ex]]
    assert any(line.startswith("lockstep step 1: 8 runs") for line in lines)
    # round 0 (everyone trains from the seed's initial model): MimiC's and MIFA's tasks are the same, trained once
    assert any(line.startswith("lockstep step 1: 8 runs, 48 clients (12 identical to another run's, trained once)")
               for line in lines), lines
    if kernels.fused_update(kernels.chosen(), torch.float32):   # plain, FedProx and SCAFFOLD clients merged
        assert all(" in 2 computations" in line for line in lines if line.startswith("lockstep step")), lines
    for s, lk in zip(jobs["serial"], jobs["lockstep"]):
        a, b = files(s.out), files(lk.out)
        assert a == b, s.label
        assert a["metrics"][-1]["accuracy"] is not None and a["metrics"][-1]["engine"].startswith("batched")
    # each run's log file has its own records only
    log = (jobs["lockstep"][0].out / "log.txt").read_text()
    assert "engine:" in log and str(jobs["lockstep"][1].out) not in log


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="lockstep merges LeNet runs only with the native kernels")
def test_a_resumed_job_beside_new_ones(tmp_path, cpu_only, cached):
    """A job resumed from round 2 of 4 runs beside fresh jobs (other rounds, so other lrs: not merged
    with them) and ends as the serial executor's resume does."""
    run_sweep([Job(config("mimic", 0, rounds=2), tmp_path / "first")], executor="serial", progress=False)
    for ex in ("serial", "lockstep"):
        first = tmp_path / ex / "mimic-s0"
        shutil.copytree(tmp_path / "first", first)
        jobs = [Job(config("mimic", 0, rounds=4), first, resume=True),
                Job(config("mifa", 0, rounds=3), tmp_path / ex / "mifa-s0"),
                Job(config("mimic", 1, rounds=3), tmp_path / ex / "mimic-s1")]
        run_sweep(jobs, executor=ex, progress=False)
    for name in ("mimic-s0", "mifa-s0", "mimic-s1"):
        assert files(tmp_path / "serial" / name) == files(tmp_path / "lockstep" / name), name
    rows = files(tmp_path / "lockstep" / "mimic-s0")["metrics"]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]


def test_jobs_that_cannot_be_merged_run_on_their_own_and_say_why(tmp_path, cpu_only):
    jobs = [Job(config("mimic", 0), tmp_path / "a"), Job(config("fedavg", 0, model="fdms-cnn"), tmp_path / "b"),
            Job(config("feddd", 0), tmp_path / "c"), Job(config("mimic", 1), tmp_path / "d"),
            Job(config("mimic", 0, model="mlp"), tmp_path / "e")]
    jobs[3].cfg.train.engine = "loop"
    units = plan(jobs)
    assert [u for u, _ in units] == [[0], [1], [2], [3], [4]]
    reasons = dict((u[0], r) for u, r in units)
    assert reasons[0] is None and reasons[4] is None                 # groups (mimic-cnn, mlp: other models)
    assert "grouped convolutions" in reasons[1] and "feddd" in reasons[2] and reasons[3] == "--engine loop"
    many = [Job(config("mimic", s), tmp_path / f"s{s}") for s in range(5)]
    if hasattr(many[4].cfg.train, "slices"):   # another --slices: another cut of a round, another group
        many[4].cfg.train.slices = 3
        assert plan(many) == [([0, 1, 2, 3], None), ([4], None)]
        many[4].cfg.train.slices = many[0].cfg.train.slices
    assert plan(many, max_runs=2) == [([0], None), ([1, 2], None), ([3, 4], None)]   # near-equal groups
    with pytest.MonkeyPatch.context() as mp:   # with a GPU: LeNets still on the CPU (auto); on the GPU, alone
        mp.setattr(torch.cuda, "is_available", lambda: True)
        assert plan(many) == [([0, 1, 2, 3, 4], None)]
        for job in many:
            job.cfg.train.device = "cuda"
        assert [u for u, _ in plan(many)] == [[0], [1], [2], [3], [4]]
        assert all(r.startswith("CUDA") for _, r in plan(many))
    assert EXECUTORS[0] == "lockstep"
    with pytest.raises(ValueError, match="unknown sweep executor"):
        run_sweep(many, executor="nope")


def test_lockstep_evaluates_at_most_one_run_per_cpu_of_the_process(monkeypatch) -> None:
    """The runs of a lockstep group evaluate outside their turns, at most one per CPU the process may use at once:
    its affinity, or in a Ray task the CPUs Ray gave it (`batched.cpus`, as `--slices auto`), not the machine's."""
    from coordinator.sim import lockstep
    monkeypatch.setattr(lockstep, "cpus", lambda: 3)
    group = lockstep.Lockstep(runs=1)
    try:
        assert [group.eval_slots.acquire(blocking=False) for _ in range(4)] == [True, True, True, False]
    finally:
        group.owner.shutdown()
