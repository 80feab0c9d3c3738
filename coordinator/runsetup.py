"""One function sets up a run, for every way of running one: `setup_run(cfg, out, mode)`.

    sim      dropfl sim (modelled availability, a replayed participation log or a device trace)
    field    dropfl coordinator, and so dropfl trial (availability comes from the agents)

It validates what it can before the first write, loads the dataset, builds the data binding
(edge_client/federation.py), the per-client shards (sim only: in the field each agent loads its own),
the model, the strategy and the availability source, then creates the run directory, writes
`config.json` and attaches the run's log files (`log.txt`, `log.jsonl`). The transports then take the
`Run` and hand it to the round loop (`coordinator/sim/run.py`, `coordinator/field/run.py`).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from coordinator import errors, tracking
from coordinator.availability import models as av
from coordinator.availability.participation import Replay
from coordinator.availability.traces import DeviceTraceAvailability
from coordinator.config import SimConfig, upgrade_renamed
from coordinator.errors import UserError
from coordinator.loop import LoopConfig
from coordinator.rundir import CHECKPOINT, RunDir, check_out, load_checkpoint_file, read_metrics
from coordinator.statestore import StateStore, auto_kind, check_snapshots
from coordinator.strategies import STRATEGIES, Strategy
from edge_client import datasets, federation, logs, partition
from edge_client.federation import DataBinding
from edge_client.models import build_model, get_buffers, get_flat, set_buffers, set_flat
from edge_client.options import build as build_options
from edge_client.options import options_class
from edge_client.registry import PluginError, blame
from edge_client.trainer import evaluate

log = logging.getLogger("dropfl.run")

# SimConfig fields that are not part of the data binding, and why (test_binding.py checks that every
# field is either bound, edge_client.federation.BINDING_SOURCE, or listed here).
NOT_BOUND: dict[tuple[str, str], str] = {
    ("data", "data_dir"): "a path on one host; the data itself is bound by data_digest",
    ("train", "lr"): "sent with every task",
    ("train", "lr_decay"): "applied by the coordinator to the lr it sends",
    ("train", "lr_min"): "applied by the coordinator to the lr it sends",
    ("train", "lr_schedule"): "applied by the coordinator to the lr it sends",
    ("train", "lr_step_every"): "applied by the coordinator to the lr it sends",
    ("train", "batch_size"): "sent with every task",
    ("train", "epochs"): "sent with every task",
    ("train", "steps"): "sent with every task",
    ("train", "engine"): "how the simulation computes; agents train with the reference local_train",
    ("train", "slices"): "how the simulation's batched engine cuts a round; agents train one task each",
    ("train", "device"): "where the simulation's batched engine computes; agents train on their own device "
                         "(dropfl client --device)",
    ("train", "ray_address"): "where the simulation computes (engine ray); agents train on their devices",
    ("clock", "profile"): "simulation only: a virtual clock; in the field time is real",
    ("run", "rounds"): "the coordinator's schedule",
    ("run", "eval_every"): "the coordinator's schedule",
    ("run", "checkpoint_every"): "the coordinator's schedule",
    ("run", "out"): "the coordinator's run directory",
    ("run", "threads"): "each host's own CPU setting",
    ("run", "state_store"): "where the coordinator keeps per-client tables; the same numbers either way",
    ("run", "participation_format"): "how the coordinator writes its participation log",
    ("run", "track"): "the coordinator's mirror of its metrics (TensorBoard, MLflow)",
    ("run", "track_dir"): "the coordinator's mirror of its metrics (TensorBoard, MLflow)",
}
# Whole sections that stay on the coordinator: availability is modelled (sim) or the agents' own (field),
# and the strategy is server-side math whose client-side parameters travel in the task.
NOT_BOUND_SECTIONS = {"availability": "simulation's model of availability; in the field the agents report theirs",
                      "strategy": "server-side; its client-side parameters (μ, dropout rate) travel in the task"}


@dataclass
class Run:
    cfg: SimConfig
    rundir: RunDir
    ds: datasets.Dataset
    binding: DataBinding
    model: torch.nn.Module           # the transport trains through this one
    eval_model: torch.nn.Module      # the coordinator evaluates (and saves) through this one
    strategy: Strategy
    loop: LoopConfig
    availability: object | None      # sim: the source; field: None (the agents are the source)
    client_data: list[tuple[torch.Tensor, torch.Tensor]] | None  # sim: every client's shard
    checkpoint: dict | None = None   # --resume: the checkpoint check_resume read and checked (read once)
    # the global model's buffers (BatchNorm's running statistics; {} for a model without): the round loop updates
    # this dict in place (coordinator/buffers.py), evaluation and the final model read it
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.ds.train.x.shape[1:])

    def w0(self) -> torch.Tensor:
        return get_flat(self.model)

    def evaluate(self, w: torch.Tensor) -> tuple[float, float]:
        return evaluate(self.eval_model, w, self.ds.test.x, self.ds.test.y, buffers=self.buffers)

    def save_final(self, w: torch.Tensor) -> None:
        set_flat(self.eval_model, w)
        if self.buffers:
            set_buffers(self.eval_model, self.buffers)
        self.rundir.save_model(self.eval_model)


def build_availability(cfg: SimConfig):
    """The run's availability source, from the --availability registry (coordinator/availability/models.py)."""
    try:
        entry = av.AVAILABILITY.entry(cfg.availability.kind)
    except PluginError as e:
        raise UserError(f"--availability: {e}") from None
    options = plugin_options(entry.obj, cfg.availability.options)
    with blame(entry, UserError, (UserError,)):
        source = av.build(entry.obj, cfg, options)
    if not callable(getattr(source, "round", None)):
        raise UserError(f"--availability {cfg.availability.kind}: it built a {type(source).__name__}, which has no "
                        f"round(t) -> RoundAvailability method")
    return source


