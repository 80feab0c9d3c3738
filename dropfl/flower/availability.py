"""Dropouts inside Flower: a dropfl availability source decides, each round, which Flower nodes a strategy may
select and which selected ones drop after selection, with the reason (docs/flower.md).

    strategy = WithDropouts(FedAvg(min_train_nodes=1, min_available_nodes=1), from_config("fed.toml"))
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=10)

`WithDropouts` wraps any Flower strategy of the Message API. Flower's round r (from 1) is dropfl's round
t = r − 1. Each round:

1. **Availability.** `availability.round(t)` (any dropfl source: the registry's models built from a dropfl config,
   bounded/MimiC's, static, ...; a replayed participation log, a field trial's included; a device trace). The
   wrapped strategy's `configure_train` sees a Grid whose `get_node_ids()` lists only the available nodes, so it
   selects among them, with its own sampling. Node ids map to dropfl's client indices through
   `dropfl.flower.nodes` (one `query` round before round 1, `discover`).
2. **After-selection drops**, where the source records them (a replayed log, `LoggedRound.drops`): a client whose
   recorded reason says its device declined before training (`battery`, `charging`, `slow_link`, `thermal`,
   `declined`: coordinator/loop.py `DECLINED`) is never sent its task; any other recorded drop (`deadline`,
   `offline`, `rejected`) is sent it and trains, and its reply is left out of the aggregate, as dropfl's round loop
   does. A replayed log with its own selection (`--replay-selection log`, `LoggedRound.selected`) shows the
   strategy only the recorded selection as available.
3. **Every round reaches the wrapped strategy** as Flower's own `Strategy.start` shows it one: `configure_train`
   with the available nodes (none, where nobody is available), then `aggregate_train` with the replies kept and
   the error replies, an empty list included (nobody available, every reply lost or left out). A dropfl strategy
   (`DropflStrategy`) then aggregates the empty round as dropfl's round loop does (MIFA and FedLaAvg move the
   model by their stored updates); Flower's FedAvg returns no arrays for it and the model stays. Only a strategy
   that waits for more nodes than the round has (`min_available_nodes` / `min_train_nodes` of Flower's
   strategies, whose sampling would sleep until they connect) is not asked that round: it trains nobody, said
   once in the log.
4. **What Flower itself lost** is recorded as what it was, never as a device's choice: a selected node whose reply
   did not come back within `start(timeout=...)` is `deadline`; an error reply is `offline` where Flower says the
   node is gone (`NODE_UNAVAILABLE`), `deadline` where the message or its reply expired (`MESSAGE_UNAVAILABLE`,
   `REPLY_MESSAGE_UNAVAILABLE`), `declined` where dropfl's ClientApp could not take the task as sent (a local
   objective not installed there: `strategy.DECLINED_TASK`), and `rejected` for any other error (the ClientApp
   raised or crashed, a mod refused), with Flower's error code and reason in the log (`dropfl.flower`, warning).

Every round is kept in `history` (`FlowerRound`: availability, selection, participants, drops with reasons, mean
training loss), and handed to `recorder` if one is given (dropfl/flower/rundir.py writes a dropfl run directory
from it). Evaluation (`configure_evaluate`) is offered to the round's available nodes that did not drop.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from coordinator.availability.models import RoundAvailability
from coordinator.loop import DECLINED
from dropfl.flower.nodes import DISCOVER_TIMEOUT, NodeMap, discover
from dropfl.flower.strategy import error_reason

log = logging.getLogger("dropfl.flower")



@dataclass
class FlowerRound:
    """One Flower round in dropfl's terms (client indices = partition ids): `avail` who could take part and why
    not, `selected` whom the strategy asked (ascending), `participated` whose update it aggregated, `dropped`
    the selected clients without an aggregated update and why."""

    round: int
    avail: RoundAvailability
    selected: list[int]
    participated: set[int] = field(default_factory=set)
    dropped: dict[int, str] = field(default_factory=dict)
    train_loss: float | None = None
    configured: bool = True     # False: fewer nodes available than the strategy waits for; it was not asked


class _AvailableGrid(Grid):
    """The real Grid with `get_node_ids()` cut down to the round's available nodes (what a strategy samples from)."""

    def __init__(self, grid: Grid, node_ids: list[int]):
        self._grid, self._ids = grid, list(node_ids)

    def set_run(self, run) -> None:
        self._grid.set_run(run)

    @property
    def run(self):
        return self._grid.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._ids)

    def push_messages(self, messages):
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids):
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages, *, timeout=None):
        return self._grid.send_and_receive(messages, timeout=timeout)


def from_config(config, clients: int | None = None):
    """The availability source of a dropfl config (a SimConfig, a mapping of sections, or a TOML/JSON file such as
    a run's config.json; checked as `dropfl sim` checks it), built through the availability registry: `bounded`,
    `static`, `replay` with its `trace`, a plugin, ... `clients` overrides `data.clients`."""
    import dropfl
    from coordinator.runsetup import build_availability

    cfg = dropfl.load_config(config)
    if clients is not None:
        cfg.data.clients = clients
    return build_availability(cfg)


