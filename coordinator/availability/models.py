"""Availability: who can take part in round t, and for each absent client, why.

Every model answers `round(t) -> RoundAvailability` and draws its randomness from a generator keyed
by (seed, t), so every algorithm in a trial sees the same participation and a round can be asked for
in any order (resume, replay). Reasons use a small vocabulary (see REASONS; docs/traces.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordinator.errors import UserError

REASONS = ("model_draw", "battery", "charging", "offline", "slow_link", "deadline", "declined",
           "rejected", "not_selected", "trace")


@dataclass
class RoundAvailability:
    available: np.ndarray                      # bool [N]
    reasons: dict[int, str] = field(default_factory=dict)  # client -> reason, for every absent client

    @property
    def active(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.available)]


class Availability:
    """Base class: subclasses implement `_draw(t, rng) -> bool array [N]` (or override `round`)."""

    name = "base"
    reason = "model_draw"

    def __init__(self, n_clients: int, seed: int = 0, first_round_all: bool = True, min_active: int = 0):
        self.n, self.seed = n_clients, seed
        self.first_round_all, self.min_active = first_round_all, min_active

    def rng(self, t: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, t, 0xA7A1])

    def round(self, t: int) -> RoundAvailability:
        if t == 0 and self.first_round_all:
            return RoundAvailability(np.ones(self.n, bool))
        rng = self.rng(t)
        avail = np.asarray(self._draw(t, rng), bool).copy()
        short = self.min_active - int(avail.sum())
        if short > 0:  # MimiC code: "if fewer than 2 clients are active, choose 2 uniformly"
            avail[:] = False
            avail[rng.choice(self.n, size=min(self.min_active, self.n), replace=False)] = True
        return RoundAvailability(avail, {int(i): self.reason for i in np.flatnonzero(~avail)})

    def _draw(self, t: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError  # abstract; every registered model overrides it


class AlwaysOn(Availability):
    name = "always"

    def _draw(self, t, rng):
        return np.ones(self.n, bool)


class Bounded(Availability):
    """MimiC scenario 1, bounded consecutive dropout: client i is active at round t ≥ 1 iff
    τ_i ∈ {0, 1} or t mod τ_i == 0 (round-robin, synchronised phases as in the released code).

    `tau_dist="uniform"` (paper): τ_i ~ UniformInt{0..τmax}. `tau_dist="halfnormal"` (released code):
    τ_i = min(round(|N(0, 3²)|), τmax). τ_i are drawn once per run from the seed."""

    name = "bounded"

    def __init__(self, n_clients, seed=0, tau_max: int = 20, tau_dist: str = "uniform", **kw):
        super().__init__(n_clients, seed, **kw)
        if tau_max < 0:
            raise UserError(f"--tau-max must be >= 0 (got {tau_max})")
        if tau_dist not in ("uniform", "halfnormal"):
            raise UserError(f"--tau-dist must be uniform or halfnormal (got {tau_dist!r})")
        rng = np.random.default_rng([seed, 0x7A0])
        if tau_dist == "uniform":
            self.tau = rng.integers(0, tau_max + 1, size=n_clients)
        else:
            self.tau = np.minimum(np.round(np.abs(rng.normal(0, 3, size=n_clients))), tau_max).astype(int)

    def _draw(self, t, rng):
        return (self.tau <= 1) | (t % np.maximum(self.tau, 1) == 0)


class Static(Availability):
    """MimiC scenario 2: each round client i is active iff U[0,1] ≤ p_i. `levels=1` (paper): p_i = p.
    `levels=5` (released code): p_i = p + (i mod 5)·(1 − p)/4."""

    name = "static"

    def __init__(self, n_clients, seed=0, p: float = 0.1, levels: int = 1, **kw):
        super().__init__(n_clients, seed, **kw)
        if not (0 < p <= 1):
            raise UserError(f"--p must be in (0, 1] (got {p})")
        if levels not in (1, 5):
            raise UserError(f"--p-levels must be 1 (paper) or 5 (released code) (got {levels})")
        i = np.arange(n_clients)
        self.p = np.full(n_clients, p) if levels == 1 else p + (i % 5) * (1 - p) / 4

    def _draw(self, t, rng):
        return rng.random(self.n) <= self.p


class TimeVarying(Availability):
    """MimiC scenario 3: each round weights a_i ~ U[1, 10]; P·N clients drawn without replacement
    with probabilities a / Σa."""

    name = "timevarying"

    def __init__(self, n_clients, seed=0, fraction: float = 0.3, **kw):
        super().__init__(n_clients, seed, **kw)
        if not (0 < fraction <= 1):
            raise UserError(f"--fraction must be in (0, 1] (got {fraction})")
        self.k = max(1, int(n_clients * fraction))

    def _draw(self, t, rng):
        a = rng.uniform(1, 10, self.n)
        out = np.zeros(self.n, bool)
        out[rng.choice(self.n, self.k, replace=False, p=a / a.sum())] = True
        return out


class Diurnal(Availability):
    """FedLaAvg's day/night pattern (code `diurnal_available`): the first N/10·D clients (those holding
    digits 0..D−1 under the one-label partition) are available iff t mod 2E < E, the rest otherwise."""

    name = "diurnal"
    reason = "offline"

    def __init__(self, n_clients, seed=0, period: int = 100, groups_d: int = 1, **kw):
        kw.setdefault("first_round_all", False)
        super().__init__(n_clients, seed, **kw)
        if period < 1:
            raise UserError(f"--period must be >= 1 (got {period})")
        if not (0 <= groups_d <= 10):
            raise UserError(f"--diurnal-d must be in 0..10 (got {groups_d})")
        self.period = period
        self.group0 = np.arange(n_clients) < n_clients // 10 * groups_d

    def _draw(self, t, rng):
        return self.group0 == ((t % (2 * self.period)) < self.period)


class ClusterDropout(Availability):
    """FL-FDMS code generator: exactly int((1 − α)·N) active clients; per cluster (consecutive blocks)
    a count in {1..size} drawn uniformly, rejecting until the counts sum to that total; the active
    clients within each cluster drawn uniformly. Every cluster keeps ≥ 1 active client."""

    name = "cluster-dropout"

    def __init__(self, n_clients, seed=0, alpha: float = 0.5, n_clusters: int = 5, **kw):
        super().__init__(n_clients, seed, **kw)
        if not (0 <= alpha < 1):
            raise UserError(f"--alpha must be in [0, 1) (got {alpha})")
        if n_clients % n_clusters:
            raise UserError(f"--clients {n_clients} is not a multiple of {n_clusters} clusters")
        self.size = n_clients // n_clusters
        self.n_clusters = n_clusters
        self.n_active = int((1 - alpha) * n_clients)
        if not (n_clusters <= self.n_active <= n_clients):
            raise UserError(f"--alpha {alpha}: {self.n_active} active clients cannot keep one per cluster")

    def _draw(self, t, rng):
        while True:
            counts = rng.integers(1, self.size + 1, self.n_clusters)
            if counts.sum() == self.n_active:
                break
        out = np.zeros(self.n, bool)
        for c, k in enumerate(counts):
            out[c * self.size + rng.choice(self.size, k, replace=False)] = True
        return out


MODELS = {cls.name: cls for cls in (AlwaysOn, Bounded, Static, TimeVarying, Diurnal, ClusterDropout)}
