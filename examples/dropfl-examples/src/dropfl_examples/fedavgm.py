"""FedAvgM: FedAvg with server momentum.

T.-M. H. Hsu, H. Qi, M. Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification", arXiv:1909.06335, 2019, §3 ("FedAvgM"): the server keeps a momentum buffer v of the averaged
update and steps along it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import dropfl
import torch

from dropfl_examples._common import check_choice, check_fraction, check_positive, mean_delta, options_or_defaults


class FedAvgM(dropfl.Strategy):
    """FedAvg with server momentum (Hsu et al. 2019), in dropfl's delta units (Δ_i = w_t − w_i, w ← w − step):

        Δ̄_t = (1/|S_t|) Σ_{i∈S_t} Δ_i        (S_t: the clients whose update arrived in round t)
        v_t  = β v_{t−1} + Δ̄_t               (v_{−1} = 0)
        w_{t+1} = w_t − η_s v_t

    With β = 0 and η_s = 1 it is FedAvg. A round in which no update arrived leaves w and v unchanged (as dropfl's
    FedAvg skips it), so momentum does not keep moving the model through rounds without clients.

    Options: `momentum` β ∈ [0, 1] (default 0.9), `server_lr` η_s > 0 (default 1.0), `weighting` of Δ̄: "uniform"
    (default, the paper's 1/|S_t|) or "samples" (n_i / Σ_{j∈S_t} n_j).
    State: "v", the momentum buffer (float32, the model's size), checkpointed with the run.
    """

    name = "fedavgm"

    @dataclass
    class Options:
        momentum: float = field(default=0.9, metadata={"help": "server momentum β in [0, 1] (v ← βv + Δ̄)"})
        server_lr: float = field(default=1.0, metadata={"help": "server step size η_s > 0 (w ← w − η_s v)"})
        weighting: Literal["uniform", "samples"] = field(
            default="uniform", metadata={"help": "Δ̄'s client weights: uniform 1/|S_t| or samples n_i/Σn_j"})

        def __post_init__(self):
            check_fraction("momentum", self.momentum)
            check_positive("server_lr", self.server_lr)
            check_choice("weighting", self.weighting, ("uniform", "samples"))

    def __init__(self, options: FedAvgM.Options | None = None):
        self.options = options_or_defaults(type(self), options)

    def init_state(self, n_clients: int, w0: torch.Tensor) -> dropfl.State:
        return {"v": torch.zeros_like(w0)}

    def aggregate(self, state: dropfl.State, t: int, w: torch.Tensor,
                  updates: dict[int, dropfl.ClientUpdate]) -> tuple[torch.Tensor, dropfl.State]:
        if not updates:   # S_t empty: nothing to average, the model and the buffer stay
            return w, state
        o = self.options
        v = o.momentum * state["v"] + mean_delta(updates, o.weighting)   # v_t = β v_{t−1} + Δ̄_t
        return w - o.server_lr * v, {**state, "v": v}                    # w_{t+1} = w_t − η_s v_t
