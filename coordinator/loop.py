"""The round loop: selection, broadcast, collection, deadline and aggregation, for every transport.

    for t in rounds:
        avail    = availability.round(t)                    # who can take part, and why not
        selected = strategy.select(state, t, avail)         # e.g. FedLaAvg's oldest-first K
        tasks    = [strategy.configure(state, t, task(i)) for i in selected]
        updates, dropped = transport.run_round(t, w, tasks) # sim: in-process; mqtt: edge agents
        w, state = strategy.aggregate(state, t, w, updates)
        log participation, metrics, checkpoint

Nothing in here knows whether clients are simulated or real.

A replayed participation log (`--availability replay`) answers with a `LoggedRound`, which also holds
the recorded selection and the recorded after-selection drops. The loop then still calls
`strategy.select` exactly as the recorded run did, but trains and aggregates the recorded selection,
and drops the recorded dropouts after the transport, with their reasons (a client that declined its
task is not trained at all: `DECLINED`) (docs/traces.md, exact replay).
With the recorded run's reports.jsonl, the round's updates carry the recorded measurements
(`ClientReport`) instead of the transport's, so strategies that use them (FedDD's allocation, FedCS's
estimates) see what the recorded run's strategy saw. Every run writes reports.jsonl (coordinator/reports.py).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from coordinator import protocols
from coordinator.buffers import aggregate_buffers
from coordinator.protocols import AvailabilitySource, StatefulTransport, Transport
from coordinator.reports import task_row
from coordinator.rundir import DIVERGED, RunDir
from coordinator.statestore import referenced
from coordinator.strategies.base import ClientUpdate, Strategy
from coordinator.strategies.schedule import lr_at
from edge_client.trainer import TrainTask

log = logging.getLogger("dropfl.replay")

# Reasons of a recorded drop whose device declined its task (the agent's policy) and so did not train: a replay
# does not train it either (FedDD's device memory then follows the recorded run). Other drops (deadline,
# rejected, offline) trained, or may have, and train in the replay; none of them is aggregated.
DECLINED = ("battery", "charging", "slow_link", "declined", "thermal")


@dataclass
class LoopConfig:
    rounds: int
    n_clients: int
    seed: int
    lr: float
    lr_decay: float = 1.0
    lr_min: float = 1e-5
    batch_size: int = 16
    epochs: int | None = 1
    steps: int | None = None
    eval_every: int = 1
    checkpoint_every: int = 1
    lr_schedule: str = "exp"
    lr_step_every: int = 1

    def lr_at(self, t: int) -> float:
        """lr_t under `lr_schedule` (coordinator/strategies/schedule.py): exp = max(lr · γ^t, lr_min), the
        MimiC released code (γ = 1 keeps it constant); inv-t = lr/(t+1), MIFA's; step = lr · γ^⌊t/k⌋."""
        return lr_at(t, self.lr, schedule=self.lr_schedule, decay=self.lr_decay, lr_min=self.lr_min,
                     step_every=self.lr_step_every)


