"""The edge agent (`dropfl client --config FILE`, or `python -m edge_client.agent --config FILE`).

One agent is one client of the federation. It connects to the broker, announces itself (device facts
and its data binding) with a retained status whose last will says offline, sends heartbeats (battery,
charging, temperature, network counters, CPU load, and whether its policy lets it train), and answers round tasks:
it declines with its policy's reason, or trains with `edge_client.trainer.local_train` on its own
shard (computed from dataset + partition + seed exactly as the simulation does), uploads the update,
reports the measured transfer and training rates and what the round cost the device (telemetry.py: seconds,
CPU, peak RSS, temperature, battery, energy), and evaluates each new global model with
onnxruntime on its own test split when idle (never delaying a task: work.py). It reads only its own
rows of the dataset (data.py). It records its own availability trace (docs/traces.md schema).

Threads: paho's network thread only queues messages; the main thread handles them (training happens
there); a heartbeat thread samples the battery and publishes; where the device has a power sensor, a
sampler thread reads it while a round is measured (edge_client/telemetry.py). Never imports `coordinator`.

The parts:
    config.py     the config file (sections, loading), broker URL, TOPIC_ROOT, AgentError, the logger
    data.py       the data binding and this client's shard
    device.py     where it trains (`[agent] device` / `--device auto|cpu|cuda`), deterministic CUDA
    link.py       MQTT plumbing: client, status, callbacks into the inbox, publishing an update
    heartbeat.py  availability: policy verdict, heartbeat thread, trace.csv
    work.py       the work: handling messages, tasks, training and upload (FedDD too), evaluation
    cli.py        `dropfl client` / `python -m edge_client.agent`
This file holds the `Agent` (its state, and its life cycle: start, run, stop, shutdown) and `run_agent`.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from pathlib import Path

import torch

from edge_client import feddd, logs, wire
from edge_client.agent.cli import add_parser, main
from edge_client.agent.config import (
    TOPIC_ROOT,
    AgentConfig,
    AgentData,
    AgentError,
    AgentModel,
    AgentSection,
    Brokers,
    broker_address,
    config_from_dict,
    load_config,
    log,
    who,
)
from edge_client.agent.data import binding_of, load_shard
from edge_client.agent.device import describe, place
from edge_client.agent.device import resolve as resolve_device
from edge_client.agent.heartbeat import TRACE_FIELDS, Heartbeat
from edge_client.agent.link import Link
from edge_client.agent.work import Work
from edge_client.battery import BatteryError, make_battery
from edge_client.models import build_model
from edge_client.telemetry import RoundRecord, Telemetry
from edge_client.trainer import TrainTask

__all__ = ["TOPIC_ROOT", "TRACE_FIELDS", "Agent", "AgentConfig", "AgentData", "AgentError", "AgentModel",
           "AgentSection", "add_parser", "binding_of", "broker_address", "config_from_dict", "load_config",
           "load_shard", "log", "main", "run_agent"]


class Agent(Link, Heartbeat, Work):
    """One client of the federation: MQTT plumbing (Link), availability (Heartbeat), the work (Work)."""

    def __init__(self, cfg: AgentConfig):
        self.cfg, self.id, self.client_idx = cfg, cfg.device_id, cfg.agent.client
        self.device = resolve_device(cfg.agent.device)  # first: `cuda` without CUDA stops here (device.py)
        self.brokers = Brokers(cfg.agent.broker, "agent.broker")  # the URL list and failover (link.py)
        try:
            self.battery = make_battery(cfg.battery, self.id)
        except BatteryError as e:
            raise AgentError(str(e)) from None
        ds, self.x, self.y, self.test_x, self.test_y = load_shard(cfg)
        self.binding = binding_of(cfg, ds)
        try:
            self.model = build_model(cfg.model.model, tuple(self.x.shape[1:]), ds.num_classes, cfg.data.seed,
                                     cfg.model.dropout)
        except ValueError as e:
            raise AgentError(str(e)) from None
        self.limits = wire.Limits(chunk_bytes=cfg.agent.chunk_bytes, max_tensor_bytes=cfg.agent.max_tensor_bytes)
        self.reasm = wire.Reassembler(self.limits)
        self.layout = feddd.unit_layout(self.model)                    # FedDD: channels/neurons of the model
        self.label_score = feddd.label_score(self.y, ds.num_classes)   # FedDD q_n, sent with every update
        # training on the device from here on (the test split stays on the CPU for onnxruntime)
        self.model, self.x, self.y = place(self.model, self.x, self.y, self.device)
        self.feddd_memory: tuple[str, feddd.Memory] | None = None      # run, last upload (eq. 5)
        self.base = f"{TOPIC_ROOT}/device/{self.id}"
        self.inbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.connected = threading.Event()
        self._beat_now = threading.Event()
        self.t0 = time.monotonic()
        # run, round, w, download_s, arrival, model digest, first-to-last chunk seconds (work.py)
        self.weights: tuple[str, int, torch.Tensor, float | None, float, str, float] | None = None
        self.global_buffers: tuple[str, int, dict] | None = None   # run, round, the model message's buffers (work.py)
        self.onnx: tuple[str, int, bytes] | None = None
        self.evaluated: tuple[str, int] | None = None                     # the last ONNX model started (work.py)
        self._eval: tuple[tuple[str, int], object] | None = None          # (run, round), its evaluation in progress
        self.evals_skipped = 0
        self.task: tuple[str, TrainTask, float, str | None] | None = None  # run, task, received at, model digest
        self._task_arrival: tuple[str, int, float] | None = None           # run, round, arrival (monotonic)
        self._first_chunk_at: dict[tuple, float] = {}                      # a message's first chunk's arrival
        # last update: run, round, model digest, frames, its telemetry record (re-sent when asked again)
        self.cache: tuple[str, int, str, list[bytes], RoundRecord] | None = None
        self.rates = {"uplink_Bps": None, "downlink_Bps": None, "train_samples_per_s": None}
        self.rounds_trained = 0
        # the coordinator's latest task or model (run, round), noted by paho's thread (link.py `_note_round`): a
        # training or upload of another round is stale; `_wake` wakes an upload's waits when it changes
        self._newest: tuple[str, int] | None = None
        self._wake = threading.Event()
        self.uploads_abandoned = 0   # stale uploads stopped (link.py)
        self.tasks_skipped = 0       # stale tasks not trained (work.py)
        self.telemetry = Telemetry(cfg.telemetry, cfg.battery)  # sensors, the round's record (telemetry.py)
        self._open_trace(Path(cfg.agent.out or f"agents/{self.id}"))
        self.mqtt = self._make_client()
        self._hb_thread = threading.Thread(target=self._heartbeats, name=f"hb-{self.id}", daemon=True)

    # --- life cycle ---
    def start(self) -> None:
        self.mqtt.connect_async(*self.brokers.address, keepalive=self.cfg.agent.keepalive_s)
        self.mqtt.loop_start()
        self.telemetry.start()
        self._hb_thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._beat_now.set()
        self._wake.set()
        self.inbox.put(None)

    def run(self) -> None:
        """Handle messages until stopped (signal, or the coordinator's "finished")."""
        self.start()
        try:
            while not self.stopping.is_set():
                item = self.inbox.get()
                if item is None:
                    break
                self._handle(*item)
                self._work()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        self.stopping.set()
        self._beat_now.set()
        self._hb_thread.join(timeout=5)
        self.telemetry.stop()
        if self.connected.is_set():
            info = self.mqtt.publish(f"{self.base}/status", self._status_frame("offline"), qos=1, retain=True)
            try:
                info.wait_for_publish(timeout=2)
            except (RuntimeError, ValueError):
                pass
        self.mqtt.disconnect()
        self.mqtt.loop_stop()
        self._trace_file.close()


def run_agent(cfg: AgentConfig, log_level: str = "info") -> int:
    """Run one agent in this process until a signal or the run's end. Sets up `dropfl` logging at
    `log_level` unless the process already did."""
    if not logging.getLogger(logs.ROOT).handlers:
        logs.setup(log_level)
    torch.set_num_threads(cfg.agent.threads)
    agent = Agent(cfg)
    # The handler only hands the signal over: it runs in the main thread between any two bytecodes,
    # possibly while that thread holds a lock that agent.stop() takes (an Event's, the inbox's), so
    # stop() runs in a thread of its own. SimpleQueue.put is reentrant, safe in a signal handler.
    signals: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=lambda: (signals.get(), agent.stop()), name="signals", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: signals.put(True))
    log.info(f"client {cfg.agent.client}: {len(agent.y)} training samples, broker {cfg.agent.broker}, "
             f"training on {describe(agent.device)}", extra=who(agent.id))
    agent.run()
    return 0
