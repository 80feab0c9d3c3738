"""`dropfl reproduce mimic-table3`: MimiC's Table 3 (FMNIST, bounded consecutive dropouts, τmax ∈ {20, 50, 100}).

One run directory per (method, τmax, trial) under --out, run by coordinator.sim.sweep.run_sweep in the paper's
setup (mimic.md §4.4 and §7). Finished runs are skipped and interrupted ones resumed from their checkpoint,
so the command can be stopped and restarted. (Over ~300 lines: one experiment end to end, grid, table,
evidence and figure, which a reviewer holding the paper reads top to bottom.)
Results: <results>/mimic_table3.json (schema of issue 3,
accuracies in percent), mimic_table3.md (ours beside the paper's numbers) and mimic_table3_fig4.png
(accuracy against uploads at τmax = 20, one line per method, mean over trials).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator import config
from coordinator.errors import UserError
from coordinator.rundir import DIVERGED, read_metrics

_log = logging.getLogger("dropfl.reproduce")

# MimiC Table 3: test accuracy (%) after 200 model uploadings, FMNIST, N = 30, 2 classes per client
PAPER_TABLE3 = {
    "FedAvg": {"20": 69.39, "50": 68.42, "100": 68.21},
    "FedProx": {"20": 72.67, "50": 67.44, "100": 64.74},
    "SCAFFOLD": {"20": 73.46, "50": 72.30, "100": 68.7},
    "MIFA": {"20": 72.92, "50": 72.82, "100": 72.20},
    "MimiC": {"20": 75.89, "50": 74.86, "100": 74.71},
}
METHODS = {"FedAvg": "fedavg", "FedProx": "fedprox", "SCAFFOLD": "scaffold", "MIFA": "mifa", "MimiC": "mimic"}
EXPERIMENTS = ("mimic-table3",)
NOT_SETUP = {("run", "threads"), ("run", "out"), ("run", "eval_every"), ("run", "checkpoint_every"),
             ("train", "engine")}


@dataclass
class Setup:
    """Paper setup (Table 2 and the released code); the last five fields exist for tests only."""

    rounds: int = 200
    engine: str = "batched"
    device: str = "auto"        # --sim-device (TrainConfig.device)
    tau_dist: str = "uniform"   # paper; "halfnormal" = the released code's τ_i (mimic.md §1.3)
    eval_every: int = 1
    threads: int | None = None
    clients: int = 30
    epochs: int = 5
    steps: int | None = None
    model: str = "mimic-cnn"
    dataset: str = "fmnist"

    def rounds_for(self, method: str) -> int:
        """Equal uploads: SCAFFOLD uploads two vectors per round, so it runs half the rounds (mimic.md §4.5)."""
        return max(1, self.rounds // 2) if method == "SCAFFOLD" else self.rounds


def sim_config(setup: Setup, method: str, tau: int, trial: int, out: Path) -> config.SimConfig:
    cfg = config.SimConfig()
    cfg.data.dataset, cfg.data.partition, cfg.data.clients, cfg.data.shards_per_client = (
        setup.dataset, "shards", setup.clients, 2)                       # 60 single-class shards, 2 per client
    cfg.model.model = setup.model                                        # MimiC FMNIST CNN (44,426 parameters)
    cfg.train.lr, cfg.train.lr_decay, cfg.train.lr_min = 0.01, 0.95, 1e-5  # lr_t = max(0.01·0.95^t, 1e-5)
    cfg.train.batch_size, cfg.train.epochs, cfg.train.steps = 16, setup.epochs, setup.steps  # B = 16, 5 epochs
    cfg.train.engine, cfg.train.device = setup.engine, setup.device
    a = cfg.availability
    a.kind, a.tau_max, a.tau_dist, a.min_active, a.first_round_all = "bounded", tau, setup.tau_dist, 2, True
    cfg.strategy.algo = METHODS[method]                                  # paper defaults of every strategy
    cfg.run.rounds, cfg.run.seed, cfg.run.eval_every = setup.rounds_for(method), trial, setup.eval_every
    cfg.run.threads, cfg.run.out = setup.threads, str(out)
    return cfg


NOTES = "mimic_table3_notes.md"  # hand-written analysis beside the generated files, linked from the .md


def run_dir(root: Path, method: str, tau: int, trial: int, tau_dist: str = "uniform") -> Path:
    dist = "" if tau_dist == "uniform" else f"-{tau_dist}"
    return root / f"{METHODS[method]}-tau{tau}{dist}-s{trial}"


def results_stem(tau_dist: str) -> str:
    return "mimic_table3" if tau_dist == "uniform" else f"mimic_table3_{tau_dist}"


def diverged_at(path: Path) -> int | None:
    """The round at which the run's global model went non-finite (its `diverged.json`), or None."""
    p = path / DIVERGED
    if not p.exists():
        return None
    try:
        return int(json.loads(p.read_text())["round"])
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{p}: damaged (not {{\"round\": R, ...}}); remove it to run the run again") from None


def finished(path: Path, rounds: int) -> bool:
    """A run is finished when its metrics reach the last round and the final model was written."""
    metrics = path / "metrics.jsonl"
    if not (metrics.exists() and (path / "model.pt").exists()):
        return False
    rows = read_metrics(metrics)
    return bool(rows) and rows[-1]["round"] == rounds - 1 and rows[-1].get("accuracy") is not None


def same_setup(path: Path, cfg: config.SimConfig) -> bool:
    """True if the run directory holds no config yet or the same one (so stale runs are never reused).
    Options added to the config schema after the run was written, and options that do not change the
    numbers (threads, engine, evaluation and checkpoint frequency, path), are not held against it."""
    p = path / "config.json"
    if not p.exists():
        return True
    old, new = json.loads(p.read_text()), json.loads(json.dumps(cfg.to_dict()))
    return all(old.get(sec, {}).get(k, v) == v for sec, fields in new.items() for k, v in fields.items()
               if (sec, k) not in NOT_SETUP)


def curve(path: Path) -> tuple[list[int], list[float]]:
    rows = read_metrics(path / "metrics.jsonl")
    ev = [r for r in rows if r.get("accuracy") is not None]
    return [r["uploads"] for r in ev], [100 * r["accuracy"] for r in ev]


def run_stats(path: Path, last: int = 5) -> dict:
    """What the results file reports per run besides its final accuracy: the mean, std and range of
    its last `last` evaluations (how noisy one final value is), its round time (Σ of the rounds' `seconds`, so a
    resumed run counts only the rounds it actually ran) and its sessions' spans of wall-clock time."""
    rows = read_metrics(path / "metrics.jsonl")
    # NaN where no round was evaluated (a run that diverged before its first evaluation)
    acc = [100 * r["accuracy"] for r in rows if r.get("accuracy") is not None][-last:] or [float("nan")]
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    return {"last_mean": round(float(np.mean(acc)), 2), "last_std": round(float(np.std(acc)), 2),
            "last_min": round(min(acc), 2), "last_max": round(max(acc), 2), "last_n": len(acc),
            "seconds": round(sum(r.get("seconds", 0.0) for r in rows), 3),
            "engine": cfg.get("train", {}).get("engine"), "sessions": sessions(path)}


def sessions(path: Path) -> list[tuple[float, float]] | None:
    """The run's spans of wall-clock time (epoch seconds), one per session (a resume starts a new one): from
    the session's start (its `run …` record in log.jsonl) for as long as its last round's `elapsed` says
    (`elapsed` restarts with every session). A later session that wrote no round is left out (the last one with
    rounds is found by the time metrics.jsonl was last written); None where the log or the rounds' `elapsed`
    are missing, or they do not pair up."""
    log, rows = path / "log.jsonl", read_metrics(path / "metrics.jsonl")
    if not log.exists() or not rows:
        return None
    starts = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
            if rec.get("logger") == "dropfl.run" and str(rec.get("message", "")).startswith("run "):
                starts.append(float(rec["time"]))
        except (ValueError, TypeError, KeyError, AttributeError):
            continue   # a damaged line: not a session start
    ends, prev = [], None
    for r in rows:
        e = r.get("elapsed")
        if not isinstance(e, (int, float)) or isinstance(e, bool):
            return None
        if prev is not None and e < prev:
            ends.append(prev)   # elapsed went back: a new session began
        prev = e
    ends.append(prev)
    if len(starts) < len(ends):
        return None
    if len(starts) > len(ends):  # a session that wrote no round (resumed with nothing left): the last session
        # with rounds is the one whose start fits the time its last row was written (the file's mtime)
        last_row_at = (path / "metrics.jsonl").stat().st_mtime
        k = min(range(len(starts)), key=lambda j: abs(starts[j] + ends[-1] - last_row_at))
        if k < len(ends) - 1:
            return None
        starts = starts[:len(ends) - 1] + [starts[k]]
    return [(s, s + e) for s, e in zip(starts, ends)]


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of the spans (runs of a lockstep group overlap in time)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single trial); the paper does not say which."""
    a = np.asarray(xs, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def run_grid(setup: Setup, methods: list[str], taus: list[int], trials: int, root: Path,
             progress: bool = True, log=None, report_only: bool = False,
             executor: str = "serial") -> dict[str, dict[str, dict]]:
    """Run (or skip, or resume) every (method, τ, trial); return ours[method][τ] = {mean, std, trials, ...}.
    The runs still to do are first listed as sweep Jobs (every run directory checked before anything is
    written), then run together by `coordinator.sim.sweep.run_sweep` with `executor`.
    With `report_only`, nothing is run: unfinished trials are left out of the cells (and said so)."""
    from coordinator.sim.sweep import run_sweep

    log = log or _log.info
    cells, jobs = plan_grid(setup, methods, taus, trials, root, log, report_only)
    if jobs:
        run_sweep(jobs, executor=executor, progress=progress, log=log, diverged_ok=True)
    ours: dict[str, dict[str, dict]] = {}
    for (method, tau), paths in cells.items():
        if not paths:
            continue
        ours.setdefault(method, {})[str(tau)] = cell_stats(paths, lambda p: curve(p)[1][-1], 2)
    return ours


def cell_stats(paths: list[tuple[int, Path]], value, digits: int) -> dict:
    """One cell of a results table from its (seed, run dir) pairs: each run's `value` (None where it diverged or
    has none), mean ± std over the others, rounded to `digits`, the runs' stats, and which runs diverged."""
    gone = {str(t): r for t, p in paths if (r := diverged_at(p)) is not None}
    vals = [None if str(t) in gone else value(p) for t, p in paths]
    got = [v for v in vals if v is not None]
    mean, std = mean_std(got) if got else (None, None)
    return {"mean": None if mean is None else round(mean, digits), "std": None if std is None else round(std, digits),
            "trials": [None if v is None else round(v, digits) for v in vals], "seeds": [t for t, _ in paths],
            "runs": [str(p) for _, p in paths], "per_run": [run_stats(p) for _, p in paths],
            **({"diverged": gone} if gone else {})}


