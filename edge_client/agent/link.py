"""The agent's MQTT plumbing (`Link`, a mixin of `Agent`).

Owns the paho client: its creation (username/password, TLS against ca_file for mqtts://, the
retained "offline" last will, reconnect delays), the status frame (device facts and data binding),
the callbacks of paho's network thread (on_connect subscribes and announces "online", on_disconnect,
on_message only queues into `self.inbox`), and publishing: `_publish` for small messages and
`_send_update` for an update's chunks (paced to uplink_limit_Bps, waits for the broker's PUBACKs,
then reports the upload's time and rate on update/stats).

Uses the Agent's cfg, id, client_idx, base, binding, y, inbox, connected, stopping, rates, _beat_now, mqtt.
"""

from __future__ import annotations

import time

from paho.mqtt import client as mqtt

from edge_client import wire
from edge_client.agent.config import TOPIC_ROOT, AgentError, log, who
from edge_client.monitor import device_facts


class Link:
    # --- the client (paho's network thread runs the callbacks) ---
    def _make_client(self) -> mqtt.Client:
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"dropfl-{self.id}", clean_session=True)
        c.username_pw_set(self.id, self.cfg.agent.password)
        if self.cfg.agent.broker.startswith("mqtts://"):
            if not self.cfg.agent.ca_file:
                raise AgentError("broker mqtts://...: set ca_file (the broker's CA certificate)")
            c.tls_set(ca_certs=self.cfg.agent.ca_file)
        c.will_set(f"{self.base}/status", self._status_frame("offline"), qos=1, retain=True)
        c.reconnect_delay_set(min_delay=0.2, max_delay=2)
        c.max_inflight_messages_set(100)
        c.on_connect, c.on_disconnect, c.on_message = self._on_connect, self._on_disconnect, self._on_message
        return c

    def _status_frame(self, state: str) -> bytes:
        meta: dict = {"state": state, "device": self.id}
        if state == "online":
            meta |= device_facts() | self.binding.to_meta() | {"num_samples": len(self.y)}
        return wire.encode("status", "", -1, self.client_idx, meta=meta)[0]

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error(f"broker refused the connection: {reason_code}", extra=who(self.id))
            return
        client.subscribe([(f"{self.base}/control", 1), (f"{TOPIC_ROOT}/model/#", 1),
                          (f"{TOPIC_ROOT}/coordinator/status", 1)])
        client.publish(f"{self.base}/status", self._status_frame("online"), qos=1, retain=True)
        self.connected.set()
        self._beat_now.set()  # a heartbeat right away: it tells the coordinator whether we can train

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()

    def _on_message(self, client, userdata, msg) -> None:
        self.inbox.put((msg.topic, msg.payload, bool(msg.retain), time.time()))

    # --- publishing (main thread) ---
    def _publish(self, sub: str, frames: list[bytes], qos: int = 1) -> None:
        for f in frames:
            self.mqtt.publish(f"{self.base}/{sub}", f, qos=qos)

    def _send_update(self, run: str, rnd: int, frames: list[bytes]) -> None:
        """Publish the update's chunks, wait for the broker's PUBACKs, then report the upload time."""
        start = time.perf_counter()
        infos, sent, limit = [], 0, self.cfg.agent.uplink_limit_Bps
        for f in frames:
            infos.append(self.mqtt.publish(f"{self.base}/update/delta", f, qos=1))
            sent += len(f)
            ahead = sent / limit - (time.perf_counter() - start) if limit > 0 else 0.0
            if ahead > 0 and self.stopping.wait(ahead):
                return
        try:
            for info in infos:
                info.wait_for_publish(timeout=self.cfg.agent.publish_timeout_s)
        except (RuntimeError, ValueError) as e:
            log.warning(f"round {rnd}: upload interrupted ({e}); it is re-sent if the coordinator asks again",
                        extra=who(self.id))
            return
        if not all(i.is_published() for i in infos):
            log.warning(f"round {rnd}: upload not acknowledged within {self.cfg.agent.publish_timeout_s} s",
                        extra=who(self.id))
            return
        upload_s = time.perf_counter() - start
        nbytes = sum(len(f) for f in frames)
        self.rates["uplink_Bps"] = nbytes / upload_s if upload_s > 0 else None
        self._publish("update/stats", wire.encode("stats", run, rnd, self.client_idx, meta={
            "upload_s": upload_s, "upload_bytes": nbytes, "uplink_Bps": self.rates["uplink_Bps"]}))
