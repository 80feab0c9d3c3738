"""Field mode: the round loop's transport over an MQTT broker, and the model's ONNX export.

`MqttTransport.run_round` publishes the round's tasks, the global weights and their ONNX export
(`export_onnx`), then waits — on the hub's condition variable, fed by paho's network thread, never by
polling sleeps — until every selected client has delivered a complete, valid update (and its upload
stats), declined, or gone offline, or until the deadline (extended while an upload keeps arriving,
`collection.keeps_open`; the rule: `closing.close`, evaluated only when a message may change its decision or
its time comes); it re-sends the task, model and ONNX to an agent that rejoins on its own control
topic, and re-broadcasts what is outstanding after the coordinator reconnects. Tasks and models carry the
model's digest (`wire.model_digest`). It then turns the updates into `ClientUpdate`s and
writes the round's row of `field.jsonl` and a row per aggregated device in `telemetry.jsonl`. The hub
(its components: connection, outage, registry, collection, absence) is coordinator/field/hub.py. Topics and
messages: docs/protocol.md.
"""

from __future__ import annotations

import inspect
import io
import logging
import time
import warnings
from pathlib import Path

import torch

from coordinator.field import closing, telemetry
from coordinator.field.collection import RoundState
from coordinator.field.hub import FieldHub
from coordinator.field.outage import LOSS_SETTLE_S
from coordinator.field.sparse import update_tensors
from coordinator.strategies.base import ClientUpdate
from edge_client import feddd, objectives, wire
from edge_client.models import set_buffers, set_flat
from edge_client.report import ClientReport
from edge_client.trainer import TrainTask

log = logging.getLogger("dropfl.coordinator")


def export_onnx(model: torch.nn.Module, w: torch.Tensor, input_shape: tuple[int, ...]) -> bytes:
    """The global model as an ONNX file (input `x` [batch, C, H, W], output `logits`). Uses the
    TorchScript exporter (`dynamo=False`): the dynamo exporter needs onnxscript, absent offline. torch < 2.1 (e.g.
    Debian's 1.13, docs/devices.md) has only that exporter and no `dynamo` argument."""
    set_flat(model, w)
    model.eval()
    buf = io.BytesIO()
    exporter = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(1, *input_shape),), buf, input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}}, **exporter)
    return buf.getvalue()


def export_onnx_or_none(model: torch.nn.Module, w: torch.Tensor, input_shape: tuple[int, ...]) -> bytes | None:
    """`export_onnx`, or None where the model cannot be exported (an operator ONNX has no form for, in a user's
    model), said in one warning line: the agents then do not evaluate it on the device; training is unaffected."""
    try:
        return export_onnx(model, w, input_shape)
    except Exception as e:  # noqa: BLE001 (whatever the exporter raises: no on-device evaluation, never a crash)
        log.warning("the model cannot be exported to ONNX (%s: %s): the agents do not evaluate it on the device",
                    type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else "")
        return None


def client_report(meta: dict, stats: dict, upload_bytes: int, model_bytes: int) -> ClientReport:
    """FedDD's and FedCS's inputs from an update's meta and its stats: durations the agent measured on its
    own monotonic clock (train_s, upload_s, download_s; docs/protocol.md "Measured rates"). The coordinator
    never subtracts another host's timestamps, so clock skew between the hosts does not enter."""
    down_s = meta.get("download_s") or 0.0
    return ClientReport(compute_s=meta.get("train_s"), up_Bps=stats.get("uplink_Bps"),
                        down_Bps=(model_bytes / down_s) if down_s > 0 else None,
                        upload_bytes=upload_bytes, download_bytes=model_bytes, label_score=meta.get("label_score"))


