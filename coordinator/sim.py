"""Simulation: build everything a run needs from a SimConfig, and the in-process transport."""

from __future__ import annotations

import torch

from coordinator import availability as av
from coordinator.clock import Profile, SimClients, load_profile
from coordinator.config import SimConfig
from coordinator.errors import UserError
from coordinator.loop import LoopConfig, run_rounds
from coordinator.participation import Replay
from coordinator.rundir import RunDir
from coordinator.strategies import STRATEGIES, ClientUpdate, Strategy
from coordinator.traces import DeviceTraceAvailability
from edge_client import datasets, partition
from edge_client.models import build_model, get_flat, set_flat
from edge_client.trainer import TrainTask, evaluate, local_train


class SimTransport:
    """In-process virtual clients. `engine="loop"` is the reference: one client after another with
    the same `local_train` the edge agent runs. Every selected client's update arrives."""

    def __init__(self, model: torch.nn.Module, client_data: list[tuple[torch.Tensor, torch.Tensor]],
                 engine: str = "loop", profile: Profile | None = None, num_classes: int | None = None):
        self.model, self.client_data, self.engine = model, client_data, engine
        self.clients = SimClients(model, profile, num_classes)  # FedDD masks and the virtual clock
        self.stats: dict[str, float] = {}
        self.batched = None
        if engine == "batched":  # coordinator/engine_batched.py: a round's clients as one computation
            from coordinator.engine_batched import BatchedEngine
            self.batched = BatchedEngine(model, client_data)

    def run_round(self, t: int, w: torch.Tensor, tasks: list[TrainTask]):
        updates, done = {}, {}
        if self.batched is not None and self.clients.profile is None:  # FedDD tasks stay on the loop
            plain = [task for task in tasks if task.dropout_rate is None]
            done = {task.client: r for task, r in zip(plain, self.batched.run(w, plain))}
        for task in tasks:
            x, y = self.client_data[task.client]
            if task.dropout_rate is not None or self.clients.profile is not None:
                updates[task.client] = self.clients.run(w, x, y, task)  # coordinator/clock.py
                continue
            r = done[task.client] if task.client in done else local_train(self.model, w, x, y, task)
            updates[task.client] = ClientUpdate(task.client, r.delta, r.num_samples, r.steps, task.lr, r.loss)
        self.stats = self.clients.round_stats(updates)
        return updates, {}

    def round_stats(self) -> dict[str, float]:
        """This round's bytes and, with a profile, virtual round time (eq. 12), for the metrics."""
        return self.stats


def build_availability(cfg: SimConfig):
    a, n, seed = cfg.availability, cfg.data.clients, cfg.run.seed
    common = {"first_round_all": a.first_round_all, "min_active": a.min_active}
    if a.kind == "replay":
        replay = Replay(a.trace, n)
        if cfg.run.rounds > replay.rounds:
            raise UserError(f"--rounds {cfg.run.rounds}: the trace {a.trace} covers only {replay.rounds} rounds")
        return replay
    if a.kind == "device-trace":
        return DeviceTraceAvailability(a.device_trace, n, a.round_seconds, a.start_seconds, a.min_battery,
                                       a.require_charging, a.min_uplink)
    if a.kind == "always":
        return av.AlwaysOn(n, seed, **common)
    if a.kind == "bounded":
        return av.Bounded(n, seed, tau_max=a.tau_max, tau_dist=a.tau_dist, **common)
    if a.kind == "static":
        return av.Static(n, seed, p=a.p, levels=a.p_levels, **common)
    if a.kind == "timevarying":
        return av.TimeVarying(n, seed, fraction=a.fraction, **common)
    if a.kind == "diurnal":
        return av.Diurnal(n, seed, period=a.period, groups_d=a.diurnal_d, **common)
    if a.kind == "cluster-dropout":
        return av.ClusterDropout(n, seed, alpha=a.alpha, **common)
    raise UserError(f"--availability: unknown model {a.kind!r}")


def build_strategy(cfg: SimConfig) -> Strategy:
    s = cfg.strategy
    cls = STRATEGIES.get(s.algo)
    if cls is None:
        raise UserError(f"--algo: unknown algorithm {s.algo!r} (choose from {', '.join(STRATEGIES)})")
    return cls.from_config(s) if hasattr(cls, "from_config") else cls(weighting=s.weighting)


def partition_kwargs(cfg: SimConfig) -> dict:
    d = cfg.data
    if d.partition == "shards":
        return {"shards_per_client": d.shards_per_client}
    if d.partition == "dirichlet":
        return {"alpha": d.dirichlet_alpha}
    return {}


def load_federation(cfg: SimConfig):
    """Dataset, per-client (x, y) tensors and the global test split."""
    try:
        ds = datasets.load(cfg.data.dataset, cfg.data.data_dir)
    except datasets.DatasetError as e:
        raise UserError(str(e)) from None
    try:
        parts = partition.partition(cfg.data.partition, ds.train.y.numpy(), cfg.data.clients, cfg.run.seed,
                                    **partition_kwargs(cfg))
    except partition.PartitionError as e:
        raise UserError(str(e)) from None
    client_data = [(ds.train.x[torch.as_tensor(p)], ds.train.y[torch.as_tensor(p)]) for p in parts]
    return ds, client_data


def run_sim(cfg: SimConfig, out: str, resume: bool = False, progress: bool = True) -> RunDir:
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    availability = build_availability(cfg)
    strategy = build_strategy(cfg)
    ds, client_data = load_federation(cfg)
    model = build_model(cfg.model.model, tuple(ds.train.x.shape[1:]), ds.num_classes, cfg.run.seed,
                        cfg.model.dropout)
    rundir = RunDir(out)
    rundir.write_json("config.json", cfg.to_dict())
    t = cfg.train
    loop = LoopConfig(rounds=cfg.run.rounds, n_clients=cfg.data.clients, seed=cfg.run.seed, lr=t.lr,
                      lr_decay=t.lr_decay, lr_min=t.lr_min, batch_size=t.batch_size, epochs=t.epochs,
                      steps=t.steps, eval_every=cfg.run.eval_every, checkpoint_every=cfg.run.checkpoint_every)
    eval_model = build_model(cfg.model.model, tuple(ds.train.x.shape[1:]), ds.num_classes, cfg.run.seed,
                             cfg.model.dropout)
    profile = load_profile(cfg.clock.profile, cfg.data.clients) if cfg.clock.profile else None
    transport = SimTransport(model, client_data, t.engine, profile, ds.num_classes)
    w = run_rounds(loop, strategy, availability, transport,
                   lambda w: evaluate(eval_model, w, ds.test.x, ds.test.y), rundir, get_flat(model),
                   resume=resume, progress=progress)
    set_flat(eval_model, w)
    rundir.save_model(eval_model)
    return rundir
