"""Shared helpers for the strategy tests: hand-made updates and a driver for pure strategy rounds."""

from __future__ import annotations

import numpy as np
import torch

from coordinator.strategies.base import ClientUpdate, Strategy


def upd(client: int, delta: list[float], lr: float = 0.1, steps: int = 1) -> ClientUpdate:
    return ClientUpdate(client, torch.tensor(delta, dtype=torch.float32), num_samples=10, steps=steps, lr=lr)


def run(strategy: Strategy, n: int, rounds: list[dict[int, list[float]]], w0: list[float] | None = None,
        lr: float = 0.1, steps: int = 1) -> tuple[list[torch.Tensor], dict]:
    """Feed hand-written deltas round by round; return the global model after every round and the state."""
    w = torch.tensor(w0 if w0 is not None else [0.0] * len(next(iter(rounds[0].values()))))
    state = strategy.init_state(n, w)
    ws = []
    for t, deltas in enumerate(rounds):
        w, state = strategy.aggregate(state, t, w, {i: upd(i, d, lr, steps) for i, d in deltas.items()})
        ws.append(w.clone())
    return ws, state


def close(a: torch.Tensor, b: list[float], tol: float = 1e-5) -> bool:
    return torch.allclose(a, torch.tensor(b, dtype=a.dtype), atol=tol, rtol=0)


def random_rounds(n: int, m: int, rounds: int, seed: int, p_active: float = 0.5,
                  first_all: bool = True) -> list[dict[int, list[float]]]:
    """Random deltas with random dropouts (round 0 everyone, as in MimiC's and FDMS's experiments)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(rounds):
        active = np.ones(n, bool) if (t == 0 and first_all) else rng.random(n) < p_active
        if not active.any():
            active[rng.integers(n)] = True
        out.append({int(i): rng.normal(size=m).tolist() for i in np.flatnonzero(active)})
    return out


def cache_dataset_loads(monkeypatch) -> None:
    """Load each dataset once per test module: sims in the tests then spend their time in the rounds."""
    import functools

    from edge_client import datasets

    monkeypatch.setattr(datasets, "load", functools.lru_cache(maxsize=2)(datasets.load))
