"""The agent's work (`Work`, a component of `Agent`), all on the main thread.

Owns the model and this client's shard (training on `device`, the test split on the CPU for onnxruntime), the
latest global model (`weights`, `global_buffers`), ONNX model (`onnx`) and task (`task`), the last update
(`cache`, re-sent when asked again), FedDD's memory, and the counts `rounds_trained`, `tasks_skipped`,
`evals_skipped`. The agent hands it each message it reassembled, by kind: `on_model` keeps a global model and its
download time, `on_onnx` an ONNX model, `on_task` checks a task and declines it with the policy's reason,
re-sends a cached update, or keeps it; after each message `step` trains once the task and its round's global
model are both here (unless a newer round made it stale: `tasks_skipped`), and evaluates a new ONNX model when
idle. `_train_and_upload` runs `edge_client.trainer.local_train` on the shard (or FedDD's `feddd.client_round`
with its sparse payload), then uploads with the link's `send_update`; `_evaluation` scores the global ONNX model
with onnxruntime on the test split and publishes the accuracy.

Given at construction: the model and the shard (the agent loads them), `limits`, the battery (a training drains
a modelled one) and the telemetry, the measured `rates` (uplink read, downlink and training written here), the
`connected` and `stopping` events, `nothing_waiting` (the inbox is empty), the link (`Uplink`: publish,
send_update, superseded) and the heartbeat (`Availability`: policy_reason, battery_pct).

**Evaluation is never on the critical path.** Training never waits for an evaluation: `_evaluate_when_idle`
runs the evaluation one batch of `eval_batch` test samples at a time (`_evaluation` is a generator), on
the main thread, only while no task is pending and the inbox is empty. A message arriving mid-evaluation
is handled after the current batch; a task then trains at once, and the evaluation resumes where it
stopped once the agent is idle again. (Chosen over a background thread: no second onnxruntime session
competing with training for a small device's cores, and no lock around the agent's state.) If the next
round's ONNX model arrives before an evaluation finished, that evaluation is skipped, and logged: a
device too slow to evaluate every round evaluates the rounds it can. `eval_every` k evaluates only rounds
that are multiples of k (0: never); onnxruntime is imported on the first evaluation.

Each trained round is measured in a `RoundRecord` (edge_client/telemetry.py: seconds, CPU, peak RSS,
temperature, battery, energy of training and upload), each evaluation in an `EvalMeter` (its busy stretches
only); both go with the round's stats (link.py).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from edge_client import feddd, objectives, wire
from edge_client.agent.config import AgentConfig, log, who
from edge_client.agent.device import place
from edge_client.battery import Battery
from edge_client.models import get_buffers, set_buffers
from edge_client.telemetry import EvalMeter, RoundRecord, Telemetry
from edge_client.trainer import TrainTask, local_train

_libc = None


def release_memory() -> None:
    """Give the heap that a round's training or evaluation freed back to the OS (glibc's malloc_trim; ~25 MiB
    of an agent's steady RSS). A no-op where there is no glibc."""
    global _libc
    if _libc is None:
        try:
            import ctypes
            libc = ctypes.CDLL("libc.so.6")
            _libc = libc if hasattr(libc, "malloc_trim") else False
        except OSError:
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


class Uplink(Protocol):
    """What the work needs of the link (link.py `Link`)."""

    def publish(self, sub: str, frames: list[bytes], qos: int = 1) -> None: ...

    def send_update(self, run: str, rnd: int, frames: list[bytes], record: RoundRecord | None = None) -> None: ...

    def superseded(self, run: str, rnd: int) -> tuple[str, int] | None: ...


class Availability(Protocol):
    """What the work needs of the heartbeat (heartbeat.py `Heartbeat`)."""

    def policy_reason(self) -> str | None: ...

    def battery_pct(self) -> float | None: ...


