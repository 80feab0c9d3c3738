"""MimiC (Sun, Mao, Zhang, IEEE TMC 2023 / arXiv:2306.12212): corrections that make every received update
imitate the central update. Server-side form (Algorithm 1) and the client-side "practical implementation"
(Sec. 5). Specification: ../shared/papers/mimic.md §2."""

from __future__ import annotations

import torch

from coordinator.strategies.base import ClientUpdate, State, Strategy

UNITS = ("delta", "gradient")


def check_units(units: str) -> str:
    if units not in UNITS:
        raise ValueError(f"units must be one of {UNITS} (got {units!r})")
    return units


def raw_update(u: ClientUpdate, units: str) -> torch.Tensor:
    """The client's raw upload in the chosen units.

    delta:    d_i = w_t − w_{t,K}^i (released code).
    gradient: ĝ_i = (w_t − w_{t,K}^i) / (η_L K), the average of the K stochastic gradients (MimiC eq. (3)).
    """
    if units == "delta":
        return u.delta
    return u.delta / (u.lr * max(u.steps, 1))  # MimiC eq. (3): ĝ_i = (1/K) Σ_k ∇F_i = d_i / (η_L K)


def global_step(units: str, t: int, server_lr: float, global_lr: float, global_lr_decay: float) -> float:
    """Step applied to the aggregate: delta units use the server step (1 in the released code);
    gradient units use the paper's global learning rate η_t = global_lr · global_lr_decay^t (Table 2:
    0.01 × 0.95^{t−1} for t = 1, 2, …, i.e. global_lr · γ^t for our 0-based rounds)."""
    return server_lr if units == "delta" else global_lr * global_lr_decay ** t


class MimiC(Strategy):
    """MimiC, Algorithm 1 (server-side corrections), Sun, Mao & Zhang, "MimiC: Combating Client Dropouts
    in Federated Learning by Mimicking Central Updates", IEEE TMC 2023.

    The server keeps one correction c_i per client (c_i = 0 at start). Each round, with S_t the clients
    whose updates arrived:

        v_t^i = ĝ_i(w_t) + c_i                      corrected update, with c_i from i's last active round
        v_t   = (1/|S_t|) Σ_{i∈S_t} v_t^i           eq. (16): averaged over the ACTIVE clients
        w_{t+1} = w_t − η_t v_t                     eq. (5)
        c_i  ← v_t − ĝ_i(w_t)   for i ∈ S_t         eq. (15): applied update minus own raw update

    Σ_i c_i is invariant, hence 0 from round 1 on when round 0 has everyone; with full participation
    every round MimiC is exactly FedAvg. Empty S_t: the model is not updated (digest §2.2, inferred).

    Args:
        units: "delta" (default) or "gradient" (MimiC digest §2.5, paper-versus-code discrepancy).
            "delta" is the released code, which produced the published tables: the upload is the model
            delta d_i = w_t − w_{t,K}^i (local lr decayed every round), w ← w − server_lr · D_t and the
            correction C_i = D_t − d_i is stored in the lr scale of the round it was computed (not rescaled).
            "gradient" is the paper's text: the upload is the average gradient ĝ_i = d_i / (η_L K) and
            the step is the global rate η_t = global_lr · global_lr_decay^t; corrections are in gradient
            units, so they are applied at the current η_t. Taken literally with η_L constant this moves the
            model far too little to reach the published accuracies (digest §2.5), hence not the default.
        server_lr: units="delta" only: step on the averaged corrected delta (1 in the released code).
        global_lr: units="gradient" only: η_0 of the global learning rate (paper: 0.01).
        global_lr_decay: units="gradient" only: per-round factor γ of η_t (paper: 0.95 FMNIST, 0.99 CIFAR-10).

    State: "corr", float32 [N, M], row i = c_i (N model-sized vectors: MimiC's server memory, Table 1).
    The tables are updated in place (N × M is too large to copy every round); `aggregate` returns them.
    """

    name = "mimic"
    tables = ("corr",)

    def __init__(self, *, units: str = "delta", server_lr: float = 1.0, global_lr: float = 0.01,
                 global_lr_decay: float = 0.95):
        self.units = check_units(units)
        self.server_lr, self.global_lr, self.global_lr_decay = server_lr, global_lr, global_lr_decay

    @classmethod
    def from_config(cls, s) -> MimiC:
        return cls(units=s.units, server_lr=s.server_lr, global_lr=s.global_lr, global_lr_decay=s.global_lr_decay)

    def init_state(self, n_clients: int, w0: torch.Tensor) -> State:
        return {"corr": self.table("corr", n_clients, w0.numel())}  # Alg. 1 line 1: c_0^i = 0

    def step(self, t: int) -> float:
        return global_step(self.units, t, self.server_lr, self.global_lr, self.global_lr_decay)

    def aggregate(self, state: State, t: int, w: torch.Tensor,
                  updates: dict[int, ClientUpdate]) -> tuple[torch.Tensor, State]:
        if not updates:  # empty S_t: no update to average (digest §2.2: skip the model update)
            return w, state
        ids = sorted(updates)
        idx = torch.tensor(ids)
        g = torch.stack([raw_update(updates[i], self.units) for i in ids])  # ĝ_i(w_t), i ∈ S_t
        corr = state["corr"]
        v = (g + corr[idx]).mean(0)      # MimiC eq. (16): v_t = (1/|S_t|) Σ_{i∈S_t} (ĝ_i(w_t) + c_i)
        corr[idx] = v - g                # MimiC eq. (15): c_i = v_t − ĝ_i(w_t)
        return w - self.step(t) * v, state  # MimiC eq. (5): w_{t+1} = w_t − η_t v_t


