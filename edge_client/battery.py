"""Battery sources for the edge agent, chosen by its config (`[battery] source = ...`):

- `psutil`: the device's real battery (`psutil.sensors_battery()`); refuses to start without one.
- `trace`:  a recorded device trace (docs/traces.md schema), replayed against the agent's clock (its
            optional temp_c column too: the thermal policy then sees the recorded temperature).
- `model`:  an energy model: capacity, draw while idle and while training, charge rate, and a
            plugged-in schedule (windows in seconds since start, optionally repeating).
- `mains`:  no battery (always powered, e.g. a Jetson on a bench supply).

Every source answers `read(t_s) -> Reading` for the agent's time t_s (seconds since it started);
the model also hears `training(seconds)` so that training drains it faster than idling.
"""

from __future__ import annotations

import csv
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import psutil


class BatteryError(Exception):
    """The configured battery source cannot be used; the message says what to do instead."""


@dataclass
class Reading:
    pct: float | None         # battery level in %, None = no battery / not recorded
    charging: bool | None     # on external power, None = not recorded
    online: bool = True       # network connected (a recorded trace may say otherwise)
    temp_c: float | None = None  # a recorded trace's temperature (its temp_c column): replaces the sensors'


@dataclass
class BatteryConfig:
    source: str = "mains"                 # mains | psutil | trace | model
    trace: str | None = None              # trace: CSV path (device trace schema)
    device: str | None = None             # trace: which device's rows (default: the agent's device id)
    capacity_j: float = 36_000.0          # model: energy when full, joules (10 Wh)
    start_pct: float = 100.0              # model: level at start
    idle_w: float = 1.0                   # model: draw while idle, watts
    train_w: float = 5.0                  # model: draw while training, watts
    charge_w: float = 10.0                # model: charging power while plugged in, watts
    plugged: list[list[float]] = field(default_factory=list)  # model: [[from_s, to_s], ...] plugged in
    plug_period_s: float | None = None    # model: the schedule repeats with this period


class MainsPower:
    def read(self, t_s: float) -> Reading:
        return Reading(None, True)

    def training(self, seconds: float) -> None:
        pass


class PsutilBattery:
    def __init__(self):
        if psutil.sensors_battery() is None:
            raise BatteryError("battery source 'psutil': this machine reports no battery "
                               "(psutil.sensors_battery() is None); use source = 'mains', 'model' or 'trace'")

    def read(self, t_s: float) -> Reading:
        b = psutil.sensors_battery()
        return Reading(None, None) if b is None else Reading(float(b.percent), bool(b.power_plugged))

    def training(self, seconds: float) -> None:
        pass


TRACE_COLUMNS = ("device", "t_s", "online", "battery_pct", "charging", "uplink_Bps", "downlink_Bps")

# column -> (accepts, what it must be); every value must also be finite (a literal nan/inf is an error)
_TRACE_RANGES = {
    "t_s": (lambda x: x >= 0, "a finite time >= 0 s"),
    "online": (lambda x: x in (0, 1), "0 or 1"),
    "battery_pct": (lambda x: 0 <= x <= 100, "a level in 0..100 %"),
    "charging": (lambda x: x in (0, 1), "0 or 1"),
    "uplink_Bps": (lambda x: x >= 0, "a finite rate >= 0 bytes/s"),
    "downlink_Bps": (lambda x: x >= 0, "a finite rate >= 0 bytes/s"),
    "temp_c": (lambda x: -40 <= x <= 200, "a temperature in -40..200 °C"),  # optional column (agents write it)
}


class TraceRowError(ValueError):
    """One row of a device trace is malformed; the message names the column and the value."""


def parse_trace_row(r: dict) -> tuple[float, dict[str, float | None]]:
    """Check one device-trace row (as csv.DictReader gives it) and return (t_s, {column: value}).

    An empty cell, or a column the file lacks, is None: "not recorded" (t_s alone is required).
    Anything else must be a finite number in range: t_s >= 0, online and charging 0 or 1,
    battery_pct 0..100, rates >= 0, temp_c (optional) -40..200. A literal `nan` is an error, not "not
    recorded": a level that is unknown is written as an empty cell. Shared by the coordinator
    (coordinator/availability/traces.py)."""
    if None in r or None in r.values():
        header = sum(k is not None for k in r)
        got = header - sum(v is None for k, v in r.items() if k is not None) + len(r.get(None) or [])
        raise TraceRowError(f"the row has {got} fields, the header {header}")
    if "device" in r and not r["device"].strip():
        raise TraceRowError("column 'device' is empty (every row names its device)")
    vals: dict[str, float | None] = {}
    for col, (accepts, want) in _TRACE_RANGES.items():
        raw = (r.get(col) or "").strip()
        if not raw:
            if col == "t_s":
                raise TraceRowError("column 't_s' is empty (every row needs its time in seconds)")
            vals[col] = None
            continue
        hint = "" if col == "t_s" else " (leave the cell empty for \"not recorded\")"
        try:
            x = float(raw)
        except ValueError:
            raise TraceRowError(f"column {col!r}: {raw!r} is not a number{hint}") from None
        if not (math.isfinite(x) and accepts(x)):
            raise TraceRowError(f"column {col!r}: {raw!r} is not {want}{hint}")
        vals[col] = x
    return vals.pop("t_s"), vals


