"""Availability: who can take part in round t, and for each absent client, why.

Every model answers `round(t) -> RoundAvailability` and draws its randomness from a generator keyed
by (seed, t), so every algorithm in a trial sees the same participation and a round can be asked for
in any order (resume, replay). Reasons use a small vocabulary (see REASONS; docs/traces.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from coordinator.errors import UserError
from edge_client.registry import Registry

REASONS = ("model_draw", "battery", "charging", "offline", "slow_link", "deadline", "declined",
           "rejected", "not_selected", "trace", "thermal")


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
    digits 0..D−1 under the one-label partition) are available iff t mod 2E < E, the rest otherwise.
    E is the half-period (`half_period`, --half-period): each group is available E rounds, then away E rounds.
    `period` is its former name, still accepted."""

    name = "diurnal"
    reason = "offline"

    def __init__(self, n_clients, seed=0, half_period: int = 100, groups_d: int = 1, *, period: int | None = None,
                 **kw):
        kw.setdefault("first_round_all", False)
        super().__init__(n_clients, seed, **kw)
        half_period = half_period if period is None else period
        if half_period < 1:
            raise UserError(f"--half-period must be >= 1 (got {half_period})")
        if not (0 <= groups_d <= 10):
            raise UserError(f"--diurnal-d must be in 0..10 (got {groups_d})")
        self.half_period = half_period
        self.group0 = np.arange(n_clients) < n_clients // 10 * groups_d

    def _draw(self, t, rng):
        return self.group0 == ((t % (2 * self.half_period)) < self.half_period)


class ClusterDropout(Availability):
    """FL-FDMS code generator: exactly int((1 − α)·N) active clients; per cluster (consecutive blocks)
    a count in {1..size} drawn uniformly, rejecting until the counts sum to that total; the active
    clients within each cluster drawn uniformly. Every cluster keeps ≥ 1 active client.

    Bounded: settings that cannot be met (fewer active clients than clusters) raise a `UserError` at
    construction. The acceptance probability of one draw, p = #{counts ∈ {1..size}^C : Σ = total} / size^C,
    is computed exactly up front. While p ≥ REJECT_MIN_P the released code's rejection loop runs (so the
    results are bit-identical to it), at most `max_tries` draws (P(all rejected) ≈ 2·10⁻⁹ at worst); after
    that, or at once where p < REJECT_MIN_P (e.g. α = 0, where every count must be `size`: p = size^−C),
    the counts are drawn directly from the same distribution (uniform over the admissible count vectors,
    one cluster after the other with the exact number of completions as weights)."""

    name = "cluster-dropout"
    REJECT_MIN_P = 1e-4         # rejection while one draw in ≤ 10 000 is accepted on average
    REJECT_MAX_TRIES = 200_000  # (1 − 1e-4)^200 000 ≈ 2·10⁻⁹: the direct draw is then all but never needed

    def __init__(self, n_clients, seed=0, alpha: float = 0.5, n_clusters: int = 5, **kw):
        super().__init__(n_clients, seed, **kw)
        if not (0 <= alpha < 1):
            raise UserError(f"--alpha must be in [0, 1) (got {alpha})")
        if n_clusters < 1 or n_clients < n_clusters or n_clients % n_clusters:
            raise UserError(f"--clients {n_clients} is not a multiple of {n_clusters} clusters")
        self.size = n_clients // n_clusters
        self.n_clusters = n_clusters
        self.n_active = int((1 - alpha) * n_clients)
        if not (n_clusters <= self.n_active <= n_clients):
            raise UserError(f"--alpha {alpha} with {n_clusters} clusters of {self.size} clients: "
                            f"int((1 − α)·N) = {self.n_active} active clients cannot keep one in each cluster; "
                            f"need at least {n_clusters}, i.e. (1 − α)·{n_clients} ≥ {n_clusters} "
                            f"(lower --alpha or use more --clients)")
        self.accept_p = float(Fraction(_n_compositions(self.n_active, n_clusters, self.size),
                                       self.size ** n_clusters))
        self.max_tries = self.REJECT_MAX_TRIES if self.accept_p >= self.REJECT_MIN_P else 0
        self._log_ways: np.ndarray | None = None  # built on the first direct draw

    def _draw(self, t, rng):
        for _ in range(self.max_tries):  # the released code's rejection sampling, bounded
            counts = rng.integers(1, self.size + 1, self.n_clusters)
            if counts.sum() == self.n_active:
                break
        else:
            counts = self._direct_counts(rng)
        out = np.zeros(self.n, bool)
        for c, k in enumerate(counts):
            out[c * self.size + rng.choice(self.size, k, replace=False)] = True
        return out

    def _direct_counts(self, rng: np.random.Generator) -> np.ndarray:
        """Counts uniform over {k ∈ {1..size}^C : Σk = total}, the distribution the rejection loop samples."""
        if self._log_ways is None:
            # log_ways[r, s]: log #ways for r clusters to hold s active clients (each 1..size)
            lw = np.full((self.n_clusters + 1, self.n_active + 1), -np.inf)
            lw[0, 0] = 0.0
            for r in range(1, self.n_clusters + 1):
                for k in range(1, min(self.size, self.n_active) + 1):
                    lw[r, k:] = np.logaddexp(lw[r, k:], lw[r - 1, :-k])
            self._log_ways = lw
        counts, left = np.empty(self.n_clusters, np.int64), self.n_active
        ks = np.arange(1, self.size + 1)
        for c in range(self.n_clusters):
            rest = self.n_clusters - c - 1
            lw = np.where(ks <= left, self._log_ways[rest, np.maximum(left - ks, 0)], -np.inf)
            prob = np.exp(lw - lw.max())
            counts[c] = ks[int(np.searchsorted(np.cumsum(prob), rng.random() * prob.sum(), side="right"))]
            left -= counts[c]
        return counts


