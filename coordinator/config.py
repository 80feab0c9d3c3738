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
import difflib
import logging
from collections.abc import Mapping
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
        lt=None, repeat: bool = False, applies: tuple[str, ...] | None = None):
    """A config field: its `--help` text, choices, flag name (default --field-name) and range
    (`minimum`/`maximum` inclusive, `gt`/`lt` exclusive), checked by `check_value` for file and flag values.
    `repeat`: a comma-separated list whose flag may also be given several times (the values are joined).
    `applies`: the built-in strategies (a StrategyConfig field) or availability models (an AvailabilityConfig
    field) the option does something for; the help starts with them, and setting the option for another one is
    a warning (`inert_settings`)."""
    if applies:
        help = f"{', '.join(applies)}: {help}"
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag, "minimum": minimum,
                                            "maximum": maximum, "gt": gt, "lt": lt, "repeat": repeat,
                                            "applies": tuple(applies) if applies else None})


def options_field(section: str, flag: str, kind: str):
    """A plugin's own options (`section`: "strategy", "availability"; `kind`: what one is called): {name: value}
    for the Options dataclass the chosen plugin declares (edge_client/options.py), from the table [SECTION.options]
    of a config file and the repeatable flag `flag` KEY=VALUE. `validate` converts and checks them against the
    plugin's Options and fills in its defaults, so a run's config.json holds every option the plugin ran with."""
    base = opt(None, "").metadata
    return field(default_factory=dict, metadata={
        **base,
        "help": f"an option of a plugin {kind} that declares an Options dataclass, as KEY=VALUE converted by the "
                f"option's type (repeat the flag for several; none sets an optional one to None); in a config "
                f"file the table [{section}.options]; `dropfl plugins {section} NAME` lists a plugin's options "
                f"(docs/extending.md)",
        "flag": flag, "options": True})


@dataclass
class DataConfig:
    dataset: str = opt("fmnist", "dataset (a plugin: module:attr or an entry point of dropfl.datasets)",
                       Names(REGISTRIES["data.dataset"]))
    data_dir: str | None = opt(None, "the dataset's directory, or its .npz file (required for cifar10, npz, "
                                     "imagefolder, leaf: docs/datasets.md)")
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


# the availability models built on `Availability` whose draws --min-active and --first-round-all change (not
# `always`: everyone is available anyway)
MODELS_WITH_DRAWS = ("bounded", "static", "timevarying", "diurnal", "cluster-dropout")
DEVICE_TRACE = ("device-trace",)


@dataclass
class AvailabilityConfig:
    kind: str = opt("always", "availability model (a plugin: module:attr or an entry point of dropfl.availability)",
                    Names(REGISTRIES["availability.kind"]), flag="--availability")
    tau_max: int = opt(20, "maximum period τmax (τ_i drawn from 0..τmax)", minimum=0, applies=("bounded",))
    tau_dist: str = opt("uniform", "τ_i distribution (paper: uniform; code: halfnormal)",
                        ["uniform", "halfnormal"], applies=("bounded",))
    p: float = opt(0.1, "active probability p in (0, 1]", gt=0, maximum=1, applies=("static",))
    p_levels: int = opt(1, "1 = identical p (paper), 5 = the code's five levels", [1, 5], applies=("static",))
    fraction: float = opt(0.3, "fraction P of clients active per round", gt=0, maximum=1, applies=("timevarying",))
    half_period: int = opt(100, "half-period E in rounds (E rounds day, E rounds night; the old "
                                "--period / key period still work, deprecated)", minimum=1, applies=("diurnal",))
    diurnal_d: int = opt(1, "D, clients of digits 0..D-1 form the day group", minimum=0, maximum=10,
                         applies=("diurnal",))
    alpha: float = opt(0.5, "dropout ratio α in [0, 1)", minimum=0, lt=1, applies=("cluster-dropout",))
    min_active: int = opt(0, "if fewer clients are available, draw this many uniformly "
                             "(MimiC released code: 2; also a plugin built on Availability)", minimum=0,
                          applies=MODELS_WITH_DRAWS)
    first_round_all: bool = opt(True, "all clients available in round 0 (MimiC, FDMS; also a plugin built on "
                                      "Availability)", applies=MODELS_WITH_DRAWS)
    trace: str | None = opt(None, "participation log (participation.csv or participation/ of a run)",
                            applies=("replay",))
    replay_selection: str = opt("auto", "whose selection to replay. log = the recorded selection and its "
                                        "after-selection drops (the same experiment, exact); strategy = the "
                                        "strategy selects among the recorded available clients, and clients that "
                                        "dropped in the log count as unavailable (compare algorithms on recorded "
                                        "availability); auto = log when the trace's run used the same --algo "
                                        "(its config.json), else strategy", ["auto", "log", "strategy"],
                                applies=("replay",))
    device_trace: str | None = opt(None, "device time series CSV (docs/traces.md)", applies=DEVICE_TRACE)
    round_seconds: float = opt(60.0, "virtual seconds per round", gt=0, applies=DEVICE_TRACE)
    start_seconds: float = opt(0.0, "trace time of round 0", applies=DEVICE_TRACE)
    min_battery: float = opt(0.0, "minimum battery %% to train", minimum=0, maximum=100, applies=DEVICE_TRACE)
    require_charging: bool = opt(False, "train only while charging", applies=DEVICE_TRACE)
    min_uplink: float = opt(0.0, "minimum uplink bytes/s to train", minimum=0, applies=DEVICE_TRACE)
    max_temp: float | None = opt(None, "decline above this temperature in °C, the trace's temp_c "
                                       "(reason thermal; default: off)", minimum=-40, maximum=200,
                                 applies=DEVICE_TRACE)
    options: dict = options_field("availability", "--availability-option", "availability model")


