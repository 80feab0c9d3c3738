"""Any dropfl strategy as a Flower strategy of the Message API (flwr 1.41: `configure_train`/`aggregate_train`).

    from dropfl.flower import DropflStrategy, model_arrays

    @server.main()
    def main(grid, context):
        strategy = DropflStrategy("mimic", LoopConfig(rounds=50, n_clients=100, seed=0, lr=0.05),
                                  participation=availability_source, state=context.state)
        result = strategy.start(grid, model_arrays(model), num_rounds=50)

One Flower round is one dropfl round, `t = server_round − 1` (plus the rounds of a state it resumes from), and
does what dropfl's round loop does (coordinator/loop.py): the participation answers who is available, the
dropfl strategy selects among them with the loop's per-round generator, configures each task, and aggregates the
updates that came back, with the same arithmetic on the same float32 vectors, so a Flower run and a dropfl run
of one federation give the same model (tests/test_flower_equivalence.py).

The model travels as an ArrayRecord of the model's parameters (`model_arrays`), in the model's parameter order,
which is dropfl's flat vector (edge_client/models.py `get_flat`: `parameters_to_vector`); `to_vector` and
`to_arrays` convert exactly (float32 bits in, the same bits out). A client replies as Flower's quickstart does:
its trained model (ArrayRecord "arrays") and a MetricRecord "metrics" with "num-examples", and, where the
strategy needs them, "steps" (SGD steps; else the task's), "lr" (else the task's) and "train_loss". The server
forms dropfl's delta `w_global − w_local` from them. dropfl's own ClientApp is `dropfl.flower.client`.

Clients are dropfl's partition ids 0..N-1; the node ids behind them are learned before round 1 by a query
(`dropfl.flower.nodes.discover`), so the ClientApp must answer queries with `nodes.partition_reply`.

State. The strategy's per-client tables (MIFA's and FedLaAvg's latest updates, MimiC's corrections, FL-FDMS's
similarities, SCAFFOLD's control variates ...) and the global model are written after every round into the
RecordDict passed as `state` (a ServerApp's `Context.state`): ArrayRecord "dropfl.state" (one array per state
entry, lossless: float32/float64/int64/bool as they are), ArrayRecord "dropfl.model" (the global model after the
round) and ConfigRecord "dropfl.meta" (strategy name, N, the last round done, the node map of the run). A
DropflStrategy built with a RecordDict that holds them resumes from them: its state, and rounds numbered on from
the last one done (`resume_arrays()` gives the model to pass to `start`); the node map is discovered again.
What Flower 1.41 itself keeps of that RecordDict: everything, for as long as the ServerApp's `main` runs, and
nothing for a later run. A ServerApp is not restartable in 1.41: `Strategy.start` always begins at round 1;
`run_simulation` gives every run a new empty `Context.state` (tested); in a deployment, `flwr run` starts every run
in a new run series, whose context (the one a run's ServerApp receives) starts empty, and `flwr-serverapp` empties
the state of a ServerApp that finished before reporting its context back ("Temporarily disable pushing resulting
context", flwr/superlink/runtime/run_serverapp.py; only `flwr chat` continues a series). So the state survives a
restart only where the ServerApp itself stores the RecordDict and hands it back: `state_file=PATH` writes it to a
file after every round (atomically), and `state=state_from_file(PATH)` resumes from it (tested bitwise). Copying
the tables into records every round costs O(N·M) per round; pass `state=None` to keep them only in this object.

Not carried: FedDD's client side (its upload selection and sparse download, edge_client/feddd.py) is the
ClientApp's; the wrapper aggregates what a client sends (a bool ArrayRecord "mask" of uploaded coordinates and
its measurements as metrics, `REPORT_METRICS`). A replayed log's recorded measurements (reports.jsonl) are not
substituted for the clients' (the round loop's `_recorded_reports`). MimiC's practical variant (mimic-client)
keeps the devices' corrections where dropfl's simulation keeps them, in the strategy state ("device_corr"), not on
the Flower clients: the same arithmetic, run on the server.
Updates are aggregated in the order of the selection, as dropfl's transports hand them over, whatever order the
replies arrived in (a mean over a stack of deltas has other float bits in another order).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy as FlowerStrategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from coordinator import protocols
from coordinator.availability.models import RoundAvailability
from coordinator.config import StrategyConfig
from coordinator.errors import UserError
from coordinator.loop import DECLINED, LoopConfig
from coordinator.strategies import STRATEGIES, ClientUpdate
from coordinator.strategies import Strategy as DropflBase
from dropfl.flower.nodes import DISCOVER_TIMEOUT, NodeMap, discover
from edge_client import objectives
from edge_client.registry import PluginError, blame
from edge_client.report import ClientReport
from edge_client.trainer import TrainTask

log = logging.getLogger("dropfl.flower")

ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"   # the record names of Flower's quickstart and FedAvg
OBJECTIVES, MASK = "objectives", "mask"   # the task's local objectives (ConfigRecord key, ArrayRecord); FedDD's mask
STATE, MODEL, META = "dropfl.state", "dropfl.model", "dropfl.meta"   # what is kept in Context.state
# Reasons of a selected client whose update was not aggregated because of Flower (coordinator/availability REASONS,
# as dropfl/flower/availability.py records them): no reply within the round's timeout is "deadline"; an error reply
# is "offline" where Flower says the node is gone, "deadline" where the message or its reply expired, else
# "rejected" (the ClientApp raised, a mod refused), with Flower's code and reason in `history`.
# A partition that no node in grid.get_node_ids() holds is NOT_CONNECTED: not connected to this run, or hidden by an
# availability wrapper's grid (dropfl/flower/availability.py), which records its own reason; never a device's state.
NOT_CONNECTED = "not_connected"
ERROR_REASONS = {ErrorCode.NODE_UNAVAILABLE: "offline", ErrorCode.MESSAGE_UNAVAILABLE: "deadline",
                 ErrorCode.REPLY_MESSAGE_UNAVAILABLE: "deadline"}
# what dropfl's ClientApp raises for a task it cannot train as asked (a local objective not installed there,
# dropfl/flower/client.py): Flower's runtime puts the message in the error reply's reason, and the client is
# recorded "declined", as a device agent's decline of the same task is (docs/objectives.md)
DECLINED_TASK = "dropfl: the client declined the task: "


def error_reason(code: int, reason: str) -> str:
    """The participation reason of a Flower error reply (ERROR_REASONS; `declined` for DECLINED_TASK; else
    `rejected`)."""
    if code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION and DECLINED_TASK in (reason or ""):
        return "declined"
    return ERROR_REASONS.get(code, "rejected")
# ClientReport fields a reply may carry as metrics (FedDD's allocation, FedCS's estimates)
REPORT_METRICS = {f.name.replace("_", "-"): f.name for f in dataclasses.fields(ClientReport)}


# ---- the model: Flower ArrayRecord <-> dropfl flat float32 vector ------------------------------------------------

def model_arrays(model: torch.nn.Module) -> ArrayRecord:
    """The model's parameters as an ArrayRecord, named and ordered as `model.named_parameters()` (dropfl's flat
    order; buffers such as BatchNorm statistics are not part of dropfl's vector and are left out)."""
    return ArrayRecord({name: Array(p.detach().cpu().numpy()) for name, p in model.named_parameters()})


