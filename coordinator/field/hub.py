"""Field mode: `FieldHub`, the coordinator's MQTT side, composed of five components under one lock.

    component                   owns                                          handles
    connection  (connection.py) the paho client, broker list, reconnects,     every MQTT callback; publishing
                                `connects`, the probe
    outage      (outage.py)     the broker's health: last contact, bytes      contact, probe echoes, silence,
                                owed, outages and their time                  disconnects: an outage begins/ends
    registry    (registry.py)   the agents: status, heartbeats, binding,      device/+/status, device/+/heartbeat;
                                liveness, who is awaited after an outage      liveness and availability queries
    collection  (collection.py) the open round: reassembly, progress, stats,  device/+/update/... (delta, stats,
                                declines, evals, rejects; field.jsonl         decline, eval)
    absence     (absence.py)    the empty-federation waits and their time     nobody there: wait, then give up
                                                                              (EmptyFederation)

Each owns its state and gets what it needs of the others explicitly, at construction: the registry tells the
round collection of an agent's arrival, loss or return (registry.py `RoundHooks`) and reads the broker's last
contact (`BrokerHealth`); absence reads the registry and the outages (absence.py `Agents`, `Broker`); the
connection reports to the outage component and hands a device's message to `_dispatch`. The decision rules are
pure functions or live in one component: when a round closes, closing.py; whether an agent is online, the
registry; whether the broker is out, the outage component; whether the federation is empty, absence.

The hub routes: `_dispatch` (a device's message, by topic), `_outage_began` and `_outage_ended` (an outage's
consequences for the registry and the open round). The lock `cond` is shared: paho's network thread writes under
it, the loop's thread (MqttTransport, FieldAvailability) reads and waits on it. `wake`, a second condition on the
same lock, is the open round's: `MqttTransport.run_round` waits on it, and it is notified only by what may change
the round-closing rule's decision (coordinator/field/closing.py): a change of a selected client's state that
`RoundState.note` says matters, a rejoin, the beginning and the end of a broker outage; never by every message.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from coordinator.field.absence import Absence
from coordinator.field.collection import Collection
from coordinator.field.connection import Connection, FieldConfig
from coordinator.field.outage import Outage
from coordinator.field.registry import Registry
from edge_client import federation, wire

log = logging.getLogger("dropfl.coordinator")


class FieldHub:
    """The coordinator's MQTT side: its components (the module's docstring) and the routing between them.
    Thread-safe: paho's network thread writes under `cond`, the loop's thread reads and waits on it."""

    def __init__(self, cfg: FieldConfig, n_clients: int, binding: federation.DataBinding, num_params: int,
                 rundir_path: Path):
        self.cfg, self.n, self.binding, self.num_params = cfg, n_clients, binding, num_params
        self.limits = wire.Limits(chunk_bytes=cfg.chunk_bytes, max_tensor_bytes=cfg.max_tensor_bytes)
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        self.wake = threading.Condition(lock)  # the open round's (above)
        self.collection = Collection(cfg, num_params, self.limits, self.wake, rundir_path)
        self.outage = Outage(cfg, self.cond, on_began=self._outage_began, on_ended=self._outage_ended)
        self.registry = Registry(cfg, n_clients, binding, self.limits, self.cond, rounds=self.collection,
                                 broker=self.outage)
        self.absence = Absence(cfg, self.cond, n_clients, agents=self.registry, broker=self.outage)
        self.connection = Connection(cfg, n_clients, self.cond, self.outage, deliver=self._dispatch,
                                     reject=self.collection.reject, fan_out=lambda: len(self.registry.agents))

    def start(self) -> None:
        self.connection.start()

    def stop(self, finished: bool) -> None:
        self.connection.stop(finished)

    # --- routing (paho's network thread, under cond) ---
    def _dispatch(self, device: str, sub: str, payload: bytes, retained: bool) -> None:
        """One message from `dropfl/device/DEVICE/SUB`: `status` and `heartbeat` to the registry, `update/...` to
        the round collection; anything from the device (a chunk too) is life (`Registry.seen`, docs/field-mode.md
        "Liveness"), a retained message is not."""
        now = time.monotonic()
        if sub in ("status", "heartbeat"):
            self.registry.on_message(device, sub, payload, retained, now)
        else:
            self.collection.on_message(self.registry.agent(device), device, sub, payload, now)
        if not retained:
            self.registry.seen(device, now)

    def _outage_began(self, now: float) -> None:
        """The broker went away (outage.py): the registry notes who was alive; the round loop looks."""
        self.registry.outage_began(now)
        self._wake()

    def _outage_ended(self, now: float, lasted_s: float) -> None:
        """The broker is back: those alive when it went away are awaited (registry), and the open round does not
        count them as gone (collection); the round loop looks."""
        back = self.registry.outage_ended(now)
        self.collection.back_after_outage({a.client for d in back if (a := self.registry.agent(d)) is not None})
        log.info("the broker is back after %.1f s; awaiting %d agents for up to %.0f s", lasted_s, len(back),
                 self.registry.back_by - now)
        self._wake()

    def _wake(self) -> None:
        with self.wake:
            self.wake.notify_all()
