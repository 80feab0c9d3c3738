"""`dropfl trial`: the command line of a one-machine field trial (coordinator/trial/run.py)."""

from __future__ import annotations

from pathlib import Path

from coordinator import config
from coordinator.errors import UserError
from coordinator.trial.run import DEFAULT_PROFILES, PROFILES, run_trial
from edge_client.configfile import check_value


def add_parser(sub) -> None:
    from coordinator.strategies import STRATEGIES

    p = sub.add_parser(
        "trial", help="one-machine field trial: private mosquitto + coordinator + N edge agents",
        description="Start a private mosquitto on a free 127.0.0.1 port, N edge agents with heterogeneous "
                    "modelled batteries and the coordinator; run the rounds; stop everything on exit. "
                    "Data, model, training and strategy options as in `dropfl sim` (--clients is --agents).")
    config.add_arguments(p, list(STRATEGIES))
    g = p.add_argument_group("trial")
    g.add_argument("--agents", type=int, required=True, help="number of edge agents (= clients)")
    g.add_argument("--profiles", default=",".join(DEFAULT_PROFILES),
                   help=f"battery profiles assigned round-robin, from {', '.join(PROFILES)} "
                        f"(default: {','.join(DEFAULT_PROFILES)})")
    g.add_argument("--deadline", type=float, default=30.0, help="per-round deadline in seconds (default: 30)")
    g.add_argument("--heartbeat", type=float, default=0.5, help="agents' heartbeat period in seconds (default: 0.5)")
    g.add_argument("--max-slowdown", type=float, default=0.0,
                   help="emulated slow devices: agent i spends i/(N-1) times this many extra seconds per SGD step")
    g.add_argument("--links", metavar="FILE", default=None,
                   help="emulated links: each agent in its own network namespace with tc tbf rate limits (and "
                        "outages) from a profile or network trace; root only (docs/links.md)")
    g.add_argument("--broker-dir", metavar="DIR", default=None,
                   help="run on a provisioned broker (`dropfl provision init DIR`) instead of a private anonymous "
                        "one: its mosquitto.conf (TLS, passwords, ACL) on its port, the coordinator's account, and "
                        "device client-<i>'s bundle for agent i (added if missing); docs/provisioning.md")
    g.add_argument("--no-progress", action="store_true", help="no progress output")
    p.set_defaults(func=run)


def run(args) -> int:
    from coordinator.strategies import STRATEGIES

    if args.agents < 1:
        raise UserError("--agents must be >= 1")
    for flag, v, limits in (("--deadline", args.deadline, {"gt": 0}), ("--heartbeat", args.heartbeat, {"gt": 0}),
                            ("--max-slowdown", args.max_slowdown, {"minimum": 0})):
        check_value(f"trial.{flag[2:].replace('-', '_')}", v, float, limits, f"from {flag}", UserError)
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
    out.mkdir(parents=True, exist_ok=True)
    summary = run_trial(cfg, out, profiles, args.deadline, args.heartbeat, args.max_slowdown, not args.no_progress,
                        links=args.links, broker_dir=args.broker_dir)
    print(summary)
    return 0