def to_vector(arrays: ArrayRecord) -> torch.Tensor:
    """The record's arrays, in its order, as one flat float32 vector (dropfl's `get_flat`; the bits unchanged)."""
    parts = []
    for name, arr in arrays.items():
        a = arr.numpy()
        if a.dtype != np.float32:
            raise ValueError(f"array {name!r} is {a.dtype}; dropfl's models are float32")
        parts.append(torch.from_numpy(a.reshape(-1)))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)


def to_arrays(w: torch.Tensor, like: ArrayRecord) -> ArrayRecord:
    """A flat float32 vector cut back into `like`'s names and shapes (the inverse of `to_vector`)."""
    shapes = [(name, tuple(arr.shape)) for name, arr in like.items()]
    sizes = [math.prod(s) for _, s in shapes]
    if sum(sizes) != w.numel():
        raise ValueError(f"a vector of {w.numel()} values for an ArrayRecord of {sum(sizes)}")
    flat = w.detach().to(torch.float32).cpu()
    return ArrayRecord({name: Array(part.reshape(shape).numpy().copy())
                        for (name, shape), part in zip(shapes, torch.split(flat, sizes), strict=True)})


# ---- the strategy's state <-> records ---------------------------------------------------------------------------

def state_to_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """dropfl strategy state (a flat dict of tensors) as an ArrayRecord, lossless (dtype and shape kept)."""
    out = ArrayRecord()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state entry {key!r} is a {type(value).__name__}; Flower's records keep arrays, so a "
                            f"strategy kept in Context.state holds tensors only")
        out[key] = Array(value.detach().cpu().numpy().copy())
    return out


