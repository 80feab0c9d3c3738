"""Flower's simulation engine (Ray) on a workload of benchmarks/sim_throughput.py; run by it with the Python of
benchmarks/.venv-flower (flwr is never a dropfl dependency).

Each Flower client trains the workload's model (benchmarks/workloads.py: the same layers as dropfl's) with a plain
PyTorch SGD loop on its preloaded tensors (the Flower PyTorch tutorial's client, minus the DataLoader), sending its
whole `state_dict` (BatchNorm's buffers too, as Flower's examples do). FedAvg; `--per-round` clients sampled per
round (default: all), 2 Ray actors × 1 CPU (`--actors`; `--device cuda`: the actors share the GPU). The server-side
strategy timestamps each round from configure_fit to aggregate_fit; the first round (actor start-up) is reported
separately.

    .venv-flower/bin/python flower_sim.py --data DIR --steps 100 --rounds 3 --out flower.json \
        [--workload mimic-fmnist --batch 16 --lr 0.01 --per-round 0]

DIR holds client_<i>.pt = {"x": float32 [n, *shape], "y": int64 [n]}, one file per client, loaded
(memory-mapped) by the client when it trains, as a Flower client loads its partition.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.simulation import run_simulation
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS, build  # noqa: E402


def client_data(cid: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)  # one Ray actor = one CPU
    d = torch.load(os.path.join(os.environ["DROPFL_FLOWER_DATA"], f"client_{cid}.pt"), mmap=True)
    return {k: v.to(device()) for k, v in d.items()}   # on a GPU: the client's data moved once per fit


def device() -> torch.device:
    """--device, read in the actor (from the environment the driver set before Ray started)."""
    return torch.device(os.environ.get("DROPFL_FLOWER_DEVICE", "cpu"))


class Client(NumPyClient):
    def __init__(self, cid: int, steps: int, batch: int, lr: float):
        self.cid, self.steps, self.batch, self.lr = cid, steps, batch, lr
        self.model = build(os.environ["DROPFL_FLOWER_WORKLOAD"]).to(device())

    def get_parameters(self, config):
        return [v.detach().cpu().numpy() for v in self.model.state_dict().values()]

    def fit(self, parameters, config):
        d = client_data(self.cid)
        x, y = d["x"], d["y"]
        with torch.no_grad():   # (FedAvg averages num_batches_tracked as a float: copy_ casts it back)
            for v, a in zip(self.model.state_dict().values(), parameters):
                v.copy_(torch.from_numpy(np.asarray(a)))
        opt = torch.optim.SGD(self.model.parameters(), lr=self.lr)
        g = torch.Generator().manual_seed(self.cid)   # batch orders drawn on the CPU, indices moved with x[idx]
        perm, pos = torch.randperm(len(y), generator=g), 0
        for _ in range(self.steps):
            if pos + self.batch > len(y):
                perm, pos = torch.randperm(len(y), generator=g), 0
            idx = perm[pos:pos + self.batch]
            pos += self.batch
            opt.zero_grad()
            nn.functional.cross_entropy(self.model(x[idx]), y[idx]).backward()
            opt.step()
        return self.get_parameters({}), len(y), {}


def client_fn(context: Context):
    cid = int(context.node_config["partition-id"])
    return Client(cid, int(os.environ["DROPFL_FLOWER_STEPS"]), int(os.environ["DROPFL_FLOWER_BATCH"]),
                  float(os.environ["DROPFL_FLOWER_LR"])).to_client()


class TimedFedAvg(FedAvg):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.rounds: list[dict[str, float]] = []

    def configure_fit(self, server_round, parameters, client_manager):
        self.rounds.append({"round": server_round, "start": time.perf_counter()})
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        out = super().aggregate_fit(server_round, results, failures)
        r = self.rounds[-1]
        r["seconds"], r["results"], r["failures"] = time.perf_counter() - r["start"], len(results), len(failures)
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workload", default="mimic-fmnist", choices=list(WORKLOADS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--per-round", type=int, default=0, help="clients sampled per round (0: all)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: every actor trains on the one GPU, which the --actors share (num_gpus 1/actors)")
    args = ap.parse_args()
    os.environ["DROPFL_FLOWER_DEVICE"] = args.device   # Ray's actors inherit it (device(), in each actor)
    os.environ["DROPFL_FLOWER_DATA"], os.environ["DROPFL_FLOWER_STEPS"] = args.data, str(args.steps)
    os.environ["DROPFL_FLOWER_WORKLOAD"], os.environ["DROPFL_FLOWER_BATCH"] = args.workload, str(args.batch)
    os.environ["DROPFL_FLOWER_LR"] = str(args.lr)
    n = len([f for f in os.listdir(args.data) if f.startswith("client_")])
    k = args.per_round or n
    init = ndarrays_to_parameters([v.detach().numpy() for v in build(args.workload).state_dict().values()])
    strategy = TimedFedAvg(fraction_fit=k / n, fraction_evaluate=0.0, min_fit_clients=k, min_available_clients=n,
                           initial_parameters=init)

    def server_fn(context: Context) -> ServerAppComponents:
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=args.rounds))

    gpus = 1 if args.device == "cuda" else 0
    start = time.perf_counter()
    run_simulation(ServerApp(server_fn=server_fn), ClientApp(client_fn=client_fn), num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": gpus / args.actors},
                                   # address "local": a Ray instance of its own, never another user's cluster
                                   "init_args": {"num_cpus": args.actors, "num_gpus": gpus,
                                                 "include_dashboard": False, "address": "local"}})
    total = time.perf_counter() - start
    rounds = [{k: v for k, v in r.items() if k != "start"} for r in strategy.rounds]
    later = [r["seconds"] for r in rounds[1:] if r.get("results") == k] or [r["seconds"] for r in rounds]
    steps_per_s = [k * args.steps / s for s in later]
    with open(args.out, "w") as f:
        json.dump({"workload": args.workload, "device": args.device, "actors": args.actors, "clients": n,
                   "clients_per_round": k, "batch": args.batch,
                   "steps": args.steps, "rounds": rounds, "total_seconds": total,
                   "client_steps_per_s": float(np.median(steps_per_s)), "per_round": steps_per_s}, f, indent=1)


if __name__ == "__main__":
    main()
