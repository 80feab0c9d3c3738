"""Field mode: what the coordinator knows about its agents.

Owns `AgentInfo` and `Registry`, the hub's component for the agents (`agents` by device id, `by_client` by
client index): an agent's status (online/offline, its announce; sent on every connect and in answer to the
coordinator's announce request, retained only as an optimisation; a rejoin only when it names a connection other
than the one held online, its `session`), its heartbeats, whether its data binding matches the coordinator's
(`edge_client.federation.diff`; an agent that differs is never selected), and who is awaited after a broker
outage (`awaited`). Liveness queries (`is_online`, `client_status`, `online_count`, `wait_for_agents`,
`device_of`) are asked by the loop's thread under the hub's lock `cond`. `FieldAvailability` answers the loop's
`availability.round(t)` from them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from coordinator.availability.models import REASONS, RoundAvailability
from coordinator.field import checks as field_checks
from coordinator.field.connection import FieldConfig
from coordinator.field.outage import AGENT_RECONNECT_S, CONTACT_SLACK_S
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


class RoundHooks(Protocol):
    """What the registry tells the round collection (coordinator/field/collection.py `Collection`)."""

    def agent_online(self, c: int) -> None: ...
    def agent_offline(self, c: int) -> None: ...
    def heard_again(self, c: int, what: str) -> bool: ...
    def reject(self, device: str, sub: str, code: str, reason: str) -> None: ...
    def write_log(self, row: dict) -> None: ...


class BrokerHealth(Protocol):
    """What the registry reads of the broker's health (coordinator/field/outage.py `Outage`)."""

    last_contact: float
    down_since: float | None

    def wait_for_broker(self, what: str) -> None: ...


