"""Field mode: collecting a round's messages.

Owns `RoundState` (the round in progress: its tasks and what each selected client has delivered,
declined, or been dropped for) and the handling of the agents' round messages: update chunks
reassembled into whole messages (`wire.Reassembler`; each upload's progress counted as its chunks arrive,
`UploadProgress`, and `keeps_open`, the rule by which it may keep the round open past its deadline), upload
stats, declines, evaluations; an update trained on another model than the round's (`model_digest`) is
rejected. Every
message is validated (`edge_client.wire`, `coordinator/field/checks.py`, `_invalid`); one that fails is
rejected: logged with its reason as a warning (structured fields: code, device, topic, round) and
counted by code (`rejects`, the round's `RoundState.rejects`). Also writes `field.jsonl` (`write_log`).
Runs on paho's network thread under the hub's lock `cond`; docs/protocol.md lists the checks.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.availability.models import REASONS
from coordinator.field import checks as field_checks
from coordinator.field import closing
from coordinator.field.connection import FieldConfig
from coordinator.field.registry import AgentInfo
from coordinator.field.sparse import is_sparse, sparse_problem
from edge_client import feddd, wire
from edge_client.trainer import TrainTask

log = logging.getLogger("dropfl.coordinator")


@dataclass
class UploadProgress:
    """An update upload in progress, on the coordinator's monotonic clock (docs/field-mode.md "Liveness")."""
    sha256: str            # the message being uploaded (a new one restarts the count)
    chunks: int            # its number of chunks
    first_at: float        # arrival of its first chunk
    last_at: float         # arrival of its latest chunk
    got: set[int] = field(default_factory=set)  # chunk indices received
    body_bytes: int = 0    # tensor bytes received so far
    done: bool = False

    def add(self, chunk: int, body_bytes: int, now: float) -> None:
        if chunk not in self.got:
            self.got.add(chunk)
            self.body_bytes += body_bytes
        self.last_at = now

    def chunk_rate(self) -> float | None:
        """Chunks per second after the first (None until two chunks arrived apart)."""
        span = self.last_at - self.first_at
        return (len(self.got) - 1) / span if len(self.got) >= 2 and span > 0 else None

    def row(self) -> dict:
        return {"chunks": len(self.got), "of": self.chunks, "bytes": self.body_bytes,
                "seconds": self.last_at - self.first_at, "done": self.done}

    def view(self, client: int, updated: bool = False, sent_at: float | None = None) -> closing.Upload:
        """What the closing rule reads of it (coordinator/field/closing.py); `sent_at`: when its task went out."""
        return closing.Upload(client, self.chunks, len(self.got), self.first_at, self.last_at, self.done, updated,
                              sent_at)


def keeps_open(p: UploadProgress, now: float, timeout_s: float, hard_end: float) -> bool:
    """The deadline's extension rule for an upload in progress (`closing.keeps_open`)."""
    return closing.keeps_open(p.view(-1), now, timeout_s, hard_end)


