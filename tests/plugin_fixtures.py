"""Plugins with their own options (an `Options` dataclass, docs/extending.md "Plugin options"), good and bad, as
source text: `write_plugins(directory)` writes them as modules, for a test to put the directory on sys.path (as
PYTHONPATH would) and name them as module:attr. Nothing here registers into dropfl's registries."""

from __future__ import annotations

import textwrap
from pathlib import Path

MOD = "dropfl_opt_plugin"          # the plugins, good and bad
BROKEN = "dropfl_opt_broken"       # a module whose import fails (a missing dependency)
SYNTAX = "dropfl_opt_syntax"       # a module that does not compile

PLUGINS = '''
"""A user's plugins with options: FedAvgM (server momentum), a Markov on/off availability model (a class and a
factory), and plugins whose options or signature are wrong."""
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from coordinator.strategies.base import mean_delta
from dropfl import Availability, RoundAvailability, Strategy

BUILT = []   # (plugin, its Options instance), as each is built


class FedAvgM(Strategy):
    """FedAvg with server momentum (Hsu et al. 2019): v = momentum v + mean delta, w = w - v."""
    name = "fedavgm"

    @dataclass
    class Options:
        momentum: float = field(default=0.9, metadata={"help": "server momentum beta in [0, 1)"})
        nesterov: bool = False
        schedule: Literal["constant", "halving"] = "constant"
        clip: float | None = None
        label: str = "m"

        def __post_init__(self):
            if not 0 <= self.momentum < 1:
                raise ValueError(f"momentum must be in [0, 1) (got {self.momentum})")

    def __init__(self, *, options):
        self.options = options
        BUILT.append(("FedAvgM", options))

    def init_state(self, n_clients, w0):
        return {"v": torch.zeros_like(w0)}

    def aggregate(self, state, t, w, updates):
        if not updates:
            return w, state
        v = self.options.momentum * state["v"] + mean_delta(updates, "uniform")
        return w - v, {**state, "v": v}


@dataclass
class MarkovOptions:
    p_off: float = field(default=0.3, metadata={"help": "P(on -> off) per round"})
    p_on: float = 0.5

    def __post_init__(self):
        if not (0 < self.p_off <= 1 and 0 < self.p_on <= 1):
            raise ValueError("p_off and p_on must be in (0, 1]")


def _chain(n, seed, t, o):
    rng = np.random.default_rng([seed, 7])
    on = np.ones(n, bool)
    for _ in range(t):
        u = rng.random(n)
        on = np.where(on, u >= o.p_off, u < o.p_on)
    return on


class Markov(Availability):
    """Each client flips on -> off with probability p_off and off -> on with p_on per round."""
    Options = MarkovOptions

    def __init__(self, n_clients, seed=0, *, first_round_all=True, min_active=0, options):
        super().__init__(n_clients, seed, first_round_all, min_active)
        self.options = options
        BUILT.append(("Markov", options))

    def _draw(self, t, rng):
        return _chain(self.n, self.seed, t, self.options)


class _Source:
    def __init__(self, n, seed, options):
        self.n, self.seed, self.options = n, seed, options

    def round(self, t):
        on = _chain(self.n, self.seed, t, self.options) if t else np.ones(self.n, bool)
        return RoundAvailability(on, {int(i): "model_draw" for i in np.flatnonzero(~on)})


def markov_factory(cfg, *, options):
    BUILT.append(("markov_factory", options))
    return _Source(cfg.data.clients, cfg.run.seed, options)


markov_factory.Options = MarkovOptions


class Plain(Strategy):
    """No Options: built as Plain(weighting=...)."""
    def __init__(self, *, weighting="uniform"):
        self.weighting = weighting

    def aggregate(self, state, t, w, updates):
        return (w - mean_delta(updates, self.weighting), state) if updates else (w, state)


class NotADataclass(FedAvgM):
    class Options:
        momentum = 0.9


class ListOption(FedAvgM):
    @dataclass
    class Options:
        layers: list[int] = field(default_factory=list)


class Required(FedAvgM):
    @dataclass
    class Options:
        momentum: float


class NoOptionsParameter(Strategy):
    Options = FedAvgM.Options

    def __init__(self, *, weighting="uniform"):
        self.weighting = weighting


class NoWeighting(Strategy):
    def __init__(self, beta):
        self.beta = beta


class MarkovNoOptionsParameter(Availability):
    Options = MarkovOptions

    def __init__(self, n_clients, seed=0):
        super().__init__(n_clients, seed)
'''


def write_plugins(directory: Path) -> Path:
    """The plugin modules MOD, BROKEN and SYNTAX in `directory`; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{MOD}.py").write_text(textwrap.dedent(PLUGINS))
    (directory / f"{BROKEN}.py").write_text("import no_such_dependency_xyz  # noqa\n")
    (directory / f"{SYNTAX}.py").write_text("def broken(:\n")
    return directory
