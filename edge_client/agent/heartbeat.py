"""The agent's availability (`Heartbeat`, a mixin of `Agent`).

Owns the availability policy's verdict (`policy_reason`: None when the agent may train, else why
not, from edge_client.monitor.decide on the battery reading, the broker connection and the temperature), the
heartbeat thread (every heartbeat_s, or at once when `_beat_now` is set: battery, charging, temperature,
network counters, CPU load, availability, the measured rates), and the agent's own availability trace
(`trace.csv` in the agent's out directory, docs/traces.md schema), one row per heartbeat.

Uses the Agent's cfg, id, client_idx, base, battery, telemetry, connected, stopping, rates, rounds_trained,
t0, _beat_now, mqtt.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

from edge_client import wire
from edge_client.monitor import decide, system_sample

TRACE_FIELDS = ("device", "t_s", "online", "battery_pct", "charging", "uplink_Bps", "downlink_Bps", "temp_c")


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.0f}"


class Heartbeat:
    def _open_trace(self, out: Path) -> None:
        """Start `out/trace.csv` (its header now, a row per heartbeat); `shutdown` closes it."""
        out.mkdir(parents=True, exist_ok=True)
        self.trace_path = out / "trace.csv"
        self._trace_file = open(self.trace_path, "w", newline="")
        self._trace = csv.DictWriter(self._trace_file, TRACE_FIELDS)
        self._trace.writeheader()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def policy_reason(self) -> str | None:
        reading = self.battery.read(self.now())
        return decide(self.cfg.policy, reading, self.connected.is_set(), self.temperature(reading))

    def temperature(self, reading) -> float | None:
        """A replayed trace's recorded temperature where it has one, else the device's (edge_client/sensors.py)."""
        return reading.temp_c if reading.temp_c is not None else self.telemetry.temperature()

    def _heartbeats(self) -> None:
        while not self.stopping.is_set():
            self.heartbeat()
            self._beat_now.wait(self.cfg.agent.heartbeat_s)
            self._beat_now.clear()

    def heartbeat(self) -> None:
        t = self.now()
        reading = self.battery.read(t)
        connected = self.connected.is_set()
        temp = self.temperature(reading)
        reason = decide(self.cfg.policy, reading, connected, temp)
        meta = {"t_s": t, "battery_pct": reading.pct, "charging": reading.charging, "temp_c": temp,
                "net_up": connected and reading.online, "available": reason is None, "reason": reason,
                "rounds_trained": self.rounds_trained} | system_sample() | self.rates
        if connected:
            self.mqtt.publish(f"{self.base}/heartbeat", wire.encode("heartbeat", "", -1, self.client_idx, meta=meta)[0],
                              qos=0)
        self._trace.writerow({"device": self.id, "t_s": f"{t:.3f}", "online": int(connected and reading.online),
                              "battery_pct": "" if reading.pct is None else f"{reading.pct:.2f}",
                              "charging": "" if reading.charging is None else int(reading.charging),
                              "uplink_Bps": _fmt(self.rates["uplink_Bps"]),
                              "downlink_Bps": _fmt(self.rates["downlink_Bps"]),
                              "temp_c": "" if temp is None else f"{temp:.1f}"})
        self._trace_file.flush()
