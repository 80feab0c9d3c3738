"""Flower's simulation engine (Ray) on the MimiC FMNIST workload; run by benchmarks/sim_throughput.py
with the Python of benchmarks/.venv-flower (flwr is never a dropfl dependency).

Each Flower client trains the same LeNet (6/16/120/84/10) with a plain PyTorch SGD loop on its
preloaded tensors (the Flower PyTorch tutorial's client, minus the DataLoader). FedAvg, full
participation, 2 Ray actors × 1 CPU. The server-side strategy timestamps each round from
configure_fit to aggregate_fit; the first round (actor start-up) is reported separately.

    .venv-flower/bin/python flower_sim.py --data DIR --steps 100 --rounds 3 --out flower.json

DIR holds client_<i>.pt = {"x": float32 [n, 1, 28, 28], "y": int64 [n]}, one file per client, loaded
(memory-mapped) by the client when it trains, as a Flower client loads its partition.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.simulation import run_simulation
from torch import nn


class LeNet(nn.Module):
    """Same layers as edge_client.models.MimicCNN."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(256, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1))))))


def client_data(cid: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)  # one Ray actor = one CPU
    return torch.load(os.path.join(os.environ["DROPFL_FLOWER_DATA"], f"client_{cid}.pt"), mmap=True)


class Client(NumPyClient):
    def __init__(self, cid: int, steps: int, batch: int, lr: float):
        self.cid, self.steps, self.batch, self.lr = cid, steps, batch, lr
        self.model = LeNet()

    def get_parameters(self, config):
        return [p.detach().numpy() for p in self.model.parameters()]

    def fit(self, parameters, config):
        d = client_data(self.cid)
        x, y = d["x"], d["y"]
        with torch.no_grad():
            for p, a in zip(self.model.parameters(), parameters):
                p.copy_(torch.from_numpy(a))
        opt = torch.optim.SGD(self.model.parameters(), lr=self.lr)
        g = torch.Generator().manual_seed(self.cid)
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
    return Client(cid, int(os.environ["DROPFL_FLOWER_STEPS"]), 16, 0.01).to_client()


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
    args = ap.parse_args()
    os.environ["DROPFL_FLOWER_DATA"], os.environ["DROPFL_FLOWER_STEPS"] = args.data, str(args.steps)
    n = len([f for f in os.listdir(args.data) if f.startswith("client_")])
    init = ndarrays_to_parameters([p.detach().numpy() for p in LeNet().parameters()])
    strategy = TimedFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_available_clients=n,
                           initial_parameters=init)

    def server_fn(context: Context) -> ServerAppComponents:
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=args.rounds))

    start = time.perf_counter()
    run_simulation(ServerApp(server_fn=server_fn), ClientApp(client_fn=client_fn), num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": args.actors, "include_dashboard": False}})
    total = time.perf_counter() - start
    rounds = [{k: v for k, v in r.items() if k != "start"} for r in strategy.rounds]
    later = [r["seconds"] for r in rounds[1:] if r.get("results") == n] or [r["seconds"] for r in rounds]
    steps_per_s = [n * args.steps / s for s in later]
    with open(args.out, "w") as f:
        json.dump({"clients": n, "steps": args.steps, "rounds": rounds, "total_seconds": total,
                   "client_steps_per_s": float(np.median(steps_per_s)), "per_round": steps_per_s}, f, indent=1)


if __name__ == "__main__":
    main()