def state_from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(arr.numpy().copy()) for key, arr in record.items()}


def state_to_file(state: RecordDict, path: str | Path) -> None:
    """Write a RecordDict (e.g. Context.state after `start`) to a file, for a ServerApp that restarts."""
    from flwr.common.serde import recorddict_to_proto

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(recorddict_to_proto(state).SerializeToString())
    tmp.replace(path)


def state_from_file(path: str | Path) -> RecordDict:
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as RecordDictProto

    proto = RecordDictProto()
    proto.ParseFromString(Path(path).read_bytes())
    return recorddict_from_proto(proto)


# ---- participation --------------------------------------------------------------------------------------------------

def participation_round(participation, t: int, n_clients: int):
    """Round t's availability: None = everyone; an object with `round(t)` (a dropfl availability source,
    coordinator/availability, a replayed participation log, or any wrapper answering the same); or a sequence
    whose item t is the set of available partition ids."""
    if participation is None:
        return RoundAvailability(np.ones(n_clients, dtype=bool))
    if callable(getattr(participation, "round", None)):
        return participation.round(t)
    ids = participation[t]
    available = np.zeros(n_clients, dtype=bool)
    available[list(ids)] = True
    return RoundAvailability(available, {i: "trace" for i in range(n_clients) if not available[i]})  # a given list


# ---- the strategy ---------------------------------------------------------------------------------------------------

def build_dropfl_strategy(algo: str, config: StrategyConfig | None, loop: LoopConfig) -> DropflBase:
    """A registered dropfl strategy from its name and config, as `coordinator.runsetup.build_strategy` builds it."""
    s = dataclasses.replace(config or StrategyConfig(), algo=algo)
    try:
        entry = STRATEGIES.entry(algo)
    except PluginError as e:
        raise UserError(f"--algo: {e}") from None
    cls = entry.obj
    with blame(entry, UserError, (UserError,)):
        strategy = cls.from_config(s) if hasattr(cls, "from_config") else cls(weighting=s.weighting)
    if hasattr(strategy, "bind_lr_schedule"):
        strategy.bind_lr_schedule(loop.lr_at)
    return strategy


@dataclasses.dataclass
class _Round:
    """What configure_train decided, for aggregate_train."""

    t: int
    w: torch.Tensor
    like: ArrayRecord
    avail: object
    available: np.ndarray
    reasons: dict[int, str]
    selected: list[int]
    tasks: dict[int, TrainTask]
    sent: list[int]
    drops: dict[int, str]


