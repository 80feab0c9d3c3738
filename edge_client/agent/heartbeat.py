"""The agent's availability (`Heartbeat`, a component of `Agent`).

Owns the agent's clock (`t0`, `now()`: seconds since the agent started, the time battery models and traces
are read at), the availability policy's verdict (`policy_reason`: None when the agent may train, else why
not, from edge_client.monitor.decide on the battery reading, the broker connection and the temperature), the
heartbeat thread (every heartbeat_s, or at once after `beat_now()`: battery, charging, temperature, network
counters, CPU load, availability, rounds trained, the measured rates), and the agent's own availability trace
(`trace.csv` in the agent's out directory, docs/traces.md schema), one row per heartbeat.

Given at construction: the battery and the telemetry (its temperature), the `connected` and `stopping` events,
the measured `rates` (written by the link and the work, read here), `rounds_trained` (the work's count) and
`publish` (the link's, for the heartbeat message).
"""

from __future__ import annotations

import csv
import threading
import time
from collections.abc import Callable
from pathlib import Path

from edge_client import wire
from edge_client.agent.config import AgentConfig
from edge_client.battery import Battery
from edge_client.monitor import decide, system_sample
from edge_client.telemetry import Telemetry

TRACE_FIELDS = ("device", "t_s", "online", "battery_pct", "charging", "uplink_Bps", "downlink_Bps", "temp_c")


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.0f}"


class Heartbeat:
    def __init__(self, cfg: AgentConfig, device_id: str, client: int, battery: Battery, telemetry: Telemetry,
                 out: Path, connected: threading.Event, stopping: threading.Event, rates: dict,
                 rounds_trained: Callable[[], int], publish: Callable[[str, list[bytes], int], None]):
        self.cfg, self.id, self.client = cfg, device_id, client
        self.battery, self.telemetry = battery, telemetry
        self.connected, self.stopping, self.rates = connected, stopping, rates
        self.rounds_trained, self.publish = rounds_trained, publish
        self.t0 = time.monotonic()
        self._beat_now = threading.Event()
        # `out/trace.csv`: its header now, a row per heartbeat; `close` closes it
        out.mkdir(parents=True, exist_ok=True)
        self.trace_path = out / "trace.csv"
        self._trace_file = open(self.trace_path, "w", newline="")
        self._trace = csv.DictWriter(self._trace_file, TRACE_FIELDS)
        self._trace.writeheader()
        self._thread = threading.Thread(target=self._heartbeats, name=f"hb-{device_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def beat_now(self) -> None:
        """A heartbeat right away (or, once `stopping` is set, the thread's end without one)."""
        self._beat_now.set()

    def stop(self) -> None:
        """The thread's end (`stopping` is set): wakes it and waits for it."""
        self._beat_now.set()
        self._thread.join(timeout=5)

    def close(self) -> None:
        self._trace_file.close()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def battery_pct(self) -> float | None:
        return self.battery.read(self.now()).pct

    def policy_reason(self) -> str | None:
        reading = self.battery.read(self.now())
        return decide(self.cfg.policy, reading, self.connected.is_set(), self.temperature(reading))

    def temperature(self, reading) -> float | None:
        """A replayed trace's recorded temperature where it has one, else the device's (edge_client/sensors.py)."""
        return reading.temp_c if reading.temp_c is not None else self.telemetry.temperature()

    def _heartbeats(self) -> None:
        while not self.stopping.is_set():
            self.beat()
            self._beat_now.wait(self.cfg.agent.heartbeat_s)
            self._beat_now.clear()

    def beat(self) -> None:
        """One heartbeat: published while connected, a row of trace.csv always."""
        t = self.now()
        reading = self.battery.read(t)
        connected = self.connected.is_set()
        temp = self.temperature(reading)
        reason = decide(self.cfg.policy, reading, connected, temp)
        meta = {"t_s": t, "battery_pct": reading.pct, "charging": reading.charging, "temp_c": temp,
                "net_up": connected and reading.online, "available": reason is None, "reason": reason,
                "rounds_trained": self.rounds_trained()} | system_sample() | self.rates
        if connected:
            self.publish("heartbeat", [wire.encode("heartbeat", "", -1, self.client, meta=meta)[0]], 0)
        self._trace.writerow({"device": self.id, "t_s": f"{t:.3f}", "online": int(connected and reading.online),
                              "battery_pct": "" if reading.pct is None else f"{reading.pct:.2f}",
                              "charging": "" if reading.charging is None else int(reading.charging),
                              "uplink_Bps": _fmt(self.rates["uplink_Bps"]),
                              "downlink_Bps": _fmt(self.rates["downlink_Bps"]),
                              "temp_c": "" if temp is None else f"{temp:.1f}"})
        self._trace_file.flush()
