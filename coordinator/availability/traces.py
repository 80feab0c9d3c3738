"""Device availability traces (schema in docs/traces.md): replay on a virtual clock, and import
from FedScale's `client_behave_trace`.

A device trace is one CSV with a row per device per sample, a step function in time:

    device,t_s,online,battery_pct,charging,uplink_Bps,downlink_Bps
    pi-01,0,1,87.5,0,250000,1000000
    pi-01,60,1,86.9,0,,

Empty cells mean "not recorded" and never make a device unavailable (an empty `online` cell is
the exception: the device counts as offline). Every row is checked on loading: a NaN, negative or
>100 battery, a non-finite or negative time or rate, an online/charging flag other than 0/1, or an
empty device id is an error naming the file, line and value. The edge agent records its
own trace in this schema, so every field trial can be replayed here.
"""

from __future__ import annotations

import csv
import math
import pickle
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator.availability.models import RoundAvailability
from coordinator.errors import UserError
from coordinator.progress import bar
from edge_client.battery import TraceRowError, parse_trace_row

TRACE_FIELDS = ("device", "t_s", "online", "battery_pct", "charging", "uplink_Bps", "downlink_Bps")


@dataclass
class DeviceSeries:
    t: list[float]
    rows: list[dict]

    def at(self, time_s: float) -> dict | None:
        """The last sample at or before `time_s` (None before the first sample)."""
        i = bisect_right(self.t, time_s) - 1
        return self.rows[i] if i >= 0 else None


def read_device_trace(path: str | Path) -> dict[str, DeviceSeries]:
    """Read and check a whole device trace (every row: edge_client.battery.parse_trace_row), so that a
    bad value is refused with its file, line and value before a run starts, never replayed."""
    series: dict[str, list[tuple[float, dict]]] = {}
    first_line: dict[str, int] = {}
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = set(TRACE_FIELDS) - set(reader.fieldnames or [])
            if missing:
                raise UserError(f"--device-trace: {path} lacks columns {sorted(missing)} (schema: docs/traces.md)")
            for r in reader:
                try:
                    t, row = parse_trace_row(r)
                except TraceRowError as e:
                    raise UserError(f"--device-trace: {path}:{reader.line_num}: {e}; fix the row "
                                    f"(schema: docs/traces.md)") from None
                series.setdefault(r["device"], []).append((t, row))
                first_line.setdefault(r["device"], reader.line_num)
    except OSError as e:
        raise UserError(f"--device-trace: cannot read {path}: {e.strerror}") from None
    except (csv.Error, UnicodeDecodeError) as e:
        raise UserError(f"--device-trace: {path} is not a readable CSV ({e}); give a device trace "
                        f"(schema: docs/traces.md)") from None
    if not series:
        raise UserError(f"--device-trace: {path} holds no samples")
    numeric: dict[int, str] = {}
    for dev in series:
        if dev.isdigit():
            other = numeric.setdefault(int(dev), dev)
            if other != dev:
                raise UserError(f"--device-trace: {path}:{first_line[dev]}: device {dev!r} and device {other!r} "
                                f"(line {first_line[other]}) are the same number, so their order is ambiguous; "
                                f"rename one")
    out = {}
    for dev, pts in series.items():
        pts.sort(key=lambda p: p[0])
        out[dev] = DeviceSeries([p[0] for p in pts], [p[1] for p in pts])
    return out


def device_order(devices) -> list[str]:
    """Devices map to clients 0..N-1 in natural order (numeric ids numerically, others by name)."""
    return sorted(devices, key=lambda d: (0, int(d), "") if d.isdigit() else (1, 0, d))


class DeviceTraceAvailability:
    """Availability from device time series on a virtual clock: round t happens at
    `start_s + t · round_s`. A device is unavailable if it is offline, below `min_battery`, not
    charging while `require_charging`, its uplink is below `min_uplink_Bps`, or hotter than `max_temp_c`
    (the optional `temp_c` column; the agent's thermal policy, reason `thermal`) — checked in that
    order, the first failing check is the reason. Before its first sample a device is offline."""

    name = "device-trace"

    def __init__(self, path: str | Path, n_clients: int, round_s: float, start_s: float = 0.0,
                 min_battery: float = 0.0, require_charging: bool = False, min_uplink_Bps: float = 0.0,
                 max_temp_c: float | None = None):
        if round_s <= 0:
            raise UserError(f"--round-seconds must be > 0 (got {round_s})")
        traces = read_device_trace(path)
        order = device_order(traces)
        if len(order) < n_clients:
            raise UserError(f"--device-trace: {path} has {len(order)} devices, fewer than --clients {n_clients}")
        self.devices = order[:n_clients]
        self.series = [traces[d] for d in self.devices]
        self.n, self.round_s, self.start_s = n_clients, round_s, start_s
        self.min_battery, self.require_charging, self.min_uplink = min_battery, require_charging, min_uplink_Bps
        self.max_temp = max_temp_c

    def time_of(self, t: int) -> float:
        return self.start_s + t * self.round_s

    def why_not(self, s: dict | None) -> str | None:
        if s is None or s["online"] is None or s["online"] < 0.5:
            return "offline"
        if s["battery_pct"] is not None and s["battery_pct"] < self.min_battery:
            return "battery"
        if self.require_charging and s["charging"] is not None and s["charging"] < 0.5:
            return "charging"
        if self.min_uplink and s["uplink_Bps"] is not None and s["uplink_Bps"] < self.min_uplink:
            return "slow_link"
        if self.max_temp is not None and s.get("temp_c") is not None and s["temp_c"] > self.max_temp:
            return "thermal"
        return None

    def round(self, t: int) -> RoundAvailability:
        now = self.time_of(t)
        avail = np.zeros(self.n, bool)
        reasons = {}
        for i, s in enumerate(self.series):
            why = self.why_not(s.at(now))
            if why is None:
                avail[i] = True
            else:
                reasons[i] = why
        return RoundAvailability(avail, reasons)


