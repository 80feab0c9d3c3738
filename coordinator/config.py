"""Typed configuration: one dataclass per concern. The CLI options and the config-file keys are
generated from these fields (their `help` metadata is the `--help` text), so they cannot drift.

Config file (TOML or JSON): sections named like the dataclasses below, keys like the fields, e.g.

    [data]
    dataset = "fmnist"
    clients = 30
    [availability]
    kind = "bounded"
    tau_max = 20

Precedence: defaults < config file < command-line flags. The resolved config is saved as
`config.json` in the run directory and can be passed back with `--config`.

Every value, from the file or a flag, is checked against its field before anything runs: the type
from the annotation, the range from `opt(..., minimum=, maximum=, gt=, lt=)` (floats must also be
finite), by one generic checker (edge_client/configfile.py `check_value`). A bad value is one line:
`data.clients must be an integer ≥ 1 (got "abc" in run.toml)`, `train.lr must be a finite number > 0
(got inf from --lr)` (docs/errors.md). Cross-field rules stay in `validate()`.

Why our own checks and not pydantic v2: these dataclasses already are the single source of the CLI
flags, the `--help` text and the config-file keys, and the edge agent (on 512 MB boards) reads its
config through the same `fill_sections`; pydantic would mean a second model layer or converting the
dataclasses plus a compiled dependency on the boards, for what is ~100 lines of type and range checks
over five kinds of field (int, float, str, bool, X | None) with messages in our one-line format.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import asdict, dataclass, field

from coordinator.errors import UserError
from edge_client.configfile import check_value, field_types, fill_sections, read_config_file, show
from edge_client.registry import Names, PluginError

# The fields that name a plugin, and their registry ("module:attr", edge_client/registry.py): their choices, the
# --help text and `validate` read the registry, so a built-in, an installed entry point or a module:attr is accepted
# wherever one of them is.
REGISTRIES = {
    "data.dataset": "edge_client.datasets:DATASETS",
    "data.partition": "edge_client.partition:PARTITIONERS",
    "model.model": "edge_client.models:MODELS",
    "availability.kind": "coordinator.availability.models:AVAILABILITY",
    "strategy.algo": "coordinator.strategies:STRATEGIES",
}

log = logging.getLogger("dropfl.config")

# edge_client/trainer.py seeds each client's round with torch.Generator.manual_seed(
# (seed·1_000_003 + round)·1_000_033 + client), which must fit in 64 bits (at most 2**64 − 1); numpy's
# default_rng([seed, ...]) and torch.manual_seed(seed) take any seed in 0..2**64 − 1, so that is the limit.
_SEED_A, _SEED_B, _SEED_TOP = 1_000_003, 1_000_033, 2 ** 64 - 1
SEED_MAX = _SEED_TOP // (_SEED_A * _SEED_B)  # 18446080: the largest seed of a 1-round, 1-client run


def max_seed(rounds: int, clients: int) -> int:
    """The largest seed whose per-client torch seeds fit in 64 bits for every round and client."""
    return ((_SEED_TOP - (clients - 1)) // _SEED_B - (rounds - 1)) // _SEED_A


def opt(default, help: str, choices=None, flag: str | None = None, *, minimum=None, maximum=None, gt=None,
        lt=None, repeat: bool = False):
    """A config field: its `--help` text, choices, flag name (default --field-name) and range
    (`minimum`/`maximum` inclusive, `gt`/`lt` exclusive), checked by `check_value` for file and flag values.
    `repeat`: a comma-separated list whose flag may also be given several times (the values are joined)."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag, "minimum": minimum,
                                            "maximum": maximum, "gt": gt, "lt": lt, "repeat": repeat})


@dataclass
class DataConfig:
    dataset: str = opt("fmnist", "dataset (a plugin: module:attr or an entry point of dropfl.datasets)",
                       Names(REGISTRIES["data.dataset"]))
    data_dir: str | None = opt(None, "directory with the dataset files (required for cifar10)")
    partition: str = opt("shards", "non-IID partitioner (shards-distinct: shards, no two of one class per client; "
                                   "fdms-clustered-80-20: fdms-clustered, each client trains on 80%% of its samples "
                                   "as the FL-FDMS code; a plugin: module:attr or an entry point of "
                                   "dropfl.partitioners)",
                         Names(REGISTRIES["data.partition"]))
    clients: int = opt(30, "number of clients N", minimum=1)
    shards_per_client: int = opt(2, "shards per client (partition=shards, shards-distinct)", minimum=1)
    dirichlet_alpha: float = opt(0.5, "concentration α (partition=dirichlet)", gt=0)


