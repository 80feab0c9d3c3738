"""Field mode: the round loop's transport over an MQTT broker, and the model's ONNX export.

`MqttTransport.run_round` publishes the round's tasks, the global weights and their ONNX export
(`export_onnx`), then waits — on the hub's condition variable, fed by paho's network thread, never by
polling sleeps — until every selected client has delivered a complete, valid update (and its upload
stats), declined, or gone offline, or until the deadline; it re-sends what is outstanding to an agent
that rejoins and after the coordinator reconnects. It then turns the updates into `ClientUpdate`s and
writes the round's row of `field.jsonl`. The hub (connection, agents, collection) is
coordinator/field/hub.py. Topics and messages: docs/protocol.md.
"""

from __future__ import annotations

import io
import logging
import time
import warnings
from pathlib import Path

import torch

from coordinator.field.collection import RoundState
from coordinator.field.hub import FieldHub
from coordinator.field.sparse import update_tensors
from coordinator.strategies.base import ClientUpdate
from edge_client import feddd, wire
from edge_client.models import set_flat
from edge_client.report import ClientReport
from edge_client.trainer import TrainTask

log = logging.getLogger("dropfl.coordinator")


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
        hub, run, lim = self.hub, self.hub.cfg.run_id, self.hub.limits
        hub.publish_frames("model/weights", wire.encode("model", run, t, -1, w, {"model": hub.binding.model}, lim))
        onnx_t = torch.frombuffer(bytearray(onnx_bytes), dtype=torch.uint8)
        hub.publish_frames("model/onnx", wire.encode("onnx", run, t, -1, onnx_t, {}, lim))

    def _publish_task(self, task: TrainTask) -> None:
        device = self.hub.device_of(task.client)
        if device is None:
            return
        meta = {"lr": task.lr, "batch_size": task.batch_size, "epochs": task.epochs, "steps": task.steps,
                "prox_mu": task.prox_mu, "seed": task.seed}
        if task.dropout_rate is not None:  # FedDD: upload 1 − D of the model, sparse (docs/protocol.md)
            meta |= {"dropout_rate": task.dropout_rate, "sparse_download": task.sparse_download}
        self.hub.publish_frames(f"device/{device}/control", wire.encode(
            "task", self.hub.cfg.run_id, task.round, task.client, task.grad_correction, meta, self.hub.limits))

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
                    log.info("round %d: reconnected to the broker; re-sending the model and open tasks", t)
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