MAX_IMPORT_ROWS = 50_000_000  # ~1.3 GB of CSV: beyond it `trace import-fedscale` asks for --max-rows


def import_fedscale(pkl: str | Path, out_csv: str | Path, horizon_s: float | None = None,
                    max_devices: int | None = None, progress: bool = False, overwrite: bool = False,
                    max_rows: int = MAX_IMPORT_ROWS) -> int:
    """Convert FedScale's `client_behave_trace` (a pickled dict client_id -> {"active": [...],
    "inactive": [...], "finish_time": T}) into our device trace. FedScale treats a client as online
    iff active[k] ≤ (t mod T) ≤ inactive[k] for some k; the pattern repeats every T seconds, and is
    unrolled here up to `horizon_s` (default: one period). Returns the number of devices written.

    Everything is checked before anything is written: every device's fields, and the number of rows the
    unrolling gives (a --horizon of many periods multiplies it: refused above `max_rows`, with the count).
    `out_csv` is written whole under a temporary name and then renamed; an existing file is replaced only
    with `overwrite`."""
    out_csv = Path(out_csv)
    if out_csv.exists() and not overwrite:
        raise UserError(f"trace import: {out_csv} exists; choose another output file or pass --overwrite")
    try:
        with open(pkl, "rb") as f:
            data = pickle.load(f)
    except OSError as e:
        raise UserError(f"trace import: cannot read {pkl}: {e.strerror}") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as e:
        raise UserError(f"trace import: {pkl} is not a pickled FedScale trace ({e})") from None
    if not isinstance(data, dict) or not data:
        raise UserError(f"trace import: {pkl} is not a dict of client traces")
    ids = sorted(data, key=lambda k: (0, int(k), "") if str(k).isdigit() else (1, 0, str(k)))
    if max_devices:
        ids = ids[:max_devices]
    devices, rows = [], 0
    for cid in ids:  # check every device and count the rows before the first write
        tr = data[cid]
        try:
            act, ina, period = [float(a) for a in tr["active"]], [float(b) for b in tr["inactive"]], \
                float(tr["finish_time"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"trace import: client {cid} lacks numeric active/inactive/finish_time") from None
        if len(act) != len(ina) or not period > 0:
            raise UserError(f"trace import: client {cid}: {len(act)} active vs {len(ina)} inactive times")
        if not all(math.isfinite(x) for x in (*act, *ina, period)):
            raise UserError(f"trace import: client {cid}: its active/inactive times and finish_time must be finite")
        reps = math.ceil((horizon_s or period) / period)
        rows += reps * (2 * len(act) + (not act or act[0] > 0))  # at most: intervals past the horizon are cut
        devices.append((cid, act, ina, period, reps))
    if rows > max_rows:
        span = f"to --horizon {horizon_s:g} s" if horizon_s else "over one period"
        raise UserError(f"trace import: unrolling {len(devices)} devices {span} gives up to {rows:,} rows (limit "
                        f"{max_rows:,}); lower --horizon or --max-devices, or raise --max-rows")
    tmp = out_csv.with_name(out_csv.name + ".tmp")
    try:
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(TRACE_FIELDS)
            for cid, act, ina, period, reps in bar(devices, total=len(devices), desc="import", unit="device",
                                                   enabled=progress):  # a terminal only
                horizon = horizon_s or period
                for rep in range(reps):
                    base = rep * period
                    if not act or act[0] > 0:
                        w.writerow([cid, base, 0, "", "", "", ""])
                    for a, b in zip(act, ina):
                        if base + a < horizon:
                            w.writerow([cid, base + a, 1, "", "", "", ""])
                            # FedScale's interval is closed at `inactive`; offline just after it.
                            w.writerow([cid, math.nextafter(base + b, math.inf), 0, "", "", "", ""])
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"trace import: cannot write {out_csv}: {e.strerror}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out_csv)
    return len(ids)
