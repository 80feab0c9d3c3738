"""The in-process transport: virtual clients trained in this process (batched engine or reference loop)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from coordinator.sim.clock import Profile, SimClients
from coordinator.statestore import StateStore
from coordinator.strategies import ClientUpdate
from edge_client.models import get_buffers, set_buffers
from edge_client.trainer import TrainTask, local_train

log = logging.getLogger("dropfl.sim")


class SimTransport:
    """In-process virtual clients; every selected client's update arrives.

    `engine="batched"` (the default) trains a round's clients as one computation
    (coordinator/sim/batched.py), with the loop's updates (to float rounding, docs/engine.md).
    `engine="loop"` is the reference: one client after another with the same `local_train` the edge
    agent runs. Tasks the batched engine does not replay run on the loop, as with `engine="loop"`:
    FedDD's (`dropout_rate`: masks and device memory, coordinator/sim/clock.py), every task of a run
    with a clock `profile`, and every task of a model that neither a hand-written batched forward nor the
    generic engine (coordinator/sim/functional.py, torch.func) can train. `feddd=True` (the
    strategy gives every task a dropout rate) starts no batched engine at all.

    What ran is recorded: `describe()` for the run (logged at its start), `round_info()["engine"]`
    for each round (a column of metrics.jsonl).
    """

    def __init__(self, model: torch.nn.Module, client_data: list[tuple[torch.Tensor, torch.Tensor]],
                 engine: str = "batched", profile: Profile | None = None, num_classes: int | None = None,
                 feddd: bool = False, store: StateStore | None = None, make_engine=None, device: str = "auto"):
        # make_engine(model, client_data): the batched engine (default: BatchedEngine); a lockstep sweep
        # `device`: --sim-device, where the generic engine trains a model the batched engine has no forward for
        # (coordinator/sim/lockstep.py) hands each run a proxy that trains its tasks with the other runs'
        if engine not in ("batched", "loop"):
            raise ValueError(f"engine {engine!r}: batched or loop")
        self.model, self.client_data, self.engine = model, client_data, engine
        # FedDD masks and memory (in the run's state store) and the virtual clock
        self.clients = SimClients(model, profile, num_classes, store if feddd else None, len(client_data))
        self.stats: dict[str, float] = {}
        self.paths: set[str] = set()    # the native parts that trained this round (`LocalResult.path`)
        self.warned: set[str] = set()   # the fallbacks already logged
        self.batched = None
        self.loop_reason: str | None = None  # why the loop trains although engine="batched"
        if engine == "batched":
            if profile is not None:
                self.loop_reason = "clock profile"
            elif feddd:
                self.loop_reason = "feddd tasks"
            else:
                from coordinator.sim.batched import BatchedEngine
                try:
                    self.batched = (make_engine or BatchedEngine)(model, client_data)
                except TypeError:  # no hand-written batched forward: the generic engine (torch.func)
                    from coordinator.sim.functional import GenericEngine
                    try:
                        self.batched = GenericEngine(model, client_data, device)
                    except TypeError as e:  # torch.func cannot run it either: the loop, said once
                        self.loop_reason = f"no batched forward for {type(model).__name__}"
                        log.warning("%s; its clients train on the reference loop", e)
        if self.batched is not None and get_buffers(model) and not self.batched.details().get("generic"):
            # the hand-written batched forwards (the built-in models) have no buffers: only torch.func carries them
            raise AssertionError(f"{type(model).__name__} has buffers, the batched engine does not carry them")
        self.last_engine = self.describe()

    def describe(self) -> str:
        """The engine of the run: "batched+native(<variant>)", "batched", "batched (cuda)", "loop", or
        "loop (<why>)" where the batched engine was asked for but cannot replay the run's tasks."""
        if self.batched is not None:
            return self.batched.describe()
        return "loop" if self.loop_reason is None else f"loop ({self.loop_reason})"

    def summary(self) -> tuple[str, dict]:
        """The log line for the start of a run, and its structured fields."""
        name = self.describe()
        fields: dict = {"engine": name, "requested": self.engine}
        if self.batched is not None:
            d = self.batched.details()
            fields |= d
            per_client = d.get("generic") and d.get("mode") == "per-client"
            text = f"a round's clients in {d['slices']} slices on {d['device']}, each client after client" \
                if per_client else f"a round's clients as one computation on {d['device']}"
            if d["workers"]:
                text += f", {d['workers']} worker processes"
            if per_client:
                text += (" (local_train on 1 thread; no hand-written batched forward for this model, and vmap over "
                         f"its clients does not pay for it: {d.get('mode_reason')})")
                if d.get("layout") == "channels-last":
                    text += (f", on a channels-last copy ({d.get('layout_reason')}; BatchNorm summed in double, "
                             f"{d.get('batchnorm')}; DROPFL_CHANNELS_LAST=0 keeps NCHW)")
            elif d.get("generic"):
                text += ", torch.func (no hand-written batched forward for this model)"
            if d["native"]:
                text += ", native LeNet kernels where their runtime checks pass (each round's engine says which ran)"
            elif "native_off" in d:
                text += f", torch ops (native kernels unavailable: {d['native_off'].splitlines()[0]})"
            if self.batched.device.type == "cuda":
                text += ", deterministic (no TF32)"
        elif self.loop_reason is None:
            text = "the reference, one client after another (local_train)"
        else:
            text = f"the reference loop, as --engine batched does not replay runs with {self.loop_reason}"
        return f"engine: {name} — {text}", fields

    streams_updates = True  # run_round takes `absorb` (coordinator/loop.py)
    carries_buffers = True  # run_round takes `buffers` (coordinator/buffers.py)

    def run_round(self, t: int, w: torch.Tensor, tasks: list[TrainTask],
                  absorb: Callable[[dict[int, ClientUpdate]], None] | None = None,
                  buffers: dict[str, torch.Tensor] | None = None):
        """Train `tasks` from `w` (and the global `buffers`, where the model has some: each update then carries its
        client's buffers after training); every update arrives. `absorb` (the loop's, for a strategy that absorbs):
        called with each slice of the batched engine's updates as the slice arrives, in task order; it takes
        the deltas out (u.delta = None), so the round's deltas are not all held at once. The updates come
        back in task order either way."""
        updates, done = {}, {}
        self.paths = set()
        if self.batched is not None:  # FedDD tasks stay on the loop
            plain = [task for task in tasks if task.dropout_rate is None]
            # slice by slice where the engine can (a lockstep sweep's proxy cannot: one part)
            kw = {"buffers": buffers} if buffers else {}   # the generic engine only (checked in __init__)
            parts = ([] if not plain else self.batched.run_iter(w, plain)
                     if absorb is not None and hasattr(self.batched, "run_iter")
                     else [self.batched.run(w, plain, **kw)])
            at = 0
            for part in parts:
                self._note_paths(part)
                got = {task.client: ClientUpdate(task.client, r.delta, r.num_samples, r.steps, task.lr, r.loss,
                                                 buffers=r.buffers)
                       for task, r in zip(plain[at:at + len(part)], part)}
                at += len(part)
                del part  # the results' deltas now live in `got` only: absorbing can free them
                if absorb is not None:
                    absorb(got)
                done |= got
        looped = False
        for task in tasks:
            x, y = self.client_data[task.client]
            if task.dropout_rate is not None or self.clients.profile is not None:
                if buffers:
                    set_buffers(self.model, buffers)   # SimClients trains self.model
                updates[task.client] = self.clients.run(w, x, y, task)  # coordinator/sim/clock.py
                if buffers:
                    updates[task.client].buffers = get_buffers(self.model)
                looped = True
                continue
            if task.client in done:
                updates[task.client] = done[task.client]
            else:
                r, looped = local_train(self.model, w, x, y, task, buffers=buffers), True
                updates[task.client] = ClientUpdate(task.client, r.delta, r.num_samples, r.steps, task.lr, r.loss,
                                                    buffers=r.buffers)
        self.stats = self.clients.round_stats(updates)
        self.last_engine = self._round_engine(bool(done), looped)
        return updates, {}

    def _note_paths(self, results: list) -> None:
        """The native parts that trained `results` (`LocalResult.path`), and each fallback's reason, logged once per
        run as a warning: the engine's name says what ran, and why a faster part did not."""
        for r in results:
            if r.path:
                self.paths.add(r.path)
            if r.fallback and r.fallback not in self.warned:
                self.warned.add(r.fallback)
                log.warning("engine: %s", r.fallback)

    def _batched_name(self) -> str:
        """The batched engine's name with the native parts that ran this round: "batched+native(avx512:
        conv+fc+loss+round)"; where slices ran different parts, each set, "|"-separated."""
        name = self.batched.describe()
        if not self.paths or not name.endswith(")") or "+native(" not in name:
            return name
        return f"{name[:-1]}: {'|'.join(sorted(self.paths))})"

    def _round_engine(self, batched: bool, looped: bool) -> str:
        """What trained this round's clients (a round without any: the run's engine)."""
        if batched and looped:   # FedDD tasks beside plain ones
            return f"{self._batched_name()} + loop (feddd tasks)"
        if looped and self.batched is not None:
            return "loop (feddd tasks)"
        return self._batched_name() if batched else self.describe()

    def state_dict(self) -> dict:
        """Per-client state the simulated devices keep between rounds (FedDD memory), for checkpoints."""
        return {"clients": self.clients.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.clients.load_state_dict(state.get("clients", {}))

    def round_stats(self) -> dict[str, float]:
        """This round's bytes and, with a profile, virtual round time (eq. 12), for the metrics."""
        return self.stats

    def round_info(self) -> dict[str, str]:
        """What ran this round, for the metrics row (not summed, unlike `round_stats`)."""
        return {"engine": self.last_engine}

    def close(self) -> None:
        """Stop the batched engine's worker processes."""
        if self.batched is not None:
            self.batched.close()
