"""`dropfl reproduce`: the command line of the paper reproductions (coordinator/report/reproduce.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coordinator.errors import UserError
from coordinator.report.reproduce import EXPERIMENTS, METHODS, Setup, markdown, reproduce_table3, results_stem


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return out


def _methods(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [m for m in out if m not in METHODS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown method(s) {bad} (choose from {', '.join(METHODS)})")
    return out


def add_parser(sub) -> None:
    p = sub.add_parser(
        "reproduce", help="reproduce a published table (mimic-table3)",
        description="Reproduce MimiC's Table 3: FedAvg, FedProx, SCAFFOLD (half the rounds: same uploads), MIFA "
                    "and MimiC on FMNIST under bounded consecutive dropouts, for each τmax, in the paper's setup "
                    "(30 clients, 2 shards each, MimiC CNN, batch 16, 5 epochs, lr 0.01·0.95^t). Finished runs are "
                    "skipped and interrupted ones resumed. Hours of CPU at full size.")
    p.add_argument("experiment", choices=EXPERIMENTS)
    p.add_argument("--trials", type=int, default=3, help="trials (seeds 0..trials-1; default 3)")
    p.add_argument("--taus", type=_int_list, default=[20, 50, 100], help="τmax values (default 20,50,100)")
    p.add_argument("--rounds", type=int, default=200, help="rounds = uploads (SCAFFOLD: half; default 200)")
    p.add_argument("--methods", type=_methods, default=list(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    p.add_argument("--out", default="runs/mimic-table3", help="directory of the run directories")
    p.add_argument("--results", default="benchmarks/results", help="where mimic_table3.{json,md} and the figure go")
    p.add_argument("--engine", default="batched",
                   help="simulation engine (TrainConfig.engine; default batched, the fast exact engine; "
                        "loop is the per-client reference)")
    p.add_argument("--eval-every", type=int, default=1, help="evaluate every n rounds (and at the last; default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tau-dist", default="uniform", choices=["uniform", "halfnormal"],
                   help="τ_i distribution: uniform (paper, default) or halfnormal (released code: "
                        "min(round(|N(0,9)|), τmax)); halfnormal runs and results get their own names")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the table, JSON and figure from the runs finished so far")
    # test-only overrides of the paper setup (hidden from --help)
    p.add_argument("--clients", type=int, default=30, help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, default=5, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default="mimic-cnn", help=argparse.SUPPRESS)
    p.add_argument("--dataset", default="fmnist", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.trials < 1 or args.rounds < 1 or args.eval_every < 1:
        raise UserError("--trials, --rounds and --eval-every must be >= 1")
    setup = Setup(rounds=args.rounds, engine=args.engine, tau_dist=args.tau_dist, eval_every=args.eval_every,
                  threads=args.threads,
                  clients=args.clients, epochs=args.epochs, steps=args.steps, model=args.model, dataset=args.dataset)
    results = reproduce_table3(setup, args.methods, args.taus, args.trials, Path(args.out), Path(args.results),
                               progress=not args.no_progress and sys.stderr.isatty(), log=print,
                               report_only=args.report_only)
    print(markdown(results, args.methods, args.taus), end="")
    print(f"wrote {Path(args.results) / results_stem(args.tau_dist)}.json, .md and _fig4.png")
    return 0
