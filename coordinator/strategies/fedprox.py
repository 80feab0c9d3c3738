"""FedProx (Li et al., MLSys 2020), as run as a baseline by MimiC (mimic.md §3)."""

from __future__ import annotations

import dataclasses

from coordinator.strategies.base import State
from coordinator.strategies.fedavg import FedAvg
from edge_client.objectives import Proximal, with_objective
from edge_client.trainer import TrainTask


class FedProx(FedAvg):
    """FedProx, Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous
    Networks", MLSys 2020. Each client minimises F_i(w) + (μ/2)‖w − w_t‖² with the same local SGD
    (the `proximal` local objective, edge_client/objectives.py: μ(w − w_t) added to every gradient);
    aggregation is FedAvg over the clients whose updates arrived: w_{t+1} = w_t − (1/|S_t|) Σ_{i∈S_t} d_i.

    Args:
        mu: proximal coefficient μ. MimiC does not report it; 0.001 (default) is NIID-Bench's default,
            the code base MimiC's experiments were built on (mimic.md §3). FedLaAvg used 1.0 (MNIST),
            FL-FDMS 0.2.
        weighting, server_lr, k: as `FedAvg` (k: FedLaAvg's FedProx baseline selects K at random too).
    """

    name = "fedprox"

    def __init__(self, *, mu: float = 0.001, weighting: str = "uniform", server_lr: float = 1.0,
                 k: int | None = None):
        super().__init__(weighting=weighting, server_lr=server_lr, k=k)
        if mu < 0:
            raise ValueError(f"mu must be >= 0 (got {mu})")
        self.mu = mu

    @classmethod
    def from_config(cls, s) -> FedProx:
        return cls(mu=s.mu, weighting=s.weighting, server_lr=s.server_lr, k=s.fedavg_k)

    def configure(self, state: State, t: int, task: TrainTask) -> TrainTask:
        # local loss F_i(w) + (μ/2)‖w − w_t‖²
        return dataclasses.replace(task, objectives=with_objective(task.objectives, Proximal(self.mu), Proximal))