@dataclass
class RoundState:
    t: int
    tasks: dict[int, TrainTask]
    started: float
    digest: str | None = None  # the round's global model (wire.model_digest): updates must echo it
    progress: dict[int, UploadProgress] = field(default_factory=dict)  # uploads of this round, by client
    # chunks of an earlier round's update that arrived while this round was open, by client: what an agent sent
    # of a stale upload before it saw this round's task or model (at most its upload window; edge_client/agent/link.py)
    stale_chunks: dict[int, int] = field(default_factory=dict)
    updates: dict[int, wire.Message] = field(default_factory=dict)
    received_at: dict[int, float] = field(default_factory=dict)
    stats: dict[int, dict] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    rejoined: set[int] = field(default_factory=set)
    # dropped `offline` in the round, then heard from again within it (a heartbeat or its update of the round's
    # model): the drop undone (`Collection.heard_again`), logged, and listed in field.jsonl (`offline_undone`)
    offline_undone: set[int] = field(default_factory=set)
    duplicates: int = 0
    rejected: int = 0
    rejects: dict[str, int] = field(default_factory=dict)  # messages rejected during the round, by code
    closed: bool = False
    # the closing rule's bookkeeping (coordinator/field/closing.py), kept per client as messages arrive (`note`):
    open: set[int] = field(default_factory=set)     # selected, neither resolved nor gone: still owed something
    gone: set[int] = field(default_factory=set)     # selected, found offline (last will, silence) in the round
    offline: set[int] = field(default_factory=set)  # dropped `offline` without an update (lost)
    lost_at: float = float("-inf")                  # when a selected client was last lost without an update
    past_deadline: bool = False                     # set by the round loop: from then on every change matters

    def __post_init__(self) -> None:
        self.open = set(self.tasks)

    def resolved(self, c: int) -> bool:
        return c in self.dropped or (c in self.updates and c in self.stats)

    def note(self, c: int, now: float | None = None) -> bool:
        """Re-file client c after its state changed (an update, stats, a drop, gone or back): O(1). `now`: the
        time of a loss. True if the change may change the closing rule's decision: the last open client
        resolved, a client lost while no update is in (the round may have nobody left), or anything past the
        deadline; the round loop is then woken (`Collection._changed`)."""
        if c not in self.tasks:
            return False
        was_open = c in self.open
        if self.resolved(c) or c in self.gone:
            self.open.discard(c)
        else:
            self.open.add(c)
        lost = c not in self.updates and (self.dropped.get(c) == "offline" or c in self.gone)
        if lost and c not in self.offline and now is not None:
            self.lost_at = now
        if c not in self.updates and self.dropped.get(c) == "offline":
            self.offline.add(c)
        else:
            self.offline.discard(c)
        return self.past_deadline or (was_open and not self.open) or (lost and not self.updates)

    def recount(self) -> None:
        """Re-file every client (after a change made to the round wholesale: an outage's end undoing drops)."""
        for c in self.tasks:
            self.note(c)


