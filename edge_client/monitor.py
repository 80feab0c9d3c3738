"""What the agent knows about its device: facts for the announce, samples for heartbeats, and the
availability policy that decides whether it may train now."""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass

import psutil

from edge_client.battery import Reading


@dataclass
class PolicyConfig:
    min_battery_pct: float = 20.0   # below this level: decline with reason "battery"
    require_charging: bool = False  # decline unless plugged in: reason "charging"
    require_network: bool = True    # decline while the network (or the trace) says offline: "offline"


def decide(policy: PolicyConfig, reading: Reading, connected: bool) -> str | None:
    """None if the device may train now, else the reason (docs/traces.md vocabulary), first failing
    check in the order offline, battery, charging. Unknown values never make a device unavailable."""
    if policy.require_network and not (connected and reading.online):
        return "offline"
    if reading.pct is not None and reading.pct < policy.min_battery_pct:
        return "battery"
    if policy.require_charging and reading.charging is False:
        return "charging"
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
