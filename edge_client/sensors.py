"""On-board sensors of a device: power (for energy per round) and temperature (telemetry, thermal policy).

Every path is looked up under a configurable root (`[telemetry] sysfs_root`, default "/"): a container
that bind-mounts the host's /sys elsewhere, and the tests' fake sysfs trees, use the same code as a board.

Power sources, the first one found wins (`find_power`):

- `ina3221-iio`: a Jetson with JetPack 4 (Nano, TX2, Xavier): `sys/bus/i2c/drivers/ina3221x/*/iio:device*/`
  `in_power<N>_input` (mW) with `rail_name_<N>`.
- `ina3221`: a Jetson with JetPack 5/6 (Orin), hwmon `sys/class/hwmon/hwmon*/` whose `name` is ina3221:
  `power<N>_input` (µW) where the driver has it, else `in<N>_input` (mV) × `curr<N>_input` (mA), with
  `in<N>_label`, for the chip's channels N = 1, 2, 3 (the driver's in4..in7 are shunt voltages, curr4 a sum).
  For both Jetson kinds the rail labelled as the module's input (`*_IN`, e.g. VDD_IN, POM_5V_IN) is the
  device's power: the other rails are parts of it, and adding them would count them twice. Without such a
  rail, the sum of all rails.
- `pmic`: a Raspberry Pi 5: `vcgencmd pmic_read_adc` lists each PMIC rail's current (`<RAIL>_A current(n)=
  xA`) and voltage (`<RAIL>_V volt(n)=yV`); the power is Σ current × voltage over the rails that have both.
- `power_supply`: a battery under `sys/class/power_supply/*` (`type` Battery): `power_now` (µW), else
  `current_now` (µA) × `voltage_now` (µV), else the `energy_now` counter (µWh). Only while its `status` is
  Discharging: on a charger these measure the charging, not what the device draws.

A reading that fails (a file vanished, a garbled value, a charger plugged in) is None: the round's energy
then falls back to the battery model (edge_client/telemetry.py), never to a guess.

Temperature: the hottest `sys/class/thermal/thermal_zone*/temp` (m°C); where the root is "/" and there is
no thermal zone, the hottest of `psutil.sensors_temperatures()`. Readings outside -40..200 °C (a zone
that reports an error value) are ignored.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

TEMP_RANGE_C = (-40.0, 200.0)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _number(path: Path) -> float | None:
    raw = _read(path)
    try:
        x = float(raw) if raw is not None else None
    except ValueError:
        return None
    return x if x is not None and math.isfinite(x) else None


def _input_rails(names: dict[str, str]) -> list[str]:
    """The keys of the rails to add up: those labelled as the module's input (`*_IN`), else all."""
    inputs = [k for k, label in names.items() if re.search(r"(^|_)IN$", label.upper())]
    return inputs or list(names)


@dataclass
class PowerSensor:
    """Reads watts now (`kind` "power") or a cumulative energy counter in joules (`kind` "counter")."""
    name: str       # what telemetry.jsonl's energy_source says, e.g. "ina3221:VDD_IN"
    kind: str       # "power" or "counter"

    def read(self) -> float | None:
        raise NotImplementedError  # abstract: every sensor kind below reads its own files


class Ina3221Iio(PowerSensor):
    def __init__(self, dirs: list[Path]):
        self.rails: dict[str, Path] = {}
        labels: dict[str, str] = {}
        for d in dirs:
            for p in sorted(d.glob("in_power*_input")):
                n = p.name[len("in_power"):-len("_input")]
                key = f"{d}:{n}"
                self.rails[key] = p
                labels[key] = _read(d / f"rail_name_{n}") or f"rail{n}"
        chosen = _input_rails(labels)
        self.rails = {k: self.rails[k] for k in chosen}
        super().__init__("ina3221-iio:" + "+".join(labels[k] for k in chosen), "power")

    def read(self) -> float | None:
        mw = [_number(p) for p in self.rails.values()]
        return None if not mw or any(v is None for v in mw) else sum(mw) / 1e3


class Ina3221Hwmon(PowerSensor):
    def __init__(self, dirs: list[Path]):
        self.channels: dict[str, tuple[Path, ...]] = {}
        labels: dict[str, str] = {}
        for d in dirs:
            for n in ("1", "2", "3"):  # the chip's three channels; in4..in7 are shunt voltages, curr4 their sum
                p, power, curr = d / f"in{n}_input", d / f"power{n}_input", d / f"curr{n}_input"
                if not p.exists():
                    continue
                if power.exists():
                    self.channels[f"{d}:{n}"] = (power,)
                elif curr.exists():
                    self.channels[f"{d}:{n}"] = (p, curr)
                else:
                    continue
                labels[f"{d}:{n}"] = _read(d / f"in{n}_label") or f"in{n}"
        chosen = _input_rails(labels)
        self.channels = {k: self.channels[k] for k in chosen}
        super().__init__("ina3221:" + "+".join(labels[k] for k in chosen), "power")

    def read(self) -> float | None:
        total = 0.0
        for files in self.channels.values():
            vals = [_number(f) for f in files]
            if any(v is None for v in vals):
                return None
            total += vals[0] / 1e6 if len(vals) == 1 else vals[0] * vals[1] / 1e6  # µW, or mV × mA
        return total if self.channels else None