def finished_runs(cell: dict) -> list[str]:
    """A cell's run directories less those that diverged: what its mean curve averages (a diverged run's
    curve stops early and would cut every trial's curve there)."""
    gone = cell.get("diverged", {})
    return [p for p, seed in zip(cell["runs"], cell["seeds"]) if str(seed) not in gone]


def plan_run(path: Path, cfg: config.SimConfig, label: str, prefix: str, jobs: list, log, report_only: bool) -> bool:
    """One run of a reproduction: refuse a directory with another setup (before anything is written), skip it
    when finished, leave it out with `report_only`, else append its sweep Job (resumed from its checkpoint if
    any). Returns whether the run counts in the results (False: left out)."""
    from coordinator.sim.sweep import Job

    if not same_setup(path, cfg):
        raise UserError(f"{path} holds a run with another setup; remove it or choose another --out")
    if (r := diverged_at(path)) is not None:
        log(f"{prefix} {label}: diverged at round {r} ({path / DIVERGED}): counted as diverged, not run again")
    elif finished(path, cfg.run.rounds):
        log(f"{prefix} {label}: done already, skipped")
    elif report_only:
        log(f"{prefix} {label}: not finished, left out of the table")
        return False
    else:
        resume = (path / "checkpoint.pt").exists()
        jobs.append(Job(cfg=cfg, out=path, resume=resume, overwrite=not resume, label=label))
    return True


