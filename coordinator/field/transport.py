"""Field mode: the round loop's transport and availability source over an MQTT broker.

`FieldHub` owns the coordinator's MQTT connection and what it knows about the agents (their retained
status, last heartbeat, data binding). `MqttTransport.run_round` publishes the round's tasks, the
global weights and their ONNX export, then waits — on a condition variable fed by paho's network
thread, never by polling sleeps — until every selected client has delivered a complete, valid update
(and its upload stats), declined, or gone offline, or until the deadline. `FieldAvailability`
answers the loop's `availability.round(t)` from the agents' own heartbeats. Topics and messages:
docs/protocol.md.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from paho.mqtt import client as mqtt

from coordinator.availability.models import REASONS, RoundAvailability
from coordinator.errors import UserError
from coordinator.field import checks as field_checks
from coordinator.field.sparse import is_sparse, sparse_problem, update_tensors
from coordinator.strategies.base import ClientUpdate
from edge_client import feddd, federation, wire
from edge_client.agent import TOPIC_ROOT, broker_address
from edge_client.models import set_flat
from edge_client.report import ClientReport
from edge_client.trainer import TrainTask


@dataclass
class FieldConfig:
    broker: str = "mqtt://127.0.0.1:1883"   # mqtts://HOST:PORT = TLS, server checked against ca_file
    username: str = "coordinator"
    password: str | None = None              # never written to the run directory
    ca_file: str | None = None
    run_id: str = ""
    deadline_s: float = 60.0          # per round, from the publish of the model and tasks
    heartbeat_timeout_s: float = 10.0  # no heartbeat for this long: offline
    wait_agents: int = 0              # at start, wait for this many agents (0: all clients)
    wait_timeout_s: float = 120.0
    round_wait_s: float = 0.0         # at each round start, wait up to this long for all agents
    chunk_bytes: int = 256 * 1024
    max_tensor_bytes: int = 256 * 1024 ** 2


@dataclass
class AgentInfo:
    device: str
    client: int
    online: bool = False
    last_heartbeat: float = -1.0      # coordinator's monotonic clock
    heartbeat: dict = field(default_factory=dict)
    announce: dict = field(default_factory=dict)
    mismatch: str | None = None       # data binding differs from the coordinator's: never selected


@dataclass
class RoundState:
    t: int
    tasks: dict[int, TrainTask]
    started: float
    updates: dict[int, wire.Message] = field(default_factory=dict)
    received_at: dict[int, float] = field(default_factory=dict)
    stats: dict[int, dict] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    rejoined: set[int] = field(default_factory=set)
    duplicates: int = 0
    rejected: int = 0
    rejects: dict[str, int] = field(default_factory=dict)  # messages rejected during the round, by code
    closed: bool = False

    def resolved(self, c: int) -> bool:
        return c in self.dropped or (c in self.updates and c in self.stats)


def log(text: str) -> None:
    print(f"[coordinator] {text}", file=sys.stderr, flush=True)


class FieldHub:
    """The coordinator's MQTT side: connection, agent registry, round collection. Thread-safe: paho's
    network thread writes under `cond`, the loop's thread reads and waits on it."""

    def __init__(self, cfg: FieldConfig, n_clients: int, binding: federation.DataBinding, num_params: int,
                 rundir_path: Path):
        self.cfg, self.n, self.binding, self.num_params = cfg, n_clients, binding, num_params
        self.limits = wire.Limits(chunk_bytes=cfg.chunk_bytes, max_tensor_bytes=cfg.max_tensor_bytes)
        self.reasm = wire.Reassembler(self.limits)
        self.layout: feddd.Layout | None = None  # the model's FedDD units, to decode sparse updates (MqttTransport)
        self.cond = threading.Condition()
        self.agents: dict[str, AgentInfo] = {}     # by device id
        self.by_client: dict[int, AgentInfo] = {}  # the same, by client index
        self.round: RoundState | None = None
        self.connects = 0
        self.late = 0
        self.rejects: dict[str, int] = {}  # the run's rejected messages, by code (docs/protocol.md)
        self.max_update_bytes = field_checks.max_update_bytes(num_params)
        self.field_log = rundir_path / "field.jsonl"
        self.mqtt = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                client_id=f"dropfl-coordinator-{uuid.uuid4().hex[:8]}", clean_session=True)
        self.mqtt.username_pw_set(cfg.username, cfg.password)
        if cfg.broker.startswith("mqtts://"):
            if not cfg.ca_file:
                raise UserError("--broker mqtts://...: the broker's CA certificate is needed (--broker-config)")
            self.mqtt.tls_set(ca_certs=cfg.ca_file)
        self.mqtt.will_set(f"{TOPIC_ROOT}/coordinator/status", self._status("offline"), qos=1, retain=True)
        self.mqtt.reconnect_delay_set(min_delay=0.2, max_delay=2)
        self.mqtt.max_inflight_messages_set(1000)
        self.mqtt.on_connect, self.mqtt.on_message = self._on_connect, self._on_message
        self.mqtt.on_disconnect = self._on_disconnect

    # --- connection ---
    def _status(self, state: str) -> bytes:
        return wire.encode("coordinator", self.cfg.run_id, -1, -1, meta={"state": state, "n_clients": self.n})[0]

    def start(self) -> None:
        try:
            host, port = broker_address(self.cfg.broker)
        except Exception as e:  # AgentError: the same parser as the agents'
            raise UserError(f"--broker: {e}") from None
        self.mqtt.connect_async(host, port, keepalive=10)
        self.mqtt.loop_start()

    def stop(self, finished: bool) -> None:
        if self.mqtt.is_connected():
            state = "finished" if finished else "offline"
            info = self.mqtt.publish(f"{TOPIC_ROOT}/coordinator/status", self._status(state), qos=1, retain=True)
            try:
                info.wait_for_publish(timeout=5)
            except (RuntimeError, ValueError):
                pass
        self.mqtt.disconnect()
        self.mqtt.loop_stop()

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log(f"broker refused the connection: {reason_code}")
            return
        dev = f"{TOPIC_ROOT}/device/+"
        client.subscribe([(f"{dev}/status", 1), (f"{dev}/heartbeat", 0), (f"{dev}/update/#", 1)])
        client.publish(f"{TOPIC_ROOT}/coordinator/status", self._status("online"), qos=1, retain=True)
        with self.cond:
            self.connects += 1
            self.cond.notify_all()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log(f"disconnected from the broker ({reason_code}); reconnecting")

    def write_log(self, row: dict) -> None:
        with open(self.field_log, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _reject(self, device: str, sub: str, code: str, reason: str) -> None:
        """Log a rejected message with its reason and count it by code (field.jsonl `rejects`)."""
        self.rejects[code] = self.rejects.get(code, 0) + 1
        r = self.round
        if r is not None and not r.closed:
            r.rejects[code] = r.rejects.get(code, 0) + 1
        log(f"{'' if r is None else f'round {r.t}: '}rejected {sub} of {device} [{code}]: {reason}")

    # --- messages (paho network thread) ---
    def _on_message(self, client, userdata, msg) -> None:
        parts = msg.topic.split("/")
        if len(parts) < 5 or parts[2] != "device":
            return
        device, sub = parts[3], "/".join(parts[4:])
        with self.cond:
            try:
                self._dispatch(device, sub, msg.payload, bool(msg.retain))
            except Exception as e:  # a bug, not bad input (that is a reject): keep paho's network thread alive
                self._reject(device, sub, "internal", f"{type(e).__name__}: {e} (a coordinator bug; please report)")
            finally:
                self.cond.notify_all()

    def _dispatch(self, device: str, sub: str, payload: bytes, retained: bool) -> None:
        now = time.monotonic()
        if sub in ("status", "heartbeat"):
            known = self.agents.get(device)
            try:  # a known device keeps the client index it announced first
                m = wire.decode([payload], self.limits, kinds=(sub,), max_nbytes=0,
                                client=None if known is None else known.client)
            except wire.WireError as e:
                self._reject(device, sub, e.code, e.reason)
                return
            problem = field_checks.status_device(m, device) if sub == "status" else None
            if problem:
                self._reject(device, sub, *problem)
                return
            if sub == "status":
                self._on_status(device, m, retained)
            elif device in self.agents:
                a = self.agents[device]
                a.last_heartbeat, a.heartbeat = now, m.meta
            return
        a = self.agents.get(device)
        if a is None:
            self._reject(device, sub, field_checks.DEVICE, "the device has not announced itself (no online status)")
            return
        r = self.round
        if sub == "update/eval":
            try:
                m = wire.decode([payload], self.limits, run=self.cfg.run_id, client=a.client, kinds=("eval",),
                                max_nbytes=0)
            except wire.WireError as e:
                self._reject(device, sub, e.code, e.reason)
                return
            fields, problem = field_checks.eval_meta(m)
            if problem:
                self._reject(device, sub, *problem)
                return
            self.write_log({"event": "eval", "round": m.header.round, "client": a.client} | fields)
            return
        kinds = {"update/delta": ("update",), "update/stats": ("stats",), "update/decline": ("decline",)}.get(sub)
        if kinds is None:
            return
        if r is None or r.closed:
            self.late += 1
            return
        try:
            m = self.reasm.add(payload, client=a.client, kinds=kinds,
                               max_nbytes=self.max_update_bytes if kinds == ("update",) else 0)
        except wire.WireError as e:
            r.rejected += 1
            self._reject(device, sub, e.code, e.reason)
            if a.client in r.tasks and not r.resolved(a.client) and a.client not in r.updates:
                r.dropped[a.client] = "rejected"
            return
        if m is None:
            return
        try:
            wire.check_binding(m.header, run=self.cfg.run_id, round=r.t)
        except wire.WireError as e:  # another run's or an earlier round's: late, never aggregated
            self.late += 1
            self._reject(device, sub, e.code, f"{e.reason} (late, stale or replayed)")
            return
        if a.client not in r.tasks:
            return
        c = a.client
        if m.kind == "decline":
            reason = m.meta.get("reason")
            if c not in r.updates:
                r.dropped.setdefault(c, reason if reason in REASONS else "declined")
        elif m.kind == "stats":
            problem = field_checks.stats(m)
            if problem:  # the update (if valid) still counts, without the upload rates
                self._reject(device, sub, *problem)
            r.stats.setdefault(c, {} if problem else m.meta)
        elif c in r.updates:
            r.duplicates += 1
        elif c in r.dropped:
            log(f"round {r.t}: discarded the update of {device}, already dropped ({r.dropped[c]})")
        else:
            problem = field_checks.update(m, self.num_params, a.announce.get("num_samples"))
            if problem is None and (invalid := self._invalid(m)):
                problem = (field_checks.PAYLOAD, invalid)
            if problem is None and is_sparse(m) and r.tasks[c].dropout_rate is None:  # masks only for FedDD
                problem = (field_checks.PAYLOAD, "a sparse update answers a task without dropout_rate (not FedDD)")
            if problem:
                r.rejected += 1
                r.dropped[c] = "rejected"
                self._reject(device, sub, *problem)
            else:
                r.updates[c], r.received_at[c] = m, now

    def _invalid(self, m: wire.Message) -> str | None:
        if is_sparse(m):  # FedDD's sparse payload (coordinator/field/sparse.py)
            problem = sparse_problem(self.layout, m)
            if problem:
                return problem
            for k in ("num_samples", "steps"):
                if not isinstance(m.meta.get(k), int) or m.meta[k] < 0:
                    return f"meta {k} missing or not a non-negative integer"
            return None
        t = m.tensor
        if t is None or t.dtype != torch.float32 or list(t.shape) != [self.num_params]:
            return f"expected a float32 tensor of shape [{self.num_params}], got {m.header.dtype} {m.header.shape}"
        if not torch.isfinite(t).all():
            return "the update holds NaN or infinite values"
        for k in ("num_samples", "steps"):
            if not isinstance(m.meta.get(k), int) or m.meta[k] < 0:
                return f"meta {k} missing or not a non-negative integer"
        return None

    def _on_status(self, device: str, m: wire.Message, retained: bool) -> None:
        meta, c = m.meta, m.header.client
        state = meta.get("state")
        a = self.agents.get(device)
        if a is None:
            if state != "online":
                return
            if not (0 <= c < self.n):
                self._reject(device, "status", wire.WRONG_CLIENT, f"client {c} outside 0..{self.n - 1}")
                return
            other = self.by_client.get(c)
            if other is not None:
                self._reject(device, "status", wire.WRONG_CLIENT, f"client {c} is already device {other.device}")
                return
            a = self.agents[device] = self.by_client[c] = AgentInfo(device, c)
        if state == "online":
            a.announce = meta
            diff = federation.diff(self.binding, meta)
            a.mismatch = None if not diff else "data binding differs: " + ", ".join(
                f"{k} (agent {mine!r}, coordinator {theirs!r})" for k, (mine, theirs) in diff.items())
            if a.mismatch:
                log(f"device {device} will not be selected: {a.mismatch}")
            r = self.round
            if r is not None and not r.closed and a.client in r.tasks and a.client not in r.updates:
                if r.dropped.get(a.client) == "offline":  # back within the round: give it the task again
                    del r.dropped[a.client]
                if not r.resolved(a.client):
                    r.rejoined.add(a.client)
            a.online = True
            a.last_heartbeat = time.monotonic()
        else:
            a.online = False
            r = self.round
            if r is not None and not r.closed and a.client in r.tasks and a.client not in r.updates:
                r.dropped.setdefault(a.client, "offline")
        self.write_log({"event": "agent", "device": device, "client": a.client, "state": state,
                        "retained": retained, "time": time.time()})

    # --- queries (loop thread, under cond) ---
    def is_online(self, a: AgentInfo, now: float) -> bool:
        """Announced online, heard from within the heartbeat timeout, and at least one heartbeat seen
        (it carries the agent's availability)."""
        return a.online and bool(a.heartbeat) and now - a.last_heartbeat <= self.cfg.heartbeat_timeout_s

    def client_status(self, c: int, now: float) -> str | None:
        """None if client c may take part now, else the reason."""
        a = self.by_client.get(c)
        if a is None or not self.is_online(a, now):
            return "offline"
        if a.mismatch:
            return "rejected"
        if a.heartbeat and not a.heartbeat.get("available", True):
            reason = a.heartbeat.get("reason")
            return reason if reason in REASONS else "declined"
        return None

    def online_count(self) -> int:
        now = time.monotonic()
        return sum(1 for a in self.agents.values() if self.is_online(a, now) and not a.mismatch)

    def wait_for_agents(self, n: int, timeout_s: float) -> int:
        """Wait until n agents are online (announced, heartbeating, same data binding); return how many are."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.online_count() < n and time.monotonic() < deadline:
                self.cond.wait(timeout=min(deadline - time.monotonic(), 1.0))
            return self.online_count()

    def device_of(self, c: int) -> str | None:
        a = self.by_client.get(c)
        return None if a is None else a.device


class FieldAvailability:
    """The loop's availability source in field mode: who is online, heartbeating and willing, per the
    agents' own reports. `round_wait_s` > 0 gives absent agents that long to (re)join first."""

    name = "field"

    def __init__(self, hub: FieldHub):
        self.hub = hub

    def round(self, t: int) -> RoundAvailability:
        if self.hub.cfg.round_wait_s > 0:
            self.hub.wait_for_agents(self.hub.n, self.hub.cfg.round_wait_s)
        now = time.monotonic()
        avail = np.zeros(self.hub.n, bool)
        reasons: dict[int, str] = {}
        with self.hub.cond:
            for c in range(self.hub.n):
                why = self.hub.client_status(c, now)
                if why is None:
                    avail[c] = True
                else:
                    reasons[c] = why
        return RoundAvailability(avail, reasons)


def export_onnx(model: torch.nn.Module, w: torch.Tensor, input_shape: tuple[int, ...]) -> bytes:
    """The global model as an ONNX file (input `x` [batch, C, H, W], output `logits`). Uses the
    TorchScript exporter (`dynamo=False`): the dynamo exporter needs onnxscript, absent offline."""
    set_flat(model, w)
    model.eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(1, *input_shape),), buf, dynamo=False, input_names=["x"],
                          output_names=["logits"], dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}})
    return buf.getvalue()