@dataclass
class ModelConfig:
    model: str = opt("mimic-cnn", "model architecture (a plugin: module:attr or an entry point of dropfl.models)",
                     Names(REGISTRIES["model.model"]))
    dropout: float | None = opt(None, "dropout probability for models with dropout layers "
                                      "(default: the reference code's 0.5)", minimum=0, lt=1)


@dataclass
class TrainConfig:
    lr: float = opt(0.01, "local learning rate at round 0", gt=0)
    lr_decay: float = opt(1.0, "decay γ: lr_t = max(lr·γ^t, lr_min) (MimiC FMNIST: 0.95); with --lr-schedule step "
                               "lr·γ^floor(t/k)", gt=0, maximum=1)
    lr_min: float = opt(1e-5, "learning-rate floor", minimum=0)
    lr_schedule: str = opt("exp", "local lr schedule: exp = max(lr·γ^t, lr_min) (MimiC code), inv-t = lr/(t+1) "
                                  "(MIFA code), step = lr·γ^floor(t/k), k = --lr-step-every",
                           ["exp", "inv-t", "step"])
    lr_step_every: int = opt(1, "--lr-schedule step: k, rounds between two decays", minimum=1)
    batch_size: int = opt(16, "local mini-batch size B", minimum=1)
    epochs: int = opt(1, "local epochs E per round (full passes, last batch may be smaller)", minimum=0)
    steps: int | None = opt(None, "local SGD steps K per round (overrides --epochs)", minimum=1)
    engine: str = opt("batched", "simulation engine: batched = a round's clients as --slices batched "
                                 "computations on worker processes, one per core at most (on a GPU if there is "
                                 "one), the loop's weights to float rounding; "
                                 "the LeNets' first two layers run as native kernels built with g++ on first use "
                                 "for the CPU's widest instruction set (DROPFL_KERNEL=avx512|avx2|generic forces "
                                 "one, DROPFL_KERNEL=off or DROPFL_NATIVE=0 turns them off); FedDD tasks and "
                                 "--clock-profile runs train on the "
                                 "loop. loop = the reference per-client loop (local_train, as the edge agents). The "
                                 "engine that ran is logged at the start and recorded per round in metrics.jsonl "
                                 "(docs/engine.md). ray = the batched engine's slices trained by Ray actors on a "
                                 "cluster (--ray-address), the weights of batched with the same --slices "
                                 "(docs/scale-out.md)",
                      ["batched", "loop", "ray"])
    slices: int = opt(0, "batched and ray engines: a round's tasks are cut into this many fixed slices, each one "
                         "batched computation (and worker process); which process or node trains a slice does not "
                         "change the results, the number of slices may (float rounding) but for mlp, logreg and "
                         "the LeNets with their native kernels (fdms-cnn excepted). 0 = auto (default): one per "
                         "CPU core (at least 2, at most 16) for those models, where it changes nothing but the "
                         "speed, else 2; ray: at most one actor per slice",
                      minimum=0)
    device: str = opt("auto", "batched engine: where a round's clients train. auto = the CPU for the LeNets "
                              "(mimic-cnn, cifar-lenet, fdms-cnn: at their batch sizes the fused CPU kernels beat a "
                              "GPU, measured on an H100 machine), a GPU for the other models where there is one, else "
                              "the CPU; cpu; cuda = the GPU (an error where there is none; not with --engine loop or "
                              "ray, which train on the CPU). docs/engine.md",
                      ["auto", "cpu", "cuda"], flag="--sim-device")
    ray_address: str | None = opt(None, "engine ray: the Ray cluster, host:port of its head (`ray start --head` "
                                        "prints it), auto = $RAY_ADDRESS or the cluster started on this machine, "
                                        "local = a private Ray in this process (default: auto; docs/scale-out.md)")


