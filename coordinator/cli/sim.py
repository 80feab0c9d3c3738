"""`dropfl sim`: federated training with in-process clients under modelled or replayed dropouts."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from coordinator import config
from coordinator.dashboard import server as dashboard

log = logging.getLogger("dropfl.replay")


def add_parser(sub) -> None:
    from coordinator.strategies import STRATEGIES

    p = sub.add_parser(
        "sim", help="simulate federated training under client dropouts",
        description="Simulate federated training with in-process clients. Every option can also be set "
                    "in a TOML/JSON file given with --config (sections as the option groups below); "
                    "flags override the file. Writes a run directory (see docs/run-directory.md).",
    )
    config.add_arguments(p, list(STRATEGIES))
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint.pt")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run in --out (without --resume or --overwrite, a directory that holds a run "
                        "is never touched)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    dashboard.add_option(p)
    p.set_defaults(func=run)


def default_out(cfg: config.SimConfig) -> str:
    return f"runs/{cfg.strategy.algo}-{cfg.availability.kind}-{cfg.data.dataset}-s{cfg.run.seed}"


def run(args) -> int:
    from coordinator.sim.run import run_sim
    from coordinator.strategies import STRATEGIES

    cfg = config.resolve(args, list(STRATEGIES))
    out = cfg.run.out or default_out(cfg)
    if cfg.availability.kind == "replay":
        replay_engine(cfg, args, out)
    cfg.run.out = out
    with dashboard.serving(args, out):
        rundir = run_sim(cfg, out, resume=args.resume, progress=not args.no_progress, overwrite=args.overwrite)
    last = _last_eval(rundir.file("metrics.jsonl"))
    print(f"run directory: {out}")
    if last:
        print(f"final: round {last['round'] + 1}/{cfg.run.rounds}, accuracy {100 * last['accuracy']:.2f}%, "
              f"uploads {last['uploads']}, client uploads {last['client_uploads']}")
    return 0


def replay_engine(cfg: config.SimConfig, args, out: str) -> None:
    """A replay trains with the engine that reproduces the recorded run bit for bit (participation.py
    `recorded_engine`: a field run's, `loop`), unless `--engine` says otherwise. An engine set in the recorded
    run's own config.json (`--config RUN/config.json`) is a record, not a choice: a field run's says `batched`,
    which its agents never ran. An explicit choice that cannot be exact is said in one line. `--resume` goes on
    with the engine the replay itself started with (its own config.json)."""
    from coordinator.availability.participation import recorded_engine

    given = getattr(args, "train.engine", None) is not None
    own_config = Path(cfg.availability.trace).parent / "config.json"
    path = getattr(args, "config", None)
    if not given and path and Path(path).resolve() != own_config.resolve():
        given = "engine" in config.load_file(path).get("train", {})
    if getattr(args, "resume", False) and not given:
        try:
            engine = json.loads((Path(out) / "config.json").read_text())["train"]["engine"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # the resume's own checks say what is wrong
        if engine in ("batched", "loop", "ray"):
            cfg.train.engine = engine
        return
    want, why = recorded_engine(cfg.availability.trace)
    if want is None or cfg.train.engine == want:
        return
    if given or cfg.train.device == "cuda":
        log.warning("replay: --engine %s%s matches the recorded run to float rounding, not bit for bit (%s; "
                    "--engine %s replays it exactly)", cfg.train.engine,
                    "" if given else " (for --sim-device cuda)", why, want)
        return
    log.info("replay: --engine %s, which reproduces the recorded run bit for bit (%s; --engine to choose "
             "another)", want, why)
    cfg.train.engine = want


def _last_eval(path):
    last = None
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("accuracy") is not None:
                last = r
    return last
