"""Stale substitution: a dropped client is represented by its last upload (FL-FDMS's "Stale" baseline,
fdms.md §3)."""

from __future__ import annotations

import torch

from coordinator.strategies.base import ClientUpdate, State, Strategy

VARIANTS = ("weights", "update")


class Stale(Strategy):
    """Stale substitution, the "use the last update" baseline of FL-FDMS (Wang & Xu, 2022), after
    Yan et al. 2020 (FedLaAvg) and Gu et al. 2021 (MIFA); no client sampling, all N clients averaged.

        variant="weights" (default, the FL-FDMS released code that produced its figures): the server
            keeps each client's last LOCAL MODEL w^k (absolute weights) and sets
                w_{t+1} = (1/N)[Σ_{k∈S_t} w^k_{t+1} + Σ_{k∉S_t} w^k_last],   w^k_{t+1} = w_t − d_k.
            This pulls the global model back toward old iterates; it is not a re-applied update.
        variant="update" (the paper's text): the server keeps each client's last UPDATE d^k and sets
                w_{t+1} = w_t − (1/N)[Σ_{k∈S_t} d^k + Σ_{k∉S_t} d^k_last]
            (the same arithmetic as `MIFA(units="delta", round_weights=False)`).

    FL-FDMS runs round 0 with every client, which fills the table. Before a client's first upload its
    stored model is the initial model w_0 ("weights") or a zero update ("update"). If nobody uploads,
    the round is skipped (fdms.md §1.3).

    Args:
        variant: "weights" (code, default) or "update" (paper text); paper-versus-code discrepancy, fdms.md §8.3.

    State: "models" float32 [N, M] (variant weights) or "latest" float32 [N, M] (variant update),
    updated in place.
    """

    name = "stale"

    def __init__(self, *, variant: str = "weights"):
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS} (got {variant!r})")
        self.variant = variant

    @classmethod
    def from_config(cls, s) -> Stale:
        return cls(variant=s.stale_variant)

    def init_state(self, n_clients: int, w0: torch.Tensor) -> State:
        if self.variant == "weights":
            return {"models": w0.detach().to(torch.float32).expand(n_clients, -1).clone()}
        return {"latest": torch.zeros(n_clients, w0.numel(), dtype=torch.float32)}

    def aggregate(self, state: State, t: int, w: torch.Tensor,
                  updates: dict[int, ClientUpdate]) -> tuple[torch.Tensor, State]:
        if not updates:
            return w, state
        if self.variant == "weights":
            models = state["models"]
            for i, u in updates.items():
                models[i] = w - u.delta  # fresh local model w^k_{t+1} = w_t − d_k
            return models.mean(0), state  # [C] average_weights over all N (fresh and stale models)
        latest = state["latest"]
        for i, u in updates.items():
            latest[i] = u.delta          # last update of each client
        return w - latest.mean(0), state  # w_{t+1} = w_t − (1/N) Σ_k d^k_latest
