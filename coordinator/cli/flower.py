"""`dropfl flower run APP_DIR`: a Flower app in Flower's simulation engine under a dropfl config's availability,
written as a dropfl run directory (dropfl/flower/simulation.py, docs/flower.md)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from coordinator import config
    from coordinator.strategies import STRATEGIES

    p = sub.add_parser("flower", help="run a Flower app under dropfl's availability (needs dropfl[flower])",
                       description="Flower apps under dropfl. See docs/flower.md.")
    cmds = p.add_subparsers(dest="flower_command", metavar="COMMAND", required=True, parser_class=type(p))
    r = cmds.add_parser(
        "run", help="run a Flower app in Flower's simulation engine, writing a dropfl run directory",
        description="Run the Flower app in APP_DIR (a pyproject.toml with [tool.flwr.app.components]) in Flower's "
                    "simulation engine (Ray on this machine, 127.0.0.1; Flower's telemetry off), one SuperNode per "
                    "dropfl client, under the availability of a dropfl config: the options below and --config, as "
                    "`dropfl sim` reads them (--availability bounded, static, replay --trace RUN/participation.csv, "
                    "...). The federation's data, model, strategy and train settings go to the app in its run "
                    "config (dropfl-config, and num-server-rounds, lr, batch-size, local-epochs, algo where the app "
                    "declares them); the app's ServerApp writes the run directory through "
                    "dropfl.flower.rundir.under_dropfl. The simulation options (--engine, --slices, --sim-device, "
                    "--ray-address, --clock-profile, --threads, --track) do not apply: the app trains its clients. "
                    "--out defaults to runs/flower-<algo>-<availability>-<dataset>-s<seed>.")
    r.add_argument("app", metavar="APP_DIR", help="the Flower app's directory (with pyproject.toml)")
    config.add_arguments(r, list(STRATEGIES))
    r.add_argument("--overwrite", action="store_true", help="replace the run in --out")
    r.add_argument("--num-cpus", type=int, default=2, metavar="N",
                   help="CPUs Ray may use for the ClientApps, one per running ClientApp (default: 2)")
    r.set_defaults(func=run)
    from coordinator.cli import _common  # --debug, --log-level, --quiet after `flower run` too

    _common(r, suppress=True)


def default_out(cfg) -> str:
    return f"runs/flower-{cfg.strategy.algo}-{cfg.availability.kind}-{cfg.data.dataset}-s{cfg.run.seed}"


def run(args) -> int:
    from coordinator import config
    from coordinator.errors import UserError
    from coordinator.strategies import STRATEGIES

    try:
        import flwr  # noqa: F401
    except ImportError:
        raise UserError("dropfl flower: Flower is not installed; pip install 'dropfl[flower]'") from None
    from dropfl.flower.simulation import run_app

    cfg = config.resolve(args, list(STRATEGIES))
    out = cfg.run.out or default_out(cfg)
    cfg.run.out = out
    rundir = run_app(args.app, cfg, out, overwrite=args.overwrite, num_cpus=args.num_cpus)
    final = rundir.final
    print(f"run directory: {out}")
    if final:
        print(f"final: round {final['round'] + 1}/{cfg.run.rounds}, accuracy {100 * final['accuracy']:.2f}%, "
              f"uploads {final['uploads']}, client uploads {final['client_uploads']}")
    return 0
