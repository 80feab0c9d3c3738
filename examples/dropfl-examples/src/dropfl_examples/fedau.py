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
    """FedAU (Wang & Ji 2023), Algorithm 1 (FedAvg with pluggable weights) with the online weight estimation of
    its Algorithm 2, in dropfl's delta units (Δ_n = w_t − w_n, w ← w − step). For each client n the server keeps
    S_n (rounds since n's current interval began), M_n (intervals counted) and Ω_n (their running mean); every
    round t, for every client n (q_n^t = 1 iff n's update arrived in round t):

        S_n ← S_n + 1
        if q_n^t = 1 or S_n = K:                  (an interval ends: n took part, or the cut-off K is reached)
            Ω_n ← S_n                 if M_n = 0
            Ω_n ← (M_n Ω_n + S_n) / (M_n + 1)    otherwise
            M_n ← M_n + 1;  S_n ← 0
        ω_n^t = Ω_n

        w_{t+1} = w_t − (η / N) Σ_{n∈S_t} ω_n^t Δ_n                     (S_t: the clients with q_n^t = 1)

    The cut-off K bounds every interval, hence every weight, by K: a client that is never seen is counted as
    one interval of K rounds every K rounds, which bounds the estimate's error for rarely participating
    clients (the paper's bias/variance trade-off in K). With every client taking part every round, ω_n = 1 and
    the rule is FedAvg (η = 1); with client n taking part every k-th round (k ≤ K), ω_n = k from its first
    full interval on.

    As implemented here (a reading of the paper's Algorithms 1 and 2; simplifications stated):
    - The estimation runs on the server from the participation it sees (the paper's clients can run it
      themselves; the numbers are the same): q_n^t = 1 iff n's update is aggregated in round t, so a selected
      client whose update was lost (deadline, rejected) counts as not taking part, as in the paper's q_n^t.
    - ω_n^t includes round t's interval (the estimate is updated before it weights the round's update).
    - A round in which no update arrived leaves w unchanged (the counters still advance).
    - The paper's two-level step sizes (local γ, global η) are dropfl's --lr (local) and `server_lr` (η).

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
        """Algorithm 2 for every client, one round: the new (since, intervals, omega); `took_part` is q^t, bool [N]."""
        since = state["since"] + 1                                     # S_n ← S_n + 1
        intervals, omega = state["intervals"].clone(), state["omega"].clone()
        ends = torch.as_tensor(took_part) | (since == self.options.cutoff)   # q_n^t = 1 or S_n = K
        m, s = intervals[ends].to(torch.float64), since[ends].to(torch.float64)
        omega[ends] = (m * omega[ends] + s) / (m + 1)   # Ω_n ← (M_n Ω_n + S_n)/(M_n + 1), which is S_n at M_n = 0
        intervals[ends] += 1                                           # M_n ← M_n + 1
        since[ends] = 0                                                # S_n ← 0
        return {"since": since, "intervals": intervals, "omega": omega}

    def aggregate(self, state: dropfl.State, t: int, w: torch.Tensor,
                  updates: dict[int, dropfl.ClientUpdate]) -> tuple[torch.Tensor, dropfl.State]:
        n = state["omega"].shape[0]
        took_part = np.zeros(n, dtype=bool)
        took_part[list(updates)] = True
        state = {**state, **self.weights(state, took_part)}
        if not updates:
            return w, state
        omega = state["omega"]
        step = sum(float(omega[i]) * updates[i].delta for i in sorted(updates))   # Σ_{n∈S_t} ω_n^t Δ_n
        return w - (self.options.server_lr / n) * step, state                      # w ← w − (η/N) Σ ω_n Δ_n
