"""Field mode: a broker outage (the coordinator disconnected from the broker) opens and closes no round.

`Outage` is the hub's component for the broker's health (coordinator/field/hub.py), under the hub's lock
`cond`. paho's network thread marks where an outage begins (`began`, on an unexpected disconnect:
`Connection._on_disconnect`) and ends (`ended`, on the reconnect, or `contact`, the first message after a
silence). The hub hears of both (`on_began`, `on_ended`) and tells the registry and the open round. The loop's
thread never acts on what it cannot see while disconnected:

- `FieldAvailability.round` (registry.py) starts no round while disconnected: it `wait_until_settled`s.
- `MqttTransport.run_round` (transport.py) neither drops clients nor closes the round while disconnected:
  it `wait_for_broker`s, and the round's deadline moves by the time spent disconnected (`downtime`).
- Agents alive when the broker went away (by their heartbeats: an `offline` last will that a broker
  shutting down sends counts for nothing) are `awaited` after the reconnect (the registry's
  `Registry.awaited`): for `AGENT_RECONNECT_S` (their own reconnect, paho's backoff) plus a heartbeat timeout,
  until heard from again. Meanwhile the open round does not count them as gone (their outage-time `offline`
  drop is undone: `Collection.back_after_outage`), and the next round waits for them before it looks who is
  available.
- A broker that stops answering while its connection stays open (frozen: SIGSTOP, a hung host) is an outage
  too: the coordinator publishes a probe to its own topic every PROBE_EVERY_S, and when nothing at all
  (an echo, any message) has arrived for `silence_bound` while connected (BROKER_SILENT_S, plus the time the
  broker may take to send what the coordinator published since the last probe it echoed, at BROKER_MIN_BPS: a
  model sent to 10,000 agents keeps a broker busy, not frozen), the outage begins, dated from the last healthy
  contact (`silence`, on the probe thread); the next message ends it (`contact`).
- `wait_for_broker` logs that it is waiting, with the time so far, and raises `BrokerOutage` (a RunFailure,
  exit 1) once the outage has lasted `--broker-outage-timeout`; coordinator/field/run.py then saves the
  last finished round's checkpoint and says how to resume.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.errors import RunFailure

if TYPE_CHECKING:
    from coordinator.field.connection import FieldConfig

log = logging.getLogger("dropfl.coordinator")

PROBE_EVERY_S = 0.5      # the coordinator publishes a probe to itself through the broker this often
BROKER_SILENT_S = 3.0    # nothing at all from the broker for this long, its connection open: an outage ...
# ... plus the time the broker may take to send what the coordinator has just given it to fan out (`silence_bound`),
# at this rate: a quarter of what one mosquitto sustained sending a 31 KB model to 10,000 subscribers on 2 shared
# cores (310 MB, its probe echo back after 7.0 s: 44 MB/s; benchmarks/results/field_load_closing.md)
BROKER_MIN_BPS = 10e6
AGENT_RECONNECT_S = 3.0  # an agent's reconnect after an outage: its backoff (at most 2 s, reconnect.py), the connect
LOG_EVERY_S = 10.0       # while waiting for the broker, say so this often
# an agent's silence counts only up to this long after the broker's last delivery to us (registry.py `is_online`):
# more than PROBE_EVERY_S, the echo of our own probe, so that while the broker answers it is always now
CONTACT_SLACK_S = 1.0
# a round whose last outstanding clients went offline less than this ago does not close yet: a broker that
# is going down may send their last wills just before it cuts the coordinator off (the outage's end undoes them)
LOSS_SETTLE_S = 0.5


def overlap_s(a0: float, a1: float, b0: float, b1: float) -> float:
    """Seconds the intervals [a0, a1] and [b0, b1] have in common (0 if they are disjoint)."""
    return max(0.0, min(a1, b1) - max(a0, b0))


def silence_bound(owed_bytes: float) -> float:
    """How long the broker may deliver nothing to the coordinator, its connection open, before that is an outage:
    BROKER_SILENT_S, plus the time to send `owed_bytes` (what the coordinator published that the broker has not
    yet shown to be through: a model to every agent) at BROKER_MIN_BPS. A busy broker is not a frozen one; a frozen
    one is still noticed, at most that long after its last healthy contact."""
    return BROKER_SILENT_S + max(owed_bytes, 0.0) / BROKER_MIN_BPS


class BrokerOutage(RunFailure):
    """The broker stayed unreachable for longer than `--broker-outage-timeout`."""


class Outage:
    """The broker's health, under the hub's lock `cond`: when the broker last answered (`last_contact`), what it
    was given to send and has not yet shown to be through (`owed_bytes`), and the outages (`down_since`, their
    spans and time). Needs nothing of the other parts: what an outage's beginning and end mean for the agents
    and the open round is the hub's, told through `on_began(now)` and `on_ended(now, lasted_s)`."""

    def __init__(self, cfg: FieldConfig, cond: threading.Condition, on_began: Callable[[float], None],
                 on_ended: Callable[[float, float], None]):
        self.cfg, self.cond, self.on_began, self.on_ended = cfg, cond, on_began, on_ended
        self.down_since: float | None = None  # monotonic time the connection was lost; None: not in an outage
        self.downtime_s = 0.0                 # time spent in outages that have ended
        self.outage_spans: list[tuple[float, float]] = []  # the outages that have ended: (from, to), in order
        self.outages = 0
        self.last_contact = 0.0               # monotonic time the broker last delivered anything to us
        self.silent = False                   # the outage in progress began by silence, not by a disconnect
        # bytes the broker was given to send (each publish times its fan-out), not yet shown to be through by the
        # echo of a probe published after them (`published`, `probe_echo`, `owed_bytes`): (time, bytes), in order
        self._owed: collections.deque[tuple[float, float]] = collections.deque()
        self._owed_sum = 0.0

    # --- paho's network thread (or the probe thread), under cond ---
    def began(self, since: float | None = None) -> None:
        """An outage from `since` (the last healthy contact, for a broker that stopped answering), or now."""
        if self.down_since is not None:
            return
        now = time.monotonic()
        self.down_since = now if since is None else since
        self.outages += 1
        self.on_began(now)
        self.cond.notify_all()

    def disconnected(self) -> None:
        """The connection dropped (unexpectedly): an outage, from now on an unreachable broker whatever began it."""
        self.began()
        self.silent = False

    def ended(self) -> None:
        if self.down_since is None:
            return
        now = time.monotonic()
        self.outage_spans.append((self.down_since, now))
        lasted, self.down_since, self.silent = now - self.down_since, None, False
        self.downtime_s += lasted
        self.on_ended(now, lasted)
        self.cond.notify_all()

    def contact(self, now: float) -> None:
        """The broker delivered something (a probe's echo, any message): it answers. Ends an outage that began
        by silence; one that began by a disconnect ends with the reconnect (`Connection._on_subscribe`)."""
        self.last_contact = now
        if self.silent:
            self.ended()

    def published(self, now: float, nbytes: float) -> None:
        """The coordinator gave the broker `nbytes` to send (a frame times its subscribers), under cond."""
        self._owed.append((now, nbytes))
        self._owed_sum += nbytes

    def probe_echo(self, now: float, sent_at: float) -> None:
        """Our probe published at `sent_at` came back: the broker has taken in everything published before it
        (it handles a client's messages in order), so that is no longer owed."""
        while self._owed and self._owed[0][0] <= sent_at:
            self._owed_sum -= self._owed.popleft()[1]
        if not self._owed:
            self._owed_sum = 0.0

    def owed_bytes(self, now: float) -> float:
        """Bytes published for the broker to send that no probe echo has shown to be through yet."""
        return self._owed_sum

    def silence(self, now: float) -> None:
        """The probe thread, connected: nothing at all from the broker for `silence_bound` (BROKER_SILENT_S, more
        while it may still be sending what the coordinator just published), though it has its own probes to echo
        every PROBE_EVERY_S (a frozen broker, its socket still open). An outage, measured from the last healthy
        contact."""
        if self.down_since is not None or not self.last_contact or \
                now - self.last_contact < silence_bound(self.owed_bytes(now)):
            return
        log.warning("the broker %s has not answered for %.1f s (its connection is open): a broker outage",
                    self.cfg.broker, now - self.last_contact)
        self.silent = True
        self.began(since=self.last_contact)

    # --- the loop's thread, under cond ---
    def downtime(self, now: float) -> float:
        """Seconds spent disconnected from the broker so far (outages after the first connect)."""
        return self.downtime_s + (now - self.down_since if self.down_since is not None else 0.0)

    def downtime_between(self, t0: float, now: float, spans_from: int = 0) -> float:
        """Seconds of [t0, now] spent in an outage: the overlap with each outage that has ended (from index
        `spans_from` of `outage_spans` on) and with the one in progress. An outage that began by silence is dated
        from the last healthy contact, which may lie before t0: only its part after t0 counts."""
        spans = self.outage_spans[spans_from:]
        if self.down_since is not None:
            spans = [*spans, (self.down_since, now)]
        return sum(overlap_s(a, b, t0, now) for a, b in spans)

    def wait_for_broker(self, what: str) -> None:
        """Return once connected (at once if not in an outage). `what` waits meanwhile ("round 3 is
        suspended"). Raises BrokerOutage once the outage has lasted `cfg.broker_outage_timeout_s`."""
        limit, next_log = self.cfg.broker_outage_timeout_s, 0.0
        while self.down_since is not None:
            now = time.monotonic()
            down = now - self.down_since
            state = "not answering" if self.silent else "unreachable"
            if down >= limit:
                raise BrokerOutage(f"the broker {self.cfg.broker} has been {state} for {down:.0f} s "
                                   f"(--broker-outage-timeout {limit:g})")
            if now >= next_log:
                log.warning("waiting for the broker %s: %s for %.0f s so far; %s (giving up after %g s, "
                            "--broker-outage-timeout)", self.cfg.broker, state, down, what, limit,
                            extra={"fields": {"outage_s": round(down, 3), "waiting": what}})
                next_log = now + LOG_EVERY_S
            self.cond.wait(timeout=max(min(limit - down, next_log - now), 0.01))
