"""Measured client rates as strategy state (FedDD, FedCS): smoothed, checkpointed, never measured here.

The transport puts what a client measured into `ClientUpdate.report` (edge_client/report.py); a
strategy folds it into its state with `observe` (exponential smoothing, the first sample taken as is)
and estimates per-client round times with `round_times` (FedDD eqs. 7, 9, 11; eq. 12 is their max).
NaN means "never measured".
"""

from __future__ import annotations

import torch

from coordinator.strategies.base import ClientUpdate, State

RATE_KEYS = ("compute_s", "up_Bps", "down_Bps")


def init_rates(n_clients: int, w0: torch.Tensor) -> State:
    state = {k: torch.full((n_clients,), float("nan"), dtype=torch.float64) for k in RATE_KEYS}
    state["model_bytes"] = torch.tensor(4.0 * w0.numel(), dtype=torch.float64)  # U: dense float32 model
    return state


def observe(state: State, updates: dict[int, ClientUpdate], smoothing: float) -> State:
    """New state with each reported measurement folded in: s ← (1 − β) s + β x (s = x the first time)."""
    out = dict(state)
    for key in RATE_KEYS:
        v = state[key].clone()
        for i, u in updates.items():
            x = getattr(u.report, key, None) if u.report is not None else None
            if x is None or not x == x:
                continue
            v[i] = x if torch.isnan(v[i]) else (1.0 - smoothing) * v[i] + smoothing * x
        out[key] = v
    return out


def round_times(state: State, dropout: torch.Tensor | None = None) -> torch.Tensor:
    """t_n^cmp + U (1 − D_n)/r_n^u + U (1 − D_n)/r_n^d per client (NaN where something is unmeasured)."""
    kept = state["model_bytes"] * (1.0 if dropout is None else 1.0 - dropout)
    return state["compute_s"] + kept / state["up_Bps"] + kept / state["down_Bps"]
