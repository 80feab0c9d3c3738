"""The strategy interface. Strategies are pure tensor math: no sockets, files or clocks.

A strategy sees, per round: the availability answer (to `select` participants), each selected
client's training task (to `configure` it, e.g. FedProx's μ or SCAFFOLD's correction), and the
updates that arrived in time (to `aggregate`). Everything it remembers between rounds lives in
`state`, a flat dict of tensors that the round loop checkpoints.

Updates are in delta units: `delta = w_global − w_local`, and the server applies `w ← w − step`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from coordinator.statestore import StateStore, Table
from edge_client.report import ClientReport
from edge_client.trainer import TrainTask

State = dict[str, torch.Tensor]


@dataclass
class ClientUpdate:
    client: int
    delta: torch.Tensor | None     # w_t − w_local, flat float32; None once absorbed (Strategy.absorb)
    num_samples: int
    steps: int                     # SGD steps taken (K)
    lr: float                      # local learning rate used this round
    loss: float = float("nan")     # mean local training loss
    mask: torch.Tensor | None = None  # FedDD: bool mask of uploaded coordinates (None = all)
    report: ClientReport | None = None  # measured compute time, link rates, bytes (FedDD, FedCS)
    buffers: dict[str, torch.Tensor] | None = None  # the model's buffers after training (coordinator/buffers.py)


class Strategy:
    """Base class. Subclasses set `name`, override what they need, and document their paper."""

    name = "base"
    uploads_per_round = 1  # vectors uploaded per participant per round (SCAFFOLD: 2)
    sets_dropout_rate = False  # its tasks carry a dropout_rate (FedDD): the simulation trains them on the loop
    tables: tuple[str, ...] = ()  # state entries that are per-client [N, M] tables, kept in `store`
    store = StateStore("memory")  # where those tables live (--state-store; runsetup.setup_run sets the run's)
    absorbs = False  # `absorb` takes each update into `state` as it arrives (the loop then drops its delta)

    def table(self, key: str, n_clients: int, m: int) -> Table:
        """A per-client table of zeros [n_clients, m] float32 in the run's store (RAM or a file of the run
        directory, coordinator/statestore.py); it answers t[i], t[i] = row, t[idx], t[idx] = rows like a tensor."""
        return self.store.zeros(f"{self.name}.{key}", n_clients, m)

    def adopt_state(self, state: State) -> State:
        """A checkpoint's state with its tables moved into this run's store (a snapshot copied back into the
        run directory, or a tensor written to disk, or a disk table read into RAM)."""
        return {k: self.store.adopt(f"{self.name}.{k}", v) if k in self.tables else v for k, v in state.items()}

    def init_state(self, n_clients: int, w0: torch.Tensor) -> State:
        return {}

    def select(self, state: State, t: int, available: np.ndarray, rng: np.random.Generator) -> list[int]:
        """Participants of round t among the available clients (default: all of them)."""
        return [int(i) for i in np.flatnonzero(available)]

    def configure(self, state: State, t: int, task: TrainTask) -> TrainTask:
        """Adjust one client's training task (default: unchanged)."""
        return task

    def absorb(self, state: State, t: int, u: ClientUpdate) -> None:
        """Take update `u` into `state` as it arrives, before `aggregate` (only where `absorbs`). The round loop
        then sets u.delta = None, so that a round of many uploads (round 0 with --first-round-all: all N) is not
        held in memory at once; `aggregate` gets the absorbed updates with delta None. Only for rules where
        this gives the bits of taking the delta in `aggregate` (MIFA: an update just replaces its client's
        row), not for sums over the round's updates, whose float rounding depends on the order."""
        raise NotImplementedError  # only strategies with absorbs = True are asked

    def aggregate(self, state: State, t: int, w: torch.Tensor,
                  updates: dict[int, ClientUpdate]) -> tuple[torch.Tensor, State]:
        raise NotImplementedError  # abstract: every strategy implements its own rule


def mean_delta(updates: dict[int, ClientUpdate], weighting: str = "uniform") -> torch.Tensor:
    """(1/|S|) Σ_i delta_i (uniform, as in the papers) or Σ_i n_i delta_i / Σ n_i ("samples")."""
    ups = list(updates.values())
    if weighting == "samples":
        total = sum(u.num_samples for u in ups)
        return sum(u.delta * (u.num_samples / total) for u in ups)
    return torch.stack([u.delta for u in ups]).mean(0)
