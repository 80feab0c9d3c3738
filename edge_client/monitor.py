"""What the agent knows about its device: facts for the announce, samples for heartbeats, and the
availability policy that decides whether it may train now (battery, charging, network, temperature)."""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass, field

import psutil

from edge_client.battery import Reading


@dataclass
class PolicyConfig:
    min_battery_pct: float = 20.0   # below this level: decline with reason "battery"
    require_charging: bool = False  # decline unless plugged in: reason "charging"
    require_network: bool = True    # decline while the network (or the trace) says offline: "offline"
    # decline above this temperature in °C (the hottest thermal zone, edge_client/sensors.py): "thermal".
    # Off (None) by default: a board's safe limit is its own (a Raspberry Pi's firmware throttles from 80 °C,
    # a Jetson's from about 95 °C), and a default would make agents on hot hosts decline unasked.
    thermal_limit_c: float | None = field(default=None, metadata={"minimum": -40, "maximum": 200})


def decide(policy: PolicyConfig, reading: Reading, connected: bool, temp_c: float | None = None) -> str | None:
    """None if the device may train now, else the reason (docs/traces.md vocabulary), first failing
    check in the order offline, battery, charging, thermal. Unknown values never make a device unavailable."""
    if policy.require_network and not (connected and reading.online):
        return "offline"
    if reading.pct is not None and reading.pct < policy.min_battery_pct:
        return "battery"
    if policy.require_charging and reading.charging is False:
        return "charging"
    if policy.thermal_limit_c is not None and temp_c is not None and temp_c > policy.thermal_limit_c:
        return "thermal"
    return None


def device_facts() -> dict:
    vm = psutil.virtual_memory()
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "memory_bytes": int(vm.total), "python": platform.python_version(),
            "has_battery": psutil.sensors_battery() is not None}


def system_sample() -> dict:
    """Network counters (all interfaces) and CPU load since the previous call."""
    net = psutil.net_io_counters()
    return {"bytes_sent": int(net.bytes_sent), "bytes_recv": int(net.bytes_recv),
            "cpu_pct": float(psutil.cpu_percent(interval=None)),
            "load1": float(os.getloadavg()[0]) if hasattr(os, "getloadavg") else None}
