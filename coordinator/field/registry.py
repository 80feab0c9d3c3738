"""Field mode: what the coordinator knows about its agents.

Owns `AgentInfo` and the registry (`agents` by device id, `by_client` by client index): an agent's
status (online/offline, its announce; sent on every connect and in answer to the coordinator's announce
request, retained only as an optimisation; a rejoin only when it names a connection other than the one held
online, its `session`), its heartbeats, and whether its data binding matches
the coordinator's (`edge_client.federation.diff`; an agent that differs is never selected). Liveness
queries (`is_online`, `client_status`, `online_count`, `wait_for_agents`, `device_of`) are asked by the
loop's thread under the hub's lock `cond`. `FieldAvailability` answers the loop's
`availability.round(t)` from them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from coordinator.availability.models import REASONS, RoundAvailability
from coordinator.field import checks as field_checks
from coordinator.field.connection import FieldConfig
from coordinator.field.outage import CONTACT_SLACK_S
from edge_client import federation, wire

if TYPE_CHECKING:
    from coordinator.field.hub import FieldHub

log = logging.getLogger("dropfl.coordinator")


@dataclass
class AgentInfo:
    device: str
    client: int
    online: bool = False
    last_heartbeat: float = -1.0      # coordinator's monotonic clock
    last_seen: float = -1.0           # the same, of anything that arrived from the device (liveness)
    heartbeat: dict = field(default_factory=dict)
    announce: dict = field(default_factory=dict)
    mismatch: str | None = None       # data binding differs from the coordinator's: never selected
    session: str | None = None        # the agent's process and connection its latest online status named


class Registry:
    """FieldHub's agent registry. Uses the hub's `cfg`, `n`, `binding`, `limits`, `cond`, and from
    coordinator/field/collection.py `_reject`, `write_log` and the round hooks `_agent_online`,
    `_agent_offline`, `heard_again`; sets `agents` and `by_client`. Messages arrive on paho's thread under `cond`."""

    cfg: FieldConfig
    n: int
    binding: federation.DataBinding
    limits: wire.Limits
    cond: threading.Condition

    def _init_registry(self) -> None:
        self.agents: dict[str, AgentInfo] = {}     # by device id
        self.by_client: dict[int, AgentInfo] = {}  # the same, by client index

    # --- messages (paho network thread, under cond) ---
    def _on_agent_message(self, device: str, sub: str, payload: bytes, retained: bool, now: float) -> None:
        """A device's `status` or `heartbeat`."""
        known = self.agents.get(device)
        try:  # a known device keeps the client index it announced first
            m = wire.decode([payload], self.limits, kinds=(sub,), max_nbytes=0,
                            client=None if known is None else known.client)
        except wire.WireError as e:
            self._reject(device, sub, e.code, e.reason)
            return
        problem = field_checks.status_device(m, device) if sub == "status" else None
        if problem:
            self._reject(device, sub, *problem)
            return
        if sub == "status":
            self._on_status(device, m, retained)
        elif device in self.agents:
            a = self.agents[device]
            a.last_heartbeat, a.heartbeat = now, m.meta
            if a.online and not a.mismatch:  # dropped `offline` in the open round, yet here: undo (collection.py)
                self.heard_again(a.client, "a heartbeat")

    def _on_status(self, device: str, m: wire.Message, retained: bool) -> None:
        meta, c = m.meta, m.header.client
        state = meta.get("state")
        a = self.agents.get(device)
        if a is None:
            if state != "online":
                return
            if not (0 <= c < self.n):
                self._reject(device, "status", wire.WRONG_CLIENT, f"client {c} outside 0..{self.n - 1}")
                return
            other = self.by_client.get(c)
            if other is not None:
                self._reject(device, "status", wire.WRONG_CLIENT, f"client {c} is already device {other.device}")
                return
            a = self.agents[device] = self.by_client[c] = AgentInfo(device, c)
        if state == "online":
            a.announce = meta
            a.mismatch = federation.refusal(self.binding, meta)
            if a.mismatch:
                log.warning("device %s will not be selected: %s", device, a.mismatch)
            # an agent's answer to our announce request (`reply`) while we hold it online is no rejoin:
            # nothing of the round was lost on its side, so nothing is re-sent (a (re)connect is one). Nor is
            # an online status of the connection we already hold online (`session`: one a broker re-delivered,
            # retained or backlogged), so a burst of old statuses re-sends nothing
            session = meta.get("session")
            repeat = a.online and session is not None and session == a.session
            if not (meta.get("reply") is True and a.online) and not repeat:
                self._agent_online(a.client)
            if session is not None:
                a.session = session
            a.online = True
            a.last_heartbeat = a.last_seen = time.monotonic()
        else:
            a.online = False
            self._agent_offline(a.client)
        self.write_log({"event": "agent", "device": device, "client": a.client, "state": state,
                        "retained": retained, "time": time.time()} | ({"refused": a.mismatch} if a.mismatch else {}))

    # --- queries (loop thread, under cond) ---
    def is_online(self, a: AgentInfo, now: float) -> bool:
        """Announced online, heard from within the heartbeat timeout (anything the device sent counts:
        a heartbeat, a status, a chunk of an upload; FieldHub._dispatch sets `last_seen`), and at least one
        heartbeat seen (it carries the agent's availability). An agent's silence counts only while the broker
        answers: up to CONTACT_SLACK_S past the broker's last delivery to us (`last_contact`, outage.py; the
        coordinator's own probe comes back every PROBE_EVERY_S), so a frozen broker's silence, noticed only
        after BROKER_SILENT_S, never makes its agents `offline` first."""
        last_contact = getattr(self, "last_contact", 0.0)
        ref = now if not last_contact else min(now, last_contact + CONTACT_SLACK_S)
        return a.online and bool(a.heartbeat) and \
            ref - max(a.last_seen, a.last_heartbeat) <= self.cfg.heartbeat_timeout_s

    def client_status(self, c: int, now: float) -> str | None:
        """None if client c may take part now, else the reason."""
        a = self.by_client.get(c)
        if a is not None and a.online and a.mismatch:
            return "rejected"   # refused at join (its announce): a setup problem, never `offline`, heartbeats or not
        if a is None or not self.is_online(a, now):
            return "offline"
        if a.heartbeat and not a.heartbeat.get("available", True):
            reason = a.heartbeat.get("reason")
            return reason if reason in REASONS else "declined"
        return None

    def online_count(self) -> int:
        now = time.monotonic()
        return sum(1 for a in self.agents.values() if self.is_online(a, now) and not a.mismatch)

    def wait_for_agents(self, n: int, timeout_s: float) -> int:
        """Wait until n agents are online (announced, heartbeating, same data binding); return how many are."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.online_count() < n and time.monotonic() < deadline:
                self.cond.wait(timeout=min(deadline - time.monotonic(), 1.0))
            return self.online_count()

    def device_of(self, c: int) -> str | None:
        a = self.by_client.get(c)
        return None if a is None else a.device


class FieldAvailability:
    """The loop's availability source in field mode: who is online, heartbeating and willing, per the
    agents' own reports. `round_wait_s` > 0 gives absent agents that long to (re)join first. No round
    starts with nobody available: it waits for one (coordinator/field/absence.py; EmptyFederation after
    --empty-federation-timeout)."""

    name = "field"

    def __init__(self, hub: FieldHub):
        self.hub = hub

    def round(self, t: int) -> RoundAvailability:
        """No round starts while the coordinator is disconnected from the broker: it waits for the broker
        first (`wait_for_broker`, coordinator/field/outage.py; BrokerOutage after --broker-outage-timeout)."""
        waiting = f"round {t} starts when it is back"
        if self.hub.cfg.round_wait_s > 0:
            with self.hub.cond:
                self.hub.wait_until_settled(waiting)
            self.hub.wait_for_agents(self.hub.n, self.hub.cfg.round_wait_s)
        avail = np.zeros(self.hub.n, bool)
        reasons: dict[int, str] = {}
        with self.hub.cond:  # after an outage, also the agents it cut off, while they may be reconnecting
            self.hub.wait_until_settled(waiting)
            if self.hub.wait_while_empty(self.hub.nobody_available, f"round {t} starts when one is"):
                self.hub.wait_until_settled(waiting)
            now = time.monotonic()
            for c in range(self.hub.n):
                why = self.hub.client_status(c, now)
                if why is None:
                    avail[c] = True
                else:
                    reasons[c] = why
        return RoundAvailability(avail, reasons)