class MqttTransport:
    """`run_round(t, w, tasks)` over the broker; same contract as SimTransport."""

    def __init__(self, hub: FieldHub, model: torch.nn.Module, input_shape: tuple[int, ...], onnx_path: Path):
        self.hub, self.model, self.input_shape, self.onnx_path = hub, model, input_shape, onnx_path
        self.scans = 0  # evaluations of the closing rule, all rounds (tests read it: not one per message)
        hub.collection.layout = feddd.unit_layout(model)
        self.stats: dict[str, float] = {}
        self._empty_mark = hub.absence.empty_time(time.monotonic())  # empty-federation time counted in earlier rounds
        self.buffers: dict[str, torch.Tensor] = {}  # the round's global buffers (a model with BatchNorm), sent with it
        self.onnx_ok = True  # False once the model could not be exported (said once; no ONNX model is sent after)

    carries_buffers = True  # run_round takes `buffers` (coordinator/buffers.py)

    def _publish_model(self, t: int, w: torch.Tensor, onnx_bytes: bytes | None, digest: str | None = None,
                       device: str | None = None) -> None:
        """The round's global weights and ONNX model: broadcast on model/..., or to one `device` only on its
        own control topic (an agent that rejoins; docs/protocol.md)."""
        hub, run, lim = self.hub, self.hub.cfg.run_id, self.hub.limits
        weights_topic, onnx_topic = ("model/weights", "model/onnx") if device is None else \
            (f"device/{device}/control",) * 2
        meta = {"model": hub.binding.model} | ({} if digest is None else {"model_digest": digest})
        if self.buffers:   # the global buffers the agents start from (docs/protocol.md)
            meta["buffers"] = wire.buffers_meta(self.buffers)
        hub.connection.publish_frames(weights_topic, wire.encode("model", run, t, -1, w, meta, lim))
        if onnx_bytes is not None:
            onnx_t = torch.frombuffer(bytearray(onnx_bytes), dtype=torch.uint8)
            hub.connection.publish_frames(onnx_topic, wire.encode("onnx", run, t, -1, onnx_t, {}, lim))

    def _buffers_of(self, client: int, meta: dict) -> dict[str, torch.Tensor] | None:
        """An update's buffers after training, where the round sent global buffers; an update without them, or with
        others than the model's, leaves them out of the buffer average (logged; its delta is aggregated)."""
        if not self.buffers:
            return None
        try:
            return wire.meta_buffers(meta.get("buffers"), self.buffers)
        except wire.WireError as e:
            log.warning("client %d's update carries no usable buffers (%s): left out of the buffer average",
                        client, e.reason)
            return None

    def _publish_task(self, task: TrainTask, digest: str | None = None) -> None:
        device = self.hub.registry.device_of(task.client)
        if device is None:
            return
        meta = {"lr": task.lr, "batch_size": task.batch_size, "epochs": task.epochs, "steps": task.steps,
                "seed": task.seed}
        objs, tensor = objectives.encode(task.objectives)  # by registry name, their tensors as the message's
        if objs:
            meta["objectives"] = objs
        if digest is not None:  # the model this task trains on: the update must echo it (stale: rejected)
            meta["model_digest"] = digest
        if task.dropout_rate is not None:  # FedDD: upload 1 − D of the model, sparse (docs/protocol.md)
            meta |= {"dropout_rate": task.dropout_rate, "sparse_download": task.sparse_download}
        self.hub.connection.publish_frames(f"device/{device}/control", wire.encode(
            "task", self.hub.cfg.run_id, task.round, task.client, tensor, meta, self.hub.limits))

    def run_round(self, t: int, w: torch.Tensor, tasks: list[TrainTask],
                  buffers: dict[str, torch.Tensor] | None = None) -> tuple[dict[int, ClientUpdate], dict[int, str]]:
        hub, start = self.hub, time.monotonic()
        self.buffers = dict(buffers or {})
        if self.buffers:   # the ONNX model evaluates with the global statistics too
            set_buffers(self.model, self.buffers)
        x0 = time.perf_counter()
        onnx_bytes = export_onnx_or_none(self.model, w, self.input_shape) if self.onnx_ok else None
        self.onnx_ok = onnx_bytes is not None
        export_s = time.perf_counter() - x0
        if onnx_bytes is not None:
            tmp = self.onnx_path.with_suffix(".onnx.tmp")
            tmp.write_bytes(onnx_bytes)
            tmp.replace(self.onnx_path)
        coll, agents, outage, absence, conn = hub.collection, hub.registry, hub.outage, hub.absence, hub.connection
        with hub.cond:
            coll.reasm.drop(before_round=t)
            r = coll.round = RoundState(t, {task.client: task for task in tasks}, start, digest=wire.model_digest(w))
            seen_connects = conn.connects
            # time disconnected from the broker (outage.py) and suspended with nobody there (absence.py)
            down = outage.downtime(start) + absence.empty_time(start)
            outage0 = outage.downtime(start)
        for task in tasks:  # tasks first: an agent then trains before it evaluates the ONNX model
            self._publish_task(task, r.digest)
        self._publish_model(t, w, onnx_bytes, r.digest)
        deadline = time.monotonic() + hub.cfg.deadline_s  # from the publish; wall_s counts the export too
        hard_end, extended = deadline + hub.cfg.upload_extension_s, False
        check_at = float("-inf")  # when to look at the open clients' liveness next (-inf: now)
        with hub.cond:
            while True:
                now = time.monotonic()
                # deadlines are suspended while disconnected from the broker, or with nobody there
                shift = outage.downtime(now) + absence.empty_time(now) - down
                deadline, hard_end, down = deadline + shift, hard_end + shift, down + shift
                if outage.down_since is None and now >= check_at:
                    check_at = self._check_liveness(r, now)
                if now >= deadline:
                    r.past_deadline = True
                v = closing.RoundView(
                    open=len(r.open), deadline=deadline, hard_end=hard_end, timeout_s=hub.cfg.heartbeat_timeout_s,
                    settle_until=r.lost_at + LOSS_SETTLE_S, outage=outage.down_since is not None,
                    empty=not r.updates and bool(r.offline) and absence.nobody_online(now) is not None,
                    check_at=check_at,
                    uploads=tuple(p.view(c, c in r.updates, r.started) for c, p in r.progress.items() if c in r.open)
                    if now >= deadline else ())
                d = closing.close(v, now)
                self.scans += 1
                if d.why == "outage":  # nobody is dropped, the round stays open
                    outage.wait_for_broker(f"round {t} is suspended")  # BrokerOutage after --broker-outage-timeout
                    check_at = float("-inf")
                    continue
                if d.why == "empty":  # everyone gone: not a result (absence.py)
                    absence.wait_while_empty(absence.nobody_online, f"round {t} is suspended")  # EmptyFederation
                    back = set(r.offline)
                    for c in back:
                        del r.dropped[c]
                        r.gone.discard(c)
                        r.note(c)
                    agents.await_back({dev for c in back if (dev := agents.device_of(c)) is not None}, time.monotonic())
                    r.lost_at, check_at = float("-inf"), float("-inf")
                    continue
                if d.closed:
                    break
                if d.extended_for and not extended:
                    extended = True
                    log.info("round %d: past the deadline, uploads still arriving: %s", t, ", ".join(
                        f"client {c} {r.progress[c].row()['chunks']}/{r.progress[c].chunks} chunks"
                        for c in d.extended_for))
                resend = set(r.rejoined)
                broadcast = False
                if conn.connects != seen_connects:  # we reconnected: re-send everything outstanding
                    seen_connects = conn.connects
                    resend, broadcast = set(r.tasks), True
                    log.info("round %d: reconnected to the broker; re-sending the model and open tasks", t)
                resend = {c for c in resend if not r.resolved(c)}
                r.rejoined.clear()
                if resend:
                    hub.cond.release()
                    try:  # tasks first, then the model (as at the round's start)
                        for c in sorted(resend):
                            self._publish_task(r.tasks[c], r.digest)
                            if not broadcast:  # a rejoining agent: the model to it alone, on its control topic
                                device = agents.device_of(c)
                                if device is not None:
                                    self._publish_model(t, w, onnx_bytes, r.digest, device=device)
                        if broadcast:
                            self._publish_model(t, w, onnx_bytes, r.digest)
                    finally:
                        hub.cond.acquire()
                    continue
                # woken by what may change the decision (collection.py `_changed`, a rejoin, an outage) or its time
                hub.wake.wait(timeout=max(d.wake_at - now, 0.001) if d.wake_at < float("inf") else None)
            r.closed = True
            end = time.monotonic()
            wall_s = end - start
            outage_s = outage.downtime(end) - outage0
            empty_s, self._empty_mark = absence.empty_time(end) - self._empty_mark, absence.empty_time(end)
        r.dropped.update(closing.final_reasons(r.tasks, r.updates, r.dropped))
        updates = {}
        for task in tasks:  # the task order, as SimTransport: aggregation sums in the same order
            m = r.updates.get(task.client)
            if m is None:
                continue
            st, meta = r.stats.get(task.client, {}), m.meta
            report = client_report(meta, st, m.header.nbytes, w.numel() * 4)
            delta, mask = update_tensors(coll.layout, m, w)
            updates[task.client] = ClientUpdate(task.client, delta, int(meta["num_samples"]), int(meta["steps"]),
                                                task.lr, float("nan") if meta.get("loss") is None else meta["loss"],
                                                mask=mask, report=report, buffers=self._buffers_of(task.client, meta))
        self.stats = {"upload_bytes": float(sum(u.report.upload_bytes for u in updates.values())),
                      "download_bytes": float(sum(u.report.download_bytes for u in updates.values())),
                      "rejected_messages": float(sum(r.rejects.values())),  # all codes; by code in field.jsonl
                      "broker_outage_s": outage_s,  # the round's time disconnected from the broker
                      # the round's time waiting with nobody there (its start included; coordinator/field/absence.py)
                      "empty_federation_s": empty_s}
        self._log_round(r, updates, wall_s, export_s)
        with hub.cond:  # what the round cost each aggregated device (coordinator/field/telemetry.py)
            rows = [telemetry.row(t, c, agents.device_of(c), r.updates[c].meta, r.stats.get(c, {}),
                                  updates[c].report.download_bytes) for c in updates]
        telemetry.write_rows(coll.field_log.with_name("telemetry.jsonl"), rows)
        dropped = {c: why for c, why in r.dropped.items() if c not in updates}
        if not updates:  # recorded (someone is still there), never silently: each drop has its reason
            log.warning("round %d: no participant: %d selected, dropped %s", t, len(tasks), ", ".join(
                f"client {c} {why}" for c, why in sorted(dropped.items())) or "none",
                extra={"fields": {"round": t, "selected": len(tasks),
                                  "dropped": {str(c): w for c, w in dropped.items()}}})
        return updates, dropped

    def _check_liveness(self, r: RoundState, now: float) -> float:
        """The open clients found offline now (not heard from within the heartbeat timeout, and not awaited after a
        broker outage) are gone: dropped `offline` without an update; with one, it counts without its stats. Returns
        when to look again: the earliest time another open client's timeout may lapse (a message only pushes it
        later), or when an awaited client stops being awaited. O(open clients); it runs about once per heartbeat
        timeout, not per message. Under the hub's lock."""
        agents, timeout = self.hub.registry, self.hub.cfg.heartbeat_timeout_s
        awaited, nxt = agents.awaited(now), float("inf")
        for c in list(r.open):
            a = agents.by_client.get(c)
            if c in awaited:
                nxt = min(nxt, agents.back_by)
            elif a is None or not agents.is_online(a, now):
                r.gone.add(c)
                if c not in r.updates and not r.resolved(c):
                    r.dropped[c] = "offline"
                r.note(c, now)
            else:
                nxt = min(nxt, max(a.last_seen, a.last_heartbeat) + timeout)
        return nxt

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
                               "train_device": meta.get("train_device"),
                               "arrived_s": r.received_at[c] - r.started}
            if c in r.progress:  # the upload as the coordinator saw its chunks arrive
                clients[str(c)]["upload_progress"] = r.progress[c].row()
        row = {"event": "round", "round": r.t, "wall_s": wall_s, "export_s": export_s, "selected": len(r.tasks),
               "participants": len(updates), "dropped": {str(c): why for c, why in sorted(r.dropped.items())},
               "slowest_participant_s": slowest if updates else None,
               "overhead_s": wall_s - slowest if updates else None,
               # the same without the time agents' messages waited while the device was busy (several
               # agents per process, or an agent still evaluating): the coordinator's and broker's share
               "overhead_excl_agent_wait_s": wall_s - slowest_busy if updates else None,
               "duplicates": r.duplicates, "rejected": r.rejected, "rejects": dict(r.rejects),
               # dropped `offline` in the round, then heard from again within it: the drop undone (collection.py)
               "offline_undone": sorted(r.offline_undone),
               "late_total": self.hub.collection.late, "clients": clients,
               # every upload of the round as far as it got (chunks, tensor bytes, seconds first→latest chunk)
               "uploads": {str(c): p.row() for c, p in sorted(r.progress.items())},
               # chunks of earlier rounds' uploads that came in during this round (a stale upload's tail)
               "stale_chunks": {str(c): n for c, n in sorted(r.stale_chunks.items())}}
        with self.hub.cond:
            row["rejects_total"] = dict(self.hub.collection.rejects)
            self.hub.collection.write_log(row)
