"""`dropfl report RUN_DIR...`: accuracy-vs-uploads plot, participation rasters and a comparison table."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="compare run directories: plots and a Markdown table",
        description="Read run directories (config.json, metrics.jsonl, participation.csv) and write "
                    "accuracy_vs_uploads.png (one line per run), participation-<run>.png (clients × rounds, "
                    "coloured by status and reason) and comparison.md (final/best accuracy, uploads, "
                    "participants per round). The table is also printed.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories written by dropfl sim")
    p.add_argument("--out", default="report", help="output directory (default: ./report)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from coordinator.report.compare import comparison_table, load_runs, write_report

    runs = load_runs(args.runs)
    files = write_report(runs, args.out)
    print(comparison_table(runs), end="")
    print(f"wrote {len(files)} files to {args.out}: " + ", ".join(sorted(p.name for p in files.values())))
    return 0