class MqttTransport:
    """`run_round(t, w, tasks)` over the broker; same contract as SimTransport."""

    def __init__(self, hub: FieldHub, model: torch.nn.Module, input_shape: tuple[int, ...], onnx_path: Path):
        self.hub, self.model, self.input_shape, self.onnx_path = hub, model, input_shape, onnx_path
        hub.layout = feddd.unit_layout(model)
        self.stats: dict[str, float] = {}

    def _publish_model(self, t: int, w: torch.Tensor, onnx_bytes: bytes) -> None:
        run, lim = self.hub.cfg.run_id, self.hub.limits
        for f in wire.encode("model", run, t, -1, w, {"model": self.hub.binding.model}, lim):
            self.hub.mqtt.publish(f"{TOPIC_ROOT}/model/weights", f, qos=1)
        onnx_t = torch.frombuffer(bytearray(onnx_bytes), dtype=torch.uint8)
        for f in wire.encode("onnx", run, t, -1, onnx_t, {}, lim):
            self.hub.mqtt.publish(f"{TOPIC_ROOT}/model/onnx", f, qos=1)

    def _publish_task(self, task: TrainTask) -> None:
        device = self.hub.device_of(task.client)
        if device is None:
            return
        meta = {"lr": task.lr, "batch_size": task.batch_size, "epochs": task.epochs, "steps": task.steps,
                "prox_mu": task.prox_mu, "seed": task.seed}
        if task.dropout_rate is not None:  # FedDD: upload 1 − D of the model, sparse (docs/protocol.md)
            meta |= {"dropout_rate": task.dropout_rate, "sparse_download": task.sparse_download}
        for f in wire.encode("task", self.hub.cfg.run_id, task.round, task.client, task.grad_correction, meta,
                             self.hub.limits):
            self.hub.mqtt.publish(f"{TOPIC_ROOT}/device/{device}/control", f, qos=1)

    def run_round(self, t: int, w: torch.Tensor, tasks: list[TrainTask]
                  ) -> tuple[dict[int, ClientUpdate], dict[int, str]]:
        hub, start = self.hub, time.monotonic()
        x0 = time.perf_counter()
        onnx_bytes = export_onnx(self.model, w, self.input_shape)
        export_s = time.perf_counter() - x0
        tmp = self.onnx_path.with_suffix(".onnx.tmp")
        tmp.write_bytes(onnx_bytes)
        tmp.replace(self.onnx_path)
        with hub.cond:
            hub.reasm.drop(before_round=t)
            r = hub.round = RoundState(t, {task.client: task for task in tasks}, start)
            seen_connects = hub.connects
        for task in tasks:  # tasks first: an agent then trains before it evaluates the ONNX model
            self._publish_task(task)
        self._publish_model(t, w, onnx_bytes)
        deadline = time.monotonic() + hub.cfg.deadline_s  # from the publish; wall_s counts the export too
        with hub.cond:
            while True:
                now = time.monotonic()
                gone = set()
                for c in r.tasks:
                    a = hub.by_client.get(c)
                    if a is None or not hub.is_online(a, now):
                        gone.add(c)  # its update (if complete) still counts; its stats will not come
                        if not r.resolved(c) and c not in r.updates:
                            r.dropped[c] = "offline"
                if all(r.resolved(c) or c in gone for c in r.tasks) or now >= deadline:
                    break
                resend = set(r.rejoined)
                if hub.connects != seen_connects:  # we reconnected: re-send everything outstanding
                    seen_connects = hub.connects
                    resend = set(r.tasks)
                    log(f"round {t}: reconnected to the broker; re-sending the model and open tasks")
                resend = {c for c in resend if not r.resolved(c)}
                r.rejoined.clear()
                if resend:
                    hub.cond.release()
                    try:
                        self._publish_model(t, w, onnx_bytes)
                        for c in sorted(resend):
                            self._publish_task(r.tasks[c])
                    finally:
                        hub.cond.acquire()
                    continue
                hub.cond.wait(timeout=min(deadline - now, 0.5))
            r.closed = True
            wall_s = time.monotonic() - start
        for c in r.tasks:
            if c not in r.updates and c not in r.dropped:
                r.dropped[c] = "deadline"
        updates = {}
        for task in tasks:  # the task order, as SimTransport: aggregation sums in the same order
            m = r.updates.get(task.client)
            if m is None:
                continue
            st, meta = r.stats.get(task.client, {}), m.meta
            down_s = meta.get("download_s") or 0.0
            # measured by the agent on this round's real transfers and training (FedDD, FedCS consume them)
            report = ClientReport(compute_s=meta.get("train_s"), up_Bps=st.get("uplink_Bps"),
                                  down_Bps=(w.numel() * 4 / down_s) if down_s > 0 else None,
                                  upload_bytes=m.header.nbytes, download_bytes=w.numel() * 4,
                                  label_score=meta.get("label_score"))
            delta, mask = update_tensors(hub.layout, m, w)
            updates[task.client] = ClientUpdate(task.client, delta, int(meta["num_samples"]), int(meta["steps"]),
                                                task.lr, float("nan") if meta.get("loss") is None else meta["loss"],
                                                mask=mask, report=report)
        self.stats = {"upload_bytes": float(sum(u.report.upload_bytes for u in updates.values())),
                      "download_bytes": float(sum(u.report.download_bytes for u in updates.values())),
                      "rejected_messages": float(sum(r.rejects.values()))}  # all codes; by code in field.jsonl
        self._log_round(r, updates, wall_s, export_s)
        dropped = {c: why for c, why in r.dropped.items() if c not in updates}
        return updates, dropped

    def round_stats(self) -> dict[str, float]:
        """Tensor bytes of this round's aggregated uploads and their downloads, and the messages rejected
        during the round, for metrics.jsonl."""
        return self.stats

    def _log_round(self, r: RoundState, updates: dict[int, ClientUpdate], wall_s: float, export_s: float) -> None:
        clients, slowest, slowest_busy = {}, 0.0, 0.0
        for c in updates:
            meta, st = r.updates[c].meta, r.stats.get(c, {})
            parts = [meta.get("download_s"), meta.get("train_s"), st.get("upload_s")]
            total = sum(p for p in parts if p is not None)
            slowest = max(slowest, total)
            slowest_busy = max(slowest_busy, total + (meta.get("wait_s") or 0.0))
            clients[str(c)] = {"download_s": parts[0], "train_s": parts[1], "upload_s": parts[2],
                               "wait_s": meta.get("wait_s"),
                               "uplink_Bps": st.get("uplink_Bps"), "upload_bytes": st.get("upload_bytes"),
                               "train_samples_per_s": meta.get("train_samples_per_s"),
                               "arrived_s": r.received_at[c] - r.started}
        row = {"event": "round", "round": r.t, "wall_s": wall_s, "export_s": export_s, "selected": len(r.tasks),
               "participants": len(updates), "dropped": {str(c): why for c, why in sorted(r.dropped.items())},
               "slowest_participant_s": slowest if updates else None,
               "overhead_s": wall_s - slowest if updates else None,
               # the same without the time agents' messages waited while the device was busy (several
               # agents per process, or an agent still evaluating): the coordinator's and broker's share
               "overhead_excl_agent_wait_s": wall_s - slowest_busy if updates else None,
               "duplicates": r.duplicates, "rejected": r.rejected, "rejects": dict(r.rejects),
               "late_total": self.hub.late, "clients": clients}
        with self.hub.cond:
            row["rejects_total"] = dict(self.hub.rejects)
            self.hub.write_log(row)
