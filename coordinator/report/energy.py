"""`dropfl report`'s energy section: energy per round and time-to-accuracy against energy, from the
telemetry.jsonl of field runs (coordinator/field/telemetry.py; docs/run-directory.md).

A round's energy is the sum over its aggregated devices of `energy_j` (training and upload) and
`eval_energy_j` (the evaluation each device finished since its previous update), as each agent measured
it or modelled it (`energy_source`; a round that mixes sources says so in the table). Rows of a round
written twice (a resumed run redoes the round it stopped in) count once: the later row.

Time-to-accuracy: the first evaluated round whose accuracy reaches the target, its `elapsed` seconds
(metrics.jsonl) and the energy of the rounds up to it. The target is `--target-accuracy` when given,
else the lowest of the runs' best accuracies (so that every run reaches it; said in the table).
Runs without telemetry.jsonl (simulations) are left out of this section, and listed as such.
"""

from __future__ import annotations

import json
from pathlib import Path

from coordinator.errors import UserError
from coordinator.report.compare import Run, _pyplot


def load_telemetry(run: Run) -> dict[int, dict[int, dict]] | None:
    """{round: {client: row}} of a run's telemetry.jsonl, None when it has none."""
    p = run.path / "telemetry.jsonl"
    if not p.exists():
        return None
    out: dict[int, dict[int, dict]] = {}
    lines = p.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            t, c = r["round"], r["client"]
            if not isinstance(t, int) or not isinstance(c, int):
                raise ValueError("round and client must be integers")
        except (ValueError, KeyError, TypeError) as e:
            if i == len(lines) and not line.endswith("\n"):
                break  # the last row was cut off mid-write
            raise UserError(f"{p}:{i}: not a telemetry row ({str(e)[:80]}); restore the file or move it "
                            f"away") from None
        out.setdefault(t, {})[c] = r
    return out


def round_energy(rows: dict[int, dict]) -> tuple[float | None, set[str]]:
    """(joules of one round over its devices, their energy sources); None if no device reported energy."""
    total, seen, sources = 0.0, False, set()
    for r in rows.values():
        for k in ("energy_j", "eval_energy_j"):
            if isinstance(r.get(k), int | float):
                total += r[k]
                seen = True
        if r.get("energy_source"):
            sources.add(r["energy_source"])
    return (total if seen else None), sources


def energy_curve(run: Run, tel: dict[int, dict[int, dict]]) -> list[dict]:
    """Per round of metrics.jsonl: round, energy_j, cumulative_j, elapsed, accuracy (None where absent)."""
    out, cum = [], 0.0
    for m in run.metrics:
        t = m.get("round")
        e, _ = round_energy(tel.get(t, {}))
        cum += e or 0.0
        out.append({"round": t, "energy_j": e, "cumulative_j": cum, "elapsed": m.get("elapsed"),
                    "accuracy": m.get("accuracy")})
    return out


def time_to_accuracy(curve: list[dict], target: float) -> tuple[int, float | None, float] | None:
    """(round, elapsed seconds, cumulative joules) of the first round whose accuracy (0..1) ≥ target, or None."""
    for r in curve:
        if r["accuracy"] is not None and r["accuracy"] >= target:
            return r["round"], r["elapsed"], r["cumulative_j"]
    return None


def _fmt(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def energy_report(runs: list[Run], out_dir: str | Path, target_pct: float | None = None,
                  tels: dict[str, dict | None] | None = None) -> tuple[dict, str]:
    """Write energy_per_round.png, accuracy_vs_energy.png and energy.md for the runs with telemetry;
    returns (files, the Markdown table) — ({}, "") when no run has telemetry. `tels`: load_telemetry of
    each run by name, if already read."""
    tels = tels if tels is not None else {r.name: load_telemetry(r) for r in runs}
    with_tel = [r for r in runs if tels[r.name] is not None]
    if not with_tel:
        return {}, ""
    curves = {r.name: energy_curve(r, tels[r.name]) for r in with_tel}
    labels = {r.name: r.label for r in with_tel}
    bests = [max(x["accuracy"] for x in c if x["accuracy"] is not None) for c in curves.values()
             if any(x["accuracy"] is not None for x in c)]
    if target_pct is not None:
        target, how = target_pct / 100, "--target-accuracy"
    else:
        target, how = (min(bests) if bests else None), "the lowest of the runs' best accuracies"
    lines = [f"target accuracy: {_fmt(None if target is None else 100 * target, 2)} % ({how})", "",
             "| run | rounds with telemetry | energy source | energy (J) | per round (J, mean) | rounds to target "
             "| time to target (s) | energy to target (J) |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in with_tel:
        c, tel = curves[r.name], tels[r.name]
        sources = set().union(*(round_energy(rows)[1] for rows in tel.values())) if tel else set()
        per = [x["energy_j"] for x in c if x["energy_j"] is not None]
        tta = time_to_accuracy(c, target) if target is not None else None
        lines.append(f"| {r.name} | {len(tel)} | {', '.join(sorted(sources)) or '–'} | "
                     f"{_fmt(c[-1]['cumulative_j'] if c else None)} | {_fmt(sum(per) / len(per) if per else None)} | "
                     f"{'not reached' if tta is None else tta[0] + 1} | {_fmt(tta and tta[1])} | "
                     f"{_fmt(tta and tta[2])} |")
    without = [r.name for r in runs if tels[r.name] is None]
    if without:
        lines += ["", "without telemetry.jsonl (not field runs): " + ", ".join(without)]
    table = "\n".join(lines) + "\n"
    out = Path(out_dir)
    plt = _pyplot()
    files = {}
    from matplotlib.ticker import MaxNLocator

    for key, fname, xk, yk, xlabel, ylabel, title in (
            ("energy_rounds", "energy_per_round.png", "round", "energy_j", "round", "energy (J)",
             "energy per round (all aggregated devices)"),
            ("energy_accuracy", "accuracy_vs_energy.png", "cumulative_j", "accuracy", "cumulative energy (J)",
             "test accuracy (%)", "time-to-accuracy against energy")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, c in curves.items():
            pts = [(x[xk], x[yk]) for x in c if x[yk] is not None]
            ax.plot([p[0] + 1 if xk == "round" else p[0] for p in pts],  # rounds from 1, as the logs print them
                    [100 * p[1] if yk == "accuracy" else p[1] for p in pts], marker="o",
                    markersize=3, linewidth=1.4, label=labels[name])
        if yk == "accuracy" and target is not None:
            ax.axhline(100 * target, color="grey", linestyle="--", linewidth=0.8, label="target")
        ax.set_xlabel(xlabel)
        if xk == "round":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)
        files[key] = out / fname
    md = ["# Energy", "", table, "![energy per round](energy_per_round.png)", "",
          "![accuracy against energy](accuracy_vs_energy.png)", ""]
    (out / "energy.md").write_text("\n".join(md))
    files["energy_table"] = out / "energy.md"
    return files, table