class Collection:
    """FieldHub's round collection: the open `round` (opened by MqttTransport), the update reassembler `reasm`,
    the model's FedDD `layout` (set by MqttTransport), the run's `late` and `rejects` counts, and `field.jsonl`
    (`write_log`). Needs nothing of the other parts: the hub hands it each round message with the sending
    device's `AgentInfo` (`on_message`), and the registry tells it of an agent's arrival, loss or return
    (`agent_online`, `agent_offline`, `heard_again`: registry.py `RoundHooks`). Wakes the round loop on `wake`
    (the hub's condition on its lock) only when a change may change the closing rule's decision."""

    def __init__(self, cfg: FieldConfig, num_params: int, limits: wire.Limits, wake: threading.Condition,
                 rundir_path: Path):
        self.cfg, self.num_params, self.limits, self.wake = cfg, num_params, limits, wake
        self.reasm = wire.Reassembler(self.limits)
        self.layout: feddd.Layout | None = None  # the model's FedDD units, to decode sparse updates (MqttTransport)
        self.round: RoundState | None = None
        self.late = 0
        self._late_logged: OrderedDict[tuple, None] = OrderedDict()  # messages logged by _late_between_rounds
        self.rejects: dict[str, int] = {}  # the run's rejected messages, by code (docs/protocol.md)
        self.max_update_bytes = field_checks.max_update_bytes(self.num_params)
        self.field_log = rundir_path / "field.jsonl"

    def write_log(self, row: dict) -> None:
        with open(self.field_log, "a") as f:
            f.write(json.dumps(row) + "\n")

    def reject(self, device: str, sub: str, code: str, reason: str) -> None:
        """Log a rejected message with its reason and count it by code (field.jsonl `rejects`)."""
        self.rejects[code] = self.rejects.get(code, 0) + 1
        r = self.round
        if r is not None and not r.closed:
            r.rejects[code] = r.rejects.get(code, 0) + 1
        log.warning("%srejected %s of %s [%s]: %s", "" if r is None else f"round {r.t}: ", sub, device, code, reason,
                    extra={"fields": {"code": code, "device": device, "topic": sub,
                                      "round": None if r is None else r.t}})

    def _late_between_rounds(self, device: str, sub: str, payload: bytes) -> None:
        """A frame of an update, stats or decline that arrives while no round is open (before the first, or after
        a round closed and before the next opens): never aggregated; counted in `late`, and logged as rejected
        once per message (at its first frame seen here), as a late message within an open round is: an update
        its agent sent is then never silently gone (tests/faultkit.py `nothing_lost_or_doubled`)."""
        self.late += 1
        try:
            h, _ = wire.decode_frame(payload, self.limits)
        except wire.WireError as e:
            self.reject(device, sub, e.code, e.reason)
            return
        key = (h.run, h.round, h.client, h.kind, h.sha256)
        if key in self._late_logged:
            return
        self._late_logged[key] = None
        if len(self._late_logged) > self.limits.max_pending:
            self._late_logged.popitem(last=False)
        r = self.round
        when = "before the first round opened" if r is None else f"after round {r.t} closed"
        self.reject(device, sub, wire.WRONG_ROUND, f"{h.kind} of round {h.round} arrived {when} "
                                                   "(late, stale or replayed)")

    def _wake(self) -> None:
        with self.wake:  # held already on paho's thread (an RLock); a caller without it (a test) takes it
            self.wake.notify_all()

    def _changed(self, r: RoundState, c: int, now: float | None = None) -> None:
        """Client c's state in round r changed: re-file it (`RoundState.note`, O(1)) and wake the round loop only
        if that may change the closing rule's decision (coordinator/field/closing.py)."""
        if r.note(c, now):
            self._wake()

    # --- hooks for the registry (registry.py `RoundHooks`): an agent of the open round came (back) online or went
    # offline, or was heard from again ---
    def agent_online(self, c: int) -> None:
        r = self.round
        if r is not None and not r.closed and c in r.tasks:
            r.gone.discard(c)  # heard from again: its stats (after an update) are due again
            if c not in r.updates:
                if r.dropped.get(c) == "offline":  # back within the round: give it the task again
                    del r.dropped[c]
                if not r.resolved(c):
                    r.rejoined.add(c)
                    self._wake()  # the round loop re-sends it the task and the model
            self._changed(r, c)

    def heard_again(self, c: int, what: str) -> bool:
        """Client c, selected in the open round and dropped `offline` in it (or found gone), was heard from again
        (`what`: "a heartbeat", "its update"): it was not unreachable after all, so the drop is undone and it is
        owed its update (or its stats) again; no task is re-sent (its connection held: an agent that reconnects
        sends a status, `agent_online`, and gets the task again). True if something was undone."""
        r = self.round
        if r is None or r.closed or c not in r.tasks:
            return False
        undo = c not in r.updates and r.dropped.get(c) == "offline"
        if not undo and c not in r.gone:
            return False
        if undo:
            del r.dropped[c]
            r.offline_undone.add(c)
            log.info("round %d: client %d, dropped offline in this round, is back (%s): the drop is undone", r.t, c,
                     what, extra={"fields": {"round": r.t, "client": c, "heard": what}})
        r.gone.discard(c)  # its stats (after an update) are due again
        self._changed(r, c)
        self._wake()
        return True

    def agent_offline(self, c: int) -> None:
        r = self.round
        if r is not None and not r.closed and c in r.tasks:
            if c not in r.updates:
                r.dropped.setdefault(c, "offline")
            r.gone.add(c)  # its update (if complete) still counts; its stats will not come
            self._changed(r, c, now=time.monotonic())

    # --- a broker outage ended (the hub, on paho's network thread, under cond; outage.py) ---
    def back_after_outage(self, clients: set[int]) -> None:
        """`clients` were alive when the broker went away: the outage decides their drops for `offline` around it,
        not they (unless their update is in), and they are not gone (their last wills count for nothing)."""
        r = self.round
        if r is None or r.closed:
            return
        for c in clients:
            if r.dropped.get(c) == "offline" and c not in r.updates:
                del r.dropped[c]
        r.gone -= clients
        r.recount()

    # --- messages (paho network thread, under cond) ---
    def on_message(self, a: AgentInfo | None, device: str, sub: str, payload: bytes, now: float) -> None:
        """A device's `update/...` message: eval, or a chunk of its update, stats or decline. `a`: the registry's
        record of `device` (None: it never announced itself)."""
        if a is None:
            self.reject(device, sub, field_checks.DEVICE, "the device has not announced itself (no online status)")
            return
        r = self.round
        if sub == "update/eval":
            try:
                m = wire.decode([payload], self.limits, run=self.cfg.run_id, client=a.client, kinds=("eval",),
                                max_nbytes=0)
            except wire.WireError as e:
                self.reject(device, sub, e.code, e.reason)
                return
            fields, problem = field_checks.eval_meta(m)
            if problem:
                self.reject(device, sub, *problem)
                return
            self.write_log({"event": "eval", "round": m.header.round, "client": a.client} | fields)
            return
        kinds = {"update/delta": ("update",), "update/stats": ("stats",), "update/decline": ("decline",)}.get(sub)
        if kinds is None:
            return
        if r is None or r.closed:
            self._late_between_rounds(device, sub, payload)
            return
        try:
            m = self.reasm.add(payload, client=a.client, kinds=kinds,
                               max_nbytes=self.max_update_bytes if kinds == ("update",) else 0)
        except wire.WireError as e:
            r.rejected += 1
            self.reject(device, sub, e.code, e.reason)
            if a.client in r.tasks and not r.resolved(a.client) and a.client not in r.updates:
                r.dropped[a.client] = "rejected"
                self._changed(r, a.client)
            return
        if kinds == ("update",):
            body = len(payload) - 8 - int.from_bytes(payload[4:8], "big")  # the frame's tensor bytes
            self._note_progress(r, a.client, body, now, done=m is not None)
        if m is None:
            return
        try:
            wire.check_binding(m.header, run=self.cfg.run_id, round=r.t)
        except wire.WireError as e:  # another run's or an earlier round's: late, never aggregated
            self.late += 1
            self.reject(device, sub, e.code, f"{e.reason} (late, stale or replayed)")
            return
        if m.kind == "update" and (problem := field_checks.stale_model(m.meta, r.digest)):
            self.reject(device, sub, *problem)  # trained on another model: never aggregated, does not drop
            return
        if a.client not in r.tasks:
            return
        c = a.client
        if m.kind == "decline":
            reason = m.meta.get("reason")
            if c not in r.updates:
                r.dropped.setdefault(c, reason if reason in REASONS else "declined")
                self._changed(r, c)
        elif m.kind == "stats":
            problem = field_checks.stats(m)
            if problem:  # the update (if valid) still counts, without the upload rates
                self.reject(device, sub, *problem)
            r.stats.setdefault(c, {} if problem else m.meta)
            self._changed(r, c)
        elif c in r.updates:
            r.duplicates += 1
        elif c in r.dropped and not (r.dropped[c] == "offline" and self.heard_again(c, "its update")):
            log.info("round %d: discarded the update of %s, already dropped (%s)", r.t, device, r.dropped[c])
        else:
            problem = field_checks.update(m, self.num_params, a.announce.get("num_samples"))
            if problem is None and (invalid := self._invalid(m)):
                problem = (field_checks.PAYLOAD, invalid)
            if problem is None and is_sparse(m) and r.tasks[c].dropout_rate is None:  # masks only for FedDD
                problem = (field_checks.PAYLOAD, "a sparse update answers a task without dropout_rate (not FedDD)")
            if problem:
                r.rejected += 1
                r.dropped[c] = "rejected"
                self.reject(device, sub, *problem)
            else:
                r.updates[c], r.received_at[c] = m, now
            self._changed(r, c)

    def _note_progress(self, r: RoundState, c: int, body_bytes: int, now: float, done: bool) -> None:
        """Count a chunk of client c's update of this round (`reasm.last`: the chunk's header)."""
        h = self.reasm.last
        if h is not None and h.run == self.cfg.run_id and h.round < r.t:
            r.stale_chunks[c] = r.stale_chunks.get(c, 0) + 1
            return
        if h is None or c not in r.tasks or h.run != self.cfg.run_id or h.round != r.t or \
                field_checks.stale_model(h.meta, r.digest):
            return
        p = r.progress.get(c)
        if p is None or p.sha256 != h.sha256:
            p = r.progress[c] = UploadProgress(h.sha256, h.chunks, now, now)
        p.add(h.chunk, body_bytes, now)
        p.done = p.done or done
        log.debug("round %d: client %d upload %d/%d chunks, %d bytes in %.2f s", r.t, c, len(p.got), p.chunks,
                  p.body_bytes, now - p.first_at)

    def _invalid(self, m: wire.Message) -> str | None:
        """A sparse (FedDD) payload's problem (coordinator/field/sparse.py), else None. A dense update's tensor
        (float32, [num_params], finite) and its meta are checked once, by `field_checks.update` before this."""
        if not is_sparse(m):
            return None
        problem = sparse_problem(self.layout, m)
        if problem:
            return problem
        for k in ("num_samples", "steps"):
            if not isinstance(m.meta.get(k), int) or m.meta[k] < 0:
                return f"meta {k} missing or not a non-negative integer"
        return None
