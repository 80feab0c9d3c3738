"""`dropfl trial`: the command line of a one-machine field trial (coordinator/trial/run.py), and
`dropfl trial --resume RUN`: the same trial again from its last checkpoint (its options from RUN/trial.json,
its config from RUN/trial-config.json).

Its options: the run's config as in `dropfl sim` (coordinator/config.py), but for what only a simulation uses
(`SIM_ONLY`: hidden, refused when given); the trial's own (`TRIAL_FLAGS`); and every field option of
`dropfl coordinator`, generated from its one table (coordinator/cli/coordinator.py FIELD_OPTIONS) and passed
on to the trial's coordinator, but for those the trial sets itself (`TRIAL_SETS`). Everything is checked
before anything is written or started (`run`, then coordinator/trial/run.py `check_trial`).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from coordinator import config
from coordinator.cli.coordinator import FIELD_LIMITS, FIELD_OPTIONS
from coordinator.dashboard import server as dashboard
from coordinator.errors import UserError
from coordinator.rundir import check_out
from coordinator.trial.run import (
    DEFAULT_PROFILES,
    PROFILES,
    TRIAL_CONFIG,
    TRIAL_JSON,
    TrialOptions,
    check_trial,
    run_trial,
)
from edge_client.configfile import check_value

# the trial's own flags: (dest, default); their defaults are None on the parser, to tell "given" from "not"
TRIAL_FLAGS = {"--agents": ("agents", None), "--profiles": ("profiles", ",".join(DEFAULT_PROFILES)),
               "--heartbeat": ("heartbeat", 0.5), "--max-slowdown": ("max_slowdown", 0.0),
               "--links": ("links", None), "--broker-dir": ("broker_dir", None),
               "--restart-agents": ("restart_agents", "on-failure"), "--restart-delay": ("restart_delay", 1.0)}

# `dropfl coordinator` field options that a trial sets itself, and why: hidden, refused when given. Every other
# option in FIELD_OPTIONS is a `dropfl trial` option too and reaches the trial's coordinator as given.
TRIAL_SETS = {"--broker": "a trial runs its own broker, a private mosquitto on 127.0.0.1 or --broker-dir DIR's; "
                          "leave it out (or run `dropfl coordinator --broker URL` with agents of your own)"}
# a trial's defaults where they differ from the coordinator's: (default, help)
TRIAL_DEFAULTS = {
    "--deadline": (30.0, "per-round deadline in seconds (default: 30)"),
    "--heartbeat-timeout": (None, "an agent silent for this long is offline (default: 10 × --heartbeat, at least 5)"),
    "--wait-agents": (None, "agents to wait for before round 0 (default: --agents)"),
}
# other flags of `dropfl coordinator` a trial has no use for (hidden, refused when given)
NOT_FOR_TRIAL = {"--broker-config": ("broker_config", "a trial's coordinator logs in with --broker-dir DIR's "
                                                      "coordinator.json; give --broker-dir")}
# config fields only a simulation uses (coordinator/runsetup.py NOT_BOUND says why), and the availability
# section: hidden from `dropfl trial --help`, refused when given as flags. In a config file they are ignored
# (a sim run's config.json holds them all), but for an availability other than `always` and a clock profile,
# which would change what the run means: refused like the flags.
SIM_ONLY = {("train", "engine"), ("train", "slices"), ("train", "device"), ("train", "ray_address"),
            ("clock", "profile")}
HELP = {  # config fields whose `dropfl sim` help is not true of a trial
    "run.out": "run directory (default: runs/trial-<algo>-<dataset>-a<agents>-s<seed>)",
    "run.threads": "the coordinator's torch intra-op threads (default: torch's choice; each agent uses 1)",
}


def _hidden(dest: str) -> bool:
    section, _, name = dest.partition(".")
    return section == "availability" or (section, name) in SIM_ONLY or dest == "data.clients"


def add_parser(sub) -> None:
    from coordinator.strategies import STRATEGIES

    p = sub.add_parser(
        "trial", help="one-machine field trial: private mosquitto + coordinator + N edge agents",
        description="Start a private mosquitto on a free 127.0.0.1 port (or --broker-dir's), N edge agents with "
                    "heterogeneous modelled batteries and the coordinator; run the rounds; stop everything on "
                    "exit. Data, model, training, strategy and run options as in `dropfl sim` (the number of "
                    "clients is --agents; availability comes from the agents); the coordinator's field options "
                    "as in `dropfl coordinator` (docs/field-mode.md). Everything is checked before anything "
                    "starts or is written.")
    config.add_arguments(p, list(STRATEGIES))
    for a in p._actions:
        if _hidden(a.dest):
            a.help = argparse.SUPPRESS
        elif a.dest in HELP:
            a.help = HELP[a.dest]
        elif a.dest == "config":
            a.help = ("TOML or JSON config file (sections: data, model, train, strategy, run; a trial's number of "
                      "clients is --agents; an [availability] kind other than always and a [clock] profile are "
                      "refused, the simulation engine's keys ignored)")
    g = p.add_argument_group("trial")
    g.add_argument("--agents", type=int, default=None, help="number of edge agents (= clients); required")
    g.add_argument("--profiles", default=None,
                   help=f"battery profiles assigned round-robin, from {', '.join(PROFILES)} "
                        f"(default: {','.join(DEFAULT_PROFILES)})")
    g.add_argument("--heartbeat", type=float, default=None, help="agents' heartbeat period in seconds (default: 0.5)")
    g.add_argument("--max-slowdown", type=float, default=None, metavar="SECONDS",
                   help="emulated slow devices: agent i spends i/(N-1) times this many extra seconds per SGD step "
                        "(default: 0)")
    g.add_argument("--restart-agents", choices=["on-failure", "no"], default=None,
                   help="restart an agent that crashes or is killed, as a device's systemd unit does (Restart="
                        "on-failure; not after a clean exit, or exit 2, a config it refuses); no: a killed agent "
                        "stays down (default: on-failure)")
    g.add_argument("--restart-delay", type=float, default=None, metavar="SECONDS",
                   help="first restart delay, doubling after each restart up to 15 s (the unit's RestartSec), back "
                        "to this after 60 s without a failure (default: 1)")
    g.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the trial in RUN_DIR from its last checkpoint: a new private broker, the same "
                        "agents and the coordinator with --resume (the trial's options and config come from "
                        "RUN_DIR; only --broker-outage-timeout, --no-progress and --dashboard may be given)")
    g.add_argument("--overwrite", action="store_true", help="replace the run in --out")
    g.add_argument("--no-progress", action="store_true", help="no progress output")
    b = p.add_argument_group("broker and links")
    b.add_argument("--broker-dir", metavar="DIR", default=None,
                   help="run on a provisioned broker (`dropfl provision init DIR`) instead of a private anonymous "
                        "one: its mosquitto.conf (TLS, passwords, ACL) on its port, the coordinator's account, and "
                        "device client-<i>'s bundle for agent i (added if missing); docs/provisioning.md")
    b.add_argument("--links", metavar="FILE", default=None,
                   help="emulated links: each agent in its own network namespace with tc tbf rate limits (and "
                        "outages) from a profile or network trace; root only (docs/links.md)")
    c = p.add_argument_group("coordinator", "the field options of `dropfl coordinator`, for the trial's coordinator")
    for flag, (dest, typ, help_) in FIELD_OPTIONS.items():
        hidden = flag in TRIAL_SETS
        c.add_argument(flag, dest=f"field.{dest}", type=typ, default=None,
                       help=argparse.SUPPRESS if hidden else TRIAL_DEFAULTS.get(flag, (None, help_))[1],
                       metavar=flag.lstrip("-").upper().replace("-", "_"))
    for flag, (dest, _) in NOT_FOR_TRIAL.items():
        p.add_argument(flag, dest=dest, default=None, help=argparse.SUPPRESS)
    dashboard.add_option(p)
    p.set_defaults(func=run)


def coordinator_options(args: argparse.Namespace) -> dict:
    """The coordinator's field options given as flags: {FieldConfig name: value}."""
    return {dest: getattr(args, f"field.{dest}") for flag, (dest, _, _) in FIELD_OPTIONS.items()
            if flag not in TRIAL_SETS and getattr(args, f"field.{dest}", None) is not None}


