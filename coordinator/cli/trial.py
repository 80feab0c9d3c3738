"""`dropfl trial`: the command line of a one-machine field trial (coordinator/trial/run.py), and
`dropfl trial --resume RUN`: the same trial again from its last checkpoint (its options from RUN/trial.json,
its config from RUN/trial-config.json)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from coordinator import config
from coordinator.dashboard import server as dashboard
from coordinator.errors import UserError
from coordinator.rundir import check_out
from coordinator.trial.run import DEFAULT_PROFILES, PROFILES, TRIAL_CONFIG, TRIAL_JSON, TrialOptions, run_trial
from edge_client.configfile import check_value

# the trial's own flags: (dest, default); their defaults are None on the parser, to tell "given" from "not"
TRIAL_FLAGS = {"--agents": ("agents", None), "--profiles": ("profiles", ",".join(DEFAULT_PROFILES)),
               "--deadline": ("deadline", 30.0), "--heartbeat": ("heartbeat", 0.5),
               "--max-slowdown": ("max_slowdown", 0.0), "--links": ("links", None),
               "--broker-dir": ("broker_dir", None), "--broker-outage-timeout": ("broker_outage_timeout", 300.0)}


def add_parser(sub) -> None:
    from coordinator.strategies import STRATEGIES

    p = sub.add_parser(
        "trial", help="one-machine field trial: private mosquitto + coordinator + N edge agents",
        description="Start a private mosquitto on a free 127.0.0.1 port, N edge agents with heterogeneous "
                    "modelled batteries and the coordinator; run the rounds; stop everything on exit. "
                    "Data, model, training and strategy options as in `dropfl sim` (--clients is --agents).")
    config.add_arguments(p, list(STRATEGIES))
    g = p.add_argument_group("trial")
    g.add_argument("--agents", type=int, default=None, help="number of edge agents (= clients); required")
    g.add_argument("--profiles", default=None,
                   help=f"battery profiles assigned round-robin, from {', '.join(PROFILES)} "
                        f"(default: {','.join(DEFAULT_PROFILES)})")
    g.add_argument("--deadline", type=float, default=None, help="per-round deadline in seconds (default: 30)")
    g.add_argument("--heartbeat", type=float, default=None, help="agents' heartbeat period in seconds (default: 0.5)")
    g.add_argument("--max-slowdown", type=float, default=None,
                   help="emulated slow devices: agent i spends i/(N-1) times this many extra seconds per SGD step")
    g.add_argument("--broker-outage-timeout", type=float, default=None, metavar="SECONDS",
                   help="the coordinator disconnected from the broker this long stops the trial (exit 1) with the "
                        "finished rounds checkpointed, to continue with --resume (default: 300)")
    g.add_argument("--links", metavar="FILE", default=None,
                   help="emulated links: each agent in its own network namespace with tc tbf rate limits (and "
                        "outages) from a profile or network trace; root only (docs/links.md)")
    g.add_argument("--broker-dir", metavar="DIR", default=None,
                   help="run on a provisioned broker (`dropfl provision init DIR`) instead of a private anonymous "
                        "one: its mosquitto.conf (TLS, passwords, ACL) on its port, the coordinator's account, and "
                        "device client-<i>'s bundle for agent i (added if missing); docs/provisioning.md")
    g.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the trial in RUN_DIR from its last checkpoint: a new private broker, the same "
                        "agents and the coordinator with --resume (the trial's options and config come from "
                        "RUN_DIR; only --broker-outage-timeout, --no-progress and --dashboard may be given)")
    g.add_argument("--overwrite", action="store_true", help="replace the run in --out")
    g.add_argument("--no-progress", action="store_true", help="no progress output")
    dashboard.add_option(p)
    p.set_defaults(func=run)


def _check_trial_values(deadline: float, heartbeat: float, max_slowdown: float, outage: float, where: str) -> None:
    for flag, v, limits in (("--deadline", deadline, {"gt": 0}), ("--heartbeat", heartbeat, {"gt": 0}),
                            ("--max-slowdown", max_slowdown, {"minimum": 0}),
                            ("--broker-outage-timeout", outage, {"gt": 0})):
        check_value(f"trial.{flag[2:].replace('-', '_')}", v, float, limits, where or f"from {flag}", UserError)


def run(args) -> int:
    from coordinator.strategies import STRATEGIES

    if args.resume is not None:
        return resume(args)
    for dest, default in TRIAL_FLAGS.values():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if args.agents is None:
        raise UserError("--agents is required (the number of edge agents), or --resume RUN_DIR")
    if args.agents < 1:
        raise UserError("--agents must be >= 1")
    _check_trial_values(args.deadline, args.heartbeat, args.max_slowdown, args.broker_outage_timeout, "")
    if getattr(args, "data.clients", None) not in (None, args.agents):
        raise UserError(f"--clients {getattr(args, 'data.clients')}: a trial has one client per agent (--agents)")
    setattr(args, "data.clients", args.agents)
    cfg = config.resolve(args, list(STRATEGIES))
    profiles = [s.strip() for s in args.profiles.split(",") if s.strip()]
    bad = [s for s in profiles if s not in PROFILES]
    if bad or not profiles:
        raise UserError(f"--profiles: unknown profile(s) {bad} (choose from {', '.join(PROFILES)})")
    out = Path(cfg.run.out or f"runs/trial-{cfg.strategy.algo}-{cfg.data.dataset}-a{args.agents}-s{cfg.run.seed}")
    cfg.run.out = str(out)
    check_out(out, resume=False, overwrite=args.overwrite)  # a run there: only with --overwrite (or --resume)
    out.mkdir(parents=True, exist_ok=True)
    extra = {"overwrite": True} if args.overwrite else {}
    if args.broker_outage_timeout != TRIAL_FLAGS["--broker-outage-timeout"][1]:
        extra["broker_outage_timeout_s"] = args.broker_outage_timeout
    with dashboard.serving(args, out):
        summary = run_trial(cfg, out, profiles, args.deadline, args.heartbeat, args.max_slowdown, not args.no_progress,
                            links=args.links, broker_dir=args.broker_dir, **extra)
    print(summary)
    return 0


def resume(args) -> int:
    """`dropfl trial --resume RUN`: the trial in RUN again, from its last checkpoint."""
    from coordinator.strategies import STRATEGIES

    out = Path(args.resume)
    given = [flag for flag, (dest, _) in TRIAL_FLAGS.items()
             if getattr(args, dest) is not None and flag != "--broker-outage-timeout"]
    given += ["--overwrite"] * bool(args.overwrite) + ["--config"] * bool(args.config)
    given += [config.flag(f) for section, factory in config.SECTIONS.items()  # the run's config flags
              for f in dataclasses.fields(factory()) if getattr(args, f"{section}.{f.name}", None) is not None]
    if given:
        raise UserError(f"--resume {out}: the trial's options and config come from {out / TRIAL_JSON} and "
                        f"{out / TRIAL_CONFIG}; leave out {', '.join(given)}")
    if not (out / TRIAL_JSON).is_file():
        raise UserError(f"--resume {out}: not a `dropfl trial` run directory (no {TRIAL_JSON}; trials started "
                        f"before dropfl saved one cannot be resumed as a trial: resume the coordinator with "
                        f"`dropfl coordinator --config {out / 'config.json'} --out {out} --resume ...` and the agents)")
    check_out(out, resume=True, overwrite=False)  # no checkpoint: nothing to resume
    opts = TrialOptions.load(out)
    if args.broker_outage_timeout is not None:
        opts.broker_outage_timeout_s = args.broker_outage_timeout
    _check_trial_values(opts.deadline_s, opts.heartbeat_s, opts.max_slowdown, opts.broker_outage_timeout_s,
                        "" if args.broker_outage_timeout is not None else f"in {out / TRIAL_JSON}")
    if not (out / TRIAL_CONFIG).is_file():
        raise UserError(f"--resume {out}: {out / TRIAL_CONFIG} (the trial's config) is missing; restore it")
    cfg = config.resolve(argparse.Namespace(config=str(out / TRIAL_CONFIG)), list(STRATEGIES))
    if cfg.data.clients != opts.agents:
        raise UserError(f"--resume {out}: {out / TRIAL_CONFIG} has {cfg.data.clients} clients, {out / TRIAL_JSON} "
                        f"{opts.agents} agents; restore the trial's files")
    cfg.run.out = str(out)
    opts.save(out)
    with dashboard.serving(args, out):
        summary = run_trial(cfg, out, opts.profiles, opts.deadline_s, opts.heartbeat_s, opts.max_slowdown,
                            not args.no_progress, links=opts.links, broker_dir=opts.broker_dir,
                            broker_outage_timeout_s=opts.broker_outage_timeout_s, resume=True)
    print(summary)
    return 0