def plan_grid(setup: Setup, methods: list[str], taus: list[int], trials: int, root: Path, log, report_only: bool,
              ) -> tuple[dict[tuple[str, int], list[tuple[int, Path]]], list]:
    """Decide for each (method, τ, trial) whether it reuses another run, is done, is left out or must run;
    return cells[(method, τ)] = [(trial, run dir)] and the jobs still to run. Raises UserError before
    anything is written if a run directory holds another setup."""
    from coordinator.runsetup import build_availability
    from coordinator.strategies import STRATEGIES

    cells: dict[tuple[str, int], list[tuple[int, Path]]] = {}
    jobs = []
    ran: dict[tuple[str, int], list[tuple[np.ndarray, Path]]] = {}   # (method, trial) → [(τ_i, run dir)]
    order: dict[Path, tuple[int, int, int]] = {}   # run dir → (trial, τmax, method): the jobs' order
    total, k = len(methods) * len(taus) * trials, 0
    for tau in sorted(taus):
        for method in methods:
            cell = cells.setdefault((method, tau), [])
            for trial in range(trials):
                k += 1
                path = run_dir(root, method, tau, trial, setup.tau_dist)
                cfg = sim_config(setup, method, tau, trial, path)
                config.validate(cfg, list(STRATEGIES))
                # τmax only caps τ_i: if no τ_i reaches the cap, the run at a smaller τmax is this very run
                # (same availability, same seed, same everything else). Happens with --tau-dist halfnormal,
                # whose τ_i stay below ~10 (mimic.md §1.3), so that τmax 50 and 100 reuse the τmax=20 runs.
                tau_i = build_availability(cfg).tau
                same = next((p for t_i, p in ran.get((method, trial), []) if np.array_equal(t_i, tau_i)), None)
                if same is not None:
                    log(f"[{k}/{total}] {method} τmax={tau} trial {trial}: same τ_i as {same.name} "
                        f"(none reaches {tau}), reusing that run")
                    cell.append((trial, same))
                    continue
                if not plan_run(path, cfg, f"{method} τmax={tau} trial {trial}", f"[{k}/{total}]", jobs, log,
                                report_only):
                    continue
                ran.setdefault((method, trial), []).append((tau_i, path))
                cell.append((trial, path))
                order[path] = (trial, tau, methods.index(method))
    # run trial by trial: the lockstep executor cuts the jobs into groups of ≤ 16 in this order, and one trial's
    # 15 runs share their client data (one copy per group) and their round 0 (every client trains from the
    # trial's initial model: FedAvg's, MIFA's and MimiC's tasks at every τmax are identical and train once,
    # coordinator/sim/lockstep.py `_unique`), which τmax by τmax they did not
    jobs.sort(key=lambda job: order[job.out])
    return cells, jobs


