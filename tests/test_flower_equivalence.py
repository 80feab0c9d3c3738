"""Issue 39 item 4: one federation (FMNIST shards, 6 clients, logreg, seed 0, MimiC's bounded availability with
dropouts) run by dropfl's simulation (`dropfl.simulate`, --engine loop) and by Flower's simulation engine
(`flwr.simulation.run_simulation`, Ray bound to 127.0.0.1, one actor of 1 CPU) with `DropflStrategy` and dropfl's
ClientApp (`dropfl.flower.client`: the same `local_train`) gives the same final model, bitwise, for FedAvg,
MimiC and MIFA: the same float32 arithmetic on the same bits, both single-threaded. One Flower simulation runs
the three strategies one after another on its grid (one Ray start for the module)."""

from __future__ import annotations

import os

import pytest

flwr = pytest.importorskip("flwr", reason="Flower is not installed (pip install 'dropfl[flower]')")
pytest.importorskip("ray", reason="Flower's simulation engine needs Ray (pip install 'dropfl[flower]')")

import torch  # noqa: E402

import dropfl  # noqa: E402
from coordinator.config import SimConfig  # noqa: E402
from coordinator.runsetup import build_availability, load_dataset, loop_config  # noqa: E402
from dropfl.flower.strategy import META, MODEL, STATE, DropflStrategy, model_arrays, to_vector  # noqa: E402
from edge_client.models import build_model  # noqa: E402

ALGOS = ("fedavg", "mimic", "mifa")


def config(algo: str) -> SimConfig:
    cfg = SimConfig()
    cfg.data.dataset, cfg.data.partition, cfg.data.clients, cfg.data.shards_per_client = "fmnist", "shards", 6, 2
    cfg.model.model = "logreg"
    cfg.train.lr, cfg.train.batch_size, cfg.train.epochs, cfg.train.steps = 0.05, 8, 1, 3  # steps win
    cfg.train.engine = "loop"
    a = cfg.availability
    a.kind, a.tau_max, a.min_active, a.first_round_all = "bounded", 2, 2, True
    cfg.strategy.algo = algo
    cfg.run.rounds, cfg.run.seed, cfg.run.eval_every, cfg.run.threads = 3, 0, 3, 1
    return cfg


@pytest.fixture(scope="module")
def flower_runs():
    """{algo: (final model, history, Context.state's keys after the run)} and the state's size at the start."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation
    from flwr.supercore import telemetry

    from dropfl.flower.client import client_app

    out: dict = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        out["state_at_start"] = len(context.state)
        for algo in ALGOS:
            cfg = config(algo)
            ds = load_dataset(cfg)
            model = build_model(cfg.model.model, tuple(ds.train.x.shape[1:]), ds.num_classes, cfg.run.seed,
                                cfg.model.dropout)
            strategy = DropflStrategy(algo, loop_config(cfg), config=cfg.strategy,
                                      participation=build_availability(cfg), state=context.state)
            result = strategy.start(grid, model_arrays(model), num_rounds=cfg.run.rounds, timeout=120)
            out[algo] = (to_vector(result.arrays), strategy.history, sorted(context.state.keys()))
            for key in (STATE, MODEL, META):   # the next strategy starts afresh
                del context.state[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLWR_TELEMETRY_ENABLED", "0")        # only loopback: no Flower telemetry, no Ray usage stats
        mp.setattr(telemetry, "FLWR_TELEMETRY_ENABLED", "0")
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # Flower's Ray backend sets PYTHONPATH to this process's sys.path and leaves it: put back below, or later
        # tests' subprocesses (a device venv's python) import from this venv (monkeypatch.delenv of an unset
        # variable records nothing to undo)
        pythonpath = os.environ.get("PYTHONPATH")
        # Ray's processes bind 127.0.0.1 only (without this its servers listen on every interface, even with
        # _node_ip_address): the processes it starts read the variable, this one read it at `import ray`
        import ray

        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        threads = torch.get_num_threads()
        try:
            run_simulation(server, client_app(config("fedavg")), num_supernodes=6, backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {"address": "local", "num_cpus": 1, "num_gpus": 0, "include_dashboard": False,
                              "_node_ip_address": "127.0.0.1", "object_store_memory": 100 * 2 ** 20}})
        finally:
            ray.shutdown()
            torch.set_num_threads(threads)
            if pythonpath is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = pythonpath
    assert all(algo in out for algo in ALGOS), f"the ServerApp did not finish: {sorted(out)}"
    return out


@pytest.mark.parametrize("algo", ALGOS)
def test_flower_run_equals_dropfl_run(algo, flower_runs, tmp_path):
    cfg = config(algo)
    threads = torch.get_num_threads()
    try:
        run = dropfl.simulate(cfg, out=tmp_path / algo, progress=False)
    finally:
        torch.set_num_threads(threads)
    w_dropfl = torch.load(run.path / "checkpoint.pt", weights_only=False)["w"]
    w_flower, history, keys = flower_runs[algo]
    assert w_flower.dtype == w_dropfl.dtype == torch.float32
    assert torch.equal(w_flower, w_dropfl)                     # bitwise
    # the same participation: per round, the participants dropfl logged are those Flower aggregated
    logged = [sum(1 for r in run.participation() if r["round"] == t and r["status"] == "participated")
              for t in range(cfg.run.rounds)]
    assert [h["participants"] for h in history] == logged
    assert logged[0] == 6 and min(logged) < 6                  # round 0 has everyone, later rounds drop someone
    assert keys == sorted([STATE, MODEL, META])                # what DropflStrategy keeps in Context.state


def test_flower_hands_the_server_app_an_empty_state(flower_runs):
    """Flower 1.41's run_simulation starts every ServerApp with an empty Context.state: nothing survives a run."""
    assert flower_runs["state_at_start"] == 0