@dataclass
class AvailabilityConfig:
    kind: str = opt("always", "availability model (a plugin: module:attr or an entry point of dropfl.availability)",
                    Names(REGISTRIES["availability.kind"]), flag="--availability")
    tau_max: int = opt(20, "bounded: maximum period τmax (τ_i drawn from 0..τmax)", minimum=0)
    tau_dist: str = opt("uniform", "bounded: τ_i distribution (paper: uniform; code: halfnormal)",
                        ["uniform", "halfnormal"])
    p: float = opt(0.1, "static: active probability p in (0, 1]", gt=0, maximum=1)
    p_levels: int = opt(1, "static: 1 = identical p (paper), 5 = the code's five levels", [1, 5])
    fraction: float = opt(0.3, "timevarying: fraction P of clients active per round", gt=0, maximum=1)
    half_period: int = opt(100, "diurnal: half-period E in rounds (E rounds day, E rounds night; the old "
                                "--period / key period still work, deprecated)", minimum=1)
    diurnal_d: int = opt(1, "diurnal: D, clients of digits 0..D-1 form the day group", minimum=0, maximum=10)
    alpha: float = opt(0.5, "cluster-dropout: dropout ratio α in [0, 1)", minimum=0, lt=1)
    min_active: int = opt(0, "if fewer clients are available, draw this many uniformly "
                             "(MimiC released code: 2)", minimum=0)
    first_round_all: bool = opt(True, "all clients available in round 0 (MimiC, FDMS)")
    trace: str | None = opt(None, "replay: participation log (participation.csv or participation/ of a run)")
    replay_selection: str = opt("auto", "replay: whose selection to replay. log = the recorded selection and its "
                                        "after-selection drops (the same experiment, exact); strategy = the "
                                        "strategy selects among the recorded available clients, and clients that "
                                        "dropped in the log count as unavailable (compare algorithms on recorded "
                                        "availability); auto = log when the trace's run used the same --algo "
                                        "(its config.json), else strategy", ["auto", "log", "strategy"])
    device_trace: str | None = opt(None, "device-trace: device time series CSV (docs/traces.md)")
    round_seconds: float = opt(60.0, "device-trace: virtual seconds per round", gt=0)
    start_seconds: float = opt(0.0, "device-trace: trace time of round 0")
    min_battery: float = opt(0.0, "device-trace: minimum battery %% to train", minimum=0, maximum=100)
    require_charging: bool = opt(False, "device-trace: train only while charging")
    min_uplink: float = opt(0.0, "device-trace: minimum uplink bytes/s to train", minimum=0)
    max_temp: float | None = opt(None, "device-trace: decline above this temperature in °C, the trace's temp_c "
                                       "(reason thermal; default: off)", minimum=-40, maximum=200)


