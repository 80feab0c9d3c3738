"""Markov on/off availability: each client's presence is a two-state Markov chain.

The two-state (Gilbert-Elliott) on/off chain is the usual model of intermittent device availability with memory:
an absent client tends to stay absent for a while, unlike the independent draws of `static`. See e.g. X. Gu,
K. Huang, J. Zhang, L. Huang, "Fast Federated Learning in the Presence of Arbitrary Device Unavailability",
NeurIPS 2021 (MIFA), whose analysis covers such correlated, non-stationary unavailability.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import dropfl
import numpy as np

from dropfl_examples._common import check_fraction, options_or_defaults

STREAM = 0x3A4C   # the chain's own random stream, apart from the base class's rng(t) (used for min_active)


class MarkovOnOff(dropfl.Availability):
    """Client i is on (available) or off in each round; between rounds t − 1 and t it switches

        on → off with probability p_drop,   off → on with probability p_return,

    independently across clients. Round 0's states are drawn from the chain's stationary distribution,
    P(on) = p_return / (p_drop + p_return), so the fraction of clients on is stationary from the start; the mean
    length of an absence is 1 / p_return rounds, of a presence 1 / p_drop.

    Reproducible and order-free, as an availability source must be (`dropfl.AvailabilitySource`): round t's
    draws come from a generator keyed by (seed, t), and the states are computed forward from round 0 once and
    kept, so round(t) gives the same answer asked in any order (resume, replay). `first_round_all` (the run's
    --first-round-all) makes round 0 everyone while the chain runs on underneath; `min_active` is the base
    class's (fewer on than that: that many drawn uniformly instead, for that round only). An absent client's
    reason is `model_draw`, the reason of every synthetic availability model.

    Options: `p_drop` ∈ [0, 1] (default 0.2), `p_return` ∈ [0, 1] (default 0.5), not both 0.
    """

    name = "markov"
    reason = "model_draw"

    @dataclass
    class Options:
        p_drop: float = field(default=0.2, metadata={"help": "P(on → off) between two rounds, in [0, 1]"})
        p_return: float = field(default=0.5, metadata={"help": "P(off → on) between two rounds, in [0, 1]"})

        def __post_init__(self):
            check_fraction("p_drop", self.p_drop)
            check_fraction("p_return", self.p_return)
            if self.p_drop + self.p_return == 0:
                raise ValueError("p_drop and p_return cannot both be 0 (the chain would have no stationary state)")

    def __init__(self, n_clients: int, seed: int = 0, first_round_all: bool = True, min_active: int = 0,
                 options: MarkovOnOff.Options | None = None):
        super().__init__(n_clients, seed, first_round_all=first_round_all, min_active=min_active)
        self.options = options_or_defaults(type(self), options)
        self._states: list[np.ndarray] = []   # the chain's state of rounds 0, 1, ... computed so far

    def chain_rng(self, t: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, t, STREAM])

    def state(self, t: int) -> np.ndarray:
        """The chain's on/off states in round t, bool [N] (before first_round_all and min_active)."""
        o = self.options
        while len(self._states) <= t:
            s = len(self._states)
            u = self.chain_rng(s).random(self.n)
            if s == 0:
                on = u < o.p_return / (o.p_drop + o.p_return)                      # stationary P(on)
            else:
                prev = self._states[-1]
                on = np.where(prev, u >= o.p_drop, u < o.p_return)               # stay on / come back
            self._states.append(on)
        return self._states[t].copy()

    def _draw(self, t: int, rng: np.random.Generator) -> np.ndarray:
        return self.state(t)
