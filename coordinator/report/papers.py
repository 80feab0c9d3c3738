"""The machinery shared by the paper presets of `dropfl reproduce` (fdms.py, fedlaavg.py, feddd.py).

A preset is a list of Arms (one curve: a method in one setting) and the orderings the paper claims. This module
runs every (arm, trial) into its own run directory with `coordinator.sim.sweep.run_sweep` (finished runs
skipped, interrupted ones resumed, a directory holding another setup refused before anything is written),
reduces each arm to mean ± sample std over trials, and writes <stem>.json, <stem>.md (ours beside the paper's
numbers where the digest gives any, then one verdict per claimed ordering) and <stem>.png (mean curves,
± std band; with paper numbers, <stem>_vs_paper.png: ours beside the paper's, as bars).

Verdict lines, printed and in the .md, have one form: `- verdict: <claim>: holds|DOES NOT HOLD|not measured
(<numbers>)`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coordinator import config
from coordinator.report.reproduce import cell_stats, cell_text, finished_runs, plan_run

HOLDS, FAILS, UNMEASURED = "holds", "DOES NOT HOLD", "not measured"


@dataclass
class Arm:
    """One curve of a figure: `method` in `setting`, run for every trial with `build(trial, out)`."""

    method: str
    setting: str
    slug: str                                            # run directory name: <slug>-s<trial>
    build: Callable[[int, Path], config.SimConfig]


@dataclass
class Claim:
    """An ordering the paper claims; `check(ours)` gives (True/False/None = not measurable, numbers shown)."""

    text: str
    check: Callable[[dict], tuple[bool | None, str]]


@dataclass
class Preset:
    name: str                       # the `dropfl reproduce` NAME
    stem: str                       # results file names
    title: str
    setup: dict                     # what the .json and .md say about the setting (and which variant each uses)
    arms: list[Arm]
    claims: list[Claim]
    metric: str = "final accuracy (%)"                   # what a cell's number is
    value: Callable[[Path], float | None] | None = None  # a run's number (default: its final accuracy, %)
    paper: dict = field(default_factory=dict)            # paper[setting][method] = number in `metric`'s unit
    paper_note: str = ""
    x_key: str = "round"                                 # the figure's x axis: a metrics.jsonl column
    prepare: Callable[[Path, int], None] | None = None   # (runs root, trials): files the runs read (FedDD's profiles)


def curve(path: Path, x_key: str = "round") -> tuple[list[float], list[float]]:
    from coordinator.rundir import read_metrics

    ev = [r for r in read_metrics(path / "metrics.jsonl") if r.get("accuracy") is not None]
    return [r[x_key] for r in ev], [100 * r["accuracy"] for r in ev]


def final_accuracy(path: Path) -> float | None:
    return curve(path)[1][-1]


def plan(preset: Preset, trials: int, root: Path, log, report_only: bool) -> tuple[dict, list]:
    """cells[(method, setting)] = [(trial, run dir)] and the sweep Jobs still to run; checks every directory
    before anything is written."""
    from coordinator.runsetup import build_availability
    from coordinator.strategies import STRATEGIES

    cells: dict[tuple[str, str], list[tuple[int, Path]]] = {}
    jobs = []
    planned: dict[Path, bool] = {}   # an arm shared by several settings (same slug) is one run: in the table?
    total, k = len(preset.arms) * trials, 0
    for arm in preset.arms:
        cell = cells.setdefault((arm.method, arm.setting), [])
        for trial in range(trials):
            k += 1
            path = root / f"{arm.slug}-s{trial}"
            if path in planned:
                if planned[path]:
                    cell.append((trial, path))
                continue
            planned[path] = False
            cfg = arm.build(trial, path)
            config.validate(cfg, list(STRATEGIES))
            build_availability(cfg)   # an impossible setting (e.g. α too large for the clusters) fails here
            if not plan_run(path, cfg, f"{arm.method} {arm.setting} trial {trial}", f"[{k}/{total}]", jobs, log,
                            report_only):
                continue
            planned[path] = True
            cell.append((trial, path))
    return cells, jobs


def run_preset(preset: Preset, trials: int, root: Path, results_dir: Path, *, executor: str = "serial",
               progress: bool = False, log=print, report_only: bool = False) -> dict:
    """Run (or skip, or resume) every arm × trial, then write the results files; returns the results dict."""
    from coordinator.sim.sweep import run_sweep

    cells, jobs = plan(preset, trials, root, log, report_only)
    if jobs and preset.prepare is not None:
        preset.prepare(root, trials)
    wall = None
    if jobs:
        tick = time.perf_counter()
        run_sweep(jobs, executor=executor, progress=progress, log=log, diverged_ok=True)
        wall = time.perf_counter() - tick
    value = preset.value or final_accuracy
    ours: dict[str, dict[str, dict]] = {}
    for (method, setting), paths in cells.items():
        if not paths:
            continue
        ours.setdefault(setting, {})[method] = cell_stats(paths, value, 3)   # diverged runs: left out
    results = {"experiment": preset.name, "title": preset.title, "metric": preset.metric, "paper": preset.paper,
               "paper_note": preset.paper_note, "ours": ours,
               "runs_run": len(jobs), "wall_s": None if wall is None else round(wall, 1),
               "setup": {**preset.setup, "trials": trials, "seeds": list(range(trials)), "runs_dir": str(root)}}
    results["verdicts"] = [verdict(c, ours) for c in preset.claims]
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{preset.stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (results_dir / f"{preset.stem}.md").write_text(markdown(preset, results))
    figure(preset, results, results_dir / f"{preset.stem}.png")
    if preset.paper:
        versus_paper(results, results_dir / f"{preset.stem}_vs_paper.png")
    return results


def verdict(claim: Claim, ours: dict) -> dict:
    try:
        ok, numbers = claim.check(ours)
    except (KeyError, TypeError):   # a cell is missing (fewer settings or methods run, or nothing finished)
        ok, numbers = None, "a cell it needs was not run or did not reach its mark"
    return {"claim": claim.text, "verdict": UNMEASURED if ok is None else HOLDS if ok else FAILS,
            "numbers": numbers}


def verdict_lines(results: dict) -> list[str]:
    return [f"- verdict: {v['claim']}: {v['verdict']} ({v['numbers']})" for v in results["verdicts"]]


def markdown(preset: Preset, results: dict) -> str:
    ours, paper, s = results["ours"], results["paper"], results["setup"]
    methods = list(dict.fromkeys(a.method for a in preset.arms))
    settings = list(dict.fromkeys(a.setting for a in preset.arms))
    lines = [f"# {preset.title}", "", f"Command: `{s.get('command', 'dropfl reproduce ' + preset.name)}`", "",
             "Setup: " + "; ".join(f"{k}: {v}" for k, v in s.items() if k not in ("command", "runs_dir")), "",
             f"Each cell: {preset.metric}, mean ± sample std (ddof 1) over trials (n)"
             + ("; beside it the paper's number." if paper else "; the paper gives no numbers for this figure, "
                                                                 "only orderings (the verdicts below)."), ""]
    if paper and preset.paper_note:
        lines += [f"Paper's numbers: {preset.paper_note}", ""]
    cols = [f"{m}: ours | paper" if paper else m for m in methods]
    lines += ["| setting | " + " | ".join(cols) + " |", "|---|" + ("---:|---:|" if paper else "---:|") * len(methods)]
    for st in settings:
        row = []
        for m in methods:
            row.append(cell_text(ours.get(st, {}).get(m), show_n=True))
            if paper:
                p = paper.get(st, {}).get(m)
                row.append("–" if p is None else f"{p:.3g}")
        lines.append(f"| {st} | " + " | ".join(row) + " |")
    lines += ["", "## Verdicts (the orderings the paper claims)", "", *verdict_lines(results), ""]
    secs = [r["seconds"] for st in ours.values() for c in st.values() for r in c["per_run"]]
    lines += ["## Wall time", "", f"{len(secs)} runs, {sum(secs):.1f} s of round time in total (Σ of the rounds' "
              "`seconds`; a resumed run counts only the rounds it ran)"
              + (f"; this command ran {results['runs_run']} of them in {results['wall_s']:.0f} s of wall time."
                 if results.get("wall_s") is not None else "."), "",
              f"![curves]({preset.stem}.png)", ""]
    if paper:
        lines += [f"![ours beside the paper's]({preset.stem}_vs_paper.png)", ""]
    return "\n".join(lines)


def figure(preset: Preset, results: dict, out: Path) -> Path:
    """One panel per setting: each method's mean test-accuracy curve over trials, with a ± std band."""
    from matplotlib.ticker import MaxNLocator

    from coordinator.report.compare import _pyplot

    plt = _pyplot()
    shift = 1 if preset.x_key == "round" else 0   # rounds from 1, as the logs print them
    settings = [st for st in dict.fromkeys(a.setting for a in preset.arms) if st in results["ours"]] or ["(none)"]
    fig, axes = plt.subplots(1, len(settings), figsize=(max(5 * len(settings), 8), 4.2), squeeze=False)
    for ax, st in zip(axes[0], settings):
        for m, c in results["ours"].get(st, {}).items():
            per = [curve(Path(p), preset.x_key) for p in finished_runs(c)]   # diverged runs left out
            n = min((len(y) for _, y in per), default=0)
            if n == 0:
                continue
            ys = np.array([y[:n] for _, y in per])
            mean, sd = ys.mean(0), ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(n)
            xs = [x + shift for x in per[0][0][:n]]
            ax.plot(xs, mean, label=m, linewidth=1.3)
            ax.fill_between(xs, mean - sd, mean + sd, alpha=0.2)
        ax.set_title(st)
        ax.set_xlabel(preset.x_key.replace("_", " "))
        if preset.x_key in ("round", "uploads", "client_uploads"):   # whole numbers (not virtual seconds)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:   # --report-only before any run has evaluated: say so instead of an empty legend
            ax.text(0.5, 0.5, "no evaluated runs yet", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(preset.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def versus_paper(results: dict, out: Path) -> Path:
    """Bars: ours (mean, std as error bar) beside the paper's number, per setting and method."""
    from coordinator.report.compare import _pyplot

    plt = _pyplot()
    keys = [(st, m) for st, ms in results["paper"].items() for m in ms]
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(keys) + 2), 4))
    x = np.arange(len(keys))
    cells = [results["ours"].get(st, {}).get(m) or {} for st, m in keys]
    ours = [c.get("mean") if c.get("mean") is not None else np.nan for c in cells]
    err = [c.get("std") or 0.0 for c in cells]
    ax.bar(x - 0.2, ours, 0.4, yerr=err, label="ours (mean ± std)", capsize=3)
    ax.bar(x + 0.2, [results["paper"][st][m] for st, m in keys], 0.4, label="paper")
    ax.set_xticks(x, [f"{m}\n{st}" for st, m in keys], fontsize=8)
    ax.set_ylabel(results["metric"])
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def greater(ours: dict, setting: str, a: str, b: str) -> tuple[bool | None, str]:
    """Claim helper: mean of `a` > mean of `b` in `setting`."""
    x, y = ours[setting][a]["mean"], ours[setting][b]["mean"]
    if x is None or y is None:
        return None, f"{a} {x}, {b} {y}"
    return x > y, f"{a} {x:.2f} vs {b} {y:.2f}"


