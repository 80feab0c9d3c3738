"""Helpers for the field-mode tests: agent processes, a coordinator process, and an MQTT watcher that
waits for events (never sleeps). Everything runs against a private mosquitto on 127.0.0.1."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from paho.mqtt import client as mqtt

from edge_client import datasets, wire

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"clients": 5, "model": "logreg", "partition": "shards", "seed": 3}
CLI = [sys.executable, "-m", "coordinator.cli"]


def agent_config(i: int, broker: str, out: Path, **agent) -> Path:
    cfg = {"agent": {"client": i, "broker": broker, "heartbeat_s": 0.3, "out": str(out / f"client-{i}"),
                     "exit_when_done": False} | agent,
           "data": {"dataset": "fmnist", "partition": SETTINGS["partition"], "clients": SETTINGS["clients"],
                    "seed": SETTINGS["seed"]},
           "model": {"model": SETTINGS["model"]}, "battery": {"source": "mains"}}
    path = out / f"client-{i}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


def start_agent(config: Path, log: Path) -> subprocess.Popen:
    with open(log, "a") as f:
        return subprocess.Popen(CLI + ["client", "--config", str(config)], stdout=f, stderr=subprocess.STDOUT,
                                cwd=ROOT, start_new_session=True)


def coordinator_cmd(broker: str, out: Path, rounds: int, algo: str = "mimic", *extra: str) -> list[str]:
    return CLI + ["coordinator", "--broker", broker, "--out", str(out), "--rounds", str(rounds),
                  "--algo", algo, "--clients", str(SETTINGS["clients"]), "--model", SETTINGS["model"],
                  "--partition", SETTINGS["partition"], "--seed", str(SETTINGS["seed"]), "--steps", "2",
                  "--lr", "0.05", "--threads", "1", "--deadline", "30", "--heartbeat-timeout", "10",
                  "--no-progress", *extra]


def start_coordinator(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "a") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


def kill_group(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
    p.wait(timeout=10)


class Watcher:
    """Subscribes to dropfl/v1/# and keeps every decoded (topic, header, meta); `wait_for` blocks on a
    condition variable until a predicate over one message holds."""

    def __init__(self, port: int):
        self.cond = threading.Condition()
        self.seen: list[tuple[str, wire.Header]] = []
        self.hooks: list[Callable[[str, wire.Header], None]] = []
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"test-watcher-{os.getpid()}")
        self.c.reconnect_delay_set(min_delay=0.2, max_delay=1)
        self.c.on_connect = lambda c, *a: c.subscribe("dropfl/v1/#", qos=1)
        self.c.on_message = self._on_message
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        try:
            h, _ = wire.decode_frame(msg.payload)
        except wire.WireError:
            return
        for hook in list(self.hooks):
            hook(msg.topic, h)
        with self.cond:
            self.seen.append((msg.topic, h))
            self.cond.notify_all()

    def mark(self) -> int:
        with self.cond:
            return len(self.seen)

    def wait_for(self, pred: Callable[[str, wire.Header], bool], timeout: float = 60.0,
                 since: int = 0) -> tuple[str, wire.Header]:
        """The first message (from index `since` on) that satisfies pred, waiting for it if needed."""
        with self.cond:
            ok = self.cond.wait_for(lambda: any(pred(*m) for m in self.seen[since:]), timeout=timeout)
            assert ok, "the awaited MQTT message never came"
            return next(m for m in self.seen[since:] if pred(*m))

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


# The marks of a test module that runs a private mosquitto: `pytestmark = NEEDS_MOSQUITTO` (or + more marks).
NEEDS_MOSQUITTO = [pytest.mark.mosquitto,
                   pytest.mark.skipif(shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists(),
                                      reason="needs the mosquitto broker (apt-get install mosquitto)")]


def needs_mosquitto(test):
    """NEEDS_MOSQUITTO on one test function (a whole module says `pytestmark = NEEDS_MOSQUITTO`)."""
    for mark in NEEDS_MOSQUITTO:
        test = mark(test)
    return test

_load = datasets.load
_cached_load = functools.lru_cache(maxsize=1)(_load)


def sim_model(out: Path, rounds: int, algo: str, trace: Path | None, clients: int | None = None,
              steps: int = 2, extra: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The same run in simulation (threads 1), replaying `trace` if given, else all clients always on.
    `clients`, `steps`: for runs that differ from SETTINGS and coordinator_cmd's defaults; `extra`: more
    flags (a strategy's options)."""
    from coordinator import config
    from coordinator.sim.run import run_sim
    from coordinator.strategies import STRATEGIES


    argv = ["--clients", str(clients or SETTINGS["clients"]), "--model", SETTINGS["model"], "--partition",
            SETTINGS["partition"], "--seed", str(SETTINGS["seed"]), "--steps", str(steps), "--lr", "0.05",
            "--threads", "1",
            "--rounds", str(rounds), "--algo", algo, "--out", str(out), *extra]
    if trace is not None:
        argv += ["--availability", "replay", "--trace", str(trace)]
    import argparse
    p = argparse.ArgumentParser()
    config.add_arguments(p, list(STRATEGIES))
    cfg = config.resolve(p.parse_args(argv), list(STRATEGIES))
    datasets.load = _cached_load  # read FMNIST once, not per replay (run_sim never modifies it)
    try:
        run_sim(cfg, str(out), progress=False)
    finally:
        datasets.load = _load
    return torch.load(out / "model.pt")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def participants(path: Path) -> dict[int, set[int]]:
    from coordinator.availability.participation import read_rows
    out: dict[int, set[int]] = {}
    for r in read_rows(path):
        out.setdefault(int(r["round"]), set())
        if r["status"] == "participated":
            out[int(r["round"])].add(int(r["client"]))
    return out