@dataclass
class StrategyConfig:
    algo: str = opt("fedavg", "aggregation strategy (a plugin: module:attr or an entry point of dropfl.strategies)",
                    Names(REGISTRIES["strategy.algo"]))
    weighting: str = opt("uniform", "client weights (also a plugin without from_config or Options)",
                         ["uniform", "samples"], applies=("fedavg", "full", "fedprox", "fedcs"))
    fedavg_k: int | None = opt(None, "select K clients uniformly at random among the available "
                                     "ones (FedLaAvg's baselines: K = βN; default: every available client, as "
                                     "MimiC and FL-FDMS)",
                               minimum=1, applies=("fedavg", "full", "fedprox"))
    mu: float = opt(0.001, "proximal coefficient μ", minimum=0, applies=("fedprox",))
    feddd_d_max: float = opt(0.8, "maximal dropout rate D_max", minimum=0, maximum=1, applies=("feddd",))
    feddd_a_server: float = opt(0.6, "upload budget A_server, the fraction of all clients' "
                                     "model bytes uploaded per round", gt=0, maximum=1, applies=("feddd", "fedcs"))
    feddd_delta: float = opt(0.0, "penalty δ of eq. 16, seconds per unit of the regulariser re_n", minimum=0,
                             applies=("feddd",))
    feddd_full_every: int = opt(1, "h, full-model download every h rounds, sparse in between (eqs. 5-6)",
                                minimum=1, applies=("feddd",))
    fedcs_deadline: float | None = opt(None, "round deadline in seconds (default: budget only)", gt=0,
                                       applies=("fedcs",))
    rate_smoothing: float = opt(0.5, "weight of a new rate measurement in the running estimate",
                                gt=0, maximum=1, applies=("feddd", "fedcs"))
    server_lr: float = opt(1.0, "global step on the averaged update (mimic: delta units; released codes: 1; "
                                "FL-FDMS paper text: 0.1)", gt=0,
                           applies=("fedavg", "full", "fedprox", "scaffold", "fdms", "mimic", "mimic-client", "fedcs"))
    units: str = opt("delta", "update units, delta = released code (w ← w − mean delta), "
                              "gradient = paper text (average gradients, w ← w − η_t v_t)", ["delta", "gradient"],
                     applies=("mimic", "mimic-client", "mifa"))
    global_lr: float = opt(0.01, "with --units gradient: η_0 of η_t = global_lr·global_lr_decay^t",
                           gt=0, applies=("mimic", "mimic-client", "mifa"))
    global_lr_decay: float = opt(0.95, "with --units gradient: per-round factor of η_t", gt=0, maximum=1,
                                 applies=("mimic", "mimic-client", "mifa"))
    mifa_round_weights: bool = opt(True, "weights round(1/N, 4) as the released code (--no-... : exact 1/N); "
                                         "exact 1/N with a warning where N·round(1/N, 4) is more than 1%% off 1 "
                                         "(N > 200 at worst, e.g. 0 for N > 20000)", applies=("mifa",))
    mifa_wait_all: bool = opt(False, "no model update until every client has uploaded once (MIFA's code); "
                                     "a no-op when round 0 has everyone (--first-round-all)", applies=("mifa",))
    mifa_storage: str = opt("raw", "stored latest updates, raw = deltas in the lr scale of their round "
                                   "(MimiC's released code), lr-normalised = delta/lr and the current lr applied "
                                   "to the average (delta units only; docs/strategies.md)", ["raw", "lr-normalised"],
                            applies=("mifa",))
    beta: float = opt(0.1, "fraction β of clients selected per round, K = βN (oldest first)",
                      gt=0, maximum=1, applies=("fedlaavg",))
    fedlaavg_storage: str = opt("raw", "stored latest updates, raw = deltas (same as the paper's constant "
                                       "lr), lr-normalised = delta/lr and the current lr applied to the average "
                                       "(the released code)", ["raw", "lr-normalised"], applies=("fedlaavg",))
    fdms_cr: str = opt("off", "complexity reduction, case1 = Θt, case2 = 0.5·Θt", ["off", "case1", "case2"],
                       applies=("fdms",))
    stale_variant: str = opt("weights", "weights = last local models (FL-FDMS code), "
                                        "update = last updates (paper text)", ["weights", "update"],
                             applies=("stale",))
    scaffold_correction_lr: float | None = opt(None, "η_L in c_i⁺ (default: the round's local lr)", gt=0,
                                               applies=("scaffold",))
    options: dict = options_field("strategy", "--strategy-option", "strategy")


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
            if f.metadata.get("options"):
                group.add_argument(flag(f), action="append", default=None, dest=f"{section}.{f.name}",
                                   metavar="KEY=VALUE", help=f.metadata["help"])
                continue
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
    """The checked config of a command line: defaults < config file < flags. Says once, as a warning, each option
    set that does nothing for the chosen strategy or availability model (`inert_settings`)."""
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
            if v is not None and not f.metadata.get("options"):
                setattr(obj, f.name, v)
                sources[f"{section}.{f.name}"] = f"from {name}"
    for key, plugin_key in OPTIONS.items():
        _merge_options(key, plugin_key, parts, file, path, getattr(args, key, None), sources)
    cfg = SimConfig(**parts)
    validate(cfg, algos, sources)
    for line in inert_settings(cfg, sources):
        log.warning("%s", line)
    return cfg