class TraceBattery:
    """Step function over one device's rows: the latest row at or before t_s holds; before the
    first row the device is offline. Empty cells mean "not recorded". Every row of the file is
    checked when it is loaded (parse_trace_row): a bad value is an error, never a reading."""

    def __init__(self, path: str | Path, device: str | None):
        try:
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                if reader.fieldnames and "t_s" not in reader.fieldnames:
                    raise BatteryError(f"battery trace {path}: no t_s column (see docs/traces.md)")
                rows = [(reader.line_num, r) for r in reader]
        except OSError as e:
            raise BatteryError(f"battery trace {path}: {e.strerror}") from None
        except (csv.Error, UnicodeDecodeError) as e:
            raise BatteryError(f"battery trace {path}: not a readable CSV ({e}); "
                               f"give a device trace (see docs/traces.md)") from None
        parsed = []
        for line, r in rows:
            try:
                t, vals = parse_trace_row(r)
            except TraceRowError as e:
                raise BatteryError(f"battery trace {path}:{line}: {e}; fix the row (see docs/traces.md)") from None
            parsed.append((r.get("device"), t, vals))
        if device is not None and rows and "device" in rows[0][1]:
            devices = sorted({d for d, _, _ in parsed})
            parsed = [p for p in parsed if p[0] == device]
            if not parsed:
                shown = ", ".join(repr(d) for d in devices[:5]) + (", ..." if len(devices) > 5 else "")
                raise BatteryError(f"battery trace {path}: no rows for device {device!r} (it has {shown}); "
                                   f"set [battery] device to one of them")
        if not parsed:
            raise BatteryError(f"battery trace {path}: no rows for device {device!r}")
        self.rows = sorted(((t, vals) for _, t, vals in parsed), key=lambda p: p[0])

    def read(self, t_s: float) -> Reading:
        last = None
        for t, r in self.rows:
            if t > t_s:
                break
            last = r
        if last is None:
            return Reading(None, None, online=False)
        pct, charging, online = last["battery_pct"], last["charging"], last["online"]
        return Reading(pct, None if charging is None else bool(charging), online is None or bool(online),
                       last.get("temp_c"))

    def training(self, seconds: float) -> None:
        pass


class ModelBattery:
    """Energy bookkeeping: E' = charge_w·plugged − idle_w, integrated in steps of at most `step_s`;
    training adds (train_w − idle_w)·seconds of drain. Level = E / capacity, clamped to [0, 100] %."""

    step_s = 0.05

    def __init__(self, cfg: BatteryConfig):
        if cfg.capacity_j <= 0 or not (0 <= cfg.start_pct <= 100) or min(cfg.idle_w, cfg.train_w, cfg.charge_w) < 0:
            raise BatteryError("battery model: need capacity_j > 0, 0 <= start_pct <= 100, non-negative watts")
        if any(len(w) != 2 or w[0] > w[1] for w in cfg.plugged):
            raise BatteryError(f"battery model: plugged must be [[from_s, to_s], ...] (got {cfg.plugged})")
        self.cfg = cfg
        self.energy = cfg.capacity_j * cfg.start_pct / 100
        self.t = 0.0
        self.lock = threading.Lock()

    def plugged(self, t_s: float) -> bool:
        p = self.cfg.plug_period_s
        x = t_s % p if p else t_s
        return any(a <= x < b for a, b in self.cfg.plugged)

    def _advance(self, t_s: float) -> None:
        while self.t < t_s:
            dt = min(self.step_s, t_s - self.t)
            power = (self.cfg.charge_w if self.plugged(self.t + dt / 2) else 0.0) - self.cfg.idle_w
            self.energy = min(max(self.energy + power * dt, 0.0), self.cfg.capacity_j)
            self.t += dt

    def read(self, t_s: float) -> Reading:
        with self.lock:
            self._advance(t_s)
            return Reading(100 * self.energy / self.cfg.capacity_j, self.plugged(t_s))

    def training(self, seconds: float) -> None:
        with self.lock:
            extra = (self.cfg.train_w - self.cfg.idle_w) * seconds
            self.energy = min(max(self.energy - extra, 0.0), self.cfg.capacity_j)


Battery = MainsPower | PsutilBattery | TraceBattery | ModelBattery
SOURCES = ("mains", "psutil", "trace", "model")


def make_battery(cfg: BatteryConfig, device_id: str) -> Battery:
    if cfg.source == "mains":
        return MainsPower()
    if cfg.source == "psutil":
        return PsutilBattery()
    if cfg.source == "trace":
        if not cfg.trace:
            raise BatteryError("battery source 'trace' needs trace = PATH (a device trace CSV)")
        return TraceBattery(cfg.trace, cfg.device or device_id)
    if cfg.source == "model":
        return ModelBattery(cfg)
    raise BatteryError(f"battery source {cfg.source!r} is unknown (choose from {', '.join(SOURCES)})")
