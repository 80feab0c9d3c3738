"""Field mode: `FieldHub`, the coordinator's MQTT side, composed of three parts under one lock.

    Connection  (connection.py)  the MQTT client: connect, TLS, last will, reconnect, publish
    Registry    (registry.py)    the agents: status, heartbeats, data binding, liveness
    Collection  (collection.py)  the open round: update reassembly, stats, declines, evals, rejects
    Absence     (absence.py)     nobody there to take part: wait, then give up (EmptyFederation)

The hub holds what they share (`cfg`, `n`, `binding`, `num_params`, `limits`) and the lock `cond`:
paho's network thread writes under it, the loop's thread (MqttTransport, FieldAvailability) reads and
waits on it. `wake`, a second condition on the same lock, is the open round's: `MqttTransport.run_round`
waits on it, and it is notified only by what may change the round-closing rule's decision
(coordinator/field/closing.py): a change of a selected client's state that `RoundState.note` says matters,
a rejoin, the beginning and the end of a broker outage; never by every message.
`_dispatch` routes a device's message to the part that owns it and notes that the device is
alive (`AgentInfo.last_seen`: every message counts, docs/field-mode.md "Liveness").
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from coordinator.field.absence import Absence
from coordinator.field.collection import Collection
from coordinator.field.connection import Connection, FieldConfig
from coordinator.field.registry import Registry
from edge_client import federation, wire


class FieldHub(Connection, Registry, Collection, Absence):
    """The coordinator's MQTT side: connection, agent registry, round collection. Thread-safe: paho's
    network thread writes under `cond`, the loop's thread reads and waits on it."""

    def __init__(self, cfg: FieldConfig, n_clients: int, binding: federation.DataBinding, num_params: int,
                 rundir_path: Path):
        self.cfg, self.n, self.binding, self.num_params = cfg, n_clients, binding, num_params
        self.limits = wire.Limits(chunk_bytes=cfg.chunk_bytes, max_tensor_bytes=cfg.max_tensor_bytes)
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        self.wake = threading.Condition(lock)  # the open round's (above)
        self._init_collection(rundir_path)
        self._init_registry()
        self._init_absence()
        self._init_connection()  # last: its callbacks may use all of the above

    def _dispatch(self, device: str, sub: str, payload: bytes, retained: bool) -> None:
        """One message from `dropfl/device/DEVICE/SUB` (paho's network thread, under `cond`)."""
        now = time.monotonic()
        if sub in ("status", "heartbeat"):
            self._on_agent_message(device, sub, payload, retained, now)
        else:
            self._on_round_message(device, sub, payload, now)
        a = self.agents.get(device)
        if a is not None and not retained:  # liveness: anything from the device is life (a chunk too)
            a.last_seen = now

    # --- a broker outage suspends the open round and its end may undo drops (outage.py): the round loop looks ---
    def _outage_began(self, since: float | None = None) -> None:
        super()._outage_began(since)
        self._wake()

    def _outage_ended(self) -> None:
        super()._outage_ended()
        r = self.round
        if r is not None and not r.closed:  # the agents it awaits are not gone (their last wills count for nothing)
            r.gone -= {a.client for d in self.expected_back if (a := self.agents.get(d)) is not None}
            r.recount()
        self._wake()
