"""The edge agent (`dropfl client --config FILE`, or `python -m edge_client.agent --config FILE`).

One agent is one client of the federation. It connects to the broker, announces itself (device facts
and its data binding) with a retained status whose last will says offline, sends heartbeats (battery,
charging, network counters, CPU load, and whether its policy lets it train), and answers round tasks:
it declines with its policy's reason, or trains with `edge_client.trainer.local_train` on its own
shard (computed from dataset + partition + seed exactly as the simulation does), uploads the update,
reports the measured transfer and training rates, and evaluates each new global model with
onnxruntime on its own test split. It records its own availability trace (docs/traces.md schema).

Threads: paho's network thread only queues messages; the main thread handles them (training happens
there); a heartbeat thread samples the battery and publishes. Never imports `coordinator`.

Config file (TOML or JSON), sections and keys as the dataclasses below, e.g.

    [agent]
    client = 3
    broker = "mqtt://127.0.0.1:1883"
    [data]
    dataset = "fmnist"
    partition = "shards"
    clients = 10
    seed = 0
    [model]
    model = "logreg"
    [policy]
    min_battery_pct = 20
    [battery]
    source = "model"
    start_pct = 60
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import math
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch
from paho.mqtt import client as mqtt

from edge_client import datasets, feddd, federation, partition, wire
from edge_client.battery import BatteryConfig, BatteryError, make_battery
from edge_client.configfile import fill_sections, read_config_file
from edge_client.models import build_model
from edge_client.monitor import PolicyConfig, decide, device_facts, system_sample
from edge_client.trainer import TrainTask, local_train

TOPIC_ROOT = "dropfl/v1"
TRACE_FIELDS = ("device", "t_s", "online", "battery_pct", "charging", "uplink_Bps", "downlink_Bps")


class AgentError(Exception):
    """The agent cannot start; the message says what to fix."""


@dataclass
class AgentSection:
    client: int = 0                        # client index = data shard (0..clients-1)
    device_id: str | None = None           # broker username / topic id (default: client-<client>)
    broker: str = "mqtt://127.0.0.1:1883"     # mqtts://HOST:PORT = TLS, server checked against ca_file
    password: str | None = None                # broker password (username = device_id)
    ca_file: str | None = None                 # CA certificate for mqtts:// (relative to the config file)
    heartbeat_s: float = 1.0
    keepalive_s: int = 10
    out: str | None = None                 # directory for trace.csv (default: agents/<device_id>)
    threads: int = 1                       # torch threads for training
    slowdown_s_per_step: float = 0.0       # emulate a slower device: extra seconds per SGD step
    uplink_limit_Bps: float = 0.0          # emulate a slow uplink: pace the update's chunks to this rate (0: off)
    exit_when_done: bool = True            # exit when the coordinator announces the run finished
    chunk_bytes: int = 256 * 1024
    max_tensor_bytes: int = 256 * 1024 ** 2
    publish_timeout_s: float = 60.0


@dataclass
class AgentData:
    dataset: str = "fmnist"
    data_dir: str | None = None
    partition: str = "shards"
    clients: int = 30
    shards_per_client: int = 2
    dirichlet_alpha: float = 0.5
    seed: int = 0


@dataclass
class AgentModel:
    model: str = "mimic-cnn"
    dropout: float | None = None


@dataclass
class AgentConfig:
    agent: AgentSection = field(default_factory=AgentSection)
    data: AgentData = field(default_factory=AgentData)
    model: AgentModel = field(default_factory=AgentModel)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    battery: BatteryConfig = field(default_factory=BatteryConfig)

    @property
    def device_id(self) -> str:
        return self.agent.device_id or f"client-{self.agent.client}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def config_from_dict(d: dict) -> AgentConfig:
    sections = {f.name: f.default_factory for f in dataclasses.fields(AgentConfig)}
    parts = fill_sections(sections, d, AgentError, "agent config")
    cfg = AgentConfig(**parts)
    if not (0 <= cfg.agent.client < cfg.data.clients):
        raise AgentError(f"agent config: client {cfg.agent.client} outside 0..{cfg.data.clients - 1}")
    if cfg.agent.heartbeat_s <= 0:
        raise AgentError("agent config: heartbeat_s must be > 0")
    return cfg


def load_config(path: str) -> AgentConfig:
    p = Path(path)
    cfg = config_from_dict(read_config_file(p, AgentError))
    if cfg.agent.ca_file and not Path(cfg.agent.ca_file).is_absolute():
        cfg.agent.ca_file = str(p.parent / cfg.agent.ca_file)
    return cfg


def broker_address(url: str) -> tuple[str, int]:
    u = urlparse(url if "://" in url else "mqtt://" + url)
    if u.scheme not in ("mqtt", "tcp", "mqtts") or not u.hostname:
        raise AgentError(f"broker {url!r}: expected mqtt://HOST[:PORT] or mqtts://HOST[:PORT]")
    return u.hostname, u.port or (8883 if u.scheme == "mqtts" else 1883)


def binding_of(cfg: AgentConfig, ds: datasets.Dataset | None = None) -> federation.DataBinding:
    """This agent's data binding (edge_client/federation.py): its [data] and [model] sections."""
    sections = {"data": cfg.data, "model": cfg.model, "run": cfg.data}  # the agent keeps the seed under [data]
    return federation.from_sections(sections, federation.label_digest(ds) if ds is not None else "")