def _refuse_unused(args: argparse.Namespace) -> None:
    """Flags a trial has no use for: one line saying why."""
    from coordinator.runsetup import NOT_BOUND

    for flag, why in TRIAL_SETS.items():
        if getattr(args, f"field.{FIELD_OPTIONS[flag][0]}", None) is not None:
            raise UserError(f"{flag}: {why}")
    for flag, (dest, why) in NOT_FOR_TRIAL.items():
        if getattr(args, dest, None) is not None:
            raise UserError(f"{flag}: {why}")
    for section, factory in config.SECTIONS.items():
        names = [f.name for f in dataclasses.fields(factory())]
        names += [old for (sec, old) in config.RENAMED if sec == section]
        for name in names:
            v = getattr(args, f"{section}.{name}", None)
            if v is None or not _hidden(f"{section}.{name}") or (section, name) == ("data", "clients"):
                continue
            if (section, name) == ("availability", "kind") and v == "always":
                continue  # what a field run is
            f = next((f for f in dataclasses.fields(factory()) if f.name == name), None)
            shown = config.flag(f) if f is not None else "--" + name.replace("_", "-")
            v = " ".join(v) if isinstance(v, list) else v   # a repeatable flag's values (--availability-option)
            if section == "availability":
                raise UserError(f"{shown} {v}: a field trial's availability comes from its agents (their "
                                f"batteries: --profiles), not from a model, so no availability option applies; "
                                f"leave it out (`dropfl sim --availability replay --trace RUN/participation.csv` "
                                f"replays a trial's availability)")
            raise UserError(f"{shown}: not used by a trial ({NOT_BOUND[(section, name)]}); leave it out")


