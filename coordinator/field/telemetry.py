"""Field mode: what a round cost each device, as its agent measured it (`telemetry.jsonl` of the run directory).

An agent sends its round's measurements with the round's `stats` message as meta `telemetry`
(edge_client/telemetry.py; docs/protocol.md "Telemetry"). `check` validates them: an object of known
keys only, each null or a finite number in its range, `energy_source` "modelled" or a short sensor name;
anything else rejects the stats message (code `meta`: the update still counts, without its upload rates
and telemetry, as for any invalid stats). `rows` turns a closed round's aggregated updates into one
telemetry.jsonl row per device (docs/run-directory.md), with the seconds and bytes the update's meta and
stats carry; a device whose agent sent no telemetry (an older agent) gets its row with those alone.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

# key -> (lowest, highest) of a number; null is always allowed
NUMBERS = {
    "energy_j": (0.0, 1e9), "train_energy_j": (0.0, 1e9), "upload_energy_j": (0.0, 1e9),
    "eval_s": (0.0, 1e7), "eval_energy_j": (0.0, 1e9),
    "cpu_pct": (0.0, 100.0 * 4096), "rss_peak_bytes": (0.0, 2.0 ** 50), "temp_c": (-40.0, 200.0),
    "battery_before_pct": (0.0, 100.0), "battery_after_pct": (0.0, 100.0),
}
INTEGERS = {"eval_round": (0, 2 ** 31 - 1)}
SOURCE_RE = re.compile(r"^[A-Za-z0-9_.:+-]{1,128}$")
KEYS = ("energy_source", *NUMBERS, *INTEGERS)

# the columns of a telemetry.jsonl row, in order (docs/run-directory.md)
ROW = ("round", "client", "device", "download_s", "train_s", "upload_s", "eval_round", "eval_s", "download_bytes",
       "upload_bytes", "cpu_pct", "rss_peak_bytes", "temp_c", "battery_before_pct", "battery_after_pct",
       "energy_j", "train_energy_j", "upload_energy_j", "eval_energy_j", "energy_source")


def check(meta: dict) -> str | None:
    """None if a stats meta's `telemetry` is absent or valid, else why not (one line)."""
    tel = meta.get("telemetry")
    if tel is None:
        return None
    if not isinstance(tel, dict):
        return f"meta telemetry = {str(tel)[:40]!r} is not an object"
    unknown = sorted(set(tel) - set(KEYS))
    if unknown:
        return f"meta telemetry has unknown keys {str(unknown)[:80]} (known: {', '.join(KEYS)})"
    src = tel.get("energy_source")
    if src is not None and not (isinstance(src, str) and SOURCE_RE.match(src)):
        return f"meta telemetry.energy_source = {str(src)[:40]!r} is not a sensor name (1-128 of A-Za-z0-9_.:+-)"
    for k, (lo, hi) in NUMBERS.items():
        v = tel.get(k)
        if v is not None and (not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v)
                              or not lo <= v <= hi):
            return f"meta telemetry.{k} = {str(v)[:40]!r} is not a number in {lo:g}..{hi:g}"
    for k, (lo, hi) in INTEGERS.items():
        v = tel.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi):
            return f"meta telemetry.{k} = {str(v)[:40]!r} is not an integer in {lo}..{hi}"
    return None


def row(t: int, client: int, device: str | None, meta: dict, stats: dict, download_bytes: int) -> dict:
    """One device's telemetry.jsonl row of round t: its update's meta, its stats and their telemetry."""
    tel = stats.get("telemetry") or {}
    out = {k: None for k in ROW} | {k: tel.get(k) for k in KEYS}
    out |= {"round": t, "client": client, "device": device, "download_s": meta.get("download_s"),
            "train_s": meta.get("train_s"), "upload_s": stats.get("upload_s"),
            "upload_bytes": stats.get("upload_bytes"), "download_bytes": download_bytes}
    return {k: out[k] for k in ROW}


def write_rows(path: Path, rows: list[dict]) -> None:
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
