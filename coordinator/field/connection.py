"""Field mode: the coordinator's MQTT client.

Owns `FieldConfig` (broker, credentials, deadlines, limits) and the connection to the broker: the paho
client, TLS against the broker's CA, the retained `coordinator/status` and its last will, reconnection
(paho's, with a short backoff; `connects` counts every successful (re)connect so the round in progress
can re-send what is outstanding), start/stop, and publishing. Incoming messages are parsed from their
topic here and handed, under the hub's lock `cond`, to `_dispatch` (coordinator/field/hub.py).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from paho.mqtt import client as mqtt

from coordinator.errors import UserError
from edge_client import wire
from edge_client.agent import TOPIC_ROOT, broker_address

log = logging.getLogger("dropfl.coordinator")


@dataclass
class FieldConfig:
    broker: str = "mqtt://127.0.0.1:1883"   # mqtts://HOST:PORT = TLS, server checked against ca_file
    username: str = "coordinator"
    password: str | None = None              # never written to the run directory
    ca_file: str | None = None
    run_id: str = ""
    deadline_s: float = 60.0          # per round, from the publish of the model and tasks
    heartbeat_timeout_s: float = 10.0  # no heartbeat for this long: offline
    wait_agents: int = 0              # at start, wait for this many agents (0: all clients)
    wait_timeout_s: float = 120.0
    round_wait_s: float = 0.0         # at each round start, wait up to this long for all agents
    chunk_bytes: int = 256 * 1024
    max_tensor_bytes: int = 256 * 1024 ** 2


class Connection:
    """FieldHub's MQTT part. Uses the hub's `cfg`, `n` and `cond`; sets `mqtt` and `connects`.
    Calls the hub's `_dispatch` and, when that raises, `_reject` (coordinator/field/collection.py)."""

    cfg: FieldConfig
    n: int
    cond: threading.Condition

    def _init_connection(self) -> None:
        cfg = self.cfg
        self.connects = 0
        self.mqtt = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                client_id=f"dropfl-coordinator-{uuid.uuid4().hex[:8]}", clean_session=True)
        self.mqtt.username_pw_set(cfg.username, cfg.password)
        if cfg.broker.startswith("mqtts://"):
            if not cfg.ca_file:
                raise UserError("--broker mqtts://...: the broker's CA certificate is needed (--broker-config)")
            self.mqtt.tls_set(ca_certs=cfg.ca_file)
        self.mqtt.will_set(f"{TOPIC_ROOT}/coordinator/status", self._status("offline"), qos=1, retain=True)
        self.mqtt.reconnect_delay_set(min_delay=0.2, max_delay=2)
        self.mqtt.max_inflight_messages_set(1000)
        self.mqtt.on_connect, self.mqtt.on_message = self._on_connect, self._on_message
        self.mqtt.on_disconnect = self._on_disconnect

    def _status(self, state: str) -> bytes:
        return wire.encode("coordinator", self.cfg.run_id, -1, -1, meta={"state": state, "n_clients": self.n})[0]

    def start(self) -> None:
        try:
            host, port = broker_address(self.cfg.broker)
        except Exception as e:  # AgentError: the same parser as the agents'
            raise UserError(f"--broker: {e}") from None
        self.mqtt.connect_async(host, port, keepalive=10)
        self.mqtt.loop_start()

    def stop(self, finished: bool) -> None:
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
        """Publish a message's frames (wire.encode's chunks) on `topic` under TOPIC_ROOT, QoS 1."""
        for f in frames:
            self.mqtt.publish(f"{TOPIC_ROOT}/{topic}", f, qos=1)

    # --- paho callbacks (network thread) ---
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("broker refused the connection: %s", reason_code)
            return
        dev = f"{TOPIC_ROOT}/device/+"
        client.subscribe([(f"{dev}/status", 1), (f"{dev}/heartbeat", 0), (f"{dev}/update/#", 1)])
        client.publish(f"{TOPIC_ROOT}/coordinator/status", self._status("online"), qos=1, retain=True)
        with self.cond:
            self.connects += 1
            self.cond.notify_all()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("disconnected from the broker (%s); reconnecting", reason_code)

    def _on_message(self, client, userdata, msg) -> None:
        parts = msg.topic.split("/")
        if len(parts) < 5 or parts[2] != "device":
            return
        device, sub = parts[3], "/".join(parts[4:])
        with self.cond:
            try:
                self._dispatch(device, sub, msg.payload, bool(msg.retain))
            except Exception as e:  # a bug, not bad input (that is a reject): keep paho's network thread alive
                self._reject(device, sub, "internal", f"{type(e).__name__}: {e} (a coordinator bug; please report)")
            finally:
                self.cond.notify_all()
