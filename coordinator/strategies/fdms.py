"""FL-FDMS: friend discovery and model substitution (Wang & Xu, arXiv:2205.13222).
Specification: ../shared/papers/fdms.md §2."""

from __future__ import annotations

import logging
import math

import torch

from coordinator.strategies.base import ClientUpdate, State, Strategy

CR_MODES = ("off", "case1", "case2")
_log = logging.getLogger("dropfl.strategy")


class FDMS(Strategy):
    """FL-FDMS, "Combating Client Dropout in Federated Learning via Friend Model Substitution"
    (Wang & Xu, 2022; later "Friends to Help: Saving Federated Learning from Client Dropout").

    The server learns which clients send similar updates ("friends") and replaces each dropped client's
    update by that of its most similar active client:

        (14) r(Δ^i, Δ^j) = ½ (⟨Δ^i, Δ^j⟩ / (‖Δ^i‖ ‖Δ^j‖) + 1) ∈ [0, 1]     for every active pair
        (15) R^{ij} ← N^{ij}/(N^{ij}+1) · R^{ij} + 1/(N^{ij}+1) · r^{ij};  N^{ij} += 1   (running mean)
             φ(k) = argmax_{i∈S_t} R^{ki}                                  for every dropped k
             Δ_t = (1/N)(Σ_{k∈S_t} Δ^k + Σ_{k∉S_t} Δ^{φ(k)});  w ← w − η Δ_t   (eq. (4), delta units)

    With full participation it is exactly FedAvg (server_lr = 1).

    Complexity reduction (§5.3, a Hoeffding race): each client k has a candidate friend set C^k
    (initially everyone but k). Only pairs with i ∈ C^k or k ∈ C^i have their similarity computed and
    counted; a dropped client is substituted from C^k ∩ S_t (all of S_t if that is empty); after the
    round, for every k with best candidate b = argmax_{i∈C^k} R^{ki}, every i with R^{kb} − R^{ki} ≥ Θ_t
    leaves C^k for good (the paper's persistent sets; the released code recomputes them every round).
    Only pairs co-active at least once (N^{ki} > 0) can leave: an unobserved R^{ki} = 0 is no estimate.

        Θ_t = sqrt((2 ln(2 N² T B_max) − 2 ln p) / (β t)) + δ_f      (Theorem 2, "case1")
        0.5 · Θ_t                                                    (§6.4 Case 2, "case2")

    with t = round + 1 (Θ is undefined at t = 0). The released code's constants are the defaults
    (N = 20: Θ_1 = 8.636, Θ_100 = 0.873). Scores lie in [0, 1], so nothing is eliminated while Θ_t ≥ 1.

    Decisions: the diagonal is excluded (a client is not its own friend); R = 0 and N = 0 before a pair
    was ever co-active (least preferred); ties go to the lowest client index (the code's `max`); a zero
    update has cosine 0 with everything (r = 0.5); the cosines of all active pairs are one matrix
    product, so with complexity reduction the number of pairs that had to be computed is what is
    counted ("pairs", cumulative, Fig. 4), values of eliminated pairs are left untouched.

    Args:
        server_lr: global learning rate η. The paper's text says 0.1, its supplement and code 1 (they
            average the models); 1 (default) reproduces the published curves (fdms.md §8.1).
        cr: "off" (default), "case1" (Θ_t) or "case2" (0.5·Θ_t).
        cr_p: failure probability p of Theorem 2 (code: 0.01).
        cr_b_max: B_max, the largest friend-set size (code: 3).
        cr_beta: β of Assumption 6, the least fraction of co-active rounds (code: 0.5).
        cr_delta_f: δ_f, the largest score spread within a friend set (code: 0.01).
        cr_horizon: T, the number of rounds in Θ_t (code: 500).

    State: "sim" float32 [N, N] (R), "count" float32 [N, N] (N^{ij}), "cand" bool [N, N] (C^k as rows),
    "friend" int64 [N] (φ(k) of the last round, −1 when k was active), "pairs" float64 scalar
    (similarity computations so far).
    """

    name = "fdms"

    def __init__(self, *, server_lr: float = 1.0, cr: str = "off", cr_p: float = 0.01, cr_b_max: int = 3,
                 cr_beta: float = 0.5, cr_delta_f: float = 0.01, cr_horizon: int = 500):
        if cr not in CR_MODES:
            raise ValueError(f"cr must be one of {CR_MODES} (got {cr!r})")
        self.server_lr, self.cr = server_lr, cr
        self.cr_p, self.cr_b_max, self.cr_beta = cr_p, cr_b_max, cr_beta
        self.cr_delta_f, self.cr_horizon = cr_delta_f, cr_horizon

    # The friend log (friends.jsonl in the run directory, docs/run-directory.md): the round loop writes
    # round_log(...) after every aggregation, so a user can see whether the right friends were found.
    round_log_file = "friends.jsonl"
    log_similarity_max = 200   # N above which the N×N matrix is left out of each row (N² floats a round)

    def round_log(self, state: State, t: int, updates: dict[int, ClientUpdate]) -> dict:
        """This round's active clients, the friend φ(k) each dropped client was substituted by (−1: active, or
        nobody to substitute in an empty round), and R after the round (R^{kφ(k)} is what φ(k) maximised:
        a dropped k's row is not updated). Floats are the float32 state values, exactly."""
        n = state["sim"].shape[0]
        friend = state["friend"].tolist() if updates else [-1] * n
        row = {"round": t, "active": sorted(updates), "friend": friend, "pairs": int(state["pairs"])}
        if n <= self.log_similarity_max:
            row["similarity"] = state["sim"].tolist()
        else:
            if not getattr(self, "_told", False):
                _log.warning("fdms: friends.jsonl leaves out the %d×%d similarity matrix (more than %d clients); "
                             "friends are logged", n, n, self.log_similarity_max)
                self._told = True
            row["similarity"] = None
        return row

    @classmethod
    def from_config(cls, s) -> FDMS:
        return cls(server_lr=s.server_lr, cr=s.fdms_cr)

    def init_state(self, n_clients: int, w0: torch.Tensor) -> State:
        cand = ~torch.eye(n_clients, dtype=torch.bool)  # C^k_0 = K \ {k}
        return {"sim": torch.zeros(n_clients, n_clients), "count": torch.zeros(n_clients, n_clients),
                "cand": cand, "friend": torch.full((n_clients,), -1, dtype=torch.int64),
                "pairs": torch.zeros((), dtype=torch.float64)}

    def theta(self, t: int, n_clients: int) -> float:
        """Θ_t of Theorem 2 (case1) or 0.5·Θ_t (case2) after round t (0-based), i.e. the paper's t + 1."""
        a = 2 * math.log(2 * n_clients ** 2 * self.cr_horizon * self.cr_b_max) - 2 * math.log(self.cr_p)
        th = math.sqrt(a / (self.cr_beta * (t + 1))) + self.cr_delta_f  # FDMS Theorem 2: Θ_t
        return 0.5 * th if self.cr == "case2" else th                    # §6.4 Case 2: 0.5·Θ_t

    def aggregate(self, state: State, t: int, w: torch.Tensor,
                  updates: dict[int, ClientUpdate]) -> tuple[torch.Tensor, State]:
        if not updates:  # all clients dropped: the round is skipped (fdms.md §1.3)
            return w, state
        sim, count, cand = state["sim"], state["count"], state["cand"]
        n = sim.shape[0]
        ids = sorted(updates)
        act = torch.tensor(ids)
        x = torch.stack([updates[i].delta for i in ids])  # [s, M]; η_L Δ^k up to sign: same cosines

        # (a) similarity of active pairs, FDMS eq. (14): r = ½(cos + 1)
        norms = x.norm(dim=1)
        unit = x / torch.where(norms > 0, norms, torch.ones_like(norms))[:, None]
        r = 0.5 * (unit @ unit.T + 1)
        need = ~torch.eye(len(ids), dtype=torch.bool)
        if self.cr != "off":
            c = cand[act][:, act]
            need &= c | c.T  # only pairs still in someone's candidate set are computed
        # (b) running mean, FDMS eq. (15): R = N/(N+1)·R + 1/(N+1)·r over co-active rounds
        rs, ns = sim[act][:, act], count[act][:, act]
        sim[act[:, None], act[None, :]] = torch.where(need, (ns * rs + r) / (ns + 1), rs)
        count[act[:, None], act[None, :]] = torch.where(need, ns + 1, ns)
        state["pairs"] += int(need.sum()) // 2

        # (c) substitution: φ(k) = argmax_{i∈S_t (∩ C^k)} R^{ki} for every dropped k
        friend = torch.full((n,), -1, dtype=torch.int64)
        mask = torch.ones(n, dtype=torch.bool)
        mask[act] = False
        dropped = torch.nonzero(mask).flatten()
        uses = torch.ones(len(ids))  # how often each active update enters the sum (itself + substitutions)
        if len(dropped):
            scores = sim[dropped][:, act]
            if self.cr != "off":
                pool = cand[dropped][:, act]
                pool[pool.sum(1) == 0] = True  # no candidate active: fall back to every active client
                scores = scores.masked_fill(~pool, -math.inf)
            phi = scores.argmax(1)  # first maximum: lowest client index on ties
            friend[dropped] = act[phi]
            uses += torch.bincount(phi, minlength=len(ids)).to(uses.dtype)
        state["friend"] = friend
        total = (uses[:, None] * x).sum(0) / n  # Δ_t = (1/N)(Σ_{k∈S_t} Δ^k + Σ_{k∉S_t} Δ^{φ(k)})
        w_new = w - self.server_lr * total      # FDMS eq. (4): w_{t+1} = w_t + η η_L Δ_t (delta units)

        if self.cr != "off":  # Hoeffding-race elimination on R_t, every client, every round
            best = sim.masked_fill(~cand, -math.inf).max(1).values
            # fdms.md §2.4 step 2: C^k ← C^k − {i : R^{kφ(k)} − R^{ki} ≥ Θ_t}, over pairs with an estimate only:
            # Θ_t is a Hoeffding confidence radius over ≥ βt co-active observations (Theorem 2), so a pair
            # never co-active (N^{ki} = 0, R^{ki} the initial 0, not a measurement) cannot be eliminated.
            cand &= ~((best[:, None] - sim >= self.theta(t, n)) & (count > 0))
        return w_new, state
