"""FedAvg (McMahan et al., 2017), dropouts ignored, and the full-participation oracle."""

from __future__ import annotations

import torch

from coordinator.strategies.base import ClientUpdate, State, Strategy, mean_delta


class FedAvg(Strategy):
    """FedAvg over the clients whose updates arrived; absent clients are simply ignored.

    MimiC eqs. (4)–(5) in delta units: w_{t+1} = w_t − (1/|S_t|) Σ_{i∈S_t} d_i.

    Args:
        weighting: "uniform" (the papers' equal client weights; default) or "samples"
            (weights n_i / Σ n_j, McMahan et al.).
        server_lr: global step size η applied to the averaged delta (1 in the released codes).
    """

    name = "fedavg"

    def __init__(self, *, weighting: str = "uniform", server_lr: float = 1.0):
        self.weighting, self.server_lr = weighting, server_lr

    @classmethod
    def from_config(cls, s) -> FedAvg:
        return cls(weighting=s.weighting, server_lr=s.server_lr)

    def aggregate(self, state: State, t: int, w: torch.Tensor,
                  updates: dict[int, ClientUpdate]) -> tuple[torch.Tensor, State]:
        if not updates:  # empty S_t: skip the model update (MimiC digest §2.2)
            return w, state
        return w - self.server_lr * mean_delta(updates, self.weighting), state


class Full(FedAvg):
    """Oracle upper bound: every client takes part in every round, whatever the availability model."""

    name = "full"

    def select(self, state, t, available, rng):
        return list(range(len(available)))