@dataclass
class StrategyConfig:
    algo: str = opt("fedavg", "aggregation strategy (a plugin: module:attr or an entry point of dropfl.strategies)",
                    Names(REGISTRIES["strategy.algo"]))
    weighting: str = opt("uniform", "fedavg: client weights", ["uniform", "samples"])
    fedavg_k: int | None = opt(None, "fedavg, fedprox: select K clients uniformly at random among the available "
                                     "ones (FedLaAvg's baselines: K = βN; default: every available client, as "
                                     "MimiC and FL-FDMS)",
                               minimum=1)
    mu: float = opt(0.001, "fedprox: proximal coefficient μ", minimum=0)
    feddd_d_max: float = opt(0.8, "feddd: maximal dropout rate D_max", minimum=0, maximum=1)
    feddd_a_server: float = opt(0.6, "feddd, fedcs: upload budget A_server, the fraction of all clients' "
                                     "model bytes uploaded per round", gt=0, maximum=1)
    feddd_delta: float = opt(0.0, "feddd: penalty δ of eq. 16, seconds per unit of the regulariser re_n", minimum=0)
    feddd_full_every: int = opt(1, "feddd: h, full-model download every h rounds, sparse in between (eqs. 5-6)",
                                minimum=1)
    fedcs_deadline: float | None = opt(None, "fedcs: round deadline in seconds (default: budget only)", gt=0)
    rate_smoothing: float = opt(0.5, "feddd, fedcs: weight of a new rate measurement in the running estimate",
                                gt=0, maximum=1)
    server_lr: float = opt(1.0, "fedavg, fedprox, scaffold, fdms, mimic (delta units): global step on the "
                                "averaged update (released codes: 1; FL-FDMS paper text: 0.1)", gt=0)
    units: str = opt("delta", "mimic, mifa: update units, delta = released code (w ← w − mean delta), "
                              "gradient = paper text (average gradients, w ← w − η_t v_t)", ["delta", "gradient"])
    global_lr: float = opt(0.01, "mimic, mifa with --units gradient: η_0 of η_t = global_lr·global_lr_decay^t",
                           gt=0)
    global_lr_decay: float = opt(0.95, "mimic, mifa with --units gradient: per-round factor of η_t", gt=0, maximum=1)
    mifa_round_weights: bool = opt(True, "mifa: weights round(1/N, 4) as the released code (--no-... : exact 1/N); "
                                         "exact 1/N with a warning where N·round(1/N, 4) is more than 1%% off 1 "
                                         "(N > 200 at worst, e.g. 0 for N > 20000)")
    mifa_wait_all: bool = opt(False, "mifa: no model update until every client has uploaded once (MIFA's code); "
                                     "a no-op when round 0 has everyone (--first-round-all)")
    mifa_storage: str = opt("raw", "mifa: stored latest updates, raw = deltas in the lr scale of their round "
                                   "(MimiC's released code), lr-normalised = delta/lr and the current lr applied "
                                   "to the average (delta units only; docs/strategies.md)", ["raw", "lr-normalised"])
    beta: float = opt(0.1, "fedlaavg: fraction β of clients selected per round, K = βN (oldest first)",
                      gt=0, maximum=1)
    fedlaavg_storage: str = opt("raw", "fedlaavg: stored latest updates, raw = deltas (same as the paper's constant "
                                       "lr), lr-normalised = delta/lr and the current lr applied to the average "
                                       "(the released code)", ["raw", "lr-normalised"])
    fdms_cr: str = opt("off", "fdms: complexity reduction, case1 = Θt, case2 = 0.5·Θt", ["off", "case1", "case2"])
    stale_variant: str = opt("weights", "stale: weights = last local models (FL-FDMS code), "
                                        "update = last updates (paper text)", ["weights", "update"])
    scaffold_correction_lr: float | None = opt(None, "scaffold: η_L in c_i⁺ (default: the round's local lr)", gt=0)


@dataclass
class ClockConfig:
    profile: str | None = opt(None, "virtual clock: per-client compute s/step and up/down bytes/s, JSON or CSV "
                                    "(coordinator/sim/clock.py, docs/feddd.md); adds virtual round time (eq. 12) "
                                    "to the metrics", flag="--clock-profile")


@dataclass
class RunConfig:
    rounds: int = opt(200, "communication rounds T", minimum=1)
    seed: int = opt(0, f"seed for partition, model init, availability and training (0..{SEED_MAX}: the clients' "
                       "torch seeds must fit 64 bits; a little less for runs of over 13000 rounds)",
                    minimum=0, maximum=SEED_MAX)
    eval_every: int = opt(1, "evaluate the global model every n rounds (and at the last round)", minimum=1)
    checkpoint_every: int = opt(1, "write checkpoint.pt every n rounds", minimum=1)
    out: str | None = opt(None, "run directory (default: runs/<algo>-<availability>-<seed>)")
    threads: int | None = opt(None, "torch intra-op threads (default: torch's choice)", minimum=1)
    state_store: str = opt("auto", "where per-client strategy tables (MIFA, MimiC, FedLaAvg, SCAFFOLD, FedDD memory) "
                                   "live: memory (RAM), disk (files in the run directory, RUN/state/), auto (disk "
                                   "when N × model parameters > 2^26; docs/scale-out.md); results are identical",
                           choices=("auto", "memory", "disk"))
    participation_format: str = opt("auto", "participation log format: csv (participation.csv, a row per client "
                                            "per round), npz (participation/, compressed columns per chunk of "
                                            "rounds), auto (npz above 10,000 clients; docs/run-directory.md)",
                                    choices=("auto", "csv", "npz"))
    track: str | None = opt(None, "mirror the config and per-round metrics to tensorboard and/or mlflow "
                                  "(comma-separated or repeated; none = off; needs pip install 'dropfl[tracking]'; "
                                  "docs/tracking.md)", repeat=True)
    track_dir: str | None = opt(None, "where --track writes, shared by runs: DIR/tb/<run name> and the MLflow "
                                      "file store DIR/mlruns; None: inside the run directory, RUN/tb and RUN/mlruns")