@av.AVAILABILITY.register("replay")
def replay_availability(cfg: SimConfig) -> Replay:
    """--availability replay: a recorded participation log (--trace)."""
    a = cfg.availability
    replay = Replay(a.trace, cfg.data.clients, selection=replay_selection(cfg))
    if cfg.run.rounds > replay.rounds:
        raise UserError(f"--rounds {cfg.run.rounds}: the trace {a.trace} covers only {replay.rounds} rounds")
    return replay


@av.AVAILABILITY.register("device-trace")
def device_trace_availability(cfg: SimConfig) -> DeviceTraceAvailability:
    """--availability device-trace: device time series on a virtual clock (--device-trace)."""
    a = cfg.availability
    return DeviceTraceAvailability(a.device_trace, cfg.data.clients, a.round_seconds, a.start_seconds, a.min_battery,
                                   a.require_charging, a.min_uplink, a.max_temp)


# --participation-format auto: the columnar log above this many clients (participation.csv has a row per
# client per round: ~25 bytes each, 250 kB a round at 10,000 clients, 2.5 MB at 100,000)
CSV_MAX_CLIENTS = 10_000


def participation_format(cfg: SimConfig) -> str:
    """csv or npz: --participation-format, auto = npz for more than CSV_MAX_CLIENTS clients."""
    fmt = cfg.run.participation_format
    if fmt != "auto":
        return fmt
    return "npz" if cfg.data.clients > CSV_MAX_CLIENTS else "csv"


def replay_selection(cfg: SimConfig) -> str:
    """`log` or `strategy` for --replay-selection (auto: log when the trace's own run used the same --algo)."""
    mode = cfg.availability.replay_selection
    if mode != "auto":
        return mode
    saved = Path(cfg.availability.trace).with_name("config.json")
    try:
        algo = json.loads(saved.read_text())["strategy"]["algo"]
    except (OSError, ValueError, KeyError, TypeError):
        return "log"  # no run beside the trace (a hand-made or imported log): replay it as recorded
    chosen = "log" if algo == cfg.strategy.algo else "strategy"
    log.info("replay: the trace was recorded with --algo %s; %s", algo,
             "replaying its selection exactly" if chosen == "log" else
             f"{cfg.strategy.algo} selects among its available clients (--replay-selection log to force the log's)")
    return chosen


def plugin_options(obj, values: dict):
    """The plugin `obj`'s Options instance for its options `values` (config.check_options converted and completed
    them), or None for a plugin that declares no Options."""
    cls = options_class(obj)
    return None if cls is None else build_options(cls, values)


