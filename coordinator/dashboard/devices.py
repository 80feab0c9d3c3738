"""The device panel: one row per client, from whatever the run directory holds about its devices.

A run records its devices in several files, none of them complete alone, so each row names its sources:

    participation.csv (or the columnar participation/): rounds trained, and the client's status (and reason)
                              in the latest round
    reports.jsonl             the latest link rates the client reported with an update (field mode, clock profile)
    field.jsonl               field mode: the device id, online/offline events with their wall time, and per
                              round the client's upload rate and training seconds
    agents/<id>/trace.csv     a trial: every heartbeat of the agent (battery, charging, online, link rates);
                              the file's modification time is the agent's last heartbeat
    telemetry.jsonl           per-device telemetry of each round trained (edge_client/telemetry.py RoundRecord):
                              the latest battery (after the round), temperature and CPU %, the energy summed
                              over the rounds (`energy_j`) and where it came from (`energy_source`); a
                              trial's heartbeats (trace.csv) are later readings, so they win where both exist

The coordinator keeps the agents' heartbeats in memory only, so a `dropfl coordinator` run with remote agents
shows battery and charging only where telemetry.jsonl carries them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.availability.participation import STATUSES

if TYPE_CHECKING:
    from coordinator.dashboard.rundata import RunData

STATUS_OF = {s[0].upper(): s for s in STATUSES}  # the raster's letters (coordinator/dashboard/participation.py)
LINK_KEYS = {"uplink_Bps": ("uplink_Bps", "up_Bps"), "downlink_Bps": ("downlink_Bps", "down_Bps")}


def _num(v):
    """A CSV cell or JSON value as a number (None if empty or not a number)."""
    if v is None or v == "" or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _agent_client(trace: Path) -> int | None:
    """The client index of the agent whose trace this is (its agent.json beside it, written by the trial)."""
    try:
        return int(json.loads((trace.parent / "agent.json").read_text())["agent"]["client"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def device_rows(run: RunData, per_round: dict[int, tuple[str, dict, dict]], n: int, shown: int) -> dict:
    """`per_round`: the participation log's rounds (coordinator/dashboard/participation.py)."""
    rows = [{"client": c, "device": None, "connection": None, "battery_pct": None, "charging": None,
             "uplink_Bps": None, "downlink_Bps": None, "last_seen": None, "rounds_trained": 0,
             "last_round": None, "last_status": None, "last_reason": None, "train_s": None, "temp_c": None,
             "cpu_pct": None, "energy_j": None, "energy_source": None,
             "sources": []} for c in range(shown)]

    def row(c) -> dict | None:
        try:
            c = int(c)
        except (TypeError, ValueError):
            return None
        return rows[c] if 0 <= c < shown else None

    def seen(r: dict, t: float | None, source: str) -> None:
        if t is not None and (r["last_seen"] is None or t > r["last_seen"]):
            r["last_seen"] = t
        if source not in r["sources"]:
            r["sources"].append(source)

    source = "participation.csv" if run.participation.csv.rows else "participation/"
    for t in sorted(per_round):
        letters, reasons, _ = per_round[t]
        for c, code in enumerate(letters[:shown]):
            if code not in STATUS_OF:
                continue
            r = rows[c]
            r["rounds_trained"] += code == "P"
            r["last_round"], r["last_status"], r["last_reason"] = t, STATUS_OF[code], reasons.get(str(c))
            seen(r, None, source)
    for rep in run.reports.rows:
        for c, m in (rep.get("reports") or {}).items():
            r = row(c)
            if r is None or not isinstance(m, dict):
                continue
            for key, names in LINK_KEYS.items():
                v = _num(m.get(names[1]))
                if v is not None:
                    r[key] = v
            seen(r, None, "reports.jsonl")
    for e in run.field.rows:
        if e.get("event") == "agent":
            r = row(e.get("client"))
            if r is not None:
                r["device"], r["connection"] = e.get("device"), e.get("state")
                seen(r, _num(e.get("time")), "field.jsonl")
        elif e.get("event") == "round":
            for c, st in (e.get("clients") or {}).items():
                r = row(c)
                if r is not None and isinstance(st, dict):
                    r["uplink_Bps"] = _num(st.get("uplink_Bps")) or r["uplink_Bps"]
                    r["train_s"] = _num(st.get("train_s"))
                    seen(r, None, "field.jsonl")
    for e in run.telemetry.rows:
        r = row(e.get("client"))
        if r is None:
            continue
        for key, name in (("battery_pct", "battery_after_pct"), ("temp_c", "temp_c"), ("cpu_pct", "cpu_pct")):
            v = _num(e.get(name))
            if v is not None:
                r[key] = v
        if _num(e.get("energy_j")) is not None:  # the round's total (its phases' energies are parts of it)
            r["energy_j"] = (r["energy_j"] or 0.0) + _num(e["energy_j"])
            r["energy_source"] = e.get("energy_source")
        r["device"] = e.get("device") or r["device"]
        seen(r, _num(e.get("time")), "telemetry.jsonl")
    for path, f in run.traces.items():
        if not f.rows:
            continue
        c = _agent_client(path)
        r = row(c)
        if r is None:
            continue
        last = f.rows[-1]
        r["device"] = last.get("device") or r["device"]
        for key in ("battery_pct", "charging", "temp_c", *LINK_KEYS):  # an empty cell: not measured
            v = _num(last.get(key))
            r[key] = v if v is not None else r[key]
        r["connection"] = r["connection"] if r["connection"] == "offline" else \
            ("online" if last.get("online") == "1" else "offline")
        try:
            mtime = path.stat().st_mtime
        except OSError:
            mtime = None
        seen(r, mtime, f"agents/{path.parent.name}/trace.csv")
    return {"clients": n, "shown": shown, "rows": rows,
            "problems": [p for f in (run.telemetry, *run.traces.values()) for p in f.problems]}