# --- a plugin's own options (edge_client/options.py) -------------------------------------------------------------

# the config fields of plugin options → the plugin field whose plugin declares them
OPTIONS = {"strategy.options": "strategy.algo", "availability.options": "availability.kind"}


class Text(str):
    """An option's value as typed on the command line (KEY=VALUE), converted by the option's type in `validate`."""


def _merge_options(key: str, plugin_key: str, parts: dict, file: dict, path: str | None, given: list[str] | None,
                   sources: dict[str, str]) -> None:
    """The options of `key` (e.g. strategy.options): the config file's table, then the flag's KEY=VALUE pairs over
    it. A file's table belongs to the plugin the file names: where a flag chooses another one (`--availability
    replay` with a run's config.json), the file's options are left out (logged)."""
    section, name = key.split(".")
    obj = parts[section]
    options = getattr(obj, name)
    file_choice = (file.get(section) or {}).get(plugin_key.split(".")[1])
    chosen = getattr(obj, plugin_key.split(".")[1])
    if isinstance(options, dict):
        for k in options:
            sources[f"{key}.{k}"] = f"in {path}"
        if options and file_choice is not None and file_choice != chosen:
            log.info("%s in %s are %s's, not %s's: left out", key, path, show(file_choice), show(chosen))
            for k in options:
                sources.pop(f"{key}.{k}")
            options = {}
    flag_ = flag(_field(section, name))
    for item in given or ():
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise UserError(f"{flag_} {show(item)}: give KEY=VALUE, e.g. {flag_} momentum=0.9")
        if not isinstance(options, dict):   # a file's bad value: `validate` says so, unless the flags replace it
            options = {}
        options = {**options, k.strip(): Text(v)}
        sources[f"{key}.{k.strip()}"] = f"from {flag_} {item}"
        sources[key] = f"from {flag_}"
    setattr(obj, name, options)


def _registry(plugin_key: str):
    return Names(REGISTRIES[plugin_key]).registry