@dataclass
class SimConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    availability: AvailabilityConfig = field(default_factory=AvailabilityConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    clock: ClockConfig = field(default_factory=ClockConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return asdict(self)


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(SimConfig)}

# Renamed options, (section, old name) → new name. The old flag (--period) and the old config-file key
# ([availability] period) still work: each logs a deprecation warning (logger "dropfl.config") naming the value
# used, and gives the same config as the new name. Giving both, with different values, is refused.
RENAMED: dict[tuple[str, str], str] = {("availability", "period"): "half_period"}


def flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, algos: list[str] | None = None) -> None:
    """One option per config field; defaults are None so that a config file can fill them. The names of a plugin
    field (`REGISTRIES`; `algos` too, kept for callers) come from its registry."""
    parser.add_argument("--config", help="TOML or JSON config file (sections: " + ", ".join(SECTIONS) + ")")
    for section, factory in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(factory()):
            kw = {"help": f"{f.metadata['help']} (default: {f.default})", "default": None,
                  "dest": f"{section}.{f.name}"}
            if f.type in ("bool", bool):
                kw["action"] = argparse.BooleanOptionalAction
            elif f.metadata.get("repeat"):
                kw["action"], kw["metavar"] = _Join, f.name.upper()
            else:
                kw["type"] = _parse_type(f.type)
                kw["metavar"] = f.name.upper()
            choices = f.metadata.get("choices")
            if choices:
                kw["help"] += f"; one of: {', '.join(map(str, choices))}"
            group.add_argument(flag(f), **kw)
        for (sec, old), new in RENAMED.items():
            if sec == section:
                f = _field(section, new)
                group.add_argument(_old_flag(old), dest=f"{section}.{old}", default=None, type=_parse_type(f.type),
                                   metavar=new.upper(), help=f"deprecated name of {flag(f)}")


