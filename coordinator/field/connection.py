"""Field mode: the coordinator's MQTT client.

Owns `FieldConfig` (broker URLs, credentials, deadlines, limits) and the connection to the broker: the
paho client, TLS against the broker's CA (one CA for every URL), the retained `coordinator/status` and
its last will, reconnection (paho's, its delays and client id set by `edge_client.agent.reconnect.Reconnect`:
backoff with jitter, a fresh client id after a connection dropped before its subscription was answered) with
failover over the URL list (on a disconnect or a failed connect paho is pointed at the next URL:
`edge_client.agent.config.Brokers`),
the announce request (on every connect a non-retained `online` frame with `announce`, to which every
agent answers with its status: retained statuses are an optimisation, never needed), `connects`
(counts every (re)connect whose subscription the broker answered, so the round in progress can re-send
what is outstanding),
start/stop, and publishing. Incoming messages are parsed from their
topic here and handed, under the hub's lock `cond`, to `deliver` (the hub's `FieldHub._dispatch`,
coordinator/field/hub.py); what they say of the broker's health goes to its `Outage` (outage.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from paho.mqtt import client as mqtt

from coordinator.errors import UserError
from coordinator.field.outage import PROBE_EVERY_S, Outage
from edge_client import wire
from edge_client.agent.config import TOPIC_ROOT, AgentError, Brokers
from edge_client.agent.reconnect import Reconnect

log = logging.getLogger("dropfl.coordinator")


@dataclass
class FieldConfig:
    broker: str = "mqtt://127.0.0.1:1883"   # URL[,URL...]: failover in order; mqtts:// = TLS, checked against ca_file
    username: str = "coordinator"
    password: str | None = None              # never written to the run directory
    ca_file: str | None = None
    run_id: str = ""
    deadline_s: float = 60.0          # per round, from the publish of the model and tasks
    heartbeat_timeout_s: float = 10.0  # nothing heard from an agent for this long: offline
    upload_extension_s: float = 60.0  # an upload still arriving at the deadline may run this much past it (0: off)
    wait_agents: int = 0              # at start, wait for this many agents (0: all clients)
    wait_timeout_s: float = 120.0
    round_wait_s: float = 0.0         # at each round start, wait up to this long for all agents
    broker_outage_timeout_s: float = 300.0  # disconnected from the broker this long: stop (resume later)
    empty_federation_timeout_s: float = 300.0  # nobody there to take part this long: stop (resume later)
    chunk_bytes: int = 256 * 1024
    max_tensor_bytes: int = 256 * 1024 ** 2


class Connection:
    """FieldHub's MQTT client: `mqtt`, the broker list `brokers`, `reconnect`, `connects`. Tells the broker's health
    component `outage` (outage.py) of every contact, probe echo, publish and disconnect; hands a device's message
    to `deliver(device, sub, payload, retained)` (the hub's router) and, when that raises, to `reject` (the
    round collection's); `fan_out()` is how many agents a `model/...` frame goes to. Under the hub's lock `cond`."""

    def __init__(self, cfg: FieldConfig, n: int, cond: threading.Condition, outage: Outage,
                 deliver: Callable[[str, str, bytes, bool], None], reject: Callable[[str, str, str, str], None],
                 fan_out: Callable[[], int]):
        self.cfg, self.n, self.cond, self.outage = cfg, n, cond, outage
        self.deliver, self.reject, self.fan_out = deliver, reject, fan_out
        self.connects = 0
        self.stopping = False
        try:
            self.brokers = Brokers(cfg.broker, "--broker")
        except AgentError as e:  # the same parser as the agents'
            raise UserError(str(e)) from None
        client_id = f"dropfl-coordinator-{uuid.uuid4().hex[:8]}"
        self.probe_topic = f"{TOPIC_ROOT}/coordinator/probe/{client_id}"  # to ourselves (outage.py `silence`)
        self._probing = threading.Event()
        self.reconnect = Reconnect(client_id)  # backoff with jitter, a fresh id after a refusal (the docstring)
        self.mqtt = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=True)
        self.mqtt.username_pw_set(cfg.username, cfg.password)
        if self.brokers.tls:
            if not cfg.ca_file:
                raise UserError("--broker mqtts://...: the broker's CA certificate is needed (--broker-config)")
            self.mqtt.tls_set(ca_certs=cfg.ca_file)
        self.mqtt.will_set(f"{TOPIC_ROOT}/coordinator/status", self._status("offline"), qos=1, retain=True)
        self.mqtt.reconnect_delay_set(min_delay=0.2, max_delay=0.2)  # the first retry; then reconnect.py decides
        self.mqtt.max_inflight_messages_set(1000)
        self.mqtt.on_connect, self.mqtt.on_message = self._on_connect, self._on_message
        self.mqtt.on_disconnect, self.mqtt.on_connect_fail = self._on_disconnect, self._on_connect_fail
        self.mqtt.on_subscribe = self._on_subscribe

    def _status(self, state: str, announce: bool = False) -> bytes:
        meta = {"state": state, "n_clients": self.n} | ({"announce": True} if announce else {})
        return wire.encode("coordinator", self.cfg.run_id, -1, -1, meta=meta)[0]

    def start(self) -> None:
        self.mqtt.connect_async(*self.brokers.address, keepalive=10)
        self.mqtt.loop_start()
        threading.Thread(target=self._probe, name="dropfl-broker-probe", daemon=True).start()

    def _probe(self) -> None:
        """Every PROBE_EVERY_S while connected: a probe through the broker to ourselves, and the silence check
        (outage.py `silence`: a broker that stopped answering, its connection open)."""
        while not self._probing.wait(PROBE_EVERY_S):
            if not self.mqtt.is_connected():
                continue
            self.mqtt.publish(self.probe_topic, repr(time.monotonic()).encode(), qos=0)  # its time: `probe_echo`
            with self.cond:
                self.outage.silence(time.monotonic())

    def stop(self, finished: bool) -> None:
        self.stopping = True
        self._probing.set()
        if self.mqtt.is_connected():
            state = "finished" if finished else "offline"
            info = self.mqtt.publish(f"{TOPIC_ROOT}/coordinator/status", self._status(state), qos=1, retain=True)
            try:
                info.wait_for_publish(timeout=5)
            except (RuntimeError, ValueError):
                pass
        self.mqtt.disconnect()
        self.mqtt.loop_stop()

    # --- publishing (any thread; paho queues while disconnected) ---
    def publish_frames(self, topic: str, frames: Iterable[bytes]) -> None:
        """Publish a message's frames (wire.encode's chunks) on `topic` under TOPIC_ROOT, QoS 1. What the broker
        is given to send is counted (outage.py `published`): a `model/...` frame once per known agent."""
        for f in frames:
            with self.cond:
                self.outage.published(time.monotonic(), len(f) * (max(self.fan_out(), 1) if topic.startswith("model/")
                                                                  else 1))
            self.mqtt.publish(f"{TOPIC_ROOT}/{topic}", f, qos=1)

    # --- paho callbacks (network thread) ---
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("broker refused the connection: %s", reason_code)
            return
        dev = f"{TOPIC_ROOT}/device/+"  # clean session: subscribe on every connect
        _, mid = client.subscribe([(f"{dev}/status", 1), (f"{dev}/heartbeat", 0), (f"{dev}/update/#", 1),
                                   (self.probe_topic, 0)])
        self.reconnect.on_connect(mid)
        status = f"{TOPIC_ROOT}/coordinator/status"
        client.publish(status, self._status("online"), qos=1, retain=True)  # for late subscribers (mosquitto)
        # the announce request: agents answer with their status; after the subscribe on this connection,
        # so their answers reach us. Needed where retained statuses do not reach `device/+/status` (RabbitMQ)
        client.publish(status, self._status("online", announce=True), qos=1)
        log.info("connected to the broker %s", self.brokers.url)

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        """The broker answered the subscription sent on connect: the connection is usable. Only now does a
        broker outage end and the round in progress re-send (a RabbitMQ node may accept a CONNACK and then drop
        the connection at the subscription: edge_client/agent/reconnect.py)."""
        if not self.reconnect.on_subscribe(mid):
            return
        with self.cond:
            self.connects += 1
            self.outage.contact(time.monotonic())
            self.outage.ended()  # a reconnect ends a broker outage (coordinator/field/outage.py)
            self.cond.notify_all()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if self.stopping:
            return
        with self.cond:  # unexpected: no round opens or closes until we are back (coordinator/field/outage.py)
            self.outage.disconnected()  # from now on unreachable, whatever began the outage
        url = self.brokers.rotate(client)
        fresh = self.reconnect.on_lost(client)
        if reason_code.is_failure or fresh:
            log.warning("disconnected from the broker (%s); reconnecting to %s%s", reason_code, url,
                        f" as {fresh} (the broker dropped the connection before answering its subscription)"
                        if fresh else "")

    def _on_connect_fail(self, client, userdata) -> None:
        failed, url = self.brokers.url, self.brokers.rotate(client)
        self.reconnect.on_lost(client)
        log.warning("could not connect to the broker %s; trying %s", failed, url)

    def _on_message(self, client, userdata, msg) -> None:
        parts = msg.topic.split("/")
        with self.cond:
            now = time.monotonic()
            self.outage.contact(now)  # anything from the broker (a probe's echo too): it answers
            if msg.topic == self.probe_topic:
                try:
                    self.outage.probe_echo(now, float(msg.payload))
                except ValueError:  # not one of ours (an older coordinator's empty probe): no time to go by
                    pass
                return
            if len(parts) < 5 or parts[2] != "device":
                return
            device, sub = parts[3], "/".join(parts[4:])
            try:
                self.deliver(device, sub, msg.payload, bool(msg.retain))
            except Exception as e:  # a bug, not bad input (that is a reject): keep paho's network thread alive
                self.reject(device, sub, "internal", f"{type(e).__name__}: {e} (a coordinator bug; please report)")
            finally:
                self.cond.notify_all()