def replay(trace: str | Path, clients: int, selection: str = "log"):
    """A recorded participation log (a simulation's or a field trial's participation.csv, or participation/) as
    the availability source; `selection` "log" (its selection and drops, exact) or "strategy" (the strategy selects
    among the recorded available clients; who dropped in the log counts as unavailable), docs/traces.md."""
    from coordinator.availability.participation import Replay

    return Replay(trace, clients, selection=selection)


def _needs(strategy: Strategy, kind: str) -> int:
    """How many nodes Flower's own strategies wait for before sampling (`min_available_nodes`, `min_train_nodes` /
    `min_evaluate_nodes`): with fewer visible nodes their `sample_nodes` would wait for ever."""
    return max(int(getattr(strategy, "min_available_nodes", 0) or 0), int(getattr(strategy, f"min_{kind}_nodes", 0)
                                                                          or 0))


class WithDropouts(Strategy):
    """Any Flower strategy under a dropfl availability source (module docstring).

    Parameters
    ----------
    strategy : flwr.serverapp.strategy.Strategy
        The strategy that selects and aggregates (Flower's FedAvg, dropfl's DropflStrategy, ...).
    availability : a dropfl availability source
        Anything with `round(t) -> RoundAvailability` (`from_config`, `replay`, `dropfl.AVAILABILITY`'s models).
    clients : int, optional
        N, the number of clients (partition ids 0..N−1); default: the source's `n`.
    nodes : NodeMap, optional
        Node ids ↔ partition ids; default: learned by `dropfl.flower.nodes.discover` before round 1.
    recorder : callable, optional
        Called with each finished round's `FlowerRound` and metrics row; at the end of `start`,
        `recorder.finish(result, nodes)` and then `recorder.close()` (however the run ended) where it has them
        (dropfl/flower/rundir.py `RunRecorder`).
    """

    def __init__(self, strategy: Strategy, availability, *, clients: int | None = None, nodes: NodeMap | None = None,
                 recorder=None, discover_timeout: float = DISCOVER_TIMEOUT):
        n = clients if clients is not None else getattr(availability, "n", None)
        if n is None:
            raise ValueError("WithDropouts: give clients= (the availability source has no `n`)")
        if not callable(getattr(availability, "round", None)):
            raise TypeError(f"WithDropouts: availability must have round(t) -> RoundAvailability "
                            f"(got {type(availability).__name__})")
        self.strategy, self.availability, self.clients = strategy, availability, int(n)
        self.nodes, self.recorder, self.discover_timeout = nodes, recorder, discover_timeout
        self.history: list[FlowerRound] = []
        self._current: FlowerRound | None = None
        self._sent: dict[int, int] = {}       # node id -> partition of this round's train messages
        self._told: set[str] = set()
        self._counters = {"uploads": 0, "client_uploads": 0}
        self._lr: float | None = None
        self._tick = self._t0 = time.perf_counter()

    def summary(self) -> None:
        log.info("dropfl availability %s over %d clients, wrapping %s", type(self.availability).__name__,
                 self.clients, type(self.strategy).__name__)
        self.strategy.summary()

    # --- training ---------------------------------------------------------------------------------------------

    def _node_map(self, grid: Grid) -> NodeMap:
        if self.nodes is None:
            self.nodes = discover(grid, self.clients, timeout=self.discover_timeout, wait=self.discover_timeout)
        if getattr(self.strategy, "nodes", False) is None:   # DropflStrategy: the same map, not a second query
            self.strategy.nodes = self.nodes
        return self.nodes

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        nodes = self._node_map(grid)
        t = server_round - 1
        self._tick = time.perf_counter()
        loop = getattr(self.strategy, "loop", None)   # DropflStrategy sends its own schedule's lr_t
        self._lr = loop.lr_at(t) if hasattr(loop, "lr_at") else float(config["lr"]) if "lr" in config else None
        avail = self.availability.round(t)
        logged = getattr(avail, "selected", None)             # a replayed log's own selection
        visible = list(logged) if logged is not None else avail.active
        need = _needs(self.strategy, "train")
        if len(visible) < need:   # its sampling would wait for ever: the round is not shown to it
            self._say("short", f"round {t}: {len(visible)} clients available, {type(self.strategy).__name__} needs "
                      f"{need} (min_available_nodes / min_train_nodes); the round trains nobody")
            self._current, self._sent = FlowerRound(t, avail, [], configured=False), {}
            return []
        view = _AvailableGrid(grid, [nodes.node(p) for p in visible])
        messages = list(self.strategy.configure_train(server_round, arrays, config, view))
        sent = {}
        for m in messages:
            node = m.metadata.dst_node_id
            if not nodes.has_node(node) or nodes.partition(node) not in visible:
                raise ValueError(f"round {t}: {type(self.strategy).__name__} sent a task to node {node}, which is not "
                                 f"among the round's available nodes; it must select from grid.get_node_ids()")
            sent[node] = nodes.partition(node)
        selected = sorted(sent.values())
        if logged is not None and selected != sorted(logged):
            self._say("selection", f"round {t}: {type(self.strategy).__name__} selected clients {selected}, the "
                                   f"replayed log selected {sorted(logged)}; the participation records this run")
        drops = {p: r for p, r in (getattr(avail, "drops", None) or {}).items() if p in sent.values()}
        declined = {p for p, r in drops.items() if r in DECLINED}   # never asked: the device said no before training
        if drops and callable(getattr(self.strategy, "record_drops", None)):   # DropflStrategy: its history too
            self.strategy.record_drops(drops)
        self._current = FlowerRound(t, avail, selected, dropped=dict(drops))
        self._sent = {n: p for n, p in sent.items() if p not in declined}
        return [m for m in messages if sent[m.metadata.dst_node_id] not in declined]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        rnd = self._current
        if rnd is None or rnd.round != server_round - 1:
            raise RuntimeError(f"aggregate_train of round {server_round} without its configure_train")
        if not rnd.configured:
            return None, None
        kept, failed, answered = [], [], set()
        for m in replies:
            node = m.metadata.src_node_id
            p = self._sent.get(node)
            if p is None:
                continue   # not one of this round's tasks
            answered.add(p)
            if p in rnd.dropped:
                continue   # a recorded drop: it trained, its update is left out
            if m.has_error():
                code, reason = m.error.code, error_reason(m.error.code, m.error.reason)
                rnd.dropped[p] = reason
                log.warning("round %d: client %d (node %d) answered with Flower error %d (%s); recorded as dropped, "
                            "%s", rnd.round, p, node, code, m.error.reason, reason,
                            extra={"fields": {"round": rnd.round, "client": p, "node": node, "flower_error": code,
                                              "reason": reason}})
                failed.append(m)
                continue
            kept.append(m)
        for p in set(self._sent.values()) - answered:
            rnd.dropped.setdefault(p, "deadline")   # no reply before start()'s timeout
        rnd.participated = {self._sent[m.metadata.src_node_id] for m in kept}
        losses = [_metric(m, "train_loss") for m in kept]
        losses = [x for x in losses if x is not None and math.isfinite(x)]
        rnd.train_loss = sum(losses) / len(losses) if losses else None
        # every reply kept, none included, and the error replies (which Flower's strategies, like DropflStrategy,
        # count as failures): as Flower's own Strategy.start calls aggregate_train after every configure_train
        # whatever came back (a dropfl strategy aggregates an empty round: MIFA, FedLaAvg move the model by their
        # stored updates; Flower's FedAvg returns no arrays and the model stays)
        return self.strategy.aggregate_train(server_round, kept + failed)

    # --- evaluation ---------------------------------------------------------------------------------------------

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        nodes = self._node_map(grid)
        rnd = self._current
        if rnd is None or rnd.round != server_round - 1:
            avail = self.availability.round(server_round - 1)
            ok = avail.active
        else:
            ok = [p for p in rnd.avail.active if p not in rnd.dropped]
        if len(ok) < max(_needs(self.strategy, "evaluate"), 1):
            return []
        return self.strategy.configure_evaluate(server_round, arrays, config,
                                                _AvailableGrid(grid, [nodes.node(p) for p in ok]))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    # --- the run ------------------------------------------------------------------------------------------------

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's `Strategy.start`, recording each round when it ends (after the server-side evaluation, whose
        `accuracy` and `loss` go into the round's metrics row) and calling `recorder.finish(result, nodes)` at the
        end."""
        self._t0 = time.perf_counter()

        def evaluate_and_record(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            res = evaluate_fn(server_round, arrays) if evaluate_fn is not None else None
            if server_round >= 1:
                self._end_round(res)
            return res

        try:
            result = super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout,
                                   train_config=train_config, evaluate_config=evaluate_config,
                                   evaluate_fn=evaluate_and_record)
            if hasattr(self.recorder, "finish"):
                self.recorder.finish(result, self.nodes)
        finally:
            if hasattr(self.recorder, "close"):
                self.recorder.close()
        return result

    def _end_round(self, evaluation: MetricRecord | None) -> None:
        rnd = self._current
        if rnd is None:
            return
        self.history.append(rnd)
        if rnd.participated:
            self._counters["uploads"] += 1
            self._counters["client_uploads"] += len(rnd.participated)
        row = {"round": rnd.round, "lr": self._lr, **self._counters,
               "available": int(rnd.avail.available.sum()), "selected": len(rnd.selected),
               "participants": len(rnd.participated), "train_loss": rnd.train_loss}
        for key in ("accuracy", "loss"):
            if evaluation is not None and key in evaluation:
                row[key] = float(evaluation[key])
        now = time.perf_counter()
        row["seconds"], row["elapsed"] = now - self._tick, now - self._t0
        if self.recorder is not None:
            self.recorder(rnd, row)
        self._current = None

    def _say(self, kind: str, message: str) -> None:
        """A warning, said once per kind (the first round it happens in)."""
        if kind not in self._told:
            self._told.add(kind)
            log.warning("%s", message)


def _metric(message: Message, key: str) -> float | None:
    for record in message.content.metric_records.values():
        if key in record:
            v = record[key]
            return float(v) if isinstance(v, (int, float)) else None
    return None