def _options_where(key: str, k: str, sources: dict[str, str]) -> str:
    """Where the option k of `key` was given: "--strategy-option k=v" or "strategy.options.k in FILE"."""
    src = sources.get(f"{key}.{k}", "")
    return src.removeprefix("from ") if src.startswith("from ") else f"{key}.{k}{' ' + src if src else ''}"


def check_options(key: str, plugin_key: str, name: str, given, sources: dict[str, str] | None = None) -> dict:
    """The options `given` for the plugin `name` (of `plugin_key`, already resolved by `check_plugin`), converted
    by the types of the Options dataclass it declares and checked by it: {option: value} for every option, the
    defaults filled in. UserError, one line naming the plugin and what to fix: a plugin that takes no options, an
    unknown option (its options listed), a value of the wrong type, a required option left out, a value its
    `__post_init__` refuses, an Options class that cannot be used."""
    from edge_client import options as po

    sources = sources or {}
    section = key.split(".")[0]
    flag_ = flag(_field(section, "options"))
    if not isinstance(given, Mapping):
        src = sources.get(key, "")
        raise UserError(f"{key} must be a table of option = value ([{key}] in a config file, {flag_} KEY=VALUE "
                        f"on the command line) (got {show(given)}{' ' + src if src else ''})")
    entry = _registry(plugin_key).entry(name)
    at = f" {sources[plugin_key]}" if sources.get(plugin_key) else ""
    try:
        cls = po.options_class(entry.obj)
        specs = po.specs(cls) if cls is not None else []
    except po.OptionsError as e:
        raise UserError(f"{plugin_key} {show(name)}{at} ({entry.origin}): {e}") from None
    _check_construction(plugin_key, name, entry, cls, at)
    if cls is None:
        if given:
            k = next(iter(given))
            why = (f"; {name}'s settings are flags of their own (`dropfl sim --help`)" if entry.origin == "built-in"
                   else f"; declare an Options dataclass on {name} to give it options")
            raise UserError(f"{_options_where(key, k, sources)}: the {section} {name} takes no options: {flag_} is "
                            f"for a plugin that declares an Options dataclass (docs/extending.md){why}")
        return {}
    by_name = {s.name: s for s in specs}
    listing = ", ".join(s.short() for s in specs) or "none"
    out = {}
    for k, v in given.items():
        where = _options_where(key, k, sources)
        spec = by_name.get(k)
        if spec is None:
            near = difflib.get_close_matches(str(k), list(by_name), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise UserError(f"{where}: {name} has no option {show(k)}{hint}; its options: {listing}")
        try:
            out[k] = po.parse(spec, v) if isinstance(v, Text) else po.conform(spec, v)
        except ValueError:
            got = show(str(v)) if isinstance(v, Text) else show(v)
            raise UserError(f"{where}: {name}'s option {k} takes {spec.expectation()} (got {got})") from None
    for s in specs:
        if s.name not in out:
            if s.required:
                raise UserError(f"{key}: {name}'s option {s.name} is required (it has no default): give {flag_} "
                                f"{s.name}=VALUE, or {s.name} = ... in [{key}] of a config file")
            out[s.name] = s.default
    try:
        po.build(cls, out)
    except po.OptionsError as e:
        where = ", ".join(_options_where(key, k, sources) for k in given) or f"{key} (its defaults)"
        raise UserError(f"{where}: {name}'s options are not valid: {e}") from None
    return {s.name: out[s.name] for s in specs}


def _check_construction(plugin_key: str, name: str, entry, cls, at: str) -> None:
    """That the plugin's constructor takes what it is built with (runsetup.build_strategy, availability.models
    .build): else UserError naming the plugin, how it is built, and what to add."""
    import inspect

    obj = entry.obj
    label = getattr(obj, "__name__", str(name))
    if plugin_key == "strategy.algo":
        if cls is not None:
            args, kwargs, how = (), {"options": None}, f"{label}(options={label}.Options(...))"
            fix = "add a keyword parameter options to its __init__"
        elif hasattr(obj, "from_config"):
            return
        else:
            args, kwargs, how = (), {"weighting": "uniform"}, f"{label}(weighting=...)"
            fix = ("add a keyword parameter weighting, a classmethod from_config(StrategyConfig), or an Options "
                   "dataclass and options=")
    else:
        from coordinator.availability.models import Availability
        if isinstance(obj, type) and issubclass(obj, Availability):
            args, kwargs = (1, 0), {"first_round_all": True, "min_active": 0}
            how = f"{label}(clients, seed, first_round_all=..., min_active=...)"
            fix = "take those parameters (as Availability.__init__ does)"
            if cls is not None:
                kwargs["options"] = None
                how = how[:-1] + f", options={label}.Options(...))"
                fix = "add a keyword parameter options to its __init__ and pass the rest to Availability.__init__"
        elif cls is not None:
            args, kwargs, how = (None,), {"options": None}, f"{label}(cfg, options={label}.Options(...))"
            fix = "add a keyword parameter options"
        else:
            return
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):   # no signature to read (a C callable): its call says what is wrong
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise UserError(f"{plugin_key} {show(name)}{at} ({entry.origin}): it is built as {how}, but its "
                        f"signature {label}{sig} does not take that ({e}): {fix}") from None