class DropflStrategy(FlowerStrategy):
    """A dropfl strategy (any entry of `coordinator.strategies.STRATEGIES`, built-in or plugin) run by Flower.

    Args:
        strategy: a registered name ("mimic", "mifa", a plugin's "module:attr" ...) built from `config` as
            `dropfl sim --algo NAME` builds it (bound to `loop`'s lr schedule where it takes one), or a dropfl
            strategy instance, used as it is.
        loop: dropfl's round-loop settings (coordinator.loop.LoopConfig): n_clients (N, the partitions
            0..N-1), seed (the selection generator and the clients' batch order), lr and its schedule
            (lr_at), batch_size, epochs/steps. Sent to the clients with every task.
        config: the strategy's settings (coordinator.config.StrategyConfig) when `strategy` is a name.
        participation: who is available in round t (see `participation_round`): None (everyone), a dropfl
            availability source with `round(t)`, a replayed log (its recorded selection and drops are followed,
            as the round loop does), or a sequence of sets of partition ids.
        nodes: the node map; None (default) discovers it before the first round (`nodes.discover`).
        state: a RecordDict to keep the strategy's state in (a ServerApp's `Context.state`); see the module
            docstring for what survives. None: kept in this object only.
        state_file: a file to write that RecordDict to after every round (`state_to_file`; a new RecordDict
            where `state` is None), so that a ServerApp started again resumes with `state=state_from_file(PATH)`.
        timeout: seconds `discover` waits for the nodes' answers (`nodes.DISCOVER_TIMEOUT`, 300).
        evaluate: send the global model to every connected node after each round (Flower's federated
            evaluation; the replies' MetricRecords are averaged weighted by "num-examples"). False (default):
            no client-side evaluation; pass `evaluate_fn` to `start` for a central one.

    After each round, `history[-1]` is what happened: round, lr, available, selected, participants, "reasons" (why
    each unavailable client was: the participation's reason, or NOT_CONNECTED) and "dropped" (for each selected
    client whose update was not aggregated: a replayed drop's recorded reason, what Flower reported,
    `ERROR_REASONS`, with Flower's own words in "errors", or NOT_CONNECTED): what happened, never a modelled
    dropout.
    """

    def __init__(self, strategy: str | DropflBase, loop: LoopConfig, *, config: StrategyConfig | None = None,
                 participation=None, nodes: NodeMap | None = None, state: RecordDict | None = None,
                 state_file: str | Path | None = None, timeout: float = DISCOVER_TIMEOUT, evaluate: bool = False):
        self.strategy = build_dropfl_strategy(strategy, config, loop) if isinstance(strategy, str) else strategy
        self.loop, self.participation, self.nodes = loop, participation, nodes
        if state is None and state_file is not None:
            state = RecordDict()
        self.record, self.state_file, self.timeout, self.evaluate = state, state_file, timeout, evaluate
        self.state: dict[str, torch.Tensor] | None = None
        self.offset = 0                   # rounds done before this object (a resumed state)
        self.history: list[dict] = []
        self._round: _Round | None = None
        if state is not None and META in state.config_records:
            self._resume(state)

    @property
    def name(self) -> str:
        return self.strategy.name

    def _resume(self, record: RecordDict) -> None:
        meta = record.config_records[META]
        if meta["algo"] != self.name or int(meta["n_clients"]) != self.loop.n_clients:
            raise UserError(f"the state in Context.state is of {meta['algo']} with {meta['n_clients']} clients, not "
                            f"{self.name} with {self.loop.n_clients}; start from an empty state")
        self.state = self.strategy.adopt_state(state_from_record(record.array_records[STATE]))
        self.offset = int(meta["round"]) + 1

    def resume_arrays(self) -> ArrayRecord | None:
        """The global model of the state this strategy resumes from (None when it starts afresh)."""
        if self.record is None or MODEL not in self.record.array_records or self.offset == 0:
            return None
        return self.record.array_records[MODEL]

    def summary(self) -> None:
        log.info("dropfl strategy %s (%s), %d clients, lr %g, batch %d, %s", self.name, type(self.strategy).__name__,
                 self.loop.n_clients, self.loop.lr, self.loop.batch_size,
                 f"{self.loop.steps} steps" if self.loop.steps is not None else f"{self.loop.epochs} epoch(s)")

    # -- training --

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        t = self.offset + server_round - 1
        n = self.loop.n_clients
        w = to_vector(arrays)
        if self.state is None:
            self.state = self.strategy.init_state(n, w)
        if self.nodes is None:
            self.nodes = discover(grid, n, timeout=self.timeout)
        avail = participation_round(self.participation, t, n)
        available = np.asarray(avail.available, dtype=bool).copy()
        connected = np.zeros(n, dtype=bool)
        connected[[self.nodes.partition(i) for i in grid.get_node_ids() if self.nodes.has_node(i)]] = True
        reasons = dict(getattr(avail, "reasons", {}) or {})
        reasons.update({int(i): NOT_CONNECTED for i in np.flatnonzero(available & ~connected)})
        available &= connected
        rng = np.random.default_rng([self.loop.seed, t, 0x5E1])   # the round loop's per-round generator
        selected = self.strategy.select(self.state, t, available, rng)
        logged = protocols.recorded_selection(avail)   # a replayed log: its recorded selection
        if logged is not None:
            selected = list(logged)
        lr = self.loop.lr_at(t)
        tasks = {i: self.strategy.configure(self.state, t, TrainTask(
            client=i, round=t, lr=lr, batch_size=self.loop.batch_size, epochs=self.loop.epochs, steps=self.loop.steps,
            seed=self.loop.seed)) for i in selected}
        drops = dict(protocols.recorded_drops(avail) or {})
        sent = [i for i in selected if drops.get(i) not in DECLINED and connected[i]]
        self._round = _Round(t, w, arrays, avail, available, reasons, list(selected), tasks, sent, drops)
        extra = {str(k): v for k, v in config.items()}
        return [Message(task_record(arrays, tasks[i], server_round, extra), dst_node_id=self.nodes.node(i),
                        message_type=MessageType.TRAIN) for i in sent]

    def record_drops(self, drops: dict[int, str]) -> None:
        """Selected clients of this round that a wrapper drops after selection, with their reasons (WithDropouts:
        a replayed log's drops): not aggregated, and kept in `history` with those reasons, not as lost replies."""
        if self._round is not None:
            self._round.drops.update({int(i): str(why) for i, why in drops.items() if int(i) in self._round.selected})

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        r = self._round
        if r is None or r.t != self.offset + server_round - 1:
            raise RuntimeError(f"aggregate_train for round {server_round} without its configure_train")
        updates: dict[int, ClientUpdate] = {}
        dropped: dict[int, str] = {}
        errors: dict[int, str] = {}
        for msg in replies:
            src = msg.metadata.src_node_id
            if not self.nodes.has_node(src) or self.nodes.partition(src) not in r.sent:
                log.warning("round %d: a reply from node %d, which was not sent a task, is ignored", r.t, src)
                continue
            i = self.nodes.partition(src)
            if msg.has_error():
                dropped[i] = error_reason(msg.error.code, msg.error.reason)
                errors[i] = f"flower error {msg.error.code}: {msg.error.reason}"
                log.warning("round %d: client %d (node %d): %s", r.t, i, src, errors[i])
                continue
            updates[i] = update_from_reply(msg, i, r.w, r.tasks[i])
        for i in r.sent:
            if i not in updates and i not in dropped:
                dropped[i] = "deadline"   # no reply within start()'s timeout
        # in the selection's order, as the round loop's transports hand them over: a strategy that sums the updates
        # in dict order (FedAvg's mean_delta) gives other float bits in another order
        updates = {i: updates[i] for i in r.selected if i in updates}
        for i, reason in r.drops.items():   # a replayed log's drops after selection: not aggregated
            updates.pop(i, None)
            dropped[i] = reason
        for i in r.selected:
            if i not in r.sent and i not in dropped:
                dropped[i] = NOT_CONNECTED   # a replayed selection of a partition that no listed node holds
        w, self.state = self.strategy.aggregate(self.state, r.t, r.w, updates)
        if not torch.isfinite(w).all():
            raise FloatingPointError(f"round {r.t}: the global model is no longer finite (lr too high?)")
        losses = [u.loss for u in updates.values() if u.loss == u.loss]
        row = {"round": r.t, "lr": self.loop.lr_at(r.t), "available": int(r.available.sum()),
               "selected": len(r.selected), "participants": len(updates), "dropped": dropped,
               "reasons": r.reasons}
        if errors:
            row["errors"] = errors
        if protocols.round_log_file(self.strategy):   # e.g. FL-FDMS's friends
            row["strategy"] = self.strategy.round_log(self.state, r.t, updates)
        self.history.append(row)
        self._round = None
        new = to_arrays(w, r.like)
        if self.record is not None:
            self._keep(r.t, new)
        metrics = MetricRecord({"participants": len(updates), "selected": len(r.selected),
                                "available": int(r.available.sum())})
        if losses:
            metrics["train_loss"] = sum(losses) / len(losses)
        return new, metrics

    def _keep(self, t: int, arrays: ArrayRecord) -> None:
        self.record[STATE] = state_to_record(self.state)
        self.record[MODEL] = arrays
        meta = self.nodes.to_record()
        meta.update({"algo": self.name, "n_clients": self.loop.n_clients, "round": t})
        self.record[META] = meta
        if self.state_file is not None:
            state_to_file(self.record, self.state_file)

    # -- evaluation --

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if not self.evaluate:
            return []
        config = ConfigRecord({**config, "server-round": server_round})
        return [Message(RecordDict({ARRAYS: arrays, CONFIG: config}), dst_node_id=i,
                        message_type=MessageType.EVALUATE) for i in grid.get_node_ids()]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        ok = [m.content for m in replies if not m.has_error()]
        return aggregate_metricrecords(ok, "num-examples") if ok else None