def _check_trial_values(heartbeat: float, max_slowdown: float, where: str) -> None:
    for flag, v, limits in (("--heartbeat", heartbeat, {"gt": 0}), ("--max-slowdown", max_slowdown, {"minimum": 0})):
        check_value(f"trial.{flag[2:].replace('-', '_')}", v, float, limits, where or f"from {flag}", UserError)


def check_coordinator_options(opts: dict, agents: int, heartbeat: float, where: str = "") -> dict:
    """The coordinator's field options of a trial against their ranges (FIELD_LIMITS, as `dropfl coordinator`
    checks them) and the trial: the agents' heartbeat, their number. Returns them with ints and floats as
    typed. `where`: where they came from ("" = from their flags)."""
    from edge_client import wire

    flags = {dest: flag for flag, (dest, _, _) in FIELD_OPTIONS.items()}
    types = {dest: typ for dest, typ, _ in FIELD_OPTIONS.values()}
    out = {}
    for dest, v in opts.items():
        src = where or f"from {flags[dest]}"
        out[dest] = check_value(f"field.{dest}", v, types[dest], FIELD_LIMITS.get(dest, {}), src, UserError)
    hb = out.get("heartbeat_timeout_s")
    if hb is not None and hb <= heartbeat:
        raise UserError(f"--heartbeat-timeout {hb:g} (the coordinator's) is not longer than the agents' heartbeat "
                        f"period (--heartbeat {heartbeat:g}){' ' + where if where else ''}: every agent would be "
                        f"offline between two heartbeats; give several heartbeats (default: 10 × --heartbeat, "
                        f"at least 5)")
    if out.get("wait_agents", 0) > agents:
        raise UserError(f"--wait-agents {out['wait_agents']}{' ' + where if where else ''}: the trial has "
                        f"{agents} agents; give at most {agents} (0 or left out: all of them)")
    if out.get("run_id"):
        try:  # bound into every message: it must fit a header (edge_client/wire.py)
            wire.encode("coordinator", out["run_id"], -1, -1)
        except (wire.WireError, ValueError) as e:
            raise UserError(f"--run-id{' ' + where if where else ''}: {e}; give a shorter run id") from None
    return out


def run(args) -> int:
    from coordinator.strategies import STRATEGIES

    if args.resume is not None:
        return resume(args)
    _refuse_unused(args)
    for dest, default in TRIAL_FLAGS.values():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if args.agents is None:
        raise UserError("--agents is required (the number of edge agents), or --resume RUN_DIR")
    if args.agents < 1:
        raise UserError(f"--agents must be >= 1 (got {args.agents}); give the number of edge agents")
    _check_trial_values(args.heartbeat, args.max_slowdown, "")
    check_value("trial.restart_delay", args.restart_delay, float, {"gt": 0, "maximum": 15}, "from --restart-delay",
                UserError)
    coord = check_coordinator_options(coordinator_options(args), args.agents, args.heartbeat)
    deadline = coord.pop("deadline_s", TRIAL_DEFAULTS["--deadline"][0])
    outage = coord.pop("broker_outage_timeout_s", None)
    if getattr(args, "data.clients", None) not in (None, args.agents):
        raise UserError(f"--clients {getattr(args, 'data.clients')}: a trial has one client per agent; give only "
                        f"--agents")
    setattr(args, "data.clients", args.agents)
    cfg = config.resolve(args, list(STRATEGIES))
    if cfg.clock.profile is not None:
        raise UserError(f"[clock] profile in {args.config}: a virtual clock is for simulation only, in a trial time "
                        f"is real; remove it from the config file")
    profiles = [s.strip() for s in args.profiles.split(",") if s.strip()]
    bad = [s for s in profiles if s not in PROFILES]
    if bad or not profiles:
        raise UserError(f"--profiles {args.profiles!r}: unknown profile(s) {bad} (choose from {', '.join(PROFILES)})")
    out = Path(cfg.run.out or f"runs/trial-{cfg.strategy.algo}-{cfg.data.dataset}-a{args.agents}-s{cfg.run.seed}")
    cfg.run.out = str(out)
    for flag, path in (("--links", args.links), ("--broker-dir", args.broker_dir)):
        if path is not None and not Path(path).exists():
            raise UserError(f"{flag} {path}: no such {'file' if flag == '--links' else 'directory'}; give an "
                            f"existing one")
    check_trial(cfg, out, args.links, args.broker_dir, resume=False, overwrite=args.overwrite)
    extra = {"overwrite": True} if args.overwrite else {}
    if outage is not None:
        extra["broker_outage_timeout_s"] = outage
    with dashboard.serving(args, out):
        summary = run_trial(cfg, out, profiles, deadline, args.heartbeat, args.max_slowdown, not args.no_progress,
                            links=args.links, broker_dir=args.broker_dir, coordinator=coord, checked=True,
                            restart_agents=args.restart_agents, restart_delay_s=args.restart_delay, **extra)
    print(summary)
    return 0