# --- options that do nothing for the chosen strategy or availability model --------------------------------------

ANY = None   # a plugin that may read any option of its section (`_plugin_reads`)


def _plugin_reads(plugin_key: str, name: str) -> frozenset[str] | None:
    """The built-in options of its section a plugin (not a built-in) is built with: a strategy with Options gets
    only its options, one with `from_config(StrategyConfig)` may read any (ANY), any other strategy gets
    `weighting`; an `Availability` subclass gets `min_active` and `first_round_all`, a callable (SimConfig) may read
    any (runsetup.build_strategy, availability.models.build)."""
    obj = _registry(plugin_key).entry(name).obj
    if plugin_key == "strategy.algo":
        if _declares_options(obj):
            return frozenset()
        return ANY if hasattr(obj, "from_config") else frozenset({"weighting"})
    from coordinator.availability.models import Availability
    if isinstance(obj, type) and issubclass(obj, Availability):
        return frozenset({"min_active", "first_round_all"})
    return ANY


def _declares_options(obj) -> bool:
    from edge_client import options as po

    try:
        return po.options_class(obj) is not None
    except po.OptionsError:
        return True


def inert_settings(cfg: SimConfig, sources: dict[str, str] | None = None) -> list[str]:
    """One line per option set to a value other than its default that does nothing for the chosen strategy or
    availability model: the fields' `applies` (opt) for built-ins, `_plugin_reads` for plugins. `sources` (as
    `validate`'s): only options given explicitly count, and an option of a config file only where the choice
    it does nothing for is not a flag's (`--config RUN/config.json --availability replay` keeps the recorded
    run's options quietly); None: every value that differs from its default counts."""
    lines = []
    for plugin_key in OPTIONS.values():
        section, choice = plugin_key.split(".")
        obj, default = getattr(cfg, section), SECTIONS[section]()
        chosen = getattr(obj, choice)
        try:
            entry = _registry(plugin_key).entry(chosen)
        except PluginError:
            continue
        reads = None if entry.origin == "built-in" else _plugin_reads(plugin_key, chosen)
        if entry.origin != "built-in" and reads is ANY:
            continue
        own = ""
        if entry.origin != "built-in" and _declares_options(entry.obj):
            own = f"; {chosen}'s own settings are its options: `dropfl plugins {section} {chosen}`"
        for f in dataclasses.fields(obj):
            applies = f.metadata.get("applies")
            key, v = f"{section}.{f.name}", getattr(obj, f.name)
            if not applies or v == getattr(default, f.name):
                continue
            if (f.name in reads) if reads is not None else (chosen in applies):
                continue
            src = ""
            if sources is not None:
                src = sources.get(key, "")
                if not src or (src.startswith("in ") and sources.get(plugin_key, "").startswith("from ")):
                    continue
            lines.append(f"{key} {show(v)}{' ' + src if src else ''} does nothing for {plugin_key} {show(chosen)} "
                         f"(it applies to {', '.join(applies)}{own}): leave it out")
    return lines


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
            if key in OPTIONS:
                continue   # after the plugin that declares them (below)
            v = check_value(key, getattr(obj, f.name), hints.get(f.name), f.metadata, sources.get(key, ""),
                            UserError)
            if key in REGISTRIES:
                check_plugin(key, v, sources.get(key, ""))
            setattr(obj, f.name, v)
    for key, plugin_key in OPTIONS.items():
        section, name = key.split(".")
        obj = getattr(cfg, section)
        plugin_section, plugin_name = plugin_key.split(".")
        chosen = getattr(getattr(cfg, plugin_section), plugin_name)
        setattr(obj, name, check_options(key, plugin_key, chosen, getattr(obj, name), sources))
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