_PMIC_LINE = re.compile(r"^\s*(\S+)_([AV])\s+(?:current|volt)\(\d+\)=([-+0-9.eE]+)[AV]\s*$")


def parse_pmic(text: str) -> float | None:
    """Watts from `vcgencmd pmic_read_adc` output: Σ current × voltage over rails with both."""
    amps: dict[str, float] = {}
    volts: dict[str, float] = {}
    for line in text.splitlines():
        m = _PMIC_LINE.match(line)
        if m:
            try:
                x = float(m.group(3))
            except ValueError:
                continue
            (amps if m.group(2) == "A" else volts)[m.group(1)] = x
    both = sorted(set(amps) & set(volts))
    if not both:
        return None
    w = sum(amps[r] * volts[r] for r in both)
    return w if math.isfinite(w) else None


class Pi5Pmic(PowerSensor):
    def __init__(self, command: str):
        self.command = command
        super().__init__("pmic", "power")

    def read(self) -> float | None:
        try:
            out = subprocess.run([self.command, "pmic_read_adc"], capture_output=True, text=True, timeout=2.0)
        except (OSError, subprocess.SubprocessError):
            return None
        return parse_pmic(out.stdout) if out.returncode == 0 else None


class PowerSupply(PowerSensor):
    def __init__(self, d: Path):
        self.dir = d
        if (d / "power_now").exists():
            self.files, kind = ("power_now",), "power"
        elif (d / "current_now").exists() and (d / "voltage_now").exists():
            self.files, kind = ("current_now", "voltage_now"), "power"
        else:
            self.files, kind = ("energy_now",), "counter"
        super().__init__(f"power_supply:{d.name}", kind)

    def read(self) -> float | None:
        if (_read(self.dir / "status") or "").lower() != "discharging":
            return None
        vals = [_number(self.dir / f) for f in self.files]
        if any(v is None for v in vals):
            return None
        if self.kind == "counter":
            return -vals[0] * 3.6e-3  # µWh → J; the counter falls as the device draws, its negative rises
        return abs(vals[0]) / 1e6 if len(vals) == 1 else abs(vals[0] * vals[1]) / 1e12  # µW, or µA × µV


def find_power(root: str | Path = "/", vcgencmd: str | None = "vcgencmd") -> PowerSensor | None:
    """The device's power sensor (the module's docstring lists them in order), or None."""
    root = Path(root)
    iio = sorted(root.glob("sys/bus/i2c/drivers/ina3221x/*/iio:device*"))
    iio = [d for d in iio if any(d.glob("in_power*_input"))]
    if iio:
        return Ina3221Iio(iio)
    hw = [d for d in sorted(root.glob("sys/class/hwmon/hwmon*")) if _read(d / "name") == "ina3221"]
    if hw:
        sensor = Ina3221Hwmon(hw)
        if sensor.channels:
            return sensor
    if vcgencmd:
        cmd = shutil.which(vcgencmd)
        if cmd and Pi5Pmic(cmd).read() is not None:  # older Pis have vcgencmd but no PMIC readings
            return Pi5Pmic(cmd)
    for d in sorted(root.glob("sys/class/power_supply/*")):
        has = {f for f in ("power_now", "current_now", "voltage_now", "energy_now") if (d / f).exists()}
        if (_read(d / "type") or "").lower() == "battery" and \
                ("power_now" in has or {"current_now", "voltage_now"} <= has or "energy_now" in has):
            return PowerSupply(d)
    return None


class Thermal:
    """The hottest temperature in °C of the root's thermal zones (or psutil's sensors on the real root)."""

    def __init__(self, root: str | Path = "/"):
        self.zones = sorted(Path(root).glob("sys/class/thermal/thermal_zone*/temp"))
        self.use_psutil = not self.zones and Path(root).resolve() == Path("/") and \
            hasattr(psutil, "sensors_temperatures")

    @property
    def present(self) -> bool:
        return bool(self.zones) or self.use_psutil

    def read(self) -> float | None:
        lo, hi = TEMP_RANGE_C
        if self.zones:
            temps = [v / 1000 for v in (_number(z) for z in self.zones) if v is not None]
        elif self.use_psutil:
            try:
                groups = psutil.sensors_temperatures()
            except (OSError, RuntimeError):
                return None
            temps = [s.current for g in groups.values() for s in g if s.current is not None]
        else:
            return None
        temps = [t for t in temps if math.isfinite(t) and lo <= t <= hi]
        return max(temps) if temps else None
