"""Field mode: the round-closing rule, a pure function of the round's state and the time.

`close(view, now) -> Decision` says whether a round's collection ends now, and if not, when to look again
(`wake_at`) should no message change the state before. No broker, clock, lock or I/O: `MqttTransport.run_round`
(transport.py) builds the `RoundView` from its per-client bookkeeping (`RoundState.open` and `offline`,
collection.py, kept up to date message by message in O(1)) and acts on the decision; tests/test_field_closing.py
tries every branch with hand-made views. The rule, in order (docs/field-mode.md "When a round closes"):

1. **Suspended by an outage**: disconnected from the broker, or the broker stopped answering
   (coordinator/field/outage.py): nobody is dropped, nothing closes; the deadline moves by the time it lasts.
2. **Suspended, nobody there**: no update in, some selected client lost `offline`, and no agent online
   (coordinator/field/absence.py): the round waits for agents instead of ending empty.
3. **Collected**: every selected client has delivered its update and stats, or declined, or been rejected,
   or is gone (offline: without an update it is dropped `offline`; with one, its update counts without
   stats) — and no client was lost in the last LOSS_SETTLE_S (a broker going down may send last wills just
   before it cuts the coordinator off, outage.py). Past the deadline, settling no longer holds the round.
4. **Deadline**: at the deadline D the round closes unless an upload extends it (`extends`): an upload in
   progress that keeps arriving at a rate that finishes it by D + E (`keeps_open`, E = `--upload-extension`),
   or a complete update whose stats are due within the heartbeat timeout of its last chunk. Never past D + E.
   The clients still owed something are then dropped `deadline` (`final_reasons`).
5. Otherwise the round stays open until the earliest of: the deadline, the end of settling, the next time an
   open client's heartbeat timeout may lapse (`check_at`: the caller looks at their liveness then), or, past
   the deadline, the time an extending upload would stall or D + E.

An `offline` drop stands only while the client stays unheard: a client dropped `offline` in the round (silent for
the heartbeat timeout, or its last will) that is heard from again before the round closes, by a heartbeat while
its registration is online or by its update of the round's model (which passed every check), was reachable after
all: the drop is undone, the client is open again (owed its update, or its stats), its update if that is what came
is accepted, and the round lists it in field.jsonl `offline_undone` (collection.py `Collection.heard_again`). Any
other drop (declined, rejected, ...) still discards a later update. An upload counts as stalled after
`Upload.stalled_after`: the heartbeat timeout, 3 chunk intervals at its rate, or 3 mean chunk intervals since the
task went out, whichever is longest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

INF = math.inf


@dataclass(frozen=True)
class Upload:
    """An open client's upload of this round, as the coordinator saw its chunks arrive (its monotonic clock)."""
    client: int
    chunks: int           # the message's number of chunks
    got: int              # chunks received so far
    first_at: float       # arrival of its first chunk
    last_at: float        # arrival of its latest chunk
    done: bool = False    # every chunk in (the message reassembled)
    updated: bool = False  # its update was accepted (stats still due)
    sent_at: float | None = None  # when the round's task went out (the round's start); None: unknown

    def mean_interval(self) -> float | None:
        """Seconds per chunk since the task went out: (latest arrival − `sent_at`) / chunks in. Slower than the
        upload's own rate (it counts the training too), never fooled by chunks that left the device's buffers in
        a burst; None without `sent_at`."""
        if self.sent_at is None or self.got < 1:
            return None
        return max(self.last_at - self.sent_at, 0.0) / self.got

    def chunk_rate(self) -> float | None:
        """Chunks per second after the first (None until two chunks arrived apart)."""
        span = self.last_at - self.first_at
        return (self.got - 1) / span if self.got >= 2 and span > 0 else None

    def stalled_after(self, timeout_s: float) -> float:
        """Silence after which the upload counts as stalled: max(timeout, 3 chunk intervals at its rate, 3 mean
        intervals since the task went out). The last term keeps an upload whose first chunks arrived close together
        (sent from the device's buffers, ahead of a slow link) from being taken for stalled while its next chunk
        crosses the link: on a link that sends a chunk every I seconds after a training of L, the k-th chunk
        arrives at about L + k·I, so 3 (L + k·I) / k ≥ 3 I."""
        rate, mean = self.chunk_rate(), self.mean_interval()
        return max(timeout_s, 0.0 if rate is None else 3.0 / rate, 0.0 if mean is None else 3.0 * mean)