def setup_dict(setup: Setup, taus: list[int], trials: int, root: Path) -> dict:
    return {
        "dataset": setup.dataset, "clients": setup.clients, "partition": "shards, 2 single-class shards per client",
        "model": setup.model, "batch_size": 16, "local_epochs": setup.epochs, "local_steps": setup.steps,
        "lr": "max(0.01 * 0.95^t, 1e-5), local SGD lr; server applies the mean delta with step 1 (released code)",
        "rounds": setup.rounds, "rounds_scaffold": setup.rounds_for("SCAFFOLD"),
        "uploads": setup.rounds, "availability": (
            "bounded: tau_i ~ UniformInt{0..tau_max} (paper)" if setup.tau_dist == "uniform" else
            "bounded: tau_i = min(round(|N(0, 3^2)|), tau_max) (released code, --tau-dist halfnormal)")
        + ", active iff tau_i <= 1 or t mod tau_i == 0, at least 2 active (code), round 0 everyone",
        "tau_dist": setup.tau_dist,
        "taus": taus, "trials": trials, "seeds": list(range(trials)), "engine": setup.engine,
        "strategy_defaults": "MimiC/MIFA units=delta, MIFA weights round(1/N,4), FedProx mu=0.001, "
                             "SCAFFOLD option II, server step 1",
        "metric": "test accuracy (%) of the global model after the last round (200 uploads), mean and sample "
                  "std (ddof=1) over trials",
        "runs_dir": str(root),
    }