def build_strategy(cfg: SimConfig) -> Strategy:
    """The run's strategy, from the --algo registry: a class with Options is built as cls(options=Options(...)),
    else with its from_config(StrategyConfig), else as cls(weighting=...) (docs/extending.md)."""
    s = cfg.strategy
    try:
        entry = STRATEGIES.entry(s.algo)
    except PluginError as e:
        raise UserError(f"--algo: {e}") from None
    cls = entry.obj
    options = plugin_options(cls, s.options)
    with blame(entry, UserError, (UserError,)):
        if options is not None:
            strategy = cls(options=options)
        elif hasattr(cls, "from_config"):
            strategy = cls.from_config(s)
        else:
            strategy = cls(weighting=s.weighting)
    if hasattr(strategy, "bind_lr_schedule"):  # applies the round's lr on the server (FedLaAvg lr-normalised)
        strategy.bind_lr_schedule(loop_config(cfg).lr_at)
    return strategy


def binding_of(cfg: SimConfig, ds: datasets.Dataset | None = None) -> DataBinding:
    """The federation's data binding from the coordinator's config (with the data digest if ds is given)."""
    sections = {"data": cfg.data, "model": cfg.model, "run": cfg.run}
    return federation.from_sections(sections, federation.label_digest(ds) if ds is not None else "")


_DATASETS: OrderedDict[tuple, datasets.Dataset] = OrderedDict()   # `load_dataset`'s decoded datasets
DATASETS_KEPT = 2
_DATASETS_LOCK = threading.Lock()   # a sweep's runs set up in threads (coordinator/sim/lockstep.py)


def load_dataset(cfg: SimConfig, keep: bool = True) -> datasets.Dataset:
    """`cfg`'s dataset, decoded once per process: the runs of a sweep and the sims of a test session share one
    copy. Decoding FMNIST or MNIST (gunzip, uint8 to float) took 1.3-3 s and 220 MB a run (measured on this
    machine), in every run of a sweep. Keyed by the dataset, its directory and its files' paths, sizes and
    modification times, so a changed file is read again; the last DATASETS_KEPT datasets are kept.
    The tensors are shared by every run that loads them: nothing may change them in place (their users here
    index them, which copies: client shards, the engines' concatenated data, the evaluators' splits)."""
    name, data_dir = cfg.data.dataset, cfg.data.data_dir
    try:
        files = datasets.source_files(name, data_dir)
        key = (name, data_dir, tuple((str(p), (st := p.stat()).st_size, st.st_mtime_ns) for p in files))
    except OSError:
        files, key = [], None   # missing or unreadable: the load below says what is wrong
    with _DATASETS_LOCK:
        if key in _DATASETS:
            _DATASETS.move_to_end(key)
            return _DATASETS[key]
        try:
            ds = datasets.load(name, data_dir)
        except datasets.DatasetError as e:
            raise UserError(str(e)) from None
        if files and keep:
            _DATASETS[key] = ds
            while len(_DATASETS) > DATASETS_KEPT:
                _DATASETS.popitem(last=False)
        return ds


def client_data(ds: datasets.Dataset, binding: DataBinding) -> list[tuple[torch.Tensor, torch.Tensor]]:
    try:
        parts = federation.client_shards(ds, binding)
    except partition.PartitionError as e:
        raise UserError(str(e)) from None
    return [(ds.train.x[torch.as_tensor(p)], ds.train.y[torch.as_tensor(p)]) for p in parts]


def loop_config(cfg: SimConfig) -> LoopConfig:
    t = cfg.train
    return LoopConfig(rounds=cfg.run.rounds, n_clients=cfg.data.clients, seed=cfg.run.seed, lr=t.lr,
                      lr_decay=t.lr_decay, lr_min=t.lr_min, batch_size=t.batch_size, epochs=t.epochs,
                      steps=t.steps, eval_every=cfg.run.eval_every, checkpoint_every=cfg.run.checkpoint_every,
                      lr_schedule=t.lr_schedule, lr_step_every=t.lr_step_every)


# Config fields a resumed run may change: the schedule and this host's settings, never the experiment.
RESUMABLE_CHANGES = {("run", "rounds"), ("run", "out"), ("run", "threads"), ("run", "eval_every"),
                     ("train", "ray_address"),  # where it computes, not what
                     ("run", "checkpoint_every"), ("run", "track"), ("run", "track_dir"), ("run", "state_store")}


# --slices 0 (auto) is 2 wherever the number of slices can change a run's results (batched.slices_for): a run written
# with 2 (the default before auto) resumes with auto, and back, with the same bits
SLICES_AS_BEFORE = {0, 2}


