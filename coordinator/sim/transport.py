"""The in-process transport: virtual clients trained in this process (reference loop or batched engine)."""

from __future__ import annotations

import torch

from coordinator.sim.clock import Profile, SimClients
from coordinator.strategies import ClientUpdate
from edge_client.trainer import TrainTask, local_train


class SimTransport:
    """In-process virtual clients. `engine="loop"` is the reference: one client after another with
    the same `local_train` the edge agent runs. Every selected client's update arrives."""

    def __init__(self, model: torch.nn.Module, client_data: list[tuple[torch.Tensor, torch.Tensor]],
                 engine: str = "loop", profile: Profile | None = None, num_classes: int | None = None):
        self.model, self.client_data, self.engine = model, client_data, engine
        self.clients = SimClients(model, profile, num_classes)  # FedDD masks and the virtual clock
        self.stats: dict[str, float] = {}
        self.batched = None
        if engine == "batched":  # coordinator/sim/batched.py: a round's clients as one computation
            from coordinator.sim.batched import BatchedEngine
            self.batched = BatchedEngine(model, client_data)

    def run_round(self, t: int, w: torch.Tensor, tasks: list[TrainTask]):
        updates, done = {}, {}
        if self.batched is not None and self.clients.profile is None:  # FedDD tasks stay on the loop
            plain = [task for task in tasks if task.dropout_rate is None]
            done = {task.client: r for task, r in zip(plain, self.batched.run(w, plain))}
        for task in tasks:
            x, y = self.client_data[task.client]
            if task.dropout_rate is not None or self.clients.profile is not None:
                updates[task.client] = self.clients.run(w, x, y, task)  # coordinator/sim/clock.py
                continue
            r = done[task.client] if task.client in done else local_train(self.model, w, x, y, task)
            updates[task.client] = ClientUpdate(task.client, r.delta, r.num_samples, r.steps, task.lr, r.loss)
        self.stats = self.clients.round_stats(updates)
        return updates, {}

    def state_dict(self) -> dict:
        """Per-client state the simulated devices keep between rounds (FedDD memory), for checkpoints."""
        return {"clients": self.clients.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.clients.load_state_dict(state.get("clients", {}))

    def round_stats(self) -> dict[str, float]:
        """This round's bytes and, with a profile, virtual round time (eq. 12), for the metrics."""
        return self.stats
