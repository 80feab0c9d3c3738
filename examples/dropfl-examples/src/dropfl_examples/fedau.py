"""FedAU: FedAvg with aggregation weights adapted online to unknown participation statistics.

S. Wang, M. Ji, "A Lightweight Method for Tackling Unknown Participation Statistics in Federated Averaging",
ICLR 2024 (arXiv:2306.03401, 2023). Each client's participation probability p_n is unknown and heterogeneous;
FedAvg over the participants then optimises a p-weighted objective instead of the average of the clients'. FedAU
weights client n's update by ω_n, an online estimate of its mean interval between participations (≈ 1/p_n),
so that E[q_n^t ω_n] ≈ 1 and the aggregate tracks the average over all N clients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import dropfl
import numpy as np
import torch

from dropfl_examples._common import check_positive, options_or_defaults


class FedAU(dropfl.Strategy):
    """FedAU (Wang & Ji 2023): FedAvg whose aggregation weight for client n is the running mean Ω_n of n's past
    participation intervals (≈ 1/p_n), with intervals cut off at K rounds; as in the paper's released code
    (github.com/IBM/fedau, main.py, `-weighting adaptive`), in dropfl's delta units (Δ_n = w_t − w_n, w ← w −
    step). For each client n the server keeps S_n (rounds since n's current interval began), M_n (intervals
    counted) and Ω_n (their mean). Round t, with q_n^t = 1 iff n's update arrived:

        ω_n^t = Ω_n if M_n > 0, else 1                      (from the intervals before round t)
        w_{t+1} = w_t − (η / N) Σ_{n∈S_t} ω_n^t Δ_n         (S_t: the clients with q_n^t = 1; N: all clients)

        then, for every client n:
        S_n ← S_n + 1
        if q_n^t = 1 or S_n = K:                            (an interval ends: n took part, or the cut-off)
            Ω_n ← (M_n Ω_n + S_n) / (M_n + 1);  M_n ← M_n + 1;  S_n ← 0

    The weight of round t uses only the intervals that ended before it, so it does not depend on whether n takes
    part in round t (the code's "interval used in the next round"). The cut-off K bounds every interval, hence
    every weight, by K: a client that is never seen counts one interval of K rounds every K rounds, which bounds
    the estimate's error for rarely participating clients (the paper's bias/variance trade-off in K). With every
    client taking part every round, ω_n = 1 and the rule is FedAvg (η = 1); with client n taking part in rounds
    k − 1, 2k − 1, 3k − 1, ... (k ≤ K), ω_n = k from its second participation on.

    As implemented here:
    - The estimation runs on the server from the participation it sees (in the paper each client can run it);
      q_n^t = 1 iff n's update is aggregated in round t, so a selected client whose update was lost (deadline,
      rejected) counts as not taking part, as the paper's q_n^t.
    - A round in which no update arrived leaves w unchanged (the counters still advance), as the code's.
    - `cutoff` K defaults to 50, the value of the README's K example; the code's own default, 100 000, is in
      effect no cut-off. The local and global step sizes are dropfl's --lr and `server_lr` (η, the code's
      `-lr-global`).

    Options: `cutoff` K ≥ 1 (default 50), `server_lr` η > 0 (default 1.0).
    State: "since" S_n and "intervals" M_n (int64 [N]), "omega" Ω_n (float64 [N]), checkpointed with the run.
    """

    name = "fedau"

    @dataclass
    class Options:
        cutoff: int = field(default=50, metadata={"help": "K ≥ 1: the longest interval counted (bounds ω_n by K)"})
        server_lr: float = field(default=1.0, metadata={"help": "global step size η > 0"})

        def __post_init__(self):
            if isinstance(self.cutoff, bool) or not isinstance(self.cutoff, int) or self.cutoff < 1:
                raise ValueError(f"cutoff must be an integer ≥ 1 (got {self.cutoff!r})")
            check_positive("server_lr", self.server_lr)

    def __init__(self, options: FedAU.Options | None = None):
        self.options = options_or_defaults(type(self), options)

    def init_state(self, n_clients: int, w0: torch.Tensor) -> dropfl.State:
        return {"since": torch.zeros(n_clients, dtype=torch.int64),
                "intervals": torch.zeros(n_clients, dtype=torch.int64),
                "omega": torch.zeros(n_clients, dtype=torch.float64)}

    def weights(self, state: dropfl.State, took_part: np.ndarray) -> dropfl.State:
        """The counters after round t, for every client: the new (since, intervals, omega); `took_part` is q^t."""
        since = state["since"] + 1                                           # S_n ← S_n + 1
        intervals, omega = state["intervals"].clone(), state["omega"].clone()
        ends = torch.as_tensor(took_part) | (since == self.options.cutoff)   # q_n^t = 1 or S_n = K
        m, s = intervals[ends].to(torch.float64), since[ends].to(torch.float64)
        omega[ends] = (m * omega[ends] + s) / (m + 1)                        # Ω_n ← (M_n Ω_n + S_n)/(M_n + 1)
        intervals[ends] += 1                                                 # M_n ← M_n + 1
        since[ends] = 0                                                      # S_n ← 0
        return {"since": since, "intervals": intervals, "omega": omega}

    def weight(self, state: dropfl.State, i: int) -> float:
        """ω_i^t: the mean of client i's intervals that ended before round t, 1 before the first one ends."""
        return float(state["omega"][i]) if int(state["intervals"][i]) > 0 else 1.0

    def aggregate(self, state: dropfl.State, t: int, w: torch.Tensor,
                  updates: dict[int, dropfl.ClientUpdate]) -> tuple[torch.Tensor, dropfl.State]:
        n = state["omega"].shape[0]
        took_part = np.zeros(n, dtype=bool)
        took_part[list(updates)] = True
        if updates:
            step = sum(self.weight(state, i) * updates[i].delta for i in sorted(updates))   # Σ_{n∈S_t} ω_n^t Δ_n
            w = w - (self.options.server_lr / n) * step                                    # w ← w − (η/N) Σ ω Δ
        return w, {**state, **self.weights(state, took_part)}