def check_resume(cfg: SimConfig, path: Path, model: torch.nn.Module) -> dict:
    """The checkpoint to resume from, after checking that it, the metrics and config.json fit this config."""
    ck = load_checkpoint_file(path / CHECKPOINT)
    damaged = check_snapshots(ck, path)  # --state-store disk: the tables checkpoint.pt refers to
    if damaged:
        raise UserError(f"--resume: {path / CHECKPOINT} refers to state-store tables that are not whole ({damaged}); "
                        f"restore them, or resume from checkpoint.prev.pt (move it over checkpoint.pt)")
    n = sum(p.numel() for p in model.parameters())
    w = ck["w"]
    if not isinstance(w, torch.Tensor) or w.numel() != n:
        raise UserError(f"--resume: {path / CHECKPOINT} holds a model of {getattr(w, 'numel', lambda: '?')()} "
                        f"parameters, --model {cfg.model.model} has {n}; resume with the run's own config "
                        f"(--config {path / 'config.json'})")
    own = get_buffers(model)
    if own and set(ck.get("buffers", {})) != set(own):
        raise UserError(f"--resume: {path / CHECKPOINT} holds no buffers of --model {cfg.model.model} (BatchNorm "
                        f"statistics: a checkpoint written before they were federated); start a new run")
    saved = path / "config.json"
    if saved.exists():
        try:
            old = json.loads(saved.read_text())
        except ValueError as e:
            raise UserError(f"--resume: {saved} is damaged ({e}); restore it or start a new run") from None
        old = upgrade_renamed(old, str(saved), warn=False) if isinstance(old, dict) else old  # e.g. period
        new, default = cfg.to_dict(), SimConfig().to_dict()
        # an option added after the run was written counts as its default (the run was made without it)
        was = {(s, k): old.get(s, {}).get(k, default[s][k]) for s, sec in new.items() for k in sec}
        differ = [f"{s}.{k} ({was[s, k]!r} → {v!r})" for s, sec in new.items() for k, v in sec.items()
                  if (s, k) not in RESUMABLE_CHANGES and was[s, k] != v
                  and not ((s, k) == ("train", "slices") and {was[s, k], v} <= SLICES_AS_BEFORE)]
        if differ:
            raise UserError(f"--resume: the run in {path} was made with other settings: {', '.join(differ)}; "
                            f"resume with its own config (--config {saved}) or start a new run")
    if (path / "metrics.jsonl").exists():
        read_metrics(path / "metrics.jsonl", tolerate_torn_tail=True)  # a damaged row: UserError now, not later
    return ck


HEADER_SPARE = 8 * 1024   # what a model or update message's header holds besides the buffers (measured: < 2 KiB)


def check_buffers_fit_the_wire(name: str, model: torch.nn.Module) -> None:
    """Field mode carries a model's buffers (BatchNorm's running statistics) as JSON in the message header
    (docs/protocol.md, "Model buffers"), bounded by the wire's header limit: a model whose buffers do not fit is a
    UserError before anything starts, not a WireError in round 0."""
    buffers = get_buffers(model)
    if not buffers:
        return
    from edge_client import wire
    # the longest JSON a value can take (a float32's shortest repr that round-trips can need 17 digits, a sign and
    # an exponent): trained statistics are as long as that, the initial zeros and ones far shorter
    worst = {n: torch.full_like(b, -1.2345678e-05 if b.is_floating_point() else -(2 ** 62)) for n, b in buffers.items()}
    size = len(json.dumps(wire.buffers_meta(worst)).encode())
    limit = wire.Limits().max_header_bytes
    if size + HEADER_SPARE > limit:
        values = sum(b.numel() for b in buffers.values())
        raise UserError(f"--model {name}: its {values} buffer values (BatchNorm's running statistics, {size} bytes "
                        f"as JSON) do not fit field mode's message header ({limit} bytes, {HEADER_SPARE} of them "
                        f"for the rest); use a model with fewer normalised channels in the field, or simulate it")


def check_model_fits(name: str, model: torch.nn.Module, ds: datasets.Dataset) -> None:
    """One training row through a copy of the model (eval mode, no grad: no state changes): a model that does not
    take the dataset's inputs, or does not give one logit per class, is a UserError before anything is written."""
    x = ds.train.x[:1]
    shape = tuple(x.shape[1:])
    try:
        with torch.no_grad():
            out = copy.deepcopy(model).eval()(x)
    except Exception as e:   # torch's shape errors are RuntimeErrors, a plugin's may be anything
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"--model {name}: it does not take {ds.name}'s inputs of shape {shape} ({first}); "
                        f"pick a model for this shape (docs/datasets.md lists which built-in fits which)") from None
    if tuple(out.shape) != (1, ds.num_classes):
        raise UserError(f"--model {name}: it gives outputs of shape {tuple(out.shape)[1:]} for one input of "
                        f"{ds.name}, which has {ds.num_classes} classes; it must give one logit per class")


