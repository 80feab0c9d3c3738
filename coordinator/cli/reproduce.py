"""`dropfl reproduce NAME`: one command per seed paper (coordinator/report/: reproduce.py is MimiC's Table 3,
papers.py the machinery of the others, one module per paper). docs/reproductions.md lists them with results."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from pathlib import Path

from coordinator.errors import UserError
from coordinator.report.reproduce import METHODS, Setup, markdown, reproduce_table3, results_stem

# name → (what it reproduces, the paper's number of trials: the default of --trials)
EXPERIMENTS = {
    "mimic-table3": ("MimiC Table 3: FMNIST, bounded consecutive dropouts, five methods, τmax 20/50/100", 3),
    "fdms-fig1": ("FL-FDMS Fig. 1: clustered MNIST, Full/Dropout/Stale/FL-FDMS, α 0.3/0.5/0.7", 10),
    "fedlaavg-fig8": ("FedLaAvg Figs. 4/8: MNIST logistic regression, diurnal availability, five (E, D) settings, "
                      "FedLaAvg C=10/C=1, FedAvg, FedSGD, FedProx", 1),
    "feddd-virtual-clock": ("FedDD time to 88 % on the virtual clock: FedAvg, FedCS, FedDD (MNIST IID)", 3),
}
# options that belong to one experiment (default None: given for another one, they are an error)
ONLY = {"taus": "mimic-table3", "methods": "mimic-table3", "tau_dist": "mimic-table3", "epochs": "mimic-table3",
        "steps": "mimic-table3", "model": "mimic-table3", "dataset": "mimic-table3", "alphas": "fdms-fig1",
        "settings": "fedlaavg-fig8", "target": "feddd-virtual-clock"}


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return out


def _float_list(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not out or not all(0 <= x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected dropout ratios in [0, 1), got {text!r}")
    return out


def _settings(text: str) -> list[tuple[int, int]]:
    try:
        out = [(int(e), int(d)) for e, d in (x.split(":") for x in text.split(",") if x.strip())]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected E:D pairs such as 100:1,50:1, got {text!r}") from None
    if not out or not all(e >= 1 and 0 <= d <= 10 for e, d in out):
        raise argparse.ArgumentTypeError(f"expected E ≥ 1 and D in 0..10, got {text!r}")
    return out


def _methods(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [m for m in out if m not in METHODS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown method(s) {bad} (choose from {', '.join(METHODS)})")
    return out


def default_executor() -> str:
    """--executor's default: run_sweep's own (coordinator/sim/sweep.py decides which executor is the default)."""
    from coordinator.sim import sweep

    return inspect.signature(sweep.run_sweep).parameters["executor"].default


def add_parser(sub) -> None:
    from coordinator.sim import sweep  # read now: other executors register themselves in sweep.EXECUTORS

    p = sub.add_parser(
        "reproduce", help="reproduce a seed paper's table or figure (" + ", ".join(EXPERIMENTS) + ")",
        description="Reproduce a seed paper's table or figure in the paper's setting (docs/reproductions.md): "
                    + "; ".join(f"{k}: {v[0]}" for k, v in EXPERIMENTS.items()) + ". One run directory per run "
                    "under --out (finished runs skipped, interrupted ones resumed); writes <results>/<name>.json, "
                    ".md (mean ± std over trials, the paper's numbers beside ours where it gives any, one verdict "
                    "per ordering the paper claims) and figures, and prints the table and verdicts. Hours of CPU "
                    "at full size; --quick is a tiny form (seconds) with its own file names.")
    p.add_argument("experiment", choices=list(EXPERIMENTS))
    p.add_argument("--quick", action="store_true",
                   help="tiny form: few clients, rounds and local steps, a small model, 1 trial; results named "
                        "<name>_quick.*, runs under runs/<name>-quick (checks the pipeline, not the paper)")
    p.add_argument("--trials", type=int, default=None, help="trials, seeds 0..trials-1 (default: the paper's: "
                   + ", ".join(f"{k} {v[1]}" for k, v in EXPERIMENTS.items()) + "; 1 with --quick)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds (default: the paper's: mimic-table3 200 = uploads, SCAFFOLD half; fdms-fig1 100; "
                        "fedlaavg-fig8 2000; feddd-virtual-clock 40)")
    p.add_argument("--out", default=None, help="directory of the run directories (default runs/<name>[-quick])")
    p.add_argument("--results", default="benchmarks/results", help="where the results files go")
    p.add_argument("--engine", default="batched",
                   help="simulation engine (TrainConfig.engine; default batched, the fast exact engine; "
                        "loop is the per-client reference)")
    p.add_argument("--sim-device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the batched engine trains every run (TrainConfig.device; default auto: the CPU for "
                        "the LeNets, a GPU for the other models where there is one; cpu: on the CPU, as the "
                        "committed results were trained; docs/engine.md)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="evaluate every n rounds and at the last (default 1; fedlaavg-fig8 20, as its code)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--executor", choices=sweep.EXECUTORS, default=default_executor(),
                   help="how the runs still to do are run (coordinator.sim.sweep; every executor gives each run "
                        "the files the serial one gives it; default %(default)s)")
    p.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="run the runs still to do as Ray tasks on a cluster (--executor ray; pip install "
                        "'dropfl[ray]'), each run directory gathered back to --out: ADDRESS is the head's host:port "
                        "(sets RAY_ADDRESS for this command), none = $RAY_ADDRESS or the cluster started on this "
                        "machine, local = a private Ray here (docs/scale-out.md)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the table, JSON and figures from the runs finished so far")
    g = p.add_argument_group("mimic-table3 only")
    g.add_argument("--taus", type=_int_list, default=None, help="τmax values (default 20,50,100)")
    g.add_argument("--methods", type=_methods, default=None,
                   help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    g.add_argument("--tau-dist", default=None, choices=["uniform", "halfnormal"],
                   help="τ_i distribution: uniform (paper, default) or halfnormal (released code: "
                        "min(round(|N(0,9)|), τmax)); halfnormal runs and results get their own names")
    g = p.add_argument_group("fdms-fig1 only")
    g.add_argument("--alphas", type=_float_list, default=None, help="dropout ratios α (default 0.3,0.5,0.7)")
    g = p.add_argument_group("fedlaavg-fig8 only")
    g.add_argument("--settings", type=_settings, default=None,
                   help="availability settings E:D (half-period E, day group digits 0..D-1; default "
                        "50:1,100:1,100:3,100:5,200:1)")
    g = p.add_argument_group("feddd-virtual-clock only")
    g.add_argument("--target", type=float, default=None, help="target test accuracy in (0, 1] (default 0.88)")
    # test-only overrides of the paper setup (hidden from --help)
    p.add_argument("--clients", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dataset", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    for key, owner in ONLY.items():
        if getattr(args, key) is not None and args.experiment != owner:
            raise UserError(f"--{key.replace('_', '-')} belongs to {owner}, not {args.experiment}; leave it out")
    if args.clients is not None and args.experiment == "fdms-fig1":
        raise UserError("--clients: fdms-fig1 has 20 clients in 5 clusters (10 with --quick); leave it out")
    for name in ("trials", "rounds", "eval_every", "clients", "epochs", "steps"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1 (got {v})")
    if args.target is not None and not 0 < args.target <= 1:
        raise UserError(f"--target must be in (0, 1] (got {args.target})")
    if args.sim_device == "cuda":
        if args.engine != "batched":
            from coordinator.config import cuda_needs_batched
            raise UserError(cuda_needs_batched(args.engine))
        from coordinator.sim.run import check_device
        check_device("cuda")
    for flag, path in (("--results", args.results), ("--out", args.out)):
        if path is not None and Path(path).exists() and not Path(path).is_dir():
            raise UserError(f"{flag} {path} is a file, not a directory; choose a directory")


def _command(args: argparse.Namespace) -> str:
    """The command line that gives these results (the options that change them), for the results files."""
    words = ["dropfl", "reproduce", args.experiment] + (["--quick"] if args.quick else [])
    for key in ("trials", "rounds", "eval_every", "alphas", "settings", "target", "clients", "engine", "sim_device"):
        v = getattr(args, key)
        if v is None or (key == "engine" and v == "batched") or (key == "sim_device" and v == "auto"):
            continue
        if key == "alphas":
            v = ",".join(map(str, v))
        elif key == "settings":
            v = ",".join(f"{e}:{d}" for e, d in v)
        words += [f"--{key.replace('_', '-')}", str(v)]
    return " ".join(words)


def run(args: argparse.Namespace) -> int:
    _check(args)
    if args.ray is not None:   # --ray [ADDRESS]: the "ray" executor (coordinator/scale/ray_sweep.py)
        if args.executor not in ("ray", default_executor()):   # the flag's default
            raise UserError(f"--ray runs the sweep on Ray, --executor {args.executor} in this process; give one")
        args.executor = "ray"
        if args.ray != "auto":
            os.environ["RAY_ADDRESS"] = args.ray   # Ray's own variable, read where the sweep connects
    quick = args.quick
    trials = args.trials or (1 if quick else EXPERIMENTS[args.experiment][1])
    root = Path(args.out or f"runs/{args.experiment}" + ("-quick" if quick else ""))
    results_dir = Path(args.results)
    progress = not args.no_progress and sys.stderr.isatty()
    if args.experiment == "mimic-table3":
        return _mimic(args, trials, root, results_dir, progress)
    from coordinator.report import fdms_fig1, feddd_clock, fedlaavg_fig, papers

    if args.experiment == "fdms-fig1":
        preset = fdms_fig1.preset(args)
    elif args.experiment == "fedlaavg-fig8":
        preset = fedlaavg_fig.preset(args)
    else:
        preset = feddd_clock.preset(args, root)
        preset.prepare = lambda r, n: feddd_clock.prepare(args, r, n)
    preset.setup["command"] = _command(args)
    results = papers.run_preset(preset, trials, root, results_dir, executor=args.executor, progress=progress,
                                log=print, report_only=args.report_only)
    print(papers.markdown(preset, results), end="")
    print(f"wrote {results_dir / preset.stem}.json, .md and figures")
    return 0


def _mimic(args, trials: int, root: Path, results_dir: Path, progress: bool) -> int:
    from coordinator.report.papers import finish_table3, verdict_lines

    taus = args.taus or ([3] if args.quick else [20, 50, 100])
    methods = args.methods or list(METHODS)
    q = args.quick
    setup = Setup(rounds=args.rounds or (2 if q else 200), engine=args.engine, device=args.sim_device,
                  tau_dist=args.tau_dist or "uniform",
                  eval_every=args.eval_every or 1, threads=args.threads,
                  clients=args.clients or (6 if q else 30), epochs=args.epochs or 5,
                  steps=args.steps or (2 if q else None), model=args.model or ("logreg" if q else "mimic-cnn"),
                  dataset=args.dataset or "fmnist")
    stem = results_stem(setup.tau_dist) + ("_quick" if q else "")
    results = reproduce_table3(setup, methods, taus, trials, root, results_dir, progress=progress, log=print,
                               report_only=args.report_only, executor=args.executor, stem=stem)
    finish_table3(results, results_dir, stem, taus)
    print(markdown(results, methods, taus), end="")
    print("\n".join(verdict_lines(results)))
    print(f"wrote {results_dir / stem}.json, .md and _fig4.png")
    return 0