def markdown(results: dict, methods: list[str], taus: list[int]) -> str:
    ours, paper = results["ours"], results["paper"]
    head = "| method | " + " | ".join(f"τmax = {t}: ours | paper" for t in taus) + " |"
    dist = results["setup"].get("tau_dist", "uniform")
    lines = [f"# MimiC Table 3 reproduction: FMNIST test accuracy (%) after {results['setup']['rounds']} model "
             "uploads (paper: 200)" + ("" if dist == "uniform" else f", τ_i {dist} (released code)"), "",
             *([f"Availability: {results['setup']['availability']}.", ""]
               if "availability" in results["setup"] else []),
             f"Setup: {results['setup']['clients']} clients, {results['setup']['rounds']} rounds "
             f"(SCAFFOLD {results['setup']['rounds_scaffold']}), {trials_done(results)} trial(s) per cell, "
             f"engine {results['setup']['engine']}; ours = mean ± std over trials.", "",
             head, "|---|" + "---:|---:|" * len(taus)]
    for m in methods:
        cells = []
        for t in taus:
            o = ours.get(m, {}).get(str(t))
            cells.append(cell_text(o))
            cells.append(f"{paper[m][str(t)]:.2f}" if str(t) in paper.get(m, {}) else "–")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "Checks (issue 3):", ""]
    for t in taus:
        got = {m: ours[m][str(t)]["mean"] for m in methods
               if str(t) in ours.get(m, {}) and ours[m][str(t)]["mean"] is not None}
        if {"MimiC", "MIFA", "FedAvg"} <= set(got):
            ok = got["MimiC"] >= got["MIFA"] >= got["FedAvg"]
            lines.append(f"- τmax = {t}: MimiC ≥ MIFA ≥ FedAvg: {'yes' if ok else 'NO'} "
                         f"({got['MimiC']:.2f}, {got['MIFA']:.2f}, {got['FedAvg']:.2f})")
        far = [f"{m} ({got[m] - paper[m][str(t)]:+.2f})" for m in got
               if str(t) in paper.get(m, {}) and abs(got[m] - paper[m][str(t)]) > 4]
        lines.append(f"- τmax = {t}: more than 4 points from the paper: {', '.join(far) if far else 'none'}")
    lines += evidence(results, methods, taus)
    notes = results.get("notes")
    if notes:
        lines += ["", f"Analysis of the differences (hand-written, kept beside this file): [{notes}]({notes})"]
    return "\n".join(lines) + "\n"


def cell_text(o: dict | None, show_n: bool = False) -> str:
    """A results cell (`cell_stats`) as text: "mean ± std" (the mean alone where one trial counts), then in
    brackets the number of trials that count (`show_n`: the paper presets' tables) and of diverged trials
    (left out of both) where any diverged; "all N diverged" or "–" where nothing counts."""
    if not o:
        return "–"
    div = len(o.get("diverged") or {})
    if o["mean"] is None:
        return f"all {div} diverged" if div else "–"
    n = sum(v is not None for v in o["trials"]) if "trials" in o else None
    notes = ([f"n={n}"] if show_n else []) + ([f"{div} diverged"] if div else [])
    spread = "" if n == 1 else f" ± {o['std']:.2f}"   # one trial: no spread to show (the JSON's std is 0)
    return f"{o['mean']:.2f}{spread}" + (f" ({', '.join(notes)})" if notes else "")


def trials_done(results: dict) -> str:
    """'3', or '1-2 of 3' when some trials of some cells have not finished (yet)."""
    want = results["setup"]["trials"]
    got = [len(c["trials"]) for cells in results["ours"].values() for c in cells.values() if "trials" in c]
    lo, hi = (min(got), max(got)) if got else (0, 0)
    return str(want) if lo == hi == want else f"{lo}-{hi} of {want}" if lo != hi else f"{lo} of {want}"