def task_record(arrays: ArrayRecord, task: TrainTask, server_round: int, extra: dict | None = None) -> RecordDict:
    """What a client receives: the global model and its dropfl TrainTask (`client.task_from_message` reads it).
    The task's local objectives (FedProx's, SCAFFOLD's, a plugin's) travel as `edge_client.objectives.encode`
    writes them for a device: the list (names and parameters) as JSON in the ConfigRecord's "objectives", their
    tensors as one float32 array in the ArrayRecord "objectives"."""
    cfg = ConfigRecord(dict(extra or {}))
    meta, tensor = objectives.encode(task.objectives)   # by registry name; their tensors as one float32 vector
    cfg.update({"server-round": server_round, "round": task.round, "partition-id": task.client, "lr": task.lr,
                "batch-size": task.batch_size, "seed": task.seed, OBJECTIVES: json.dumps(meta)})
    if task.epochs is not None:
        cfg["epochs"] = task.epochs
    if task.steps is not None:
        cfg["steps"] = task.steps
    if task.dropout_rate is not None:
        cfg["dropout-rate"] = task.dropout_rate
        cfg["sparse-download"] = task.sparse_download
    content = {ARRAYS: arrays, CONFIG: cfg}
    if tensor is not None:
        content[OBJECTIVES] = ArrayRecord({OBJECTIVES: Array(tensor.detach().cpu().numpy().copy())})
    return RecordDict(content)


