"""The agent's MQTT plumbing (`Link`, a component of `Agent`), and the reassembly of what arrives (`Incoming`).

`Link` owns the paho client (`mqtt`): its creation (username/password, TLS against ca_file for mqtts://, the
retained "offline" last will, reconnect delays), failover over the broker list (`brokers`: on_disconnect and
on_connect_fail point paho at the next URL, paho's reconnect loop backs off and connects there; `reconnect`,
reconnect.py: backoff with jitter, a fresh client id after a connection dropped before its subscription was
acknowledged), the status frame (device facts and data binding), the callbacks of paho's network thread
(on_connect subscribes and announces "online", on_disconnect, on_message queues into the agent's inbox, and
answers the coordinator's announce request at once), and publishing: `publish` for small messages and
`send_update` for an update's chunks (at most `upload_window` unacknowledged at once, so heartbeats pass between
them; paced to uplink_limit_Bps; waits for the broker's PUBACKs, then reports the upload's time and rate, and the
round's telemetry, on update/stats). Arrival times handed to the inbox are this host's `time.monotonic()`.

**A stale upload stops at once.** The network thread notes the round of every task or global model the
coordinator sends (`_note_round`, from the frame's header, before the main thread sees it, into `_newest`). The
coordinator sends round t+1's task and model only after round t has closed, so an upload (or a training) of round
t is stale the moment a frame of another round arrives (`superseded`): `send_update` checks before every chunk and
while it waits for a PUBACK, stops publishing, sends no stats, and logs `round t: upload abandoned after k of n
chunks` (`uploads_abandoned` counts them). At most the `upload_window` chunks already in flight still reach the
broker.

Given at construction: the agent's identity, binding and sample count (its status), the broker list (checked
before anything else is loaded), the `inbox` it queues into,
the `connected` event (set and cleared here) and `stopping`, the measured `rates` (the upload's rate written
here), `beat_now` (a heartbeat right after connecting) and `battery_pct` (the round's telemetry), both the
heartbeat's.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable

from paho.mqtt import client as mqtt

from edge_client import federation, wire
from edge_client.agent.config import TOPIC_ROOT, AgentConfig, AgentError, Brokers, log, who
from edge_client.agent.reconnect import Reconnect
from edge_client.monitor import device_facts
from edge_client.telemetry import RoundRecord

ACK_SLICE_S = 0.05  # a PUBACK wait wakes this often to see whether a newer round made the upload stale


class Link:
    def __init__(self, cfg: AgentConfig, device_id: str, client: int, binding: federation.DataBinding,
                 num_samples: int, brokers: Brokers, limits: wire.Limits, inbox: queue.Queue,
                 connected: threading.Event, stopping: threading.Event, rates: dict, beat_now: Callable[[], None],
                 battery_pct: Callable[[], float | None]):
        self.cfg, self.id, self.client_idx = cfg, device_id, client
        self.binding, self.num_samples, self.limits = binding, num_samples, limits
        self.inbox, self.connected, self.stopping, self.rates = inbox, connected, stopping, rates
        self.beat_now, self.battery_pct = beat_now, battery_pct
        self.base = f"{TOPIC_ROOT}/device/{device_id}"
        self.brokers = brokers  # the URL list and failover (config.py)
        # the coordinator's latest task or model (run, round), noted by paho's thread (`_note_round`): a training
        # or upload of another round is stale; `_wake` wakes an upload's waits when it changes, or at a stop
        self._newest: tuple[str, int] | None = None
        self._wake = threading.Event()
        self.uploads_abandoned = 0   # stale uploads stopped
        self.reconnect = Reconnect(f"dropfl-{device_id}")  # backoff with jitter, a fresh id after a refusal
        self.mqtt = self._make_client()

    # --- life cycle (the agent's main thread; `wake` from any thread) ---
    def start(self) -> None:
        self.mqtt.connect_async(*self.brokers.address, keepalive=self.cfg.agent.keepalive_s)
        self.mqtt.loop_start()

    def wake(self) -> None:
        """Ends an upload's wait at once (it then sees `stopping`)."""
        self._wake.set()

    def close(self) -> None:
        """The retained "offline" status if connected (waited for 2 s at most), then the disconnect."""
        if self.connected.is_set():
            info = self.mqtt.publish(f"{self.base}/status", self._status_frame("offline"), qos=1, retain=True)
            try:
                info.wait_for_publish(timeout=2)
            except (RuntimeError, ValueError):
                pass
        self.mqtt.disconnect()
        self.mqtt.loop_stop()

    # --- the client (paho's network thread runs the callbacks) ---
    def _make_client(self) -> mqtt.Client:
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.reconnect.client_id, clean_session=True)
        c.username_pw_set(self.id, self.cfg.agent.password)
        if self.brokers.tls:  # one CA for every URL of the list; each server's host name is checked
            if not self.cfg.agent.ca_file:
                raise AgentError("broker mqtts://...: set ca_file (the broker's CA certificate)")
            c.tls_set(ca_certs=self.cfg.agent.ca_file)
        c.will_set(f"{self.base}/status", self._status_frame("offline"), qos=1, retain=True)
        c.reconnect_delay_set(min_delay=0.2, max_delay=0.2)  # the first retry; then reconnect.py decides
        c.max_inflight_messages_set(100)
        c.on_connect, c.on_disconnect, c.on_message = self._on_connect, self._on_disconnect, self._on_message
        c.on_connect_fail, c.on_subscribe = self._on_connect_fail, self._on_subscribe
        return c

    def _status_frame(self, state: str, reply: bool = False) -> bytes:
        """`reply`: an announce answering the coordinator's request, not a (re)connect (docs/protocol.md)."""
        # `session`: this process and connection (a status repeated or delivered late names an old one: no
        # rejoin, coordinator/field/registry.py)
        meta: dict = {"state": state, "device": self.id, "session": f"{self.reconnect.token}:{self.reconnect.sessions}"}
        if state == "online":
            meta |= device_facts() | self.binding.to_meta() | {"num_samples": self.num_samples}
            if reply:
                meta["reply"] = True
        return wire.encode("status", "", -1, self.client_idx, meta=meta)[0]

    def _announce(self, client: mqtt.Client, reply: bool = False) -> None:
        """Publish the `online` status (retained: an optimisation for brokers that deliver it to late
        subscribers; correctness never depends on it) and a heartbeat right away."""
        client.publish(f"{self.base}/status", self._status_frame("online", reply), qos=1, retain=True)
        self.beat_now()  # a heartbeat right away: it tells the coordinator whether we can train

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error(f"broker refused the connection: {reason_code}", extra=who(self.id))
            return
        # clean session: subscribe on every connect, whichever broker of the list this is
        _, mid = client.subscribe([(f"{self.base}/control", 1), (f"{TOPIC_ROOT}/model/#", 1),
                                   (f"{TOPIC_ROOT}/coordinator/status", 1)])
        self.reconnect.on_connect(mid)
        log.info(f"connected to {self.brokers.url}", extra=who(self.id))
        self.connected.set()
        self._announce(client)

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self.reconnect.on_subscribe(mid)  # a healthy connection: the backoff starts over (reconnect.py)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        if not self.stopping.is_set():
            url = self.brokers.rotate(client)
            fresh = self.reconnect.on_lost(client)
            log.warning(f"disconnected from the broker ({reason_code}); reconnecting to {url}"
                        + (f" as {fresh} (the broker dropped the connection before acknowledging its "
                           f"subscription)" if fresh else ""), extra=who(self.id))

    def _on_connect_fail(self, client, userdata) -> None:
        failed, url = self.brokers.url, self.brokers.rotate(client)
        self.reconnect.on_lost(client)
        log.warning(f"could not connect to {failed}; trying {url}", extra=who(self.id))

    def _on_message(self, client, userdata, msg) -> None:
        self._note_round(msg.topic, msg.payload)
        if msg.topic == f"{TOPIC_ROOT}/coordinator/status" and not msg.retain and self._announce_requested(msg.payload):
            self._announce(client, reply=True)  # here, not in the inbox: the main thread may be training
        self.inbox.put((msg.topic, msg.payload, bool(msg.retain), time.monotonic()))  # arrival, this host's clock

    def _note_round(self, topic: str, payload: bytes) -> None:
        """Network thread: remember the (run, round) of the latest task or global model from the coordinator,
        read from the frame's header (docs/protocol.md: "DFL1", u32 header length, JSON header) without
        decoding its body, and wake an upload waiting for a PUBACK. Invalid frames are left to `Incoming`."""
        if topic != f"{self.base}/control" and not topic.startswith(f"{TOPIC_ROOT}/model/"):
            return
        if len(payload) < 8 or payload[:4] != wire.MAGIC:
            return
        n = int.from_bytes(payload[4:8], "big")
        if n > self.limits.max_header_bytes:
            return
        try:
            h = json.loads(payload[8:8 + n])
        except (UnicodeDecodeError, ValueError, RecursionError):
            return
        if isinstance(h, dict) and h.get("kind") in ("task", "model", "onnx") and isinstance(h.get("run"), str) \
                and isinstance(h.get("round"), int) and (h["run"], h["round"]) != self._newest:
            self._newest = (h["run"], h["round"])
            self._wake.set()

    def superseded(self, run: str, rnd: int) -> tuple[str, int] | None:
        """The (run, round) that made round `rnd` of `run` stale, or None: the coordinator's latest task or model
        is of another round (it sends round t+1's only once round t has closed; a resumed coordinator's earlier
        round, too, means that this round is over)."""
        newest = self._newest
        return newest if newest is not None and newest != (run, rnd) else None

    @staticmethod
    def _announce_requested(payload: bytes) -> bool:
        """The coordinator's non-retained "online" frame with `announce`: it (re)connected and asks
        every agent for its status, because retained statuses may not reach it (RabbitMQ)."""
        try:
            h, _ = wire.decode_frame(payload)
        except wire.WireError:
            return False
        return h.kind == "coordinator" and h.meta.get("state") == "online" and h.meta.get("announce") is True

    # --- publishing (main thread; `publish` from the heartbeat thread too) ---
    def publish(self, sub: str, frames: list[bytes], qos: int = 1) -> None:
        for f in frames:
            self.mqtt.publish(f"{self.base}/{sub}", f, qos=qos)

    def _await_ack(self, info, run: str, rnd: int) -> None:
        """Wait for one chunk's PUBACK (publish_timeout_s at most), in slices of ACK_SLICE_S so that a newer
        round's task or model (`superseded`) or a stop ends the wait at once; raises `UploadStopped`."""
        end = time.monotonic() + self.cfg.agent.publish_timeout_s
        while not info.is_published():
            self._check_upload(run, rnd)
            left = end - time.monotonic()
            if left <= 0:
                raise UploadStopped(f"not acknowledged within {self.cfg.agent.publish_timeout_s} s")
            info.wait_for_publish(timeout=min(left, ACK_SLICE_S))

    def _check_upload(self, run: str, rnd: int) -> None:
        if self.stopping.is_set():
            raise UploadStopped("the agent is stopping")
        newer = self.superseded(run, rnd)
        if newer is not None:
            raise UploadStopped(f"round {newer[1]}'s task or model arrived: round {rnd} is closed", stale=True)

    def send_update(self, run: str, rnd: int, frames: list[bytes], record: RoundRecord | None = None) -> None:
        """Publish the update's chunks with at most `upload_window` unacknowledged at once (the next chunk
        waits for the broker's PUBACK of the one `upload_window` back, so a heartbeat, published by its own
        thread, waits behind at most that many chunks), then report the upload time on update/stats, with
        the round's `record` as meta `telemetry` (edge_client/telemetry.py). Stops, without stats, as soon as
        the upload is stale (the module's docstring)."""
        if record is not None:
            record.begin("upload", busy=False)
        try:
            self._upload(run, rnd, frames, record)
        finally:
            if record is not None:
                record.end()  # an interrupted upload closes its phase too

    def _upload(self, run: str, rnd: int, frames: list[bytes], record: RoundRecord | None) -> None:
        start = time.perf_counter()
        infos, sent, limit, window = [], 0, self.cfg.agent.uplink_limit_Bps, self.cfg.agent.upload_window
        acked = [0, 0.0]  # bytes acknowledged so far, and when the latest PUBACK was seen (perf_counter)

        def ack(i: int) -> None:
            self._await_ack(infos[i], run, rnd)
            acked[0] += len(frames[i])
            acked[1] = time.perf_counter()

        try:
            for i, f in enumerate(frames):
                self._check_upload(run, rnd)
                if i >= window:
                    ack(i - window)
                    self._check_upload(run, rnd)
                infos.append(self.mqtt.publish(f"{self.base}/update/delta", f, qos=1))
                sent += len(f)
                ahead = sent / limit - (time.perf_counter() - start) if limit > 0 else 0.0
                while ahead > 0:  # emulated uplink: wait, waking for a newer round or a stop
                    self._wake.clear()
                    self._check_upload(run, rnd)
                    self._wake.wait(ahead)
                    ahead = sent / limit - (time.perf_counter() - start)
            for i in range(max(len(frames) - window, 0), len(frames)):
                ack(i)
        except UploadStopped as e:
            if acked[0] and acked[1] > start:  # a measured rate all the same (chunk sizes of the next upload)
                self.rates["uplink_Bps"] = acked[0] / (acked[1] - start)
            if e.stale:
                self.uploads_abandoned += 1
                log.info(f"round {rnd}: upload abandoned after {len(infos)} of {len(frames)} chunks "
                         f"({acked[0]} bytes acknowledged): {e}", extra=who(self.id))
            else:
                log.warning(f"round {rnd}: upload stopped after {len(infos)} of {len(frames)} chunks ({e}); it is "
                            f"re-sent if the coordinator asks again", extra=who(self.id))
            return
        except (RuntimeError, ValueError) as e:
            log.warning(f"round {rnd}: upload interrupted ({e}); it is re-sent if the coordinator asks again",
                        extra=who(self.id))
            return
        upload_s = time.perf_counter() - start
        nbytes = sum(len(f) for f in frames)
        # every chunk acknowledged by the broker: the agent's own record of a sent update (tests/faultkit.py
        # counts these against what the coordinator aggregated)
        log.info(f"round {rnd}: update sent, {len(frames)} chunks ({nbytes} bytes) acknowledged, run {run}",
                 extra=who(self.id))
        self.rates["uplink_Bps"] = nbytes / upload_s if upload_s > 0 else None
        meta = {"upload_s": upload_s, "upload_bytes": nbytes, "uplink_Bps": self.rates["uplink_Bps"]}
        if record is not None:
            meta["telemetry"] = record.finish(self.battery_pct())
        self.publish("update/stats", wire.encode("stats", run, rnd, self.client_idx, meta=meta))