def run_rounds(cfg: LoopConfig, strategy: Strategy, availability: AvailabilitySource, transport: Transport,
               evaluate: Callable[[torch.Tensor], tuple[float, float]], rundir: RunDir,
               w0: torch.Tensor, resume: bool = False, progress: bool = True,
               checkpoint: dict | None = None,
               observers: list[Callable[[dict], None]] | None = None,
               buffers: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Run rounds [start, cfg.rounds) and return the final global model (flat). On `resume`, continue from
    `checkpoint` (already read, e.g. by runsetup.check_resume), else from the run directory's.
    `observers`: called with each round's metrics row once it is written (coordinator/tracking.py).
    `buffers`: the global model's buffers (BatchNorm's running statistics; {} or None: a model without), updated in
    place after each round by coordinator/buffers.py's rule (and from the checkpoint on `resume`), so the caller's
    evaluation and final model read them."""
    start, w, state = 0, w0.clone(), None
    buffers = {} if buffers is None else buffers
    counters = {"uploads": 0, "client_uploads": 0}
    rundir.checkpoint_refs = set()  # the state-store snapshots the current checkpoint.pt refers to (none yet)
    if resume:
        ck = checkpoint if checkpoint is not None else rundir.load_checkpoint()
        if ck is not None:  # the tables go into this run's store (a disk snapshot is copied back into RUN/state)
            start, w, counters = ck["round"] + 1, ck["w"], ck["counters"]
            buffers.update(ck.get("buffers", {}))
            state = strategy.adopt_state(ck["state"])
            rundir.checkpoint_refs = referenced(ck)
            if "transport" in ck and isinstance(transport, StatefulTransport):  # absent in older checkpoints
                transport.load_state_dict(ck["transport"])
    if resume and rundir.file(DIVERGED).exists():   # a run that diverged is tried again from its checkpoint
        log.warning("resuming a run that diverged (%s): %s", DIVERGED,
                    json.loads(rundir.file(DIVERGED).read_text()).get("message"))
        rundir.file(DIVERGED).unlink()
    if state is None:  # init only when not resuming: a table of N rows is not built twice
        state = strategy.init_state(cfg.n_clients, w0)
    plog = rundir.participation_log(resume_from_round=start if resume else None)
    rlog = rundir.reports_log(resume_from_round=start if resume else None)
    metrics = rundir.metrics_writer(resume_from_round=start if resume else None)
    # a strategy's own per-round log (FL-FDMS: friends.jsonl), cut back to the checkpoint on resume like metrics
    slog = (rundir.round_log(strategy.round_log_file, resume_from_round=start if resume else None)
            if protocols.round_log_file(strategy) else None)
    bar = _progress(cfg.rounds, start, progress)
    t0 = time.perf_counter()
    differs: list[int] = []  # replay: rounds where the strategy would have selected other clients than the log
    told: set[str] = set()   # replay with recorded reports: what was said once already
    carried = bool(buffers) and protocols.carries_buffers(transport)   # else the global buffers stay as they are
    if buffers and not carried:
        log.warning("%s does not carry model buffers: the global model's buffers (BatchNorm statistics) stay as they "
                    "are (docs/engine.md)", type(transport).__name__)
    extra = {"buffers": buffers} if carried else {}
    for t in range(start, cfg.rounds):
        tick = time.perf_counter()
        avail = availability.round(t)
        rng = np.random.default_rng([cfg.seed, t, 0x5E1])
        selected = strategy.select(state, t, avail.available, rng)
        logged = protocols.recorded_selection(avail)  # a replayed log: the recorded selection
        if logged is not None and set(selected) != set(logged):
            _selection_differs(strategy, t, selected, logged, differs)
            selected = list(logged)
        lr = cfg.lr_at(t)
        tasks = [strategy.configure(state, t, TrainTask(client=i, round=t, lr=lr, batch_size=cfg.batch_size,
                                                        epochs=cfg.epochs, steps=cfg.steps, seed=cfg.seed))
                 for i in selected]
        drops = protocols.recorded_drops(avail)  # a replayed log: dropped after selection, with the reason
        trained = [task for task in tasks if not drops or drops.get(task.client) not in DECLINED]
        if strategy.absorbs and protocols.streams(transport):  # e.g. MIFA in simulation
            updates, dropped = transport.run_round(t, w, trained, absorb=_absorber(strategy, state, t, drops),
                                                   **extra)
        else:
            updates, dropped = transport.run_round(t, w, trained, **extra)
        if drops:
            updates = {i: u for i, u in updates.items() if i not in drops}
            dropped = {**dropped, **drops}  # drops ⊆ the recorded selection = selected
        recorded = protocols.recorded_reports(avail)  # a replayed log with reports.jsonl: what the clients measured
        if recorded is not None:
            updates = _recorded_reports(strategy, t, updates, tasks, recorded, avail.tasks or {}, told)
        w, state = strategy.aggregate(state, t, w, updates)
        if carried:
            buffers.update(aggregate_buffers(buffers, updates))
        if not torch.isfinite(w).all():   # recorded in the run directory: a diverged run is a result (reproduce)
            message = f"round {t}: the global model is no longer finite (lr too high?)"
            rundir.write_json(DIVERGED, {"round": t, "message": message})
            raise FloatingPointError(message)
        if updates:
            counters["uploads"] += strategy.uploads_per_round
            counters["client_uploads"] += strategy.uploads_per_round * len(updates)
        if slog is not None:
            slog.write(strategy.round_log(state, t, updates))
        rlog.write_round(t, updates, tasks)  # before the participation row: a log's rounds all have reports
        plog.write_round(t, cfg.n_clients, avail, selected, set(updates), dropped)
        row = {"round": t, "lr": lr, "uploads": counters["uploads"], "client_uploads": counters["client_uploads"],
               "available": int(avail.available.sum()), "selected": len(selected), "participants": len(updates),
               "train_loss": _mean([u.loss for u in updates.values()])}
        row |= protocols.round_info(transport)  # sim: the engine that ran
        for key, v in protocols.round_stats(transport).items():
            counters[key] = counters.get(key, 0.0) + v  # what the transport measured: bytes, virtual round time
            row[key], row[key + "_total"] = v, counters[key]
        if (t + 1) % cfg.eval_every == 0 or t == cfg.rounds - 1:
            row["accuracy"], row["loss"] = evaluate(w)
        row["seconds"] = time.perf_counter() - tick
        row["elapsed"] = time.perf_counter() - t0
        metrics.write(row)
        for observe in observers or ():
            observe(row)
        ck = {"round": t, "w": w, "state": state, "counters": dict(counters)}
        if buffers:   # a model with buffers only: other checkpoints keep their keys
            ck["buffers"] = {n: b.clone() for n, b in buffers.items()}
        if isinstance(transport, StatefulTransport):  # what the clients keep between rounds (sim: FedDD memory)
            ck["transport"] = transport.state_dict()
        if (t + 1) % cfg.checkpoint_every == 0 or t == cfg.rounds - 1:
            rundir.save_checkpoint(ck)
        else:  # not due yet: a run stopped before the next round ends (field: broker outage) saves it then
            rundir.unsaved_checkpoint = ck
        if bar is not None:
            bar.update(1)
            bar.set_postfix(_postfix(row, metrics.last_accuracy))
        elif progress and "accuracy" in row:  # not a terminal: one line per evaluation
            eta = row["elapsed"] / (t + 1 - start) * (cfg.rounds - t - 1)
            print(f"round {t + 1}/{cfg.rounds}  accuracy {100 * row['accuracy']:.2f}%  "
                  f"participants {row['participants']}/{row['available']}  eta {eta:.0f}s",
                  file=sys.stderr, flush=True)
    if bar is not None:
        bar.close()
    if len(differs) > 1:
        log.warning("replay: %s would have selected other clients than the log in %d rounds (%s); every round "
                    "replayed the log's selection", strategy.name, len(differs), ", ".join(map(str, differs[:20]))
                    + (", ..." if len(differs) > 20 else ""))
    return w


def _absorber(strategy: Strategy, state, t: int, drops: dict[int, str] | None
              ) -> Callable[[dict[int, ClientUpdate]], None]:
    """What the transport calls with each slice of the round's updates as it arrives: each update is taken into
    the strategy's state (Strategy.absorb: MIFA writes its row) and its delta dropped, so that a round in which
    all N clients upload (round 0 with --first-round-all) does not hold N deltas at once. The same rows are
    written as `aggregate` would write them, so the bits are the same. A recorded drop of a replay is not
    aggregated, so not absorbed either (it keeps its delta until the loop leaves it out)."""
    def absorb(part: dict[int, ClientUpdate]) -> None:
        for i, u in part.items():
            if not drops or i not in drops:
                strategy.absorb(state, t, u)
                u.delta = None
    return absorb


def _selection_differs(strategy: Strategy, t: int, selected: list[int], logged: list[int],
                       differs: list[int]) -> None:
    """A replay whose strategy selects other clients than the recorded run did: the log's selection is
    replayed (so the participation is the recorded one); said once, with the first round, then summed up."""
    differs.append(t)
    if len(differs) == 1:
        log.warning("replay: round %d: %s selects clients %s, the log selected %s; replaying the log's selection "
                    "(the log was recorded with another strategy or other settings, or the strategy's inputs "
                    "differ, e.g. FedCS's measured times in a field trial)", t, strategy.name,
                    sorted(selected), list(logged),
                    extra={"fields": {"round": t, "strategy_selected": sorted(selected), "log_selected": list(logged)}})


def _recorded_reports(strategy: Strategy, t: int, updates: dict[int, ClientUpdate], tasks: list[TrainTask],
                      recorded: dict, recorded_tasks: dict[int, dict], told: set[str]) -> dict[int, ClientUpdate]:
    """The round's updates with the recorded run's measurements in place of the transport's (a client the
    recorded run did not aggregate keeps its own, said once). A task parameter that differs from the
    recorded one (FedDD's dropout rate: another strategy or other settings) is said once, not replaced."""
    out = {}
    for i, u in updates.items():
        if i in recorded:
            rec = recorded[i]
            out[i] = replace(u, report=None if rec is None else replace(rec))
        else:
            out[i] = u
            if "report" not in told:
                told.add("report")
                log.warning("replay: round %d: reports.jsonl has no measurement of client %d; its update carries "
                            "the simulation's own (said once)", t, i)
    for task in tasks:
        mine, theirs = task_row(task), recorded_tasks.get(task.client)
        if mine is not None and theirs is not None and mine != theirs and "task" not in told:
            told.add("task")
            log.warning("replay: round %d: %s sets client %d's task to %s, the recorded run's was %s (another "
                        "strategy or other settings; said once)", t, strategy.name, task.client, mine, theirs,
                        extra={"fields": {"round": t, "client": task.client, "task": mine, "recorded_task": theirs}})
    return out


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else None


def _postfix(row: dict, last_acc: float | None) -> dict:
    out = {"part": f"{row['participants']}/{row['available']}"}
    if last_acc is not None and not math.isnan(last_acc):
        out["acc"] = f"{100 * last_acc:.2f}%"
    return out


def _progress(total: int, start: int, enabled: bool):
    """A tqdm bar (round, accuracy, ETA) on a terminal; None otherwise."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=start, desc="rounds", unit="round", dynamic_ncols=True)
