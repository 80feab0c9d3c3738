"""FedDD: differential parameter dropout (Feng, Chen, Wu, Wu, Zhang, Huang, "FedDD: Toward
Communication-efficient Federated Learning with Differential Parameter Dropout"). Spec and errata:
../shared/papers/feddd.md; implementation notes: docs/feddd.md.

Per round (Algorithm 1): every client trains, uploads the fraction 1 − D_n of its model chosen channel-
and neuron-wise (client side, edge_client/feddd.py), the server averages each coordinate over the
clients that uploaded it (eq. 4), then solves the allocation LP (eqs. 14-17, cvx/allocation.py) for
next round's D_n from the measured compute times and link rates, the losses, data sizes and label
scores the clients reported. Round 0 uses D = 0 for everyone (Algorithm 1's D^1 = 0).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from coordinator.errors import UserError
from coordinator.strategies.base import ClientUpdate, State, Strategy
from coordinator.strategies.measured import RATE_KEYS, init_rates, observe
from edge_client.trainer import TrainTask

log = logging.getLogger(__name__)


def masked_mean_delta(updates: dict[int, ClientUpdate]) -> torch.Tensor:
    """FedDD eq. (4) in delta units: per coordinate, Σ m_n M_n δ_n / Σ m_n M_n over the clients that
    uploaded it (m_n = samples, M_n = mask, None = all); 0 where nobody did (the global value stays)."""
    first = next(iter(updates.values())).delta
    num = torch.zeros_like(first, dtype=torch.float64)
    den = torch.zeros_like(first, dtype=torch.float64)
    for u in updates.values():
        m = torch.ones_like(first, dtype=torch.bool) if u.mask is None else u.mask
        weight = float(u.num_samples) * m.double()
        num += weight * u.delta.double()
        den += weight
    return torch.where(den > 0, num / den.clamp_min(1e-300), 0.0).to(first.dtype)


def _fill(v: torch.Tensor, how: str, default: float) -> np.ndarray:
    """Unmeasured (NaN) entries take the median/mean of the measured ones, or `default` if none is."""
    a = v.numpy().astype(float)
    known = a[~np.isnan(a)]
    fill = default if known.size == 0 else float(np.median(known) if how == "median" else known.mean())
    return np.where(np.isnan(a), fill, a)


class FedDD(Strategy):
    """FedDD with the paper's allocation and per-coordinate aggregation.

    Args:
        d_max: D_max, the largest dropout rate a client may get (paper: 0.8).
        a_server: A_server, the uploaded fraction of all clients' model bytes per round; the allocation
            makes Σ U_n (1 − D_n) = A_server Σ U_n (paper: 0.6). Needs 1 − d_max <= a_server <= 1.
        delta: δ >= 0, seconds per unit of the regulariser re_n in eq. (16) (paper: unstated; 0 = pure
            round-time minimisation).
        full_every: h; the download is the full model when t mod h = 0 (eq. 6) and the sparse
            W^t ⊙ M_n otherwise (eq. 5). 1 (default, the paper's testbed) = always full.
        smoothing: weight β of a new measurement in the rate estimates, s ← (1 − β) s + β x.
        solver: cvxpy solver for the allocation.
    """

    name = "feddd"
    sets_dropout_rate = True

    def __init__(self, *, d_max: float = 0.8, a_server: float = 0.6, delta: float = 0.0, full_every: int = 1,
                 smoothing: float = 0.5, solver: str = "CLARABEL"):
        if not 0.0 <= d_max <= 1.0:
            raise ValueError(f"feddd: D_max must be in [0, 1], got {d_max}")
        if not 1.0 - d_max <= a_server <= 1.0:
            raise ValueError(f"feddd: A_server = {a_server} is infeasible, it must be in [1 − D_max, 1] = "
                             f"[{1.0 - d_max:g}, 1]")
        if delta < 0 or full_every < 1 or not 0.0 < smoothing <= 1.0:
            raise ValueError(f"feddd: need delta >= 0, full_every >= 1, 0 < smoothing <= 1 "
                             f"(got {delta}, {full_every}, {smoothing})")
        self.d_max, self.a_server, self.delta = d_max, a_server, delta
        self.full_every, self.smoothing, self.solver = full_every, smoothing, solver
        self._allocator = None  # cvx.allocation.DropoutAllocator, built once (a cache, not state)

    @classmethod
    def from_config(cls, s) -> FedDD:
        try:
            return cls(d_max=s.feddd_d_max, a_server=s.feddd_a_server, delta=s.feddd_delta,
                       full_every=s.feddd_full_every, smoothing=s.rate_smoothing)
        except ValueError as e:
            raise UserError(str(e)) from None

    def init_state(self, n_clients: int, w0: torch.Tensor) -> State:
        from cvx.allocation import DropoutAllocator

        if self._allocator is None or self._allocator.n != n_clients:  # cvxpy's ~2 s import: before round 0
            self._allocator = DropoutAllocator(n_clients, solver=self.solver)
        state = init_rates(n_clients, w0)
        state["dropout"] = torch.zeros(n_clients, dtype=torch.float64)  # Algorithm 1: D^1 = 0
        for key in ("loss", "num_samples", "label_score"):
            state[key] = torch.full((n_clients,), float("nan"), dtype=torch.float64)
        state["modelled_round_s"] = torch.tensor(float("nan"), dtype=torch.float64)
        return state

    def configure(self, state: State, t: int, task: TrainTask) -> TrainTask:
        sparse = self.full_every > 1 and t % self.full_every != 0   # eq. (5) vs eq. (6)
        return replace(task, dropout_rate=float(state["dropout"][task.client]), sparse_download=sparse)

    def aggregate(self, state: State, t: int, w: torch.Tensor,
                  updates: dict[int, ClientUpdate]) -> tuple[torch.Tensor, State]:
        if updates:
            w = w - masked_mean_delta(updates)                              # eq. (4)
        state = observe(state, updates, self.smoothing)
        for key in ("loss", "num_samples", "label_score"):
            v = state[key].clone()
            for i, u in updates.items():
                x = u.loss if key == "loss" else u.num_samples if key == "num_samples" else \
                    (u.report.label_score if u.report is not None else None)
                if x is not None and x == x:
                    v[i] = x
            state[key] = v
        dropout, modelled = self.allocate(state)                           # eqs. (14)-(17) for round t + 1
        state["dropout"] = torch.as_tensor(dropout, dtype=torch.float64)
        state["modelled_round_s"] = torch.tensor(modelled, dtype=torch.float64)
        return w, state

    def allocate(self, state: State) -> tuple[np.ndarray, float]:
        """Next round's D_n and the modelled round time. Clients never measured take the median of the
        measured ones; with no measurement at all, the uniform rule D_n = 1 − A_server."""
        from cvx.allocation import AllocationInputs, DropoutAllocator

        n = len(state["dropout"])
        measured = ~torch.stack([state[k].isnan() for k in RATE_KEYS]).any(0)
        if not measured.any():
            log.warning("feddd: no client has reported compute time and link rates yet; "
                        "using the uniform rule D_n = 1 − A_server")
            return np.full(n, 1.0 - self.a_server), float("nan")
        if self._allocator is None or self._allocator.n != n:
            self._allocator = DropoutAllocator(n, solver=self.solver)
        U = float(state["model_bytes"])
        inp = AllocationInputs(
            compute_s=_fill(state["compute_s"], "median", 0.0), up_rate=_fill(state["up_Bps"], "median", 1.0),
            down_rate=_fill(state["down_Bps"], "median", 1.0), model_bytes=np.full(n, U), global_bytes=U,
            num_samples=_fill(state["num_samples"], "mean", 1.0), label_score=_fill(state["label_score"], "mean", 1.0),
            loss=_fill(state["loss"], "mean", 1.0), delta=self.delta, d_max=self.d_max, a_server=self.a_server)
        res = self._allocator.solve(inp)
        return res.dropout, res.round_time