class UploadStopped(Exception):
    """An upload that stops before its last PUBACK: `stale` when a newer round made it useless."""

    def __init__(self, reason: str, stale: bool = False):
        super().__init__(reason)
        self.stale = stale


class Incoming:
    """The main thread's side of receiving: reassembles the inbox's frames into messages (wire.Reassembler) and
    notes when each message's first chunk arrived (a global model's download time, work.py)."""

    def __init__(self, device_id: str, limits: wire.Limits):
        self.id = device_id
        self.reasm = wire.Reassembler(limits)
        self._first_chunk_at: dict[tuple, float] = {}   # a message's first chunk's arrival

    def add(self, topic: str, payload: bytes, received: float) -> tuple[wire.Message, float] | None:
        """The message this frame completes and its first chunk's arrival (this host's monotonic clock), or None:
        a chunk of a message still incomplete, or a frame rejected (logged)."""
        try:
            msg = self.reasm.add(payload)
        except wire.WireError as e:
            log.warning(f"rejected a message on {topic}: {e.reason}", extra=who(self.id))
            return None
        last = self.reasm.last
        key = (last.run, last.round, last.kind, last.sha256)
        if msg is None:  # a chunk: note when the message's first chunk arrived (download time)
            if len(self._first_chunk_at) > 64:
                self._first_chunk_at.clear()
            self._first_chunk_at.setdefault(key, received)
            return None
        return msg, self._first_chunk_at.pop(key, received)
