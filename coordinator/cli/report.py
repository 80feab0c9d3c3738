"""`dropfl report RUN_DIR...`: accuracy-vs-uploads plot, participation rasters and a comparison table."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="compare run directories: plots and a Markdown table",
        description="Read run directories (config.json, metrics.jsonl, participation.csv) and write "
                    "accuracy_vs_uploads.png (one line per run), participation-<run>.png (clients × rounds, "
                    "coloured by status and reason), friends-<run>.png for FL-FDMS runs (similarity and friend "
                    "matrices, share of friends in the client's own cluster per round) and comparison.md "
                    "(final/best accuracy, uploads, participants per round); for field runs with telemetry.jsonl also "
                    "energy_per_round.png, accuracy_vs_energy.png and energy.md (energy per round, time and "
                    "energy to a target accuracy). The tables are also printed.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories written by dropfl sim")
    p.add_argument("--out", default="report", help="output directory (default: ./report)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (shown on a terminal only)")
    p.add_argument("--target-accuracy", type=float, default=None, metavar="PCT",
                   help="field runs with telemetry.jsonl: the accuracy (%%) for time- and energy-to-accuracy in "
                        "energy.md (default: the lowest of the runs' best accuracies)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from coordinator.report.compare import comparison_table, load_runs, write_report

    target = getattr(args, "target_accuracy", None)
    if target is not None and not 0 < target <= 100:  # before anything is written
        from coordinator.errors import UserError
        raise UserError(f"--target-accuracy {target}: an accuracy in % must be in (0, 100]; give e.g. 80")
    from coordinator.report.energy import energy_report, load_telemetry  # field runs: energy, time-to-accuracy

    runs = load_runs(args.runs)
    telemetry = {r.name: load_telemetry(r) for r in runs}  # a damaged telemetry.jsonl: refused before writing
    files = write_report(runs, args.out, progress=not getattr(args, "no_progress", False))
    print(comparison_table(runs), end="")
    energy_files, energy_table = energy_report(runs, args.out, target, telemetry)
    files |= energy_files
    print(energy_table, end="")
    print(f"wrote {len(files)} files to {args.out}: " + ", ".join(sorted(p.name for p in files.values())))
    return 0