@dataclass
class Checked:
    """What `check_run` built from a run's input, nothing written yet."""
    path: Path
    availability: object | None
    strategy: Strategy
    ds: datasets.Dataset
    binding: DataBinding
    shards: list | None
    model: torch.nn.Module
    eval_model: torch.nn.Module
    checkpoint: dict | None
    store: str


def check_run(cfg: SimConfig, out: str, mode: str = "sim", resume: bool = False, overwrite: bool = False,
              keep_dataset: bool = True) -> Checked:
    """Every check of a run's input (flags, files, traces, dataset, model, checkpoint, tracking), writing nothing:
    `setup_run` and `dropfl trial` (before its broker and agents start) both call it. keep_dataset=False: the
    decoded dataset is not kept in this process's cache (a trial's own process has no use for it)."""
    if mode not in ("sim", "field"):
        raise ValueError(f"mode {mode!r}")
    path = check_out(out, resume, overwrite)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    availability = build_availability(cfg) if mode == "sim" else None
    strategy = build_strategy(cfg)
    ds = load_dataset(cfg, keep=keep_dataset)
    binding = binding_of(cfg, ds)
    shards = client_data(ds, binding) if mode == "sim" else None
    shape = tuple(ds.train.x.shape[1:])
    try:
        model = build_model(cfg.model.model, shape, ds.num_classes, cfg.run.seed, cfg.model.dropout)
        eval_model = build_model(cfg.model.model, shape, ds.num_classes, cfg.run.seed, cfg.model.dropout)
    except ValueError as e:   # build_model's messages start with --model
        raise UserError(str(e) if str(e).startswith("--model") else f"--model {cfg.model.model}: {e}") from e
    check_model_fits(cfg.model.model, eval_model, ds)
    if mode == "field":
        check_buffers_fit_the_wire(cfg.model.model, model)
    checkpoint = check_resume(cfg, path, model) if resume else None
    store = auto_kind(cfg.run.state_store, cfg.data.clients, sum(p.numel() for p in model.parameters()))
    strategy.store = StateStore(store, path)  # nothing is written before the round loop creates the tables
    tracking.check(tracking.parse(cfg.run.track), path, cfg.run.track_dir, resume, overwrite)
    if mode == "sim" and cfg.train.engine != "loop":
        from coordinator.sim import kernels
        kernels.requested()   # $DROPFL_KERNEL: an unknown variant, or one this CPU cannot run, is a UserError
    return Checked(path, availability, strategy, ds, binding, shards, model, eval_model, checkpoint, store)


def setup_run(cfg: SimConfig, out: str, mode: str = "sim", resume: bool = False, overwrite: bool = False) -> Run:
    """Everything a run needs, built and checked before the run directory is written: nothing in `out`
    changes if any input (flags, files, traces, dataset, checkpoint) is wrong."""
    c = check_run(cfg, out, mode, resume, overwrite)
    availability, strategy, ds, binding, shards = c.availability, c.strategy, c.ds, c.binding, c.shards
    model, eval_model, checkpoint, store = c.model, c.eval_model, c.checkpoint, c.store
    # --- everything checked: from here on the run directory is written ---
    rundir = RunDir(out, overwrite=overwrite)
    rundir.participation_format = participation_format(cfg)
    errors.current_run_dir = rundir.path
    logs.attach_run_files(rundir.path)
    rundir.write_json("config.json", cfg.to_dict())
    if strategy.tables:
        log.info("state store: %s (--state-store %s) for %s's per-client tables: %s", store, cfg.run.state_store,
                 cfg.strategy.algo, ", ".join(strategy.tables))
    log.debug("run %s: %s on %s, %d clients, %s availability, binding %s%s", out, cfg.strategy.algo,
             cfg.data.dataset, cfg.data.clients, cfg.availability.kind if mode == "sim" else "field",
             binding.data_digest, " (resumed)" if resume else "")
    return Run(cfg, rundir, ds, binding, model, eval_model, strategy, loop_config(cfg), availability, shards,
               checkpoint, get_buffers(model))
