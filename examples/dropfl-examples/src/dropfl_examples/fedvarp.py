"""FedVARP: variance reduction for partial client participation.

D. Jhunjhunwala, P. Sharma, A. Nagarkatti, G. Joshi, "FedVARP: Tackling the Variance Due to Partial Client
Participation in Federated Learning", UAI 2022 (arXiv:2207.14130), Algorithm 1. The server keeps the latest
update y_i of every client and corrects the participants' average with it (a SAGA-style estimator), which
removes the variance that sampling the participants adds, at the cost of a per-client table on the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import dropfl
import torch

from dropfl_examples._common import check_positive, options_or_defaults, table_sum


class FedVARP(dropfl.Strategy):
    """FedVARP (Jhunjhunwala et al. 2022, Algorithm 1), in dropfl's delta units (Δ_i = w_t − w_i, w ← w − step):

        v_t = (1/|S_t|) Σ_{i∈S_t} (Δ_i − y_i) + (1/N) Σ_{j=1}^N y_j      (y: the table before this round)
        y_i ← Δ_i for i ∈ S_t;  y_j kept otherwise                      (y_j = 0 until j first takes part)
        w_{t+1} = w_t − η_g v_t

    S_t is the set of clients whose update arrived in round t (the paper samples S_t uniformly; here it is
    whoever the availability let through, the setting MIFA and MimiC study). With every client in S_t every
    round, v_t = (1/N) Σ Δ_i: FedAvg. A round in which no update arrived leaves w and y unchanged: the paper
    always has |S_t| = M ≥ 1, and the FedVARP baseline of FedAU's released code (github.com/IBM/fedau, main.py,
    `-weighting fedvarp`) steps by 0 in such a round (it does not step along (1/N) Σ y_j, as MIFA would).

    Options: `server_lr` η_g > 0 (default 1.0).
    State: "y", float32 [N, M], row i = y_i, a per-client table in the run's state store (--state-store: RAM or
    a file of the run directory), summed over all N rows each round.
    """

    name = "fedvarp"
    tables = ("y",)

    @dataclass
    class Options:
        server_lr: float = field(default=1.0, metadata={"help": "global step size η_g > 0 (w ← w − η_g v)"})

        def __post_init__(self):
            check_positive("server_lr", self.server_lr)

    def __init__(self, options: FedVARP.Options | None = None):
        self.options = options_or_defaults(type(self), options)

    def init_state(self, n_clients: int, w0: torch.Tensor) -> dropfl.State:
        return {"y": self.table("y", n_clients, w0.numel())}

    def aggregate(self, state: dropfl.State, t: int, w: torch.Tensor,
                  updates: dict[int, dropfl.ClientUpdate]) -> tuple[torch.Tensor, dropfl.State]:
        if not updates:
            return w, state
        y = state["y"]
        n = y.shape[0]
        clients = sorted(updates)
        y_mean = table_sum(y) / n                                                  # (1/N) Σ_j y_j
        correction = torch.stack([updates[i].delta - y[i] for i in clients]).mean(0)   # (1/|S|) Σ (Δ_i − y_i)
        v = correction + y_mean
        for i in clients:
            y[i] = updates[i].delta                                                # y_i ← Δ_i, i ∈ S_t
        return w - self.options.server_lr * v, state                               # w ← w − η_g v_t
