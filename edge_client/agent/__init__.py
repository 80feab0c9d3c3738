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
    heartbeat.py  `Heartbeat`: the clock, the policy's verdict, the heartbeat thread, trace.csv
    link.py       `Link`: the paho client, status, callbacks into the inbox, publishing an update, which round
                  is the newest; `Incoming`: reassembly of the inbox's frames
    work.py       `Work`: the model and shard; tasks, training and upload (FedDD too), evaluation
    reconnect.py  backoff with jitter and fresh client ids (the link's)
    cli.py        `dropfl client` / `python -m edge_client.agent`
This file holds the `Agent` (it composes the components and routes the inbox; its life cycle: start, run,
stop, shutdown) and `run_agent`.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
from pathlib import Path

import torch

from edge_client import logs, wire
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
from edge_client.agent.device import describe
from edge_client.agent.device import resolve as resolve_device
from edge_client.agent.heartbeat import TRACE_FIELDS, Heartbeat
from edge_client.agent.link import Incoming, Link
from edge_client.agent.work import Work
from edge_client.battery import BatteryError, make_battery
from edge_client.models import build_model
from edge_client.telemetry import Telemetry

__all__ = ["TOPIC_ROOT", "TRACE_FIELDS", "Agent", "AgentConfig", "AgentData", "AgentError", "AgentModel",
           "AgentSection", "add_parser", "binding_of", "broker_address", "config_from_dict", "load_config",
           "load_shard", "log", "main", "run_agent"]


class Agent:
    """One client of the federation, composed of three components, each owning its state and given what it needs
    of the others at construction (the events `connected` and `stopping`, the inbox and the measured `rates` are
    the agent's, shared with them):

        component   owns                                         handles
        heartbeat   the clock, battery reads, the policy's       its thread: a heartbeat every heartbeat_s, or at
                    verdict, trace.csv                           once on connect; `policy_reason` for a task
        link        the paho client, broker list, reconnects,    paho's thread: connect, disconnect, every
                    the newest round seen, uploads abandoned     message into the inbox (noting a task's or
                                                                 model's round: `superseded`), the announce
                                                                 request on coordinator/status; publishing
        work        the model and shard, the latest global       the inbox's messages by kind (`_handle` below);
                    model, ONNX model and task, the cached       `step`: train once a task and its model are
                    update, FedDD's memory, evaluations          here (not if superseded), else evaluate

    The main thread takes the inbox's frames (`run`), reassembles them (`incoming`) and routes each message by kind
    (`_handle`): the coordinator's "finished" stops the agent; a task (device/ID/control), a global model
    (model/weights) and an ONNX model (model/onnx) go to the work."""

    def __init__(self, cfg: AgentConfig):
        self.cfg, self.id, self.client_idx = cfg, cfg.device_id, cfg.agent.client
        self.device = resolve_device(cfg.agent.device)  # first: `cuda` without CUDA stops here (device.py)
        brokers = Brokers(cfg.agent.broker, "agent.broker")  # the URL list and failover (link.py)
        try:
            self.battery = make_battery(cfg.battery, self.id)
        except BatteryError as e:
            raise AgentError(str(e)) from None
        ds, x, y, test_x, test_y = load_shard(cfg)
        self.binding = binding_of(cfg, ds)
        try:
            model = build_model(cfg.model.model, tuple(x.shape[1:]), ds.num_classes, cfg.data.seed, cfg.model.dropout)
        except ValueError as e:
            raise AgentError(str(e)) from None
        limits = wire.Limits(chunk_bytes=cfg.agent.chunk_bytes, max_tensor_bytes=cfg.agent.max_tensor_bytes)
        self.inbox: queue.Queue = queue.Queue()       # (topic, payload, retained, arrival): paho's thread to ours
        self.stopping = threading.Event()
        self.connected = threading.Event()            # set and cleared by the link
        self.rates = {"uplink_Bps": None, "downlink_Bps": None, "train_samples_per_s": None}  # measured, sent
        self.telemetry = Telemetry(cfg.telemetry, cfg.battery)  # sensors, the round's record (telemetry.py)
        # the heartbeat reads the work's count and publishes through the link, both built below (its thread starts
        # in `start`); the link and the work are given the heartbeat itself
        self.heartbeat = Heartbeat(cfg, self.id, self.client_idx, self.battery, self.telemetry,
                                   Path(cfg.agent.out or f"agents/{self.id}"), self.connected, self.stopping,
                                   self.rates, rounds_trained=lambda: self.work.rounds_trained,
                                   publish=lambda sub, frames, qos: self.link.publish(sub, frames, qos))
        self.link = Link(cfg, self.id, self.client_idx, self.binding, len(y), brokers, limits, self.inbox,
                         self.connected, self.stopping, self.rates, beat_now=self.heartbeat.beat_now,
                         battery_pct=self.heartbeat.battery_pct)
        self.work = Work(cfg, self.id, self.client_idx, self.device, model, x, y, test_x, test_y, ds.num_classes,
                         limits=limits, battery=self.battery, telemetry=self.telemetry, rates=self.rates,
                         connected=self.connected, stopping=self.stopping, nothing_waiting=self.inbox.empty,
                         link=self.link, availability=self.heartbeat)
        self.incoming = Incoming(self.id, limits)

    # --- routing (main thread) ---
    def _handle(self, topic: str, payload: bytes, retained: bool, received: float) -> None:
        """One frame from the inbox; `received`: its arrival on this host's monotonic clock (link.py)."""
        got = self.incoming.add(topic, payload, received)
        if got is None:  # a chunk of a message not yet complete, or a frame rejected (logged)
            return
        msg, first_at = got
        h = msg.header
        if h.kind == "coordinator":
            if msg.meta.get("state") == "finished" and not retained and self.cfg.agent.exit_when_done:
                log.info(f"run {h.run} finished; exiting", extra=who(self.id))
                self.stop()
        elif h.kind == "model":
            self.work.on_model(msg, first_at, received)
        elif h.kind == "onnx":
            self.work.on_onnx(msg)
        elif h.kind == "task":
            self.work.on_task(msg, received)

    # --- life cycle ---
    def start(self) -> None:
        self.link.start()
        self.telemetry.start()
        self.heartbeat.start()

    def stop(self) -> None:
        """From any thread: ends the main loop, the heartbeat thread and an upload's wait."""
        self.stopping.set()
        self.heartbeat.beat_now()  # its thread wakes, sees `stopping` and ends
        self.link.wake()
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
                self.work.step()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        self.stopping.set()
        self.heartbeat.stop()
        self.telemetry.stop()
        self.link.close()
        self.heartbeat.close()


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
    log.info(f"client {cfg.agent.client}: {len(agent.work.y)} training samples, broker {cfg.agent.broker}, "
             f"training on {describe(agent.device)}", extra=who(agent.id))
    agent.run()
    return 0