@functools.lru_cache(maxsize=2)
def _federation(binding: federation.DataBinding, data_dir: str | None):
    """Dataset, train partition and test partition (cached: several agents may share a process)."""
    ds = datasets.load(binding.dataset, data_dir)
    return ds, federation.client_shards(ds, binding), federation.test_shards(ds, binding)


def load_shard(cfg: AgentConfig) -> tuple[datasets.Dataset, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """(dataset, x, y of this client's training shard, x, y of its test split as numpy)."""
    try:
        ds, parts, test_parts = _federation(binding_of(cfg), cfg.data.data_dir)
    except (datasets.DatasetError, partition.PartitionError) as e:
        raise AgentError(str(e)) from None
    idx, tidx = torch.as_tensor(parts[cfg.agent.client]), torch.as_tensor(test_parts[cfg.agent.client])
    return ds, ds.train.x[idx], ds.train.y[idx], ds.test.x[tidx].numpy(), ds.test.y[tidx].numpy()


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


class Agent:
    def __init__(self, cfg: AgentConfig):
        self.cfg, self.id, self.client_idx = cfg, cfg.device_id, cfg.agent.client
        self.host, self.port = broker_address(cfg.agent.broker)
        try:
            self.battery = make_battery(cfg.battery, self.id)
        except BatteryError as e:
            raise AgentError(str(e)) from None
        ds, self.x, self.y, self.test_x, self.test_y = load_shard(cfg)
        self.binding = binding_of(cfg, ds)
        try:
            self.model = build_model(cfg.model.model, tuple(ds.train.x.shape[1:]), ds.num_classes, cfg.data.seed,
                                     cfg.model.dropout)
        except ValueError as e:
            raise AgentError(str(e)) from None
        self.limits = wire.Limits(chunk_bytes=cfg.agent.chunk_bytes, max_tensor_bytes=cfg.agent.max_tensor_bytes)
        self.reasm = wire.Reassembler(self.limits)
        self.layout = feddd.unit_layout(self.model)                    # FedDD: channels/neurons of the model
        self.label_score = feddd.label_score(self.y, ds.num_classes)   # FedDD q_n, sent with every update
        self.feddd_memory: tuple[str, feddd.Memory] | None = None      # run, last upload (eq. 5)
        self.base = f"{TOPIC_ROOT}/device/{self.id}"
        self.inbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.connected = threading.Event()
        self._beat_now = threading.Event()
        self.t0 = time.monotonic()
        self.weights: tuple[str, int, torch.Tensor, float, float] | None = None  # run, round, w, download_s, at
        self.onnx: tuple[str, int, bytes] | None = None
        self.evaluated: tuple[str, int] | None = None
        self.task: tuple[str, TrainTask, float] | None = None                # run, task, received at
        self.cache: tuple[str, int, list[bytes]] | None = None            # last update, for re-sends
        self.rates = {"uplink_Bps": None, "downlink_Bps": None, "train_samples_per_s": None}
        self.rounds_trained = 0
        out = Path(cfg.agent.out or f"agents/{self.id}")
        out.mkdir(parents=True, exist_ok=True)
        self.trace_path = out / "trace.csv"
        self._trace_file = open(self.trace_path, "w", newline="")
        self._trace = csv.DictWriter(self._trace_file, TRACE_FIELDS)
        self._trace.writeheader()
        self.mqtt = self._make_client()
        self._hb_thread = threading.Thread(target=self._heartbeats, name=f"hb-{self.id}", daemon=True)

    # --- MQTT plumbing (paho network thread) ---
    def _make_client(self) -> mqtt.Client:
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"dropfl-{self.id}", clean_session=True)
        c.username_pw_set(self.id, self.cfg.agent.password)
        if self.cfg.agent.broker.startswith("mqtts://"):
            if not self.cfg.agent.ca_file:
                raise AgentError("broker mqtts://...: set ca_file (the broker's CA certificate)")
            c.tls_set(ca_certs=self.cfg.agent.ca_file)
        c.will_set(f"{self.base}/status", self._status_frame("offline"), qos=1, retain=True)
        c.reconnect_delay_set(min_delay=0.2, max_delay=2)
        c.max_inflight_messages_set(100)
        c.on_connect, c.on_disconnect, c.on_message = self._on_connect, self._on_disconnect, self._on_message
        return c

    def _status_frame(self, state: str) -> bytes:
        meta: dict = {"state": state, "device": self.id}
        if state == "online":
            meta |= device_facts() | self.binding.to_meta() | {"num_samples": len(self.y)}
        return wire.encode("status", "", -1, self.client_idx, meta=meta)[0]

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log(self.id, f"broker refused the connection: {reason_code}")
            return
        client.subscribe([(f"{self.base}/control", 1), (f"{TOPIC_ROOT}/model/#", 1),
                          (f"{TOPIC_ROOT}/coordinator/status", 1)])
        client.publish(f"{self.base}/status", self._status_frame("online"), qos=1, retain=True)
        self.connected.set()
        self._beat_now.set()  # a heartbeat right away: it tells the coordinator whether we can train

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()

    def _on_message(self, client, userdata, msg) -> None:
        self.inbox.put((msg.topic, msg.payload, bool(msg.retain), time.time()))

    # --- life cycle ---
    def start(self) -> None:
        self.mqtt.connect_async(self.host, self.port, keepalive=self.cfg.agent.keepalive_s)
        self.mqtt.loop_start()
        self._hb_thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._beat_now.set()
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
        if self.connected.is_set():
            info = self.mqtt.publish(f"{self.base}/status", self._status_frame("offline"), qos=1, retain=True)
            try:
                info.wait_for_publish(timeout=2)
            except (RuntimeError, ValueError):
                pass
        self.mqtt.disconnect()
        self.mqtt.loop_stop()
        self._trace_file.close()

    # --- messages (main thread) ---
    def _handle(self, topic: str, payload: bytes, retained: bool, received: float) -> None:
        try:
            msg = self.reasm.add(payload)
        except wire.WireError as e:
            log(self.id, f"rejected a message on {topic}: {e.reason}")
            return
        if msg is None:
            return
        h = msg.header
        if h.kind == "coordinator":
            if msg.meta.get("state") == "finished" and not retained and self.cfg.agent.exit_when_done:
                log(self.id, f"run {h.run} finished; exiting")
                self.stop()
        elif h.kind == "model":
            n = sum(p.numel() for p in self.model.parameters())
            if msg.tensor is None or msg.tensor.dtype != torch.float32 or list(msg.tensor.shape) != [n]:
                log(self.id, f"rejected a global model of {h.dtype} {h.shape} (expected float32 [{n}])")
                return
            download_s = max(received - h.sent_at, 0.0)
            self.weights = (h.run, h.round, msg.tensor, download_s, received)
            if download_s > 0:
                self.rates["downlink_Bps"] = h.nbytes / download_s
        elif h.kind == "onnx" and msg.tensor is not None and msg.tensor.dtype == torch.uint8:
            self.onnx = (h.run, h.round, msg.tensor.numpy().tobytes())
        elif h.kind == "task":
            self._on_task(msg, received)

    def _on_task(self, msg: wire.Message, received: float) -> None:
        h, m = msg.header, msg.meta
        if h.client != self.client_idx:
            log(self.id, f"rejected a task for client {h.client} (this agent is client {self.client_idx})")
            return
        reason = self.policy_reason()
        if reason is not None:
            self._publish("update/decline", wire.encode("decline", h.run, h.round, self.client_idx,
                                                         meta={"reason": reason}))
            return
        if self.cache is not None and self.cache[:2] == (h.run, h.round):
            self._send_update(h.run, h.round, self.cache[2])  # re-request after a reconnect: same update
            return
        try:
            steps, epochs, rate = m.get("steps"), m.get("epochs"), m.get("dropout_rate")
            task = TrainTask(client=self.client_idx, round=h.round, lr=float(m["lr"]),
                             batch_size=int(m["batch_size"]), epochs=None if epochs is None else int(epochs),
                             steps=None if steps is None else int(steps), prox_mu=float(m.get("prox_mu", 0.0)),
                             grad_correction=msg.tensor, seed=int(m["seed"]),
                             dropout_rate=None if rate is None else float(rate),
                             sparse_download=bool(m.get("sparse_download", False)))
            if task.dropout_rate is not None and not 0.0 <= task.dropout_rate <= 1.0:
                raise ValueError(f"dropout_rate {task.dropout_rate} outside [0, 1]")
        except (KeyError, TypeError, ValueError) as e:
            log(self.id, f"rejected a malformed task for round {h.round}: {e!r}")
            return
        self.task = (h.run, task, received)

    def _work(self) -> None:
        ready = self.task is not None and self.weights is not None
        if ready and self.weights[:2] == (self.task[0], self.task[1].round):
            (run, task, task_at), self.task = self.task, None
            wait_s = max(time.time() - max(task_at, self.weights[4]), 0.0)  # busy with earlier messages
            self._train_and_upload(run, task, self.weights[2], self.weights[3], wait_s)
        if self.task is None and self.onnx is not None and self.onnx[:2] != self.evaluated:
            self._evaluate(*self.onnx)

    def _train_and_upload(self, run: str, task: TrainTask, w: torch.Tensor, download_s: float,
                          wait_s: float = 0.0) -> None:
        start = time.perf_counter()
        sparse_payload = None
        if task.dropout_rate is None:
            r = local_train(self.model, w, self.x, self.y, task)
        else:  # FedDD: Algorithm 2's mask, the kept values as a sparse payload (edge_client/feddd.py)
            memory = self.feddd_memory[1] if self.feddd_memory and self.feddd_memory[0] == run else None
            out, memory = feddd.client_round(self.model, self.layout, w, self.x, self.y, task, memory)
            self.feddd_memory, r = (run, memory), out.result
            sparse_payload = feddd.encode_sparse(self.layout, memory.masks, memory.w_local)
        if self.cfg.agent.slowdown_s_per_step > 0 and self.stopping.wait(self.cfg.agent.slowdown_s_per_step * r.steps):
            return
        train_s = time.perf_counter() - start
        self.battery.training(train_s)
        samples = r.steps * min(task.batch_size, len(self.y))
        self.rates["train_samples_per_s"] = samples / train_s if train_s > 0 else None
        meta = {"num_samples": r.num_samples, "steps": r.steps, "loss": _finite(r.loss), "train_s": train_s,
                "download_s": download_s, "wait_s": wait_s, "train_samples_per_s": self.rates["train_samples_per_s"]}
        body = r.delta
        if sparse_payload is not None:
            body = torch.frombuffer(bytearray(sparse_payload), dtype=torch.uint8)
            meta |= {"encoding": feddd.WIRE_ENCODING, "dropout_rate": task.dropout_rate,
                     "label_score": self.label_score}
        frames = wire.encode("update", run, task.round, self.client_idx, body, meta, self.limits)
        self.cache = (run, task.round, frames)
        self.rounds_trained += 1
        self._send_update(run, task.round, frames)

    def _send_update(self, run: str, rnd: int, frames: list[bytes]) -> None:
        """Publish the update's chunks, wait for the broker's PUBACKs, then report the upload time."""
        start = time.perf_counter()
        infos, sent, limit = [], 0, self.cfg.agent.uplink_limit_Bps
        for f in frames:
            infos.append(self.mqtt.publish(f"{self.base}/update/delta", f, qos=1))
            sent += len(f)
            ahead = sent / limit - (time.perf_counter() - start) if limit > 0 else 0.0
            if ahead > 0 and self.stopping.wait(ahead):
                return
        try:
            for info in infos:
                info.wait_for_publish(timeout=self.cfg.agent.publish_timeout_s)
        except (RuntimeError, ValueError) as e:
            log(self.id, f"round {rnd}: upload interrupted ({e}); it is re-sent if the coordinator asks again")
            return
        if not all(i.is_published() for i in infos):
            log(self.id, f"round {rnd}: upload not acknowledged within {self.cfg.agent.publish_timeout_s} s")
            return
        upload_s = time.perf_counter() - start
        nbytes = sum(len(f) for f in frames)
        self.rates["uplink_Bps"] = nbytes / upload_s if upload_s > 0 else None
        self._publish("update/stats", wire.encode("stats", run, rnd, self.client_idx, meta={
            "upload_s": upload_s, "upload_bytes": nbytes, "uplink_Bps": self.rates["uplink_Bps"]}))

    def _evaluate(self, run: str, rnd: int, model_bytes: bytes) -> None:
        import onnxruntime as ort

        self.evaluated = (run, rnd)
        start = time.perf_counter()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.cfg.agent.threads
        correct = 0
        try:
            sess = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
            name = sess.get_inputs()[0].name
            for i in range(0, len(self.test_y), 1000):
                logits = sess.run(None, {name: self.test_x[i:i + 1000]})[0]
                correct += int((logits.argmax(1) == self.test_y[i:i + 1000]).sum())
        except Exception as e:  # onnxruntime raises its own exception types for a bad or foreign model
            log(self.id, f"round {rnd}: could not evaluate the ONNX model: {e}")
            return
        acc = correct / max(len(self.test_y), 1)
        self._publish("update/eval", wire.encode("eval", run, rnd, self.client_idx, meta={
            "accuracy": acc, "samples": int(len(self.test_y)), "seconds": time.perf_counter() - start}))

    def _publish(self, sub: str, frames: list[bytes], qos: int = 1) -> None:
        for f in frames:
            self.mqtt.publish(f"{self.base}/{sub}", f, qos=qos)

    # --- availability ---
    def now(self) -> float:
        return time.monotonic() - self.t0

    def policy_reason(self) -> str | None:
        return decide(self.cfg.policy, self.battery.read(self.now()), self.connected.is_set())

    def _heartbeats(self) -> None:
        while not self.stopping.is_set():
            self.heartbeat()
            self._beat_now.wait(self.cfg.agent.heartbeat_s)
            self._beat_now.clear()

    def heartbeat(self) -> None:
        t = self.now()
        reading = self.battery.read(t)
        connected = self.connected.is_set()
        reason = decide(self.cfg.policy, reading, connected)
        meta = {"t_s": t, "battery_pct": reading.pct, "charging": reading.charging,
                "net_up": connected and reading.online, "available": reason is None, "reason": reason,
                "rounds_trained": self.rounds_trained} | system_sample() | self.rates
        if connected:
            self.mqtt.publish(f"{self.base}/heartbeat", wire.encode("heartbeat", "", -1, self.client_idx, meta=meta)[0],
                              qos=0)
        self._trace.writerow({"device": self.id, "t_s": f"{t:.3f}", "online": int(connected and reading.online),
                              "battery_pct": "" if reading.pct is None else f"{reading.pct:.2f}",
                              "charging": "" if reading.charging is None else int(reading.charging),
                              "uplink_Bps": _fmt(self.rates["uplink_Bps"]),
                              "downlink_Bps": _fmt(self.rates["downlink_Bps"])})
        self._trace_file.flush()


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.0f}"