def update_from_reply(msg: Message, client: int, w: torch.Tensor, task: TrainTask) -> ClientUpdate:
    """dropfl's ClientUpdate from a training reply: delta = w_global − w_local (masked with FedDD's "mask")."""
    content = msg.content
    if ARRAYS not in content.array_records or METRICS not in content.metric_records:
        raise ValueError(f"client {client}: a training reply needs ArrayRecord {ARRAYS!r} and MetricRecord "
                         f"{METRICS!r} (has {sorted(content.array_records)} and {sorted(content.metric_records)})")
    m = content.metric_records[METRICS]
    w_local = to_vector(content.array_records[ARRAYS])
    if w_local.numel() != w.numel():
        raise ValueError(f"client {client}: a model of {w_local.numel()} values, the global one has {w.numel()}")
    delta = w - w_local   # dropfl's delta units (coordinator/strategies/base.py)
    mask = None
    if MASK in content.array_records:
        mask = torch.from_numpy(np.asarray(content.array_records[MASK][MASK].numpy(), dtype=bool).copy())
        delta = torch.where(mask, delta, torch.zeros_like(delta))
    report = {f: m[k] for k, f in REPORT_METRICS.items() if k in m}
    return ClientUpdate(client=client, delta=delta, num_samples=int(m["num-examples"]),
                        steps=int(m["steps"]) if "steps" in m else int(task.steps or 0),
                        lr=float(m["lr"]) if "lr" in m else task.lr,
                        loss=float(m["train_loss"]) if "train_loss" in m else float("nan"), mask=mask,
                        report=ClientReport(**report) if report else None)