def _n_compositions(total: int, parts: int, size: int) -> int:
    """#{k ∈ {1..size}^parts : Σk = total}, by inclusion-exclusion over the parts that exceed size."""
    m, out = total - parts, 0  # extras y_i = k_i − 1 ∈ [0, size − 1], Σy = m
    for j in range(parts + 1):
        if m - j * size < 0:
            break
        out += (-1) ** j * math.comb(parts, j) * math.comb(m - j * size + parts - 1, parts - 1)
    return out


def _is_availability(obj) -> str | None:
    return None if callable(obj) else ("an Availability subclass, or a callable (SimConfig) -> an availability "
                                       "source (with round(t) -> RoundAvailability)")


# The availability models by --availability name (edge_client/registry.py). An entry is an `Availability` subclass,
# built as cls(clients, seed, first_round_all=, min_active=), or a callable taking the run's SimConfig and returning
# anything with `round(t) -> RoundAvailability`; a plugin (entry point group dropfl.availability, or module:attr) is
# the same, with options=Options(...) added where it declares an Options dataclass (`build`). `replay` and
# `device-trace` register in coordinator/runsetup.py.
AVAILABILITY = Registry("availability model", "dropfl.availability", check=_is_availability,
                        builtins=("coordinator.runsetup",))


def _common(cfg) -> dict:
    return {"first_round_all": cfg.availability.first_round_all, "min_active": cfg.availability.min_active}


def build(obj, cfg, options=None):
    """The availability source of the registry entry `obj` for the run `cfg` (a SimConfig). `options`: the
    instance of the Options dataclass `obj` declares (docs/extending.md), passed as the keyword `options`."""
    extra = {} if options is None else {"options": options}
    if isinstance(obj, type) and issubclass(obj, Availability):
        return obj(cfg.data.clients, cfg.run.seed, **_common(cfg), **extra)
    return obj(cfg, **extra)


AVAILABILITY.register("always", AlwaysOn)


@AVAILABILITY.register("bounded")
def bounded(cfg):
    a = cfg.availability
    return Bounded(cfg.data.clients, cfg.run.seed, tau_max=a.tau_max, tau_dist=a.tau_dist, **_common(cfg))


@AVAILABILITY.register("static")
def static(cfg):
    a = cfg.availability
    return Static(cfg.data.clients, cfg.run.seed, p=a.p, levels=a.p_levels, **_common(cfg))


@AVAILABILITY.register("timevarying")
def timevarying(cfg):
    return TimeVarying(cfg.data.clients, cfg.run.seed, fraction=cfg.availability.fraction, **_common(cfg))


@AVAILABILITY.register("diurnal")
def diurnal(cfg):
    a = cfg.availability
    return Diurnal(cfg.data.clients, cfg.run.seed, half_period=a.half_period, groups_d=a.diurnal_d, **_common(cfg))


@AVAILABILITY.register("cluster-dropout")
def cluster_dropout(cfg):
    return ClusterDropout(cfg.data.clients, cfg.run.seed, alpha=cfg.availability.alpha, **_common(cfg))
