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

from edge_client.report import ClientReport
from edge_client.trainer import TrainTask

State = dict[str, torch.Tensor]


@dataclass
class ClientUpdate:
    client: int
    delta: torch.Tensor            # w_t − w_local, flat float32
    num_samples: int
    steps: int                     # SGD steps taken (K)
    lr: float                      # local learning rate used this round
    loss: float = float("nan")     # mean local training loss
    mask: torch.Tensor | None = None  # FedDD: bool mask of uploaded coordinates (None = all)
    report: ClientReport | None = None  # measured compute time, link rates, bytes (FedDD, FedCS)


class Strategy:
    """Base class. Subclasses set `name`, override what they need, and document their paper."""

    name = "base"
    uploads_per_round = 1  # vectors uploaded per participant per round (SCAFFOLD: 2)
    sets_dropout_rate = False  # its tasks carry a dropout_rate (FedDD): the simulation trains them on the loop

    def init_state(self, n_clients: int, w0: torch.Tensor) -> State:
        return {}

    def select(self, state: State, t: int, available: np.ndarray, rng: np.random.Generator) -> list[int]:
        """Participants of round t among the available clients (default: all of them)."""
        return [int(i) for i in np.flatnonzero(available)]

    def configure(self, state: State, t: int, task: TrainTask) -> TrainTask:
        """Adjust one client's training task (default: unchanged)."""
        return task

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