def table3_verdicts(ours: dict, taus: list[int]) -> list[dict]:
    """MimiC Table 3's orderings (ours[method][τ]): MimiC > MIFA > FedAvg, and MimiC the best of the five."""
    out = []
    for t in taus:
        got = {m: c[str(t)]["mean"] for m, c in ours.items() if str(t) in c and c[str(t)]["mean"] is not None}

        def chain(_ours, got=got):
            ok = got["MimiC"] > got["MIFA"] > got["FedAvg"]
            return ok, f"{got['MimiC']:.2f}, {got['MIFA']:.2f}, {got['FedAvg']:.2f}"

        def best(_ours, got=got):
            if not got:
                return None, "no finished run at this τmax"
            top = max(got, key=got.get)
            return (top == "MimiC" if len(got) == 5 else None), f"best: {top} {got[top]:.2f} of {len(got)} methods"

        out += [verdict(Claim(f"τmax = {t}: MimiC > MIFA > FedAvg", chain), ours),
                verdict(Claim(f"τmax = {t}: MimiC is the best of the five methods", best), ours)]
    return out


def finish_table3(results: dict, results_dir: Path, stem: str, taus: list[int]) -> dict:
    """Add the verdicts (JSON and .md) and <stem>_vs_paper.png to what reproduce_table3 wrote."""
    results["verdicts"] = table3_verdicts(results["ours"], taus)
    (results_dir / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    paper = {f"τmax = {t}": {m: v[str(t)] for m, v in results["paper"].items() if str(t) in v} for t in taus}
    paper = {k: v for k, v in paper.items() if v}   # the paper has τmax 20, 50, 100 only
    ours = {f"τmax = {t}": {m: c[str(t)] for m, c in results["ours"].items() if str(t) in c} for t in taus}
    if paper:
        versus_paper({"paper": paper, "ours": ours, "metric": "test accuracy (%)"},
                     results_dir / f"{stem}_vs_paper.png")
    with open(results_dir / f"{stem}.md", "a") as f:
        f.write("\n## Verdicts (the orderings the paper claims)\n\n" + "\n".join(verdict_lines(results)) + "\n"
                + (f"\n![ours beside the paper's]({stem}_vs_paper.png)\n" if paper else ""))
    return results