class Registry:
    """FieldHub's agents: `agents` by device id, `by_client` by client index, and those awaited after a broker
    outage or an empty-federation wait (`expected_back`). Tells the open round of an agent's arrival, loss or
    return through `rounds` (`RoundHooks`); reads the broker's `last_contact` (`BrokerHealth`), so an agent's
    silence counts only while the broker answers. Messages arrive on paho's thread under `cond`; the loop's
    thread asks the queries under it too."""

    def __init__(self, cfg: FieldConfig, n: int, binding: federation.DataBinding, limits: wire.Limits,
                 cond: threading.Condition, rounds: RoundHooks, broker: BrokerHealth):
        self.cfg, self.n, self.binding, self.limits, self.cond = cfg, n, binding, limits, cond
        self.rounds, self.broker = rounds, broker
        self.agents: dict[str, AgentInfo] = {}     # by device id
        self.by_client: dict[int, AgentInfo] = {}  # the same, by client index
        self._alive_at_outage: set[str] = set()
        self.expected_back: set[str] = set()  # devices awaited after the last outage (`awaited`)
        self.reconnected_at = self.back_by = 0.0

    # --- messages (paho network thread, under cond) ---
    def on_message(self, device: str, sub: str, payload: bytes, retained: bool, now: float) -> None:
        """A device's `status` or `heartbeat`."""
        known = self.agents.get(device)
        try:  # a known device keeps the client index it announced first
            m = wire.decode([payload], self.limits, kinds=(sub,), max_nbytes=0,
                            client=None if known is None else known.client)
        except wire.WireError as e:
            self.rounds.reject(device, sub, e.code, e.reason)
            return
        problem = field_checks.status_device(m, device) if sub == "status" else None
        if problem:
            self.rounds.reject(device, sub, *problem)
            return
        if sub == "status":
            self._on_status(device, m, retained)
        elif device in self.agents:
            a = self.agents[device]
            a.last_heartbeat, a.heartbeat = now, m.meta
            if a.online and not a.mismatch:  # dropped `offline` in the open round, yet here: undo (collection.py)
                self.rounds.heard_again(a.client, "a heartbeat")

    def seen(self, device: str, now: float) -> None:
        """Something arrived from `device` (not retained): it is alive (`AgentInfo.last_seen`)."""
        a = self.agents.get(device)
        if a is not None:
            a.last_seen = now

    def _on_status(self, device: str, m: wire.Message, retained: bool) -> None:
        meta, c = m.meta, m.header.client
        state = meta.get("state")
        a = self.agents.get(device)
        if a is None:
            if state != "online":
                return
            if not (0 <= c < self.n):
                self.rounds.reject(device, "status", wire.WRONG_CLIENT, f"client {c} outside 0..{self.n - 1}")
                return
            other = self.by_client.get(c)
            if other is not None:
                self.rounds.reject(device, "status", wire.WRONG_CLIENT, f"client {c} is already device {other.device}")
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
                self.rounds.agent_online(a.client)
            if session is not None:
                a.session = session
            a.online = True
            a.last_heartbeat = a.last_seen = time.monotonic()
        else:
            a.online = False
            self.rounds.agent_offline(a.client)
        self.rounds.write_log({"event": "agent", "device": device, "client": a.client, "state": state,
                               "retained": retained, "time": time.time()}
                              | ({"refused": a.mismatch} if a.mismatch else {}))

    # --- a broker outage: who is awaited after it (paho's network thread, under cond; outage.py) ---
    def outage_began(self, now: float) -> None:
        """The broker went away: note who was alive, by their heartbeats, whatever their status says (a broker
        going down may send last wills first), and who is still awaited after an earlier outage."""
        self._alive_at_outage = {d for d, a in self.agents.items()
                                 if not a.mismatch and self.is_online(dataclasses.replace(a, online=True), now)}
        self._alive_at_outage |= self.expected_back if now < self.back_by else set()  # still awaited

    def outage_ended(self, now: float) -> set[str]:
        """The broker is back: those alive when it went away are awaited (`awaited`) until `back_by`. Returns them."""
        self.reconnected_at, self.back_by = now, now + AGENT_RECONNECT_S + self.cfg.heartbeat_timeout_s
        self.expected_back, self._alive_at_outage = self._alive_at_outage, set()
        return self.expected_back

    def await_back(self, devices: set[str], now: float) -> None:
        """After an empty-federation wait (absence.py): `devices` (selected, lost without an update) get the time
        agents get after a broker outage to come back (`awaited`)."""
        if not devices:
            return
        still = self.expected_back if now < self.back_by else set()  # a broker outage's, still awaited
        self.expected_back = set(devices) | still
        self.reconnected_at, self.back_by = now, now + AGENT_RECONNECT_S + self.cfg.heartbeat_timeout_s

    # --- queries (loop thread, under cond) ---
    def agent(self, device: str) -> AgentInfo | None:
        return self.agents.get(device)

    def is_online(self, a: AgentInfo, now: float) -> bool:
        """Announced online, heard from within the heartbeat timeout (anything the device sent counts:
        a heartbeat, a status, a chunk of an upload; `seen` sets `last_seen`), and at least one
        heartbeat seen (it carries the agent's availability). An agent's silence counts only while the broker
        answers: up to CONTACT_SLACK_S past the broker's last delivery to us (`last_contact`, outage.py; the
        coordinator's own probe comes back every PROBE_EVERY_S), so a frozen broker's silence, noticed only
        after BROKER_SILENT_S, never makes its agents `offline` first."""
        last_contact = self.broker.last_contact
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

    def awaited(self, now: float) -> set[int]:
        """Clients alive when the broker went away, not heard from since it came back, while they may still
        be reconnecting (until `back_by`)."""
        if self.broker.down_since is not None or not self.expected_back:
            return set()
        if now >= self.back_by:
            self.expected_back = set()
            return set()
        out = set()
        for d in list(self.expected_back):
            a = self.agents.get(d)
            if a is None:
                self.expected_back.discard(d)
            elif a.online and a.last_heartbeat >= self.reconnected_at:  # its status or a heartbeat: back
                self.expected_back.discard(d)
            else:
                out.add(a.client)
        return out

    def wait_until_settled(self, what: str) -> None:
        """Return once connected and no agent is `awaited` any more (BrokerOutage as `Outage.wait_for_broker`)."""
        while True:
            self.broker.wait_for_broker(what)
            now = time.monotonic()
            if not self.awaited(now):
                return
            self.cond.wait(timeout=max(min(self.back_by - now, 0.5), 0.01))


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
        hub, agents, absence = self.hub, self.hub.registry, self.hub.absence
        waiting = f"round {t} starts when it is back"
        if hub.cfg.round_wait_s > 0:
            with hub.cond:
                agents.wait_until_settled(waiting)
            agents.wait_for_agents(hub.n, hub.cfg.round_wait_s)
        avail = np.zeros(hub.n, bool)
        reasons: dict[int, str] = {}
        with hub.cond:  # after an outage, also the agents it cut off, while they may be reconnecting
            agents.wait_until_settled(waiting)
            if absence.wait_while_empty(absence.nobody_available, f"round {t} starts when one is"):
                agents.wait_until_settled(waiting)
            now = time.monotonic()
            for c in range(hub.n):
                why = agents.client_status(c, now)
                if why is None:
                    avail[c] = True
                else:
                    reasons[c] = why
        return RoundAvailability(avail, reasons)
