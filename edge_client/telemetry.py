"""What a round cost the device: seconds, CPU, peak memory, temperature, battery and energy (`[telemetry]`).

The agent measures each round it trains in a `RoundRecord`: the training phase and the upload phase (and
the evaluation it finished since its previous update, which runs off the critical path, after an upload),
and sends the result with the round's `stats` message as meta `telemetry` (docs/protocol.md). The
coordinator writes it to the run directory's telemetry.jsonl (docs/run-directory.md).

Energy comes from the device's power sensor where it has one (edge_client/sensors.py), integrated over
each phase: a thread samples the sensor every `interval_s` while a phase is open (and once at each phase's
start and end) and adds up the trapezoids; a counter sensor (a battery's energy_now) is read at the two
ends. Without a sensor, or when a reading failed during any phase of the round, every phase's energy
comes from the battery model's watts instead (`[battery] train_w` while training and evaluating, `idle_w`
while uploading), and `energy_source` says "modelled": one source per record, never a mix.

Peak RSS is the process's high-water mark since the round's start: Linux resets it when "5" is written to
/proc/self/clear_refs; where that is not possible the peak is not reported (None), never the lifetime peak
passed off as the round's.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from edge_client.battery import BatteryConfig
from edge_client.sensors import PowerSensor, Thermal, find_power

MODELLED = "modelled"


@dataclass
class TelemetryConfig:
    # where /sys is looked up: "/" on a board; a container's bind mount of the host's /sys parent elsewhere
    sysfs_root: str = "/"
    vcgencmd: str = "vcgencmd"    # the Raspberry Pi 5's PMIC readings ("" : never run it)
    interval_s: float = field(default=0.2, metadata={"gt": 0})   # power sampling while a phase is open


class EnergyCounter:
    """Cumulative joules of one sensor. For a power sensor (watts), a thread samples it every `interval_s`
    while a phase is open and integrates by trapezoids; a failed read counts in `fails` and the gap around
    it is not integrated, so a phase spanning it has no sensor energy. A counter sensor is read directly."""

    def __init__(self, sensor: PowerSensor, interval_s: float):
        self.sensor, self.interval_s = sensor, interval_s
        self.lock = threading.Lock()
        self.joules, self.fails, self.last, self.active = 0.0, 0, None, 0
        self.wake, self.stopping = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="power-sampler", daemon=True) \
            if sensor.kind == "power" else None

    def start(self) -> None:
        if self.thread is not None:
            self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        if self.thread is not None and self.thread.is_alive():
            self.thread.join(timeout=5)

    def _sample(self) -> None:  # under the lock
        t, w = time.monotonic(), self.sensor.read()
        if w is None:
            self.fails += 1
            self.last = None
            return
        if self.last is not None:
            self.joules += (w + self.last[1]) / 2 * (t - self.last[0])
        self.last = (t, w)

    def _run(self) -> None:
        while not self.stopping.is_set():
            if self.active:
                with self.lock:
                    if self.active:
                        self._sample()
                self.stopping.wait(self.interval_s)
            else:
                self.wake.wait()
                self.wake.clear()

    def _snapshot(self) -> tuple[float, int] | None:
        if self.sensor.kind == "counter":
            v = self.sensor.read()
            return None if v is None else (v, 0)
        self._sample()
        return self.joules, self.fails

    def open(self) -> tuple[float, int] | None:
        with self.lock:
            self.active += 1
            if self.active == 1:
                self.last = None  # nothing is integrated while no phase is open
            snap = self._snapshot()
        self.wake.set()
        return snap

    def close(self) -> tuple[float, int] | None:
        with self.lock:
            snap = self._snapshot()
            self.active = max(self.active - 1, 0)
        return snap


def between(a: tuple[float, int] | None, b: tuple[float, int] | None) -> float | None:
    """Joules from snapshot a to snapshot b; None if a read failed in between or the counter went back."""
    if a is None or b is None or a[1] != b[1] or b[0] < a[0]:
        return None
    return b[0] - a[0]


def _cpu_seconds() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    try:
        m = re.search(r"^VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


class Telemetry:
    """The agent's sensors and its record of the last evaluation (sent with the next update)."""

    def __init__(self, cfg: TelemetryConfig, battery: BatteryConfig):
        self.cfg = cfg
        self.power = find_power(cfg.sysfs_root, cfg.vcgencmd or None)
        self.counter = EnergyCounter(self.power, cfg.interval_s) if self.power is not None else None
        self.thermal = Thermal(cfg.sysfs_root)
        self.busy_w, self.idle_w = battery.train_w, battery.idle_w
        self.last_eval: dict | None = None  # eval_round, eval_s, sensor and modelled joules (RoundRecord.finish)

    @property
    def source(self) -> str:
        return MODELLED if self.power is None else self.power.name

    def start(self) -> None:
        if self.counter is not None:
            self.counter.start()

    def stop(self) -> None:
        if self.counter is not None:
            self.counter.stop()

    def temperature(self) -> float | None:
        return self.thermal.read()

    def phase(self, busy: bool) -> Phase:
        return Phase(self, self.busy_w if busy else self.idle_w)