class _Join(argparse.Action):
    """A repeatable flag of a comma-separated list field: `--track a --track b` is `--track a,b`."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, f"{before},{values}" if before else values)


def _field(section: str, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(SECTIONS[section]()) if f.name == name)


def _old_flag(old: str) -> str:
    return "--" + old.replace("_", "-")


def upgrade_renamed(file: dict, source: str | None = None, warn: bool = True) -> dict:
    """A config file's sections with every renamed key (`RENAMED`) under its new name, and one deprecation
    warning per old key (`warn`). Both names with different values: UserError."""
    for (section, old), new in RENAMED.items():
        values = file.get(section)
        if not isinstance(values, dict) or old not in values:
            continue
        where = f" in {source}" if source else ""
        if new in values and values[new] != values[old]:
            raise UserError(f"{section}.{old}{where} is the deprecated name of {section}.{new}, and the two differ "
                            f"({show(values[old])} and {show(values[new])}); give only {section}.{new}")
        values = dict(values)
        v = values.pop(old)
        values[new] = v
        file = {**file, section: values}
        if warn:
            log.warning("%s.%s%s is deprecated, use %s.%s (the value %s is used)", section, old, where, section,
                        new, show(v))
    return file


def _renamed_flags(args: argparse.Namespace) -> dict[str, tuple[object, str]]:
    """{"section.new": (value, old flag)} for every deprecated flag given, with its warning."""
    out = {}
    for (section, old), new in RENAMED.items():
        v = getattr(args, f"{section}.{old}", None)
        if v is None:
            continue
        new_flag = flag(_field(section, new))
        given = getattr(args, f"{section}.{new}", None)
        if given is not None and given != v:
            raise UserError(f"{_old_flag(old)} is the deprecated name of {new_flag}, and the two differ ({v} and "
                            f"{given}); give only {new_flag}")
        log.warning("%s is deprecated, use %s (the value %s is used)", _old_flag(old), new_flag, show(v))
        out[f"{section}.{new}"] = (v, _old_flag(old))
    return out


def _parse_type(t):
    t = str(t)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def load_file(path: str) -> dict:
    return read_config_file(path, UserError)


def resolve(args: argparse.Namespace, algos: list[str]) -> SimConfig:
    path = getattr(args, "config", None)
    file = upgrade_renamed(load_file(path), path) if path else {}
    parts = fill_sections(SECTIONS, file, UserError, source=path)  # checks the file's values
    sources = {f"{section}.{k}": f"in {path}" for section, values in file.items() for k in values}
    renamed = _renamed_flags(args)
    for section, obj in parts.items():
        for f in dataclasses.fields(obj):
            v, name = getattr(args, f"{section}.{f.name}", None), flag(f)
            if v is None and f"{section}.{f.name}" in renamed:
                v, name = renamed[f"{section}.{f.name}"]
            if v is not None:
                setattr(obj, f.name, v)
                sources[f"{section}.{f.name}"] = f"from {name}"
    cfg = SimConfig(**parts)
    validate(cfg, algos, sources)
    return cfg


def check_plugin(key: str, name: str, where: str = "") -> None:
    """That the plugin field `key` (`REGISTRIES`) names one its registry resolves (a built-in, an installed entry
    point, a module:attr that imports and is of the right kind): else UserError, one line saying what to fix."""
    registry = Names(REGISTRIES[key]).registry
    try:
        registry.entry(name)
    except PluginError as e:
        at = f" {where}" if where else ""
        if ":" not in name and name not in registry.names():
            raise UserError(f"{key} must be one of: {', '.join(registry.names())} (got {show(name)}{at}), or a "
                            f"plugin as module:attr (`dropfl plugins` lists the installed ones)") from None
        raise UserError(f"{key} {show(name)}{at}: {e.reason}") from None


def cuda_needs_batched(engine: str) -> str:
    """The error of --sim-device cuda with an engine that trains on the CPU (`validate`; `dropfl reproduce` checks
    it before any run starts)."""
    return (f"--sim-device cuda trains the batched engine on the GPU; --engine {engine} trains on the CPU: use "
            f"--engine batched, or --sim-device auto or cpu")


def validate(cfg: SimConfig, algos: list[str] | None = None, sources: dict[str, str] | None = None) -> None:
    """Every field against its type, range and choices (`check_value`), each plugin name against its registry
    (`check_plugin`: this imports a module:attr plugin), then the rules that join fields; models and datasets
    check the rest when built. `sources`: "section.field" → "in FILE" / "from --flag", where each value came
    from, for the messages. `algos`: unused, the strategy names come from their registry (kept for callers)."""
    sources = sources or {}
    for section in SECTIONS:
        obj = getattr(cfg, section)
        hints = field_types(type(obj))
        for f in dataclasses.fields(obj):
            key = f"{section}.{f.name}"
            v = check_value(key, getattr(obj, f.name), hints.get(f.name), f.metadata, sources.get(key, ""),
                            UserError)
            if key in REGISTRIES:
                check_plugin(key, v, sources.get(key, ""))
            setattr(obj, f.name, v)
    c, t, r = cfg.data, cfg.train, cfg.run

    def got(key: str, v) -> str:
        return f"(got {v}{' ' + sources[key] if key in sources else ''})"

    checks = [
        (t.epochs >= 1 or (t.steps or 0) >= 1,
         f"train.epochs must be an integer ≥ 1 unless train.steps is set {got('train.epochs', t.epochs)}"),
        (r.seed <= max_seed(r.rounds, c.clients),
         f"run.seed must be an integer in 0..{max_seed(r.rounds, c.clients)} for {r.rounds} rounds of "
         f"{c.clients} clients, so that the clients' torch seeds fit 64 bits {got('run.seed', r.seed)}"),
        (cfg.availability.kind != "replay" or cfg.availability.trace, "--trace is required with --availability replay"),
        (cfg.availability.kind != "device-trace" or cfg.availability.device_trace,
         "--device-trace is required with --availability device-trace"),
        (t.device != "cuda" or t.engine == "batched", cuda_needs_batched(t.engine)),
        (cfg.strategy.mifa_storage == "raw" or cfg.strategy.units == "delta",
         f"strategy.mifa_storage {cfg.strategy.mifa_storage} needs strategy.units delta (gradient units already "
         f"divide by the lr) {got('strategy.units', cfg.strategy.units)}: use --units delta or --mifa-storage raw"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)
    from coordinator.tracking import parse as parse_track
    parse_track(r.track, sources.get("run.track", ""))  # names only; installed packages: runsetup.setup_run