def keeps_open(p: Upload, now: float, timeout_s: float, hard_end: float) -> bool:
    """The deadline's extension rule: an upload in progress keeps its round open past the deadline while
    (1) its chunks keep arriving: the latest within `Upload.stalled_after` (max(`timeout_s` (the heartbeat
    timeout), 3 chunk intervals at the measured rate, 3 mean intervals since the task went out)), and (2) at the
    rate they arrive, the rest arrives by `hard_end` (deadline + upload_extension_s): latest arrival + missing
    chunks / chunk rate ≤ hard_end (with a single chunk so far, the rate is unknown and (1) with `hard_end` bounds
    it alone). Never past `hard_end`."""
    if p.done or now >= hard_end or now - p.last_at > p.stalled_after(timeout_s):
        return False
    rate = p.chunk_rate()
    return rate is None or p.last_at + (p.chunks - p.got) / rate <= hard_end


def extends(p: Upload, now: float, timeout_s: float, hard_end: float) -> bool:
    """Whether client `p.client` holds the round open past its deadline: its upload `keeps_open`, or its update
    is complete and its stats are due (sent after the last PUBACK: within `timeout_s` of the last chunk)."""
    if now >= hard_end:
        return False
    return keeps_open(p, now, timeout_s, hard_end) or (p.updated and now - p.last_at <= timeout_s)


def _extension_ends(p: Upload, timeout_s: float, hard_end: float) -> float:
    """When `extends(p, ...)` turns false if no chunk arrives meanwhile (the rate test changes only with one)."""
    return min(p.last_at + (timeout_s if p.updated else p.stalled_after(timeout_s)), hard_end)


@dataclass(frozen=True)
class RoundView:
    """What the closing rule reads of a round in progress; times on the coordinator's monotonic clock."""
    open: int                  # selected clients still owed something: not resolved (update and stats in, or
    #                            dropped for a reason) and not gone (offline)
    deadline: float            # D, moved by the time the round was suspended
    hard_end: float            # D + E (--upload-extension), moved likewise
    timeout_s: float           # --heartbeat-timeout
    settle_until: float = -INF  # the latest loss of a selected client without an update + LOSS_SETTLE_S
    outage: bool = False       # disconnected from the broker, or it stopped answering (outage.py)
    empty: bool = False        # no update in, a selected client lost offline, no agent online (absence.py)
    check_at: float = INF      # the earliest time an open client's heartbeat timeout may lapse
    uploads: tuple[Upload, ...] = ()  # the open clients' uploads with a chunk in (read from the deadline on)


@dataclass(frozen=True)
class Decision:
    closed: bool
    why: str                   # "outage", "empty", "collected", "deadline", "extended", "settling", "open"
    wake_at: float = INF       # look again then if no message changed the state before (INF: a message only)
    extended_for: tuple[int, ...] = ()  # past the deadline: the clients whose upload holds the round open

    @property
    def suspended(self) -> bool:
        return self.why in ("outage", "empty")


def close(v: RoundView, now: float) -> Decision:
    """The round-closing rule (the module's docstring, steps 1–5)."""
    if v.outage:
        return Decision(False, "outage")
    if v.empty:
        return Decision(False, "empty")
    if v.open == 0 and now >= v.settle_until:
        return Decision(True, "collected")
    if now >= v.deadline:
        ext = [p for p in v.uploads if extends(p, now, v.timeout_s, v.hard_end)]
        if not ext:
            return Decision(True, "deadline")
        wake = min(min(_extension_ends(p, v.timeout_s, v.hard_end) for p in ext), v.check_at)
        return Decision(False, "extended", wake, tuple(sorted(p.client for p in ext)))
    if v.open == 0:
        return Decision(False, "settling", min(v.settle_until, v.deadline))
    return Decision(False, "open", min(v.deadline, v.check_at, v.settle_until if v.settle_until > now else INF))


def final_reasons(selected: Iterable[int], updates: Iterable[int], dropped: Mapping[int, str]) -> dict[int, str]:
    """Why each selected client without an accepted update is not aggregated once the round has closed: the
    reason it was dropped for during the round, else `deadline` (it was still working when time ran out)."""
    got = set(updates)
    return {c: dropped.get(c, "deadline") for c in selected if c not in got}