def log(device: str, text: str) -> None:
    print(f"[agent {device}] {text}", file=sys.stderr, flush=True)


def run_agent(cfg: AgentConfig) -> int:
    torch.set_num_threads(cfg.agent.threads)
    agent = Agent(cfg)
    # The handler only hands the signal over: it runs in the main thread between any two bytecodes,
    # possibly while that thread holds a lock that agent.stop() takes (an Event's, the inbox's), so
    # stop() runs in a thread of its own. SimpleQueue.put is reentrant, safe in a signal handler.
    signals: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=lambda: (signals.get(), agent.stop()), name="signals", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: signals.put(True))
    log(agent.id, f"client {cfg.agent.client}: {len(agent.y)} training samples, broker {cfg.agent.broker}")
    agent.run()
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("client", help="run an edge agent (one federated client) against an MQTT broker",
                       description="Run an edge agent: announce, heartbeat, train on request, upload, evaluate "
                                   "the global model with onnxruntime. See edge_client/agent.py for the config.")
    p.add_argument("--config", required=True, help="agent config file (TOML or JSON)")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    try:
        return run_agent(load_config(args.config))
    except AgentError as e:
        print(f"dropfl client: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dropfl-client")
    parser.add_argument("--config", required=True, help="agent config file (TOML or JSON)")
    return _cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
