"""SCAFFOLD (Karimireddy et al., ICML 2020), option II, as run as a baseline by MimiC (mimic.md §3)."""

from __future__ import annotations

import dataclasses

import torch

from coordinator.strategies.base import ClientUpdate, State, Strategy
from edge_client.objectives import Correction, with_objective
from edge_client.trainer import TrainTask


class Scaffold(Strategy):
    """SCAFFOLD, Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled
    Averaging for Federated Learning", ICML 2020, with control variates of option II (as NIID-Bench):

        local step:  y ← y − η_L (∇F_i(y) + c − c_i)                 (Alg. 1 line 10)
        after K:     c_i⁺ = c_i − c + (w_t − y)/(K η_L)               (option II, line 12)
        server:      w_{t+1} = w_t − η_g (1/|S_t|) Σ_{i∈S_t} d_i      (line 16; d_i = w_t − y_i)
                     c ← c + (1/N) Σ_{i∈S_t} (c_i⁺ − c_i)             (line 17)

    Clients are kept stateless: the server state holds c and every c_i; `configure` sends c − c_i with
    the task (the `correction` local objective, edge_client/objectives.py) and `aggregate` derives c_i⁺
    from the uploaded delta. That is the same number the client would compute and upload as
    Δc_i = c_i⁺ − c_i, since the server knows c_i, c, K and η_L; the client only uploads d_i. In the
    field each participant uploads two model-sized vectors (d_i and Δc_i), so a round counts as two
    uploads (`uploads_per_round = 2`): MimiC compares methods at equal uploads, hence SCAFFOLD runs half the rounds.

    Args:
        server_lr: global step η_g (1, as NIID-Bench and MimiC's comparison).
        correction_lr: η_L in c_i⁺. None (default) uses the learning rate the client actually trained
            with this round (inferred for a decaying lr); a number fixes it, as NIID-Bench does with its
            constant base lr (mimic.md §3).

    State: "c" float32 [M], "c_clients" float32 [N, M] (updated in place).
    """

    name = "scaffold"
    uploads_per_round = 2
    tables = ("c_clients",)

    def __init__(self, *, server_lr: float = 1.0, correction_lr: float | None = None):
        self.server_lr, self.correction_lr = server_lr, correction_lr

    @classmethod
    def from_config(cls, s) -> Scaffold:
        return cls(server_lr=s.server_lr, correction_lr=s.scaffold_correction_lr)

    def init_state(self, n_clients: int, w0: torch.Tensor) -> State:
        return {"c": torch.zeros(w0.numel(), dtype=torch.float32),                       # c = 0
                "c_clients": self.table("c_clients", n_clients, w0.numel())}              # c_i = 0

    def configure(self, state: State, t: int, task: TrainTask) -> TrainTask:
        corr = state["c"] - state["c_clients"][task.client]  # SCAFFOLD line 10: gradient + (c − c_i)
        return dataclasses.replace(task, objectives=with_objective(task.objectives, Correction(corr), Correction))

    def aggregate(self, state: State, t: int, w: torch.Tensor,
                  updates: dict[int, ClientUpdate]) -> tuple[torch.Tensor, State]:
        if not updates:
            return w, state
        c, ci = state["c"], state["c_clients"]
        n = ci.shape[0]
        dc_sum = torch.zeros_like(c)
        for i in sorted(updates):
            u = updates[i]
            lr = self.correction_lr if self.correction_lr is not None else u.lr
            new = ci[i] - c + u.delta / (max(u.steps, 1) * lr)  # SCAFFOLD option II: c_i⁺ = c_i − c + (x − y_i)/(K η_L)
            dc_sum += new - ci[i]                               # Δc_i = c_i⁺ − c_i
            ci[i] = new
        deltas = torch.stack([updates[i].delta for i in sorted(updates)])
        w_new = w - self.server_lr * deltas.mean(0)  # SCAFFOLD line 16: x ← x + η_g (1/|S|) Σ Δy_i
        c += dc_sum / n                              # SCAFFOLD line 17: c ← c + (1/N) Σ Δc_i
        return w_new, state
