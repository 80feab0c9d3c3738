"""FedLaAvg (Yan et al., arXiv:2002.07399), Algorithm 2. Specification: ../shared/papers/fedlaavg.md §2."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from coordinator.strategies.base import ClientUpdate, State, Strategy
from coordinator.strategies.schedule import LrNormalisedTable, server_lr


class FedLaAvg(LrNormalisedTable, Strategy):
    """FedLaAvg, Algorithm 2 (C local iterations per round), Yan, Niu, Ding, Zheng, Wu, Chen, Tang, Wu,
    "Distributed Non-Convex Optimization with Sublinear Speedup under Intermittent Client Availability",
    arXiv:2002.07399 (2020).

    Each round the server selects, among the available clients, the K = βN whose latest participation
    R_i is oldest (line 6), and the global step is the average over ALL N clients of every client's
    latest local delta (stale deltas of absent clients included, never-seen clients counting 0):

        line 6:  B^r = the K clients of C^r with the lowest R_i (ties: lower client index, as the
                 released code's stable sort; all of C^r when |C^r| ≤ K)
        line 8:  client i ∈ B^r uploads u_i^r − u_i^{R_i} (its new delta minus its previous one)
        line 9:  u^r = u^{r−1} + (1/N) Σ_i (u_i^r − u_i^{R_i})
        line 7:  R_i ← r
        line 10: x^r = x^{r−1} + u^r                               (server step 1, every round)

    In our delta units (d = w_global − w_local = −u_i) line 10 reads w ← w − u. Lemma 1: with every
    client available at least once in any E successive rounds, t − R_i ≤ ⌈N/K⌉E − 1.

    Decisions:
      * R_i is set when the update arrives (in `aggregate`), not at selection: a selected client whose
        update is lost still holds its old delta, so it stays "old" and is preferred next round. With no
        losses (the paper's setting) this is identical to line 7.
      * Rounds are 0-based here, so "never participated" is R_i = −1 (the paper's R_i^0 = 0 with r ≥ 1).
      * Line 10 runs every round, also when nobody was selected (u^r = u^{r−1} is re-applied), exactly
        as Algorithm 2 is written.
      * The released code scales each client's loss by N·n_i/n_total (f_i = w_i N f̃_i); that is a
        local-training change this strategy cannot make. It is the identity for equal client data sizes
        (the shards partition); with unbalanced data the average here weights clients equally.

    Args:
        beta: proportion β of clients selected per round, K = max(1, round(β N)) (paper default 0.1).
        storage: what the latest-update table holds, a paper-versus-code choice that matters only when the
            local lr changes between rounds (fedlaavg.md §2.2: the paper's runs use a constant γ = 0.01, where
            both are the same numbers):
            "raw" (default; dropfl's rule since the start): u_i = the delta d_i, and line 10 applies w ← w − u.
            "lr-normalised" (the released code, `train/server.py`: clients upload gradient sums, the server
            keeps their running average and steps `lr(current_round) · average`): u_i = d_i / η_i, with η_i the
            lr client i trained with, and line 10 applies w ← w − η_t u, η_t the lr of the current round, also
            in a round without uploads. Needs the run's schedule (`lr_at`, or `bind_lr_schedule`); without
            one, η_t is the lr of this round's updates, or the last round's when none arrived.
        lr_at: the run's local lr schedule t → η_t (`coordinator/strategies/schedule.py`), for "lr-normalised";
            `runsetup.build_strategy` binds the loop's.

    State: "latest" float32 [N, M] (row i = u_i, the delta each client keeps locally in the paper; held
    here because simulated clients are stateless), "avg" float32 [M] (u^r, the server's running average,
    invariant (3): avg = mean of latest), "last" int64 [N] (R_i); with "lr-normalised" also "lr" float64 [1]
    (the last η_t applied, the fallback above).
    """

    name = "fedlaavg"
    tables = ("latest",)

    def __init__(self, *, beta: float = 0.1, storage: str = "raw", lr_at: Callable[[int], float] | None = None):
        if not 0 < beta <= 1:
            raise ValueError(f"beta must be in (0, 1] (got {beta})")
        self.set_storage(storage, lr_at)
        self.beta = beta

    @classmethod
    def from_config(cls, s) -> FedLaAvg:
        return cls(beta=s.beta, storage=s.fedlaavg_storage)

    def k(self, n_clients: int) -> int:
        return max(1, round(self.beta * n_clients))  # K = βN

    def init_state(self, n_clients: int, w0: torch.Tensor) -> State:
        state = {"latest": self.table("latest", n_clients, w0.numel()),               # u_i^0 = 0
                 "avg": torch.zeros(w0.numel(), dtype=torch.float32),                # u^0 = 0
                 "last": torch.full((n_clients,), -1, dtype=torch.int64)}            # R_i^0 (never)
        if self.storage == "lr-normalised":
            state["lr"] = torch.zeros(1, dtype=torch.float64)  # the last η_t applied (0: none yet)
        return state

    def select(self, state: State, t: int, available: np.ndarray, rng: np.random.Generator) -> list[int]:
        avail = np.flatnonzero(available)
        last = state["last"].numpy()[avail]
        oldest = avail[np.lexsort((avail, last))]  # FedLaAvg line 6: lowest R_i first, ties: lower index (numpy)
        return sorted(int(i) for i in oldest[:self.k(len(available))])

    def aggregate(self, state: State, t: int, w: torch.Tensor,
                  updates: dict[int, ClientUpdate]) -> tuple[torch.Tensor, State]:
        latest, avg, last = state["latest"], state["avg"], state["last"]
        n = latest.shape[0]
        normalised = self.storage == "lr-normalised"
        for i in sorted(updates):
            u = updates[i]
            d = u.delta / u.lr if normalised else u.delta  # code: the client's gradient sum d_i/η_i; else d_i
            avg += (d - latest[i]) / n  # FedLaAvg lines 8–9: u^r += (1/N)(u_i^r − u_i^{R_i})
            latest[i] = d               # the client's stored latest update
            last[i] = t                 # FedLaAvg line 7: R_i ← r
        if not normalised:
            return w - avg, state       # FedLaAvg line 10: x^r = x^{r−1} + u^r (delta units: w − avg)
        lr = server_lr(state, t, updates, self.lr_at)
        return w - lr * avg, state      # line 10, released code: x ← x − lr(current_round) · average gradient sum