class Phase:
    """One measured stretch of work: `end()` returns (seconds, sensor joules or None, modelled joules)."""

    def __init__(self, tel: Telemetry, watts: float):
        self.tel, self.watts = tel, watts
        self.t0 = time.perf_counter()
        self.e0 = tel.counter.open() if tel.counter is not None else None

    def end(self) -> tuple[float, float | None, float]:
        seconds = time.perf_counter() - self.t0
        joules = between(self.e0, self.tel.counter.close()) if self.tel.counter is not None else None
        return seconds, joules, self.watts * seconds


class RoundRecord:
    """One round's measurements, from the start of training to the end of the upload (docs/protocol.md)."""

    def __init__(self, tel: Telemetry, battery_pct: float | None):
        self.tel = tel
        self.rss_reset = reset_peak_rss()
        self.cpu0, self.t0 = _cpu_seconds(), time.perf_counter()
        self.battery_before = battery_pct
        self.temps = [tel.temperature()]
        self.phases: dict[str, tuple[float, float | None, float]] = {}
        self._open: tuple[str, Phase] | None = None
        self.eval: dict | None = None  # the agent's last evaluation, taken at the first finish

    def begin(self, name: str, busy: bool) -> None:
        self.end()
        self._open = (name, self.tel.phase(busy))

    def end(self) -> None:
        if self._open is not None:
            name, ph = self._open
            self.phases[name] = ph.end()
            self._open = None
            self.temps.append(self.tel.temperature())

    def finish(self, battery_pct: float | None) -> dict:
        """The wire's `telemetry` meta (docs/protocol.md); takes the agent's last evaluation at the first call. A
        cached update sent again (the coordinator asked again) is finished again with that upload's phase."""
        self.end()
        wall = time.perf_counter() - self.t0
        cpu = _cpu_seconds() - self.cpu0
        if self.eval is None:
            self.eval, self.tel.last_eval = self.tel.last_eval or {}, None
        ev = self.eval
        parts = list(self.phases.values()) + ([ev["phase"]] if ev else [])
        sensed = self.tel.counter is not None and all(p[1] is not None for p in parts)
        energy = {name: (p[1] if sensed else p[2]) for name, p in self.phases.items()}
        temps = [t for t in self.temps if t is not None]
        out = {"energy_source": self.tel.source if sensed else MODELLED,
               "energy_j": sum(energy.values()),
               "train_energy_j": energy.get("train"), "upload_energy_j": energy.get("upload"),
               "cpu_pct": 100 * cpu / wall if wall > 0 else None,
               "rss_peak_bytes": peak_rss_bytes() if self.rss_reset else None,
               "temp_c": max(temps) if temps else None,
               "battery_before_pct": self.battery_before, "battery_after_pct": battery_pct}
        if ev:
            out |= {"eval_round": ev["round"], "eval_s": ev["phase"][0],
                    "eval_energy_j": ev["phase"][1] if sensed else ev["phase"][2]}
        return out


class EvalMeter:
    """An evaluation's busy stretches (it pauses while a task trains): their seconds and joules added up."""

    def __init__(self, tel: Telemetry):
        self.tel = tel
        self.total: tuple[float, float | None, float] = (0.0, 0.0, 0.0)
        self._ph: Phase | None = None

    def resume(self) -> None:
        self._ph = self.tel.phase(busy=True)

    def pause(self) -> None:
        if self._ph is not None:
            self.total = _add(self.total, self._ph.end())
            self._ph = None

    def done(self, rnd: int) -> None:
        """Keep the evaluation for the next round's record (a failed evaluation is not kept). Evaluations
        finished since the last record (the agent declined or was not selected meanwhile) add up, under
        the latest one's round."""
        self.pause()
        prev = self.tel.last_eval
        if prev is not None:
            self.total = _add(prev["phase"], self.total)
        self.tel.last_eval = {"round": rnd, "phase": self.total}


def _add(a: tuple[float, float | None, float], b: tuple[float, float | None, float]) -> tuple:
    """(seconds, sensor joules or None, modelled joules) of two stretches together."""
    return a[0] + b[0], None if a[1] is None or b[1] is None else a[1] + b[1], a[2] + b[2]