class MimiCClient(MimiC):
    """MimiC, "practical implementation" (Sec. 5): each client keeps its own correction and uploads the
    already corrected update, so the server only averages (compatible with secure aggregation).

        client i ∈ S_t:  uploads v_t^i = ĝ_i(w_t) + c_i          (c_i held on the device)
        server:          v_t = (1/|S_t|) Σ_{i∈S_t} v_t^i ;  w_{t+1} = w_t − η_t v_t
        client i ∈ S_t:  learns v_t (sent back with the round's acknowledgement; equivalently
                         (w_t − w_{t+1})/η_t from the next broadcast), sets c_i = v_t − ĝ_i(w_t)

    This is the same arithmetic as `MimiC` in a different place, so both give the same model
    (tests/test_strategies_mimic.py proves it round by round, and end to end from the CLI). Clients are
    simulated stateless in this code base, so the devices' memory is modelled as the state entry
    "device_corr" [N, M]; only `client_upload` and `client_refresh` (the device side) touch it, the
    server part of `aggregate` sees nothing but the uploaded corrected vectors.

    Args: as `MimiC`.
    """

    name = "mimic-client"
    tables = ("device_corr",)

    def init_state(self, n_clients: int, w0: torch.Tensor) -> State:
        return {"device_corr": self.table("device_corr", n_clients, w0.numel())}

    def client_upload(self, state: State, u: ClientUpdate) -> tuple[torch.Tensor, torch.Tensor]:
        """Device side: (raw update ĝ_i, corrected upload v_t^i = ĝ_i + c_i)."""
        g = raw_update(u, self.units)
        return g, g + state["device_corr"][u.client]  # MimiC Sec. 5: v_t^i = ĝ_i(w_t) + c_{t'}^i

    def client_refresh(self, state: State, client: int, g: torch.Tensor, v: torch.Tensor) -> None:
        """Device side, after the round: c_i = v_t − ĝ_i(w_t)."""
        state["device_corr"][client] = v - g  # MimiC eq. (15), computed on the device

    def aggregate(self, state: State, t: int, w: torch.Tensor,
                  updates: dict[int, ClientUpdate]) -> tuple[torch.Tensor, State]:
        if not updates:
            return w, state
        ids = sorted(updates)
        sent = {i: self.client_upload(state, updates[i]) for i in ids}
        v = torch.stack([sent[i][1] for i in ids]).mean(0)  # server: plain average of the uploads
        for i in ids:
            self.client_refresh(state, i, sent[i][0], v)
        return w - self.step(t) * v, state  # MimiC eq. (5)