def resume(args) -> int:
    """`dropfl trial --resume RUN`: the trial in RUN again, from its last checkpoint."""
    from coordinator.strategies import STRATEGIES

    out = Path(args.resume)
    given = [flag for flag, (dest, _) in TRIAL_FLAGS.items() if getattr(args, dest) is not None]
    given += [flag for flag, (dest, _, _) in FIELD_OPTIONS.items()
              if getattr(args, f"field.{dest}", None) is not None and flag != "--broker-outage-timeout"]
    given += [flag for flag, (dest, _) in NOT_FOR_TRIAL.items() if getattr(args, dest, None) is not None]
    given += ["--overwrite"] * bool(args.overwrite) + ["--config"] * bool(args.config)
    given += [config.flag(f) for section, factory in config.SECTIONS.items()  # the run's config flags
              for f in dataclasses.fields(factory()) if getattr(args, f"{section}.{f.name}", None) is not None]
    given += ["--" + old.replace("_", "-") for (sec, old) in config.RENAMED if getattr(args, f"{sec}.{old}", None)
              is not None]
    if given:
        raise UserError(f"--resume {out}: the trial's options and config come from {out / TRIAL_JSON} and "
                        f"{out / TRIAL_CONFIG}; leave out {', '.join(given)}")
    if not (out / TRIAL_JSON).is_file():
        raise UserError(f"--resume {out}: not a `dropfl trial` run directory (no {TRIAL_JSON}; trials started "
                        f"before dropfl saved one cannot be resumed as a trial: resume the coordinator with "
                        f"`dropfl coordinator --config {out / 'config.json'} --out {out} --resume ...` and the agents)")
    check_out(out, resume=True, overwrite=False)  # no checkpoint: nothing to resume, whatever trial.json holds
    opts = TrialOptions.load(out)
    saved = f"in {out / TRIAL_JSON}"
    outage = getattr(args, "field.broker_outage_timeout_s")
    _check_trial_values(opts.heartbeat_s, opts.max_slowdown, saved)
    opts.coordinator = check_coordinator_options(opts.coordinator, opts.agents, opts.heartbeat_s, saved)
    check_coordinator_options({"deadline_s": opts.deadline_s}, opts.agents, opts.heartbeat_s, saved)
    if outage is not None:
        opts.broker_outage_timeout_s = check_coordinator_options({"broker_outage_timeout_s": outage}, opts.agents,
                                                                 opts.heartbeat_s)["broker_outage_timeout_s"]
    else:
        check_coordinator_options({"broker_outage_timeout_s": opts.broker_outage_timeout_s}, opts.agents,
                                  opts.heartbeat_s, saved)
    if not (out / TRIAL_CONFIG).is_file():
        raise UserError(f"--resume {out}: {out / TRIAL_CONFIG} (the trial's config) is missing; restore it")
    cfg = config.resolve(argparse.Namespace(config=str(out / TRIAL_CONFIG)), list(STRATEGIES))
    if cfg.data.clients != opts.agents:
        raise UserError(f"--resume {out}: {out / TRIAL_CONFIG} has {cfg.data.clients} clients, {out / TRIAL_JSON} "
                        f"{opts.agents} agents; restore the trial's files")
    cfg.run.out = str(out)
    check_trial(cfg, out, opts.links, opts.broker_dir, resume=True, overwrite=False)
    with dashboard.serving(args, out):
        summary = run_trial(cfg, out, opts.profiles, opts.deadline_s, opts.heartbeat_s, opts.max_slowdown,
                            not args.no_progress, links=opts.links, broker_dir=opts.broker_dir,
                            broker_outage_timeout_s=opts.broker_outage_timeout_s, resume=True,
                            coordinator=opts.coordinator, checked=True, restart_agents=opts.restart_agents,
                            restart_delay_s=opts.restart_delay_s)
    print(summary)
    return 0