def evidence(results: dict, methods: list[str], taus: list[int]) -> list[str]:
    """Per-run spread of the last evaluations, the same table on the last-5 mean, and wall times."""
    ours = results["ours"]
    cells = [(m, t, ours[m][str(t)]) for t in taus for m in methods if str(t) in ours.get(m, {})]
    if not cells or "per_run" not in cells[0][2]:
        return []
    n = cells[0][2]["per_run"][0]["last_n"]
    lines = ["", "## Evidence: how noisy one final value is", "",
             "The paper's statistic is the accuracy after the last upload. Under bounded dropouts the global "
             "model keeps oscillating (few participants per round, 2 labels each), so below are the mean ± std "
             f"and range of each run's last {n} evaluations (every `--eval-every` rounds), and the table "
             "recomputed on that less noisy statistic. A run reused for several τmax (no τ_i reaches the "
             "larger cap: the same run) is listed once.", "",
             "| method | τmax | seed | final | last-n mean ± std (ddof 0) | last-n min-max |",
             "|---|---:|---:|---:|---:|---:|"]
    runs: dict[str, dict] = {}   # run dir → its row (distinct runs only)
    for m, t, c in cells:
        for path, seed, final, r in zip(c["runs"], c["seeds"], c["trials"], c["per_run"]):
            runs.setdefault(path, {"m": m, "taus": [], "seed": seed, "final": final, "r": r})["taus"].append(t)
    for row in runs.values():
        r = row["r"]
        final = "diverged" if row["final"] is None else f"{row['final']:.2f}"
        lines.append(f"| {row['m']} | {', '.join(map(str, row['taus']))} | {row['seed']} | {final} | "
                     f"{r['last_mean']:.2f} ± {r['last_std']:.2f} | {r['last_min']:.2f}-{r['last_max']:.2f} |")
    lines += ["", f"Mean over trials of each run's last-{n} mean:", "",
              "| method | " + " | ".join(f"τmax = {t}" for t in taus) + " |", "|---|" + "---:|" * len(taus)]
    for m in methods:
        row = []
        for t in taus:
            c = ours.get(m, {}).get(str(t))
            row.append(f"{np.mean([r['last_mean'] for r in c['per_run']]):.2f} (n={len(c['per_run'])})" if c else "–")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    for t in taus:
        got = {m: np.mean([r["last_mean"] for r in ours[m][str(t)]["per_run"]])
               for m in ("MimiC", "MIFA", "FedAvg") if str(t) in ours.get(m, {})}
        if len(got) == 3:
            ok = got["MimiC"] >= got["MIFA"] >= got["FedAvg"]
            lines.append(f"- τmax = {t}, last-{n} mean: MimiC ≥ MIFA ≥ FedAvg: {'yes' if ok else 'NO'}")
    secs = [(row["r"]["seconds"], row["r"]["engine"]) for row in runs.values()]
    engines = sorted({e for _, e in secs if e})
    total = sum(x for x, _ in secs)
    spans = [row["r"].get("sessions") for row in runs.values()]
    lines += ["", "## Wall time", ""]
    if spans and all(spans):
        busy = busy_seconds([s for run_spans in spans for s in run_spans])
        lines.append(f"The {len(secs)} distinct runs were computing for **{busy / 3600:.2f} h** of wall time: the "
                     f"union of their sessions' spans (log.jsonl and the rounds' `elapsed`), gaps between "
                     f"sessions left out; engine: {', '.join(engines) or 'unknown'}; machine shared with other "
                     f"work at times. Σ of the rounds' `seconds` is {total / 3600:.2f} h: runs of a lockstep "
                     f"group wait for each other's rounds, so their round times overlap.")
    else:
        lines.append(f"The {len(secs)} distinct runs took {total / 3600:.2f} h of round time in total (Σ of the "
                     f"rounds' `seconds`, which overlap where runs advanced in lockstep; engine: "
                     f"{', '.join(engines) or 'unknown'}; machine shared with other work at times).")
    return lines


def figure(results: dict, methods: list[str], tau: int, out: Path) -> Path:
    """Fig. 4-like: accuracy against uploads at one τmax, one line per method (mean over trials)."""
    from coordinator.report.compare import accuracy_plot

    curves = {}
    for m in methods:
        cell = results["ours"].get(m, {}).get(str(tau))
        if not cell:
            continue
        per_trial = [curve(Path(p)) for p in finished_runs(cell)]
        if not per_trial:
            continue
        n = min(len(x) for x, _ in per_trial)
        x = per_trial[0][0][:n]
        y = np.mean([acc[:n] for _, acc in per_trial], axis=0)
        curves[m] = (x, list(y))
    return accuracy_plot(curves, out, f"FMNIST, bounded dropout τmax = {tau} (cf. MimiC Fig. 4)")


def reproduce_table3(setup: Setup, methods: list[str], taus: list[int], trials: int, root: Path, results_dir: Path,
                     progress: bool = True, log=None, report_only: bool = False, executor: str = "serial",
                     stem: str | None = None) -> dict:
    ours = run_grid(setup, methods, taus, trials, root, progress, log, report_only, executor)
    results = {"paper": PAPER_TABLE3, "ours": ours, "setup": setup_dict(setup, taus, trials, root)}
    if (results_dir / NOTES).exists():
        results["notes"] = NOTES
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or results_stem(setup.tau_dist)
    (results_dir / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (results_dir / f"{stem}.md").write_text(markdown(results, methods, taus))
    fig_tau = 20 if 20 in taus else taus[0]
    figure(results, methods, fig_tau, results_dir / f"{stem}_fig4.png")
    return results


