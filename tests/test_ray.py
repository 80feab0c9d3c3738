"""Scale-out on Ray (coordinator/scale/): a sweep's runs as Ray tasks, and one run's rounds on Ray actors,
each bitwise equal to the same run done locally (model.pt, metrics without timing fields, participation).

One local two-node cluster (ray.cluster_utils.Cluster: two raylets on loopback, 1 CPU each, no
dashboard) serves the whole module; the fixture starts it and shuts it down.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from strategy_helpers import cache_dataset_loads

from coordinator.config import SimConfig
from coordinator.errors import UserError
from coordinator.sim.sweep import Job, run_sweep

TIMING = ("seconds", "elapsed")


def config(algo: str, seed: int = 0, model: str = "mlp", rounds: int = 2) -> SimConfig:
    cfg = SimConfig()
    cfg.data.dataset, cfg.data.partition, cfg.data.clients, cfg.data.shards_per_client = "fmnist", "shards", 6, 2
    cfg.model.model = model
    cfg.train.lr, cfg.train.batch_size, cfg.train.epochs, cfg.train.steps = 0.05, 8, None, 2
    a = cfg.availability
    a.kind, a.tau_max, a.min_active, a.first_round_all = "bounded", 3, 2, True
    cfg.strategy.algo = algo
    cfg.run.rounds, cfg.run.seed, cfg.run.eval_every, cfg.run.threads = rounds, seed, rounds, 1
    return cfg


def files(run, skip=()) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"model": (run / "model.pt").read_bytes(),
            "metrics": [{k: v for k, v in r.items() if k not in TIMING + skip} for r in rows],
            "participation": (run / "participation.csv").read_text(),
            "config": json.loads((run / "config.json").read_text())}


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        # every node, and this driver, on 127.0.0.1 (loopback only): the nodes read the variable, this
        # process has read it already (at `import ray`)
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        cache_dataset_loads(mp)                                # the driver's loads; the nodes load their own
        node = {"num_cpus": 1, "object_store_memory": 400 * 2 ** 20}
        c = Cluster(initialize_head=True, head_node_args=node | {"include_dashboard": False})
        try:
            c.add_node(**node)
            ray.init(address=c.address, log_to_driver=False)
            c.wait_for_nodes(timeout=120)
            yield c
        finally:
            ray.shutdown()
            c.shutdown()


@pytest.mark.slow
def test_sweep_on_ray_equals_serial(tmp_path, cluster):
    jobs = {ex: [Job(config(algo), tmp_path / ex / algo, label=algo) for algo in ("fedavg", "mifa")]
            for ex in ("serial", "ray")}
    run_sweep(jobs["serial"], executor="serial", progress=False)
    lines: list[str] = []
    assert run_sweep(jobs["ray"], executor="ray", progress=False, log=lines.append) == [j.out for j in jobs["ray"]]
    for s, r in zip(jobs["serial"], jobs["ray"]):
        assert files(s.out) == files(r.out), s.label
    assert lines[0].startswith("ray: 2 runs submitted to 2 node(s), 2 CPUs")
    assert sorted(line.split(":")[0] for line in lines[1:]) == ["[1/2] fedavg", "[2/2] mifa"] or \
        sorted(line.split(":")[0] for line in lines[1:]) == ["[1/2] mifa", "[2/2] fedavg"]
    # a resumed run is shipped to its node and back: as the serial executor's resume
    more = {ex: Job(config("mifa", rounds=3), jobs[ex][1].out, resume=True) for ex in ("serial", "ray")}
    for ex, job in more.items():
        run_sweep([job], executor=ex, progress=False)
    assert files(more["serial"].out) == files(more["ray"].out)
    assert [r["round"] for r in files(more["ray"].out)["metrics"]] == [0, 1, 2]


def test_auto_slices_count_a_ray_tasks_cpus_not_its_nodes(cluster):
    """--slices auto inside a Ray task (a sweep's run on Ray takes 1 CPU) counts the CPU Ray assigned it, not the
    node's cores: its engine then starts 2 worker processes, as before auto, instead of one per core of the node.
    On the driver it counts this process's CPUs."""
    import ray

    from coordinator.sim import batched
    assert ray.get(ray.remote(num_cpus=1)(batched.cpus).remote()) == 1
    assert batched.cpus() == len(os.sched_getaffinity(0))


def test_sweep_on_ray_checks_every_run_directory_first(tmp_path, cluster):
    done = tmp_path / "done"
    run_sweep([Job(config("fedavg", rounds=1), done)], executor="serial", progress=False)
    before = files(done)
    jobs = [Job(config("fedavg"), tmp_path / "new"), Job(config("fedavg"), done)]
    with pytest.raises(UserError, match="already holds a run"):
        run_sweep(jobs, executor="ray", progress=False)
    assert not (tmp_path / "new").exists() and files(done) == before


@pytest.mark.parametrize("model", ["mimic-cnn", "mlp"])
def test_one_run_on_ray_actors_equals_the_local_engine(tmp_path, cluster, model):
    from coordinator.sim.run import run_sim

    local, remote = config("mimic", model=model), config("mimic", model=model)
    local.train.slices = remote.train.slices = 3
    remote.train.engine = "ray"
    run_sim(local, str(tmp_path / "local"), progress=False)
    run_sim(remote, str(tmp_path / "ray"), progress=False)
    a, b = files(tmp_path / "local", skip=("engine",)), files(tmp_path / "ray", skip=("engine",))
    assert a["config"]["train"].pop("engine") == "batched" and b["config"]["train"].pop("engine") == "ray"
    assert a == b
    engines = [json.loads(line)["engine"] for line in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    local_engine = json.loads((tmp_path / "local" / "metrics.jsonl").read_text().splitlines()[0])["engine"]
    assert engines == ["ray:" + local_engine] * 2
    start = next(json.loads(line) for line in (tmp_path / "ray" / "log.jsonl").read_text().splitlines()
                 if json.loads(line)["message"].startswith("engine:"))
    assert start.get("actors") == 2 and start.get("nodes") == 2, start   # both nodes trained slices


def test_without_ray_one_line_says_how_to_install_it(monkeypatch):
    from coordinator.scale import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)   # import ray → ImportError
    with pytest.raises(UserError, match=r"pip install 'dropfl\[ray\]'"):
        require_ray("--ray")


def test_reproduce_with_ray_flag_runs_the_sweep_on_the_cluster(tmp_path, cluster, monkeypatch, capsys):
    from coordinator.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)   # --ray ADDRESS sets it for the command; restored after
    rc = main(["reproduce", "mimic-table3", "--quick", "--methods", "FedAvg", "--no-progress", "--ray", cluster.address,
               "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results")])
    out = capsys.readouterr().out
    assert rc == 0 and "ray: 1 runs submitted to 2 node(s)" in out and "[1/1]" in out
    run = tmp_path / "runs" / "fedavg-tau3-s0"
    assert [r["round"] for r in files(run)["metrics"]] == [0, 1]
    assert (tmp_path / "results" / "mimic_table3_quick.json").exists()
    assert main(["reproduce", "mimic-table3", "--quick", "--executor", "serial", "--ray", "--out",
                 str(tmp_path / "x")]) == 2
    assert "dropfl: error: --ray runs the sweep on Ray, --executor serial" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
