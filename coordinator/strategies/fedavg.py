"""FedAvg (McMahan et al., 2017), dropouts ignored, and the full-participation oracle."""

from __future__ import annotations

import numpy as np
import torch

from coordinator.strategies.base import ClientUpdate, State, Strategy, mean_delta


class FedAvg(Strategy):
    """FedAvg over the clients whose updates arrived; absent clients are simply ignored.

    MimiC eqs. (4)–(5) in delta units: w_{t+1} = w_t − (1/|S_t|) Σ_{i∈S_t} d_i.

    Args:
        weighting: "uniform" (the papers' equal client weights; default) or "samples"
            (weights n_i / Σ n_j, McMahan et al.).
        server_lr: global step size η applied to the averaged delta (1 in the released codes).
        k: None (default) selects every available client (MimiC's FedAvg); an integer K selects K clients
            uniformly at random, without replacement, among the available ones, all of them if fewer than K are
            available: the FedAvg/FedProx baselines of FedLaAvg (code `random.sample`, fedlaavg.md §3, K = βN).
            (FL-FDMS's K is the number of clients; its "Dropout" baseline averages every active one: k = None.)
            The draw uses the round loop's per-round `rng`, so it is reproducible by seed and the same
            in simulation and field mode. The average is still over the clients whose updates arrived.
    """

    name = "fedavg"

    def __init__(self, *, weighting: str = "uniform", server_lr: float = 1.0, k: int | None = None):
        if k is not None and k < 1:
            raise ValueError(f"k must be >= 1 (got {k})")
        self.weighting, self.server_lr, self.k = weighting, server_lr, k

    @classmethod
    def from_config(cls, s) -> FedAvg:
        return cls(weighting=s.weighting, server_lr=s.server_lr, k=s.fedavg_k)

    def select(self, state: State, t: int, available: np.ndarray, rng: np.random.Generator) -> list[int]:
        avail = np.flatnonzero(available)
        if self.k is None or len(avail) <= self.k:
            return [int(i) for i in avail]  # every available client (FedLaAvg code: all if fewer than K)
        return sorted(int(i) for i in rng.choice(avail, size=self.k, replace=False))  # K uniformly at random

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