class Work:
    def __init__(self, cfg: AgentConfig, device_id: str, client: int, device: torch.device, model: torch.nn.Module,
                 x: torch.Tensor, y: torch.Tensor, test_x: np.ndarray, test_y: np.ndarray, num_classes: int, *,
                 limits: wire.Limits, battery: Battery, telemetry: Telemetry, rates: dict,
                 connected: threading.Event, stopping: threading.Event, nothing_waiting: Callable[[], bool],
                 link: Uplink, availability: Availability):
        self.cfg, self.id, self.client_idx, self.device = cfg, device_id, client, device
        self.limits, self.battery, self.telemetry, self.rates = limits, battery, telemetry, rates
        self.connected, self.stopping, self.nothing_waiting = connected, stopping, nothing_waiting
        self.link, self.availability = link, availability
        self.layout = feddd.unit_layout(model)                    # FedDD: channels/neurons of the model
        self.label_score = feddd.label_score(y, num_classes)     # FedDD q_n, sent with every update
        # training on the device from here on (the test split stays on the CPU for onnxruntime)
        self.model, self.x, self.y = place(model, x, y, device)
        self.test_x, self.test_y = test_x, test_y
        self.feddd_memory: tuple[str, feddd.Memory] | None = None      # run, last upload (eq. 5)
        # run, round, w, download_s, arrival, model digest, first-to-last chunk seconds
        self.weights: tuple[str, int, torch.Tensor, float | None, float, str, float] | None = None
        self.global_buffers: tuple[str, int, dict] | None = None   # run, round, the model message's buffers
        self.onnx: tuple[str, int, bytes] | None = None
        self.evaluated: tuple[str, int] | None = None                     # the last ONNX model started
        self._eval: tuple[tuple[str, int], object] | None = None          # (run, round), its evaluation in progress
        self.evals_skipped = 0
        self.task: tuple[str, TrainTask, float, str | None] | None = None  # run, task, received at, model digest
        self._task_arrival: tuple[str, int, float] | None = None           # run, round, arrival (monotonic)
        # last update: run, round, model digest, frames, its telemetry record (re-sent when asked again)
        self.cache: tuple[str, int, str, list[bytes], RoundRecord] | None = None
        self.rounds_trained = 0
        self.tasks_skipped = 0       # stale tasks not trained

    # --- the messages the agent hands over (agent/__init__.py `_handle`) ---
    def on_model(self, msg: wire.Message, first_at: float, received: float) -> None:
        """A global model: its last chunk arrived at `received`, its first at `first_at` (this host's clock)."""
        h = msg.header
        n = sum(p.numel() for p in self.model.parameters())
        if msg.tensor is None or msg.tensor.dtype != torch.float32 or list(msg.tensor.shape) != [n]:
            log.warning(f"rejected a global model of {h.dtype} {h.shape} (expected float32 [{n}])",
                        extra=who(self.id))
            return
        digest = wire.model_digest(msg.tensor)
        if msg.meta.get("model_digest") not in (None, digest):
            log.warning(f"rejected a global model whose digest {digest} is not the one it names "
                        f"({str(msg.meta['model_digest'])[:64]})", extra=who(self.id))
            return
        # download time on this host's monotonic clock (never the coordinator's sent_at): from the arrival
        # of the round's task (published just before the model) or of the model's first chunk, whichever
        # came first, to the arrival of its last chunk; None if that is not measurable (docs/protocol.md)
        start = first_at
        if self._task_arrival is not None and self._task_arrival[:2] == (h.run, h.round):
            start = min(start, self._task_arrival[2])
        download_s = received - start if received > start else None
        self.weights = (h.run, h.round, msg.tensor, download_s, received, digest, received - first_at)
        self.global_buffers = None
        if "buffers" in msg.meta:   # the global BatchNorm statistics this round's training starts from
            try:
                self.global_buffers = (h.run, h.round, wire.meta_buffers(msg.meta["buffers"],
                                                                         get_buffers(self.model)))
            except wire.WireError as e:
                log.warning(f"round {h.round}: the model's buffers are not this model's ({e.reason}); training "
                            f"from its own", extra=who(self.id))
        if download_s is not None:
            self.rates["downlink_Bps"] = h.nbytes / download_s

    def on_onnx(self, msg: wire.Message) -> None:
        """The global model as ONNX (evaluated when idle); anything but a uint8 tensor is ignored."""
        if msg.tensor is not None and msg.tensor.dtype == torch.uint8:
            self.onnx = (msg.header.run, msg.header.round, msg.tensor.numpy().tobytes())

    def on_task(self, msg: wire.Message, received: float) -> None:
        h, m = msg.header, msg.meta
        if h.client != self.client_idx:
            log.warning(f"rejected a task for client {h.client} (this agent is client {self.client_idx})",
                        extra=who(self.id))
            return
        self._task_arrival = (h.run, h.round, received)  # the model follows it (its download time, `on_model`)
        digest = m.get("model_digest")  # the model the task trains on (None: any model of its round)
        reason = self.availability.policy_reason()
        if reason == "offline" and not self.connected.is_set():
            # a task that reached us just before the broker went away: a decline would arrive only once we
            # are back online, and then untrue. The coordinator re-sends open tasks when we rejoin.
            log.info(f"round {h.round}: task received as the broker went away; it comes again when we are back",
                     extra=who(self.id))
            return
        if reason is not None:
            self.link.publish("update/decline", wire.encode("decline", h.run, h.round, self.client_idx,
                                                            meta={"reason": reason}))
            return
        if self.cache is not None and self.cache[:2] == (h.run, h.round):
            if digest is None or digest == self.cache[2]:  # re-request after a reconnect: the same update
                self.link.send_update(h.run, h.round, self.cache[3], self.cache[4])
                return
            log.info(f"round {h.round}: the cached update was trained on model {self.cache[2]}, the task's is "
                     f"{digest}: training again", extra=who(self.id))
        try:
            steps, epochs, rate = m.get("steps"), m.get("epochs"), m.get("dropout_rate")
            # the local objectives, looked up by name in this device's registry (never a module the message names);
            # without `objectives`, the older form: `prox_mu` and a bare SCAFFOLD correction tensor
            objs = objectives.decode(m["objectives"], msg.tensor) if "objectives" in m else \
                objectives.legacy(m.get("prox_mu", 0.0), msg.tensor)
            task = TrainTask(client=self.client_idx, round=h.round, lr=float(m["lr"]),
                             batch_size=int(m["batch_size"]), epochs=None if epochs is None else int(epochs),
                             steps=None if steps is None else int(steps), objectives=objs, seed=int(m["seed"]),
                             dropout_rate=None if rate is None else float(rate),
                             sparse_download=bool(m.get("sparse_download", False)))
            if task.dropout_rate is not None and not 0.0 <= task.dropout_rate <= 1.0:
                raise ValueError(f"dropout_rate {task.dropout_rate} outside [0, 1]")
        except objectives.PluginError as e:   # an objective not installed here: declined, with the name, at once
            log.warning(f"round {h.round}: declined the task: {e}", extra=who(self.id))
            self.link.publish("update/decline", wire.encode("decline", h.run, h.round, self.client_idx,
                                                            meta={"reason": "declined", "detail": str(e)}))
            return
        except (KeyError, TypeError, ValueError) as e:
            log.warning(f"rejected a malformed task for round {h.round}: {e!r}", extra=who(self.id))
            return
        self.task = (h.run, task, received, digest)

    # --- after each message ---
    def step(self) -> None:
        """Train if the task and its round's global model are both here, then evaluate while idle."""
        ready = self.task is not None and self.weights is not None
        if ready and self.weights[:2] == (self.task[0], self.task[1].round) and self.task[3] in (None, self.weights[5]):
            (run, task, task_at, _), self.task = self.task, None
            newer = self.link.superseded(run, task.round)
            if newer is not None:  # round t+1's task or model is already here: round t has closed (link.py)
                log.info(f"round {task.round}: not trained: round {newer[1]}'s task or model arrived first",
                         extra=who(self.id))
                self.tasks_skipped += 1
                return
            wait_s = max(time.monotonic() - max(task_at, self.weights[4]), 0.0)  # busy with earlier messages
            self._train_and_upload(run, task, self.weights[2], self.weights[3], wait_s)
        if self.task is None:
            self._evaluate_when_idle()

    def _evaluate_when_idle(self) -> None:
        """Start evaluating a new ONNX model (every `eval_every` rounds), then run the evaluation a batch at a
        time while nothing waits in the inbox (the module's docstring: never on the critical path)."""
        if self.onnx is not None and self.onnx[:2] != self.evaluated:
            run, rnd, model_bytes = self.onnx
            self.evaluated = (run, rnd)  # started (or skipped) once per model
            if self._eval is not None:
                log.info(f"round {self._eval[0][1]}: evaluation skipped: round {rnd}'s model arrived before it "
                         f"finished", extra=who(self.id))
                self.evals_skipped += 1
                self._eval = None
            every = self.cfg.agent.eval_every
            if every > 0 and rnd % every == 0:
                self._eval = ((run, rnd), self._evaluation(run, rnd, model_bytes))
        while self._eval is not None and self.nothing_waiting() and not self.stopping.is_set():
            try:
                next(self._eval[1])
            except StopIteration:
                self._eval = None

    def _train_and_upload(self, run: str, task: TrainTask, w: torch.Tensor, download_s: float | None,
                          wait_s: float = 0.0) -> None:
        record = RoundRecord(self.telemetry, self.availability.battery_pct())  # what the round costs
        record.begin("train", busy=True)
        start = time.perf_counter()
        sparse_payload = None
        gb = self.global_buffers
        buffers = gb[2] if gb is not None and gb[:2] == (run, task.round) else None
        if task.dropout_rate is None:
            r = local_train(self.model, w, self.x, self.y, task, buffers=buffers)
        else:  # FedDD: Algorithm 2's mask, the kept values as a sparse payload (edge_client/feddd.py)
            memory = self.feddd_memory[1] if self.feddd_memory and self.feddd_memory[0] == run else None
            if buffers:
                set_buffers(self.model, buffers)
            out, memory = feddd.client_round(self.model, self.layout, w, self.x, self.y, task, memory)
            self.feddd_memory, r = (run, memory), out.result
            sparse_payload = feddd.encode_sparse(self.layout, memory.masks, memory.w_local)
        if self.cfg.agent.slowdown_s_per_step > 0 and self.stopping.wait(self.cfg.agent.slowdown_s_per_step * r.steps):
            return
        train_s = time.perf_counter() - start
        record.end()
        self.battery.training(train_s)
        samples = r.steps * min(task.batch_size, len(self.y))
        self.rates["train_samples_per_s"] = samples / train_s if train_s > 0 else None
        digest = self.weights[5] if self.weights is not None and self.weights[2] is w else wire.model_digest(w)
        meta = {"num_samples": r.num_samples, "steps": r.steps, "loss": _finite(r.loss), "train_s": train_s,
                "download_s": download_s, "wait_s": wait_s, "train_samples_per_s": self.rates["train_samples_per_s"],
                "model_digest": digest, "train_device": self.device.type}  # cpu or cuda (device.py)
        if self.weights is not None and self.weights[2] is w:
            meta["download_span_s"] = self.weights[6]  # the model's first chunk to its last, this host's clock
        if buffers and r.buffers:   # the buffers after training, for the coordinator's average (docs/protocol.md)
            meta["buffers"] = wire.buffers_meta(r.buffers)
        body = r.delta
        if sparse_payload is not None:
            body = torch.frombuffer(bytearray(sparse_payload), dtype=torch.uint8)
            meta |= {"encoding": feddd.WIRE_ENCODING, "dropout_rate": task.dropout_rate,
                     "label_score": self.label_score}
        frames = wire.encode("update", run, task.round, self.client_idx, body, meta, self._upload_limits())
        self.cache = (run, task.round, digest, frames, record)
        self.rounds_trained += 1
        self.link.send_update(run, task.round, frames, record)
        release_memory()

    def _upload_limits(self) -> wire.Limits:
        """Chunks small enough that one takes at most heartbeat_s at the uplink rate measured on the last
        upload (at least 4 KiB, at most chunk_bytes): something reaches the coordinator at least that often
        while an upload is in progress (docs/field-mode.md "Liveness"). Before any rate is measured (the first
        upload), chunks of `first_chunk_bytes` (8 KiB): never one large chunk that heartbeats queue behind."""
        up = self.rates.get("uplink_Bps")
        if not up:
            chunk = self.cfg.agent.first_chunk_bytes
        else:
            chunk = max(4096, int(up * self.cfg.agent.heartbeat_s))
        return dataclasses.replace(self.limits, chunk_bytes=chunk) if chunk < self.limits.chunk_bytes else self.limits

    def _eval_batch(self, sess, name: str, x, y) -> int:
        """Correct predictions of one batch (a seam for tests)."""
        logits = sess.run(None, {name: x})[0]
        return int((logits.argmax(1) == y).sum())

    def _evaluation(self, run: str, rnd: int, model_bytes: bytes):
        """A generator: yields after the session is built and after every batch; publishes the accuracy at the
        end. `seconds` counts only the time spent evaluating, not the pauses for other work."""
        import onnxruntime as ort

        busy, start = 0.0, time.perf_counter()
        meter = EvalMeter(self.telemetry)  # its seconds and energy go with the next update (telemetry.py)
        meter.resume()
        step = self.cfg.agent.eval_batch
        correct = 0
        try:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = self.cfg.agent.threads
            # basic graph optimizations: the extended ones cost ~12 MiB more at session creation, for nothing
            # on models this small (measured, benchmarks/agent_footprint.py)
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            sess = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
            name = sess.get_inputs()[0].name
            for i in range(0, len(self.test_y), step):
                busy += time.perf_counter() - start
                meter.pause()
                yield
                meter.resume()
                start = time.perf_counter()
                correct += self._eval_batch(sess, name, self.test_x[i:i + step], self.test_y[i:i + step])
        except Exception as e:  # onnxruntime raises its own exception types for a bad or foreign model
            log.warning(f"round {rnd}: could not evaluate the ONNX model: {e}", extra=who(self.id))
            meter.pause()
            return
        busy += time.perf_counter() - start
        meter.done(rnd)
        del sess
        release_memory()
        acc = correct / max(len(self.test_y), 1)
        self.link.publish("update/eval", wire.encode("eval", run, rnd, self.client_idx, meta={
            "accuracy": acc, "samples": int(len(self.test_y)), "seconds": busy}))
