"""FedCS-style selection (Nishio & Yonetani, "Client Selection for Federated Learning with Heterogeneous
Resources in Mobile Edge", 2019), as the FedDD paper uses it for a baseline: "the clients with the long
communication time will be dropout, in order to satisfy the communication budget" (feddd.md §6.5).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from coordinator.errors import UserError
from coordinator.strategies.base import ClientUpdate, State, Strategy, mean_delta
from coordinator.strategies.measured import init_rates, observe, round_times


class FedCS(Strategy):
    """Select the available clients with the shortest estimated round time t_n^cmp + U/r_n^u + U/r_n^d
    (measured, smoothed), as many as fit the upload budget Σ_sel U_n <= A Σ_all U_n (equal U_n: at most
    floor(A·N) clients) and, if a deadline is set, only those whose estimate is within it. Selected
    clients upload their full models; aggregation is FedAvg over them.

    Before any client has been measured, every available client is selected (FedCS's resource request:
    the first round tells the server each client's times). Clients never measured rank after all the
    measured ones and are never selected under a deadline.

    Args:
        budget: A, the uploaded fraction of all clients' model bytes per round (FedDD's A_server, 0.6).
        deadline_s: the round deadline in seconds (None: budget only, as in the FedDD paper's baseline).
        smoothing: weight β of a new measurement, s ← (1 − β) s + β x.
        weighting: "uniform" or "samples" client weights in the average (as FedAvg).
        server_lr: global step on the averaged delta.
    """

    name = "fedcs"

    def __init__(self, *, budget: float = 0.6, deadline_s: float | None = None, smoothing: float = 0.5,
                 weighting: str = "uniform", server_lr: float = 1.0):
        if not 0.0 < budget <= 1.0 or not 0.0 < smoothing <= 1.0 or (deadline_s is not None and deadline_s <= 0):
            raise ValueError(f"fedcs: need 0 < budget <= 1, 0 < smoothing <= 1, deadline > 0 "
                             f"(got {budget}, {smoothing}, {deadline_s})")
        self.budget, self.deadline_s, self.smoothing = budget, deadline_s, smoothing
        self.weighting, self.server_lr = weighting, server_lr

    @classmethod
    def from_config(cls, s) -> FedCS:
        try:
            return cls(budget=s.feddd_a_server, deadline_s=s.fedcs_deadline, smoothing=s.rate_smoothing,
                       weighting=s.weighting, server_lr=getattr(s, "server_lr", 1.0))
        except ValueError as e:
            raise UserError(str(e)) from None

    def init_state(self, n_clients: int, w0: torch.Tensor) -> State:
        return init_rates(n_clients, w0)

    def select(self, state: State, t: int, available: np.ndarray, rng: np.random.Generator) -> list[int]:
        avail = np.flatnonzero(available)
        est = round_times(state).numpy()[avail]
        if np.isnan(est).all():
            return [int(i) for i in avail]
        cap = math.floor(self.budget * len(available) + 1e-9)
        order = sorted(range(len(avail)), key=lambda j: (np.isnan(est[j]), est[j], avail[j]))
        chosen = []
        for j in order:
            if len(chosen) == cap:
                break
            if self.deadline_s is not None and not est[j] <= self.deadline_s:
                continue
            chosen.append(int(avail[j]))
        return sorted(chosen)

    def aggregate(self, state: State, t: int, w: torch.Tensor,
                  updates: dict[int, ClientUpdate]) -> tuple[torch.Tensor, State]:
        state = observe(state, updates, self.smoothing)
        if not updates:
            return w, state
        return w - self.server_lr * mean_delta(updates, self.weighting), state
