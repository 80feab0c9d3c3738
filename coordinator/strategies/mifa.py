"""MIFA (Gu, Huang, Zhang, Liu, NeurIPS 2021), as described and released with MimiC (mimic.md §3)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from coordinator.statestore import row_sum
from coordinator.strategies.base import ClientUpdate, State, Strategy
from coordinator.strategies.mimic import check_units, global_step, raw_update
from coordinator.strategies.schedule import LrNormalisedTable, server_lr

log = logging.getLogger("dropfl.strategy")

# The released code's weight round(1/N, 4) is kept only while the N weights sum to within this relative
# tolerance of 1 (|N·round(1/N, 4) − 1| ≤ 1%: always for N ≤ 200, e.g. 0.999 for N = 30). Beyond it the
# rounding is an artefact, not a choice (N = 3 000: sum 0.9; N = 15 000: 1.5; N > 20 000: 0, the model
# never moves), so the exact 1/N of the paper is used instead, with one warning per MIFA instance.
ROUND_WEIGHTS_REL_TOL = 0.01


class MIFA(LrNormalisedTable, Strategy):
    """MIFA, "Fast Federated Learning in the Presence of Arbitrary Device Unavailability" (Gu et al.,
    NeurIPS 2021), the rule used as a baseline by MimiC: the server stores the latest update of every
    client and averages all N of them, so a dropped client is represented by its last update.

        G_i ← ĝ_i(w_t)   for i ∈ S_t;   G_i kept otherwise        (G_i = 0 until i first takes part)
        v_t = (1/N) Σ_{i=1}^N G_i ;  w_{t+1} = w_t − η_t v_t

    The rule does not depend on S_t, so it is applied every round, also when no update arrived.
    With everyone active every round (and `round_weights=False`) it is exactly FedAvg.

    Args:
        units: "delta" (default, released code: the table holds raw model deltas d_i, in the lr scale of
            the round they were computed, and w ← w − v_t) or "gradient" (paper: G_i = ĝ_i = d_i/(η_L K) and
            w ← w − η_t v_t with η_t = global_lr · global_lr_decay^t). See `MimiC` and mimic.md §2.5.
        round_weights: True (default) uses the released code's weight round(1/N, 4) per client
            (0.0333 each for N = 30, summing to 0.999), which produced the published MIFA numbers;
            False uses the exact 1/N of the paper. Paper-versus-code discrepancy, mimic.md §3. Where the
            rounding is meaningless (|N·round(1/N, 4) − 1| > ROUND_WEIGHTS_REL_TOL = 1%, e.g. N ≥ 20 001
            where it is 0) the exact 1/N is used and a warning is logged once ("dropfl.strategy").
        global_lr, global_lr_decay: units="gradient" only, as in `MimiC`.
        storage: what the table holds with units="delta" (with "gradient" only "raw" is allowed):
            "raw" (default; MimiC's released code): G_i = d_i, the delta in the lr scale of the round it was
            trained in, and w ← w − v_t. Under a decaying lr a stored delta from an early round then outweighs
            fresh ones (0.01 against 0.01·0.95^t), and after the lr's floor the table's stale rows move the
            model by the same vector every round until their clients return.
            "lr-normalised": G_i = d_i / η_i (η_i the lr client i trained with) and w ← w − η_t v_t, η_t the
            current round's lr (the run's schedule, `lr_at`), also in a round without uploads: every stored
            update counts in the current lr's scale, as FedLaAvg's released code keeps its table
            (`FedLaAvg(storage="lr-normalised")`). With a constant lr both give the same models.
        lr_at: the run's local lr schedule t → η_t, for "lr-normalised" (`runsetup.build_strategy` binds the
            loop's); without one, η_t is this round's updates' lr, or the last one used when none arrived.
        wait_all: False (default; MimiC's MIFA, and a no-op whenever round 0 has everyone, --first-round-all)
            or True, MIFA's own code and Algorithm 1's "every device participates in the first round": the
            updates are stored, but the model is not updated (w_{t+1} = w_t) until every client has uploaded at
            least once; from the round in which the last first upload arrives the rule above runs every round.
            The waiting rounds count as rounds (the lr schedule, e.g. MIFA's lr_0/(t+1), advances through them).

    State: "latest", float32 [N, M], row i = G_i. Updated in place (a sim with N = 10 000 clients of a
    7,850-parameter model holds 314 MB here, and nothing else of that size), in the run's state store
    (--state-store: RAM or a file of the run directory). The sum over all N rows is `row_sum`'s, in fixed
    blocks of rows: exactly latest.sum(0) while N fits one block, and O(N) row reads per round either way.
    With wait_all also "seen", bool [N]: which clients have uploaded at least once. With "lr-normalised"
    also "lr", float64 [1]: the last η_t applied (`schedule.server_lr`).
    """

    name = "mifa"
    tables = ("latest",)
    absorbs = True  # an update only replaces its client's row: written as it arrives (Strategy.absorb)

    def __init__(self, *, units: str = "delta", round_weights: bool = True, global_lr: float = 0.01,
                 global_lr_decay: float = 0.95, wait_all: bool = False, storage: str = "raw",
                 lr_at: Callable[[int], float] | None = None):
        self.units = check_units(units)
        self.set_storage(storage, lr_at)
        if storage != "raw" and self.units != "delta":
            raise ValueError(f"storage {storage!r} needs units 'delta' (gradient units already divide by the lr)")
        self.round_weights, self.global_lr, self.global_lr_decay = round_weights, global_lr, global_lr_decay
        self.wait_all = wait_all
        self._warned = False  # the fallback warning is logged once per instance

    @classmethod
    def from_config(cls, s) -> MIFA:
        return cls(units=s.units, round_weights=s.mifa_round_weights, global_lr=s.global_lr,
                   global_lr_decay=s.global_lr_decay, wait_all=s.mifa_wait_all, storage=s.mifa_storage)

    def init_state(self, n_clients: int, w0: torch.Tensor) -> State:
        state = {"latest": self.table("latest", n_clients, w0.numel())}
        if self.wait_all:
            state["seen"] = torch.zeros(n_clients, dtype=torch.bool)
        if self.storage == "lr-normalised":
            state["lr"] = torch.zeros(1, dtype=torch.float64)  # the last η_t applied (0: none yet)
        return state

    def stored(self, u: ClientUpdate) -> torch.Tensor:
        """G_i for an upload: the raw update in the chosen units, divided by its lr with "lr-normalised"."""
        g = raw_update(u, self.units)
        return g / u.lr if self.storage == "lr-normalised" else g

    def weight(self, n: int) -> float:
        """Per-client weight: code round(1/N, 4) (mimic.md §3) while it stays within 1% of the paper's 1/N."""
        if not self.round_weights:
            return 1 / n  # paper: v_t = (1/N) Σ G_i
        rounded = round(1 / n, 4)  # released code: round(1/N, 4)
        if abs(n * rounded - 1) <= ROUND_WEIGHTS_REL_TOL:
            return rounded
        if not self._warned:
            self._warned = True
            log.warning("mifa: the released code's weight round(1/N, 4) = %g is %.1f%% off 1/N = %.6g for N = %d "
                        "(tolerance %g%%); using the exact 1/N", rounded, 100 * abs(n * rounded - 1), 1 / n, n,
                        100 * ROUND_WEIGHTS_REL_TOL)
        return 1 / n

    def absorb(self, state: State, t: int, u: ClientUpdate) -> None:
        state["latest"][u.client] = self.stored(u)  # G_i ← ĝ_i(w_t), as `aggregate` would write it

    def aggregate(self, state: State, t: int, w: torch.Tensor,
                  updates: dict[int, ClientUpdate]) -> tuple[torch.Tensor, State]:
        latest = state["latest"]
        for i, u in updates.items():
            if u.delta is not None:  # None: already written by `absorb`
                latest[i] = self.stored(u)  # MIFA: G_i ← ĝ_i(w_t) for i ∈ S_t, kept otherwise
        if self.wait_all:
            seen = state["seen"]
            seen[list(updates)] = True
            if not bool(seen.all()):
                return w, state  # MIFA code: no update until every device has taken part once
        v = row_sum(latest) * self.weight(latest.shape[0])  # MIFA: v_t = (1/N) Σ_{i=1}^N G_i (blocks of rows)
        if self.storage == "lr-normalised":
            step = server_lr(state, t, updates, self.lr_at)  # the current round's lr on the lr-normalised mean
        else:
            step = global_step(self.units, t, 1.0, self.global_lr, self.global_lr_decay)
        return w - step * v, state  # w_{t+1} = w_t − η_t v_t
