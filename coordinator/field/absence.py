"""Field mode: an empty federation (no agent there to take part) burns no round; it waits, then gives up.

An empty round in the field is not the answer of a model of availability, as in simulation: every agent
gone at once is a fault (agents killed, a network cut; a broker that stops answering is an outage, outage.py).
`Absence` is the hub's component for it (coordinator/field/hub.py), used by the loop's thread under the hub's lock
`cond`; it reads the agents' states from the registry and the broker's outages from `Outage`:

- `FieldAvailability.round` (registry.py) starts no round while no client is available (`nobody_available`):
  it `wait_while_empty`s until one is.
- `MqttTransport.run_round` (transport.py) does not close a round in which no update arrived, some selected
  client was lost (`offline`) and no agent is online any more (`nobody_online`): the round is suspended, its
  deadline moves by the time spent waiting. When an agent is back, the selected clients lost without an
  update get the time agents get after a broker outage to come back (`Registry.await_back`: their
  `offline` drop is undone; one that is not back by then is `offline`, as always).
- `wait_while_empty` logs that it is waiting, with the time so far and why nobody is there, every
  LOG_EVERY_S, and raises `EmptyFederation` (a RunFailure, exit 1) once the federation has been empty for
  `--empty-federation-timeout` (time disconnected from the broker does not count: that is an outage, with its
  own timeout); coordinator/field/run.py then saves the last finished round's checkpoint and says how to resume.
  The round in progress is not recorded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from coordinator.errors import RunFailure
from coordinator.field.outage import LOG_EVERY_S

if TYPE_CHECKING:
    from coordinator.field.connection import FieldConfig

log = logging.getLogger("dropfl.coordinator")


class EmptyFederation(RunFailure):
    """No agent was there to take part for longer than `--empty-federation-timeout`."""


class Agents(Protocol):
    """What the empty-federation waits read of the agents (registry.py `Registry`)."""

    def client_status(self, c: int, now: float) -> str | None: ...
    def online_count(self) -> int: ...
    def awaited(self, now: float) -> set[int]: ...
    def wait_until_settled(self, what: str) -> None: ...


class Broker(Protocol):
    """What they read of the broker's outages (outage.py `Outage`): its time is not the federation's."""

    down_since: float | None
    outage_spans: list[tuple[float, float]]

    def downtime_between(self, t0: float, now: float, spans_from: int = 0) -> float: ...


class Absence:
    """FieldHub's empty-federation waits, and the time they took (`empty_s`, `empty_time`). Reads the agents'
    states (`Agents`) and the broker's outages (`Broker`); under the hub's lock `cond`."""

    def __init__(self, cfg: FieldConfig, cond: threading.Condition, n: int, agents: Agents, broker: Broker):
        self.cfg, self.cond, self.n, self.agents, self.broker = cfg, cond, n, agents, broker
        self.empty_s = 0.0                    # time spent in empty-federation waits that have ended
        self._empty_since: float | None = None
        self._empty_spans0 = 0                # outages that had ended when the wait in progress began

    def empty_time(self, now: float) -> float:
        """Seconds spent waiting with the federation empty so far: the wait's time less its overlap with broker
        outages (`downtime_between`: an outage dated from a contact before the wait began counts only from the
        wait's start, so the time is never negative)."""
        if self._empty_since is None:
            return self.empty_s
        since = self._empty_since
        return self.empty_s + (now - since) - self.broker.downtime_between(since, now, self._empty_spans0)

    def _absent(self, now: float) -> str:
        """Why nobody is there: the clients' reasons, counted ("3 offline, 2 battery")."""
        counts = Counter(self.agents.client_status(c, now) or "available" for c in range(self.n))
        return ", ".join(f"{k} {why}" for why, k in counts.most_common())

    def nobody_available(self, now: float) -> str | None:
        """None if some client may take part now, else why none may (`_absent`)."""
        if any(self.agents.client_status(c, now) is None for c in range(self.n)):
            return None
        return self._absent(now)

    def nobody_online(self, now: float) -> str | None:
        """None if some agent (with the run's data binding) is online, or awaited after a broker outage; else
        why nobody is there."""
        if self.agents.online_count() or self.agents.awaited(now):
            return None
        return self._absent(now)

    def wait_while_empty(self, empty: Callable[[float], str | None], what: str) -> float:
        """Return once `empty(now)` is None (at once if it is already); return the seconds waited. `what`
        waits meanwhile ("round 3 is suspended"). Raises EmptyFederation once the wait has lasted
        `cfg.empty_federation_timeout_s` (BrokerOutage while disconnected, as `wait_for_broker`)."""
        now = time.monotonic()
        why = empty(now)
        if why is None:
            return 0.0
        limit, next_log = self.cfg.empty_federation_timeout_s, 0.0
        self._empty_since, self._empty_spans0 = now, len(self.broker.outage_spans)
        try:
            while why is not None:
                if self.broker.down_since is not None:  # an outage: its own wait and timeout; not counted here
                    self.agents.wait_until_settled(what)
                now = time.monotonic()
                waited = self.empty_time(now) - self.empty_s
                if waited >= limit:
                    raise EmptyFederation(f"no agent has been there to take part for {waited:.0f} s ({why}; "
                                          f"--empty-federation-timeout {limit:g})")
                if now >= next_log:
                    log.warning("waiting for agents: none there to take part for %.0f s so far (%s); %s (giving up "
                                "after %g s, --empty-federation-timeout)", waited, why, what, limit,
                                extra={"fields": {"empty_s": round(waited, 3), "absent": why, "waiting": what}})
                    next_log = now + LOG_EVERY_S
                self.cond.wait(timeout=max(min(limit - waited, next_log - now), 0.01))  # a message wakes it
                why = empty(time.monotonic())
            waited = self.empty_time(time.monotonic()) - self.empty_s
            log.info("agents are back after %.1f s with nobody there; %s", waited, what.replace(
                "is suspended", "goes on").replace("starts when one is", "starts"))
            return waited
        finally:
            self.empty_s = self.empty_time(time.monotonic())
            self._empty_since = None
