"""Compare run directories: accuracy against uploads, who took part when (and why not), and a table.

Reads only what a run directory holds (config.json, metrics.jsonl, participation.csv or the columnar
participation/; docs/run-directory.md)
and writes PNGs (matplotlib, Agg backend: no display needed) and Markdown.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coordinator.availability import columnar
from coordinator.availability.models import REASONS
from coordinator.availability.participation import FIELDS, STATUSES
from coordinator.errors import UserError
from coordinator.progress import bar

# raster colours: participated / not selected, then one colour per reason (unavailable: blues and greys,
# dropped: reds and oranges)
STATUS_COLOURS = {"participated": "#2ca02c", "not_selected": "#d9d9d9"}
UNAVAILABLE_COLOURS = ["#1f77b4", "#9467bd", "#17becf", "#7f7f7f", "#aec7e8", "#c5b0d5", "#8c564b", "#bcbd22"]
DROPPED_COLOURS = ["#d62728", "#ff7f0e", "#e377c2", "#ff9896", "#ffbb78"]


@dataclass
class Run:
    name: str
    path: Path
    config: dict
    metrics: list[dict]
    participation: list[dict] = field(default_factory=list)
    columnar: tuple | None = None  # (rounds, status, reason) of RUN/participation/ (availability/columnar.py)

    @property
    def algo(self) -> str:
        return self.config.get("strategy", {}).get("algo", "?")

    @property
    def label(self) -> str:
        """A curve's name in the plots' legends: the algorithm, then the run (`mimic (x-mimic)`); unique as the
        run names are (load_runs); the algorithm alone where the run is named after it."""
        return self.algo if self.name == self.algo else f"{self.algo} ({self.name})"

    @property
    def is_field(self) -> bool:
        """A field run (`dropfl coordinator`: field.json) or a one-machine trial (`dropfl trial`: trial.json)."""
        return (self.path / "field.json").exists() or (self.path / "trial.json").exists()

    @property
    def availability(self) -> str:
        return describe_availability(self)

    def evaluated(self) -> list[dict]:
        return [r for r in self.metrics if r.get("accuracy") is not None]


# what a model's parameters are called in the report (config.json `availability` keys)
MODEL_PARAMS = {"bounded": (("tau_max", "τmax"),), "static": (("p", "p"),), "timevarying": (("fraction", "P"),),
                "diurnal": (("half_period", "E"),), "cluster-dropout": (("alpha", "α"),)}


def model_text(avail: dict) -> str:
    """An availability model as the report names it: `bounded (τmax 20)`, `static (p 0.1)`, `always`."""
    kind = avail.get("kind", "?")
    params = [f"{name} {avail[key]:g}" if isinstance(avail[key], float) else f"{name} {avail[key]}"
              for key, name in MODEL_PARAMS.get(kind, ()) if avail.get(key) is not None]
    if kind == "device-trace" and avail.get("device_trace"):
        params.append(Path(avail["device_trace"]).name)
    return f"{kind} ({', '.join(params)})" if params else kind


def _pct(share: float) -> str:
    pct = 100 * share
    return f"{pct:.0f} %" if pct >= 1 or pct == 0 else f"{pct:.1f} %"


def reason_shares(run: Run) -> list[tuple[str, float]]:
    """Each reason clients were unavailable or dropped for, with its share of the log's client-rounds, the
    largest first (ties: by name); [] without a participation log."""
    if not run.participation and run.columnar is None:
        return []
    codes, labels = raster_codes(run)
    counts = np.bincount(codes[codes >= 0].ravel(), minlength=len(labels))
    total = int(counts.sum())
    per: dict[str, int] = {}
    for lab, n in zip(labels, counts.tolist()):
        if ": " in lab:
            why = lab.split(": ", 1)[1]
            per[why] = per.get(why, 0) + n
    return sorted(((why, n / total) for why, n in per.items() if n), key=lambda x: (-x[1], x[0])) if total else []


def field_text(run: Run) -> str:
    """A field run's availability: the recorded causes, `field: battery 12 %, offline 3 %` (shares of the
    client-rounds), `field: none lost` when every client took part or was not selected."""
    shares = reason_shares(run)
    if not shares:
        return "field: none lost" if run.participation or run.columnar is not None else "field (no participation log)"
    return "field: " + ", ".join(f"{why} {_pct(share)}" for why, share in shares)


def _recorded_run(trace: str, run_path: Path) -> Path | None:
    """The run directory a replay's trace (its participation.csv or participation/) was recorded in."""
    for base in (Path(trace), run_path.parent / trace):
        if base.exists():
            return base.parent if base.name in ("participation.csv", columnar.DIR) or base.is_file() else base
    return None


def describe_availability(run: Run) -> str:
    """The availability column: the model (`bounded (τmax 20)`); for a replay, what the trace came from
    (`replay of bounded (τmax 20)`, `replay of field: battery 12 %`); for a field run, the recorded causes."""
    if run.is_field:
        return field_text(run)
    avail = run.config.get("availability", {})
    if avail.get("kind") != "replay":
        return model_text(avail)
    trace = avail.get("trace")
    src = _recorded_run(trace, run.path) if trace else None
    if src is None:
        return f"replay of {Path(trace).name if trace else '?'}"
    try:
        rec = load_run(src)
    except UserError:
        return f"replay of {src.name}"
    return f"replay of {rec.availability}"


def load_run(path: str | Path, name: str | None = None) -> Run:
    p = Path(path)
    if not (p / "metrics.jsonl").exists():
        raise UserError(f"{p}: not a run directory (no metrics.jsonl)")
    try:
        config = json.loads((p / "config.json").read_text()) if (p / "config.json").exists() else {}
        metrics = [json.loads(line) for line in (p / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise UserError(f"{p}: unreadable JSON ({e})") from None
    rows, cols = [], None
    if (p / columnar.DIR).is_dir():  # the columnar log of a large run (--participation-format npz)
        cols = columnar.read_columnar(p / columnar.DIR)
    part = p / "participation.csv"
    if part.exists():
        with open(part, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None or not set(FIELDS) <= set(reader.fieldnames):
                raise UserError(f"{part}: not a participation log (need columns {', '.join(FIELDS)})")
            rows = list(reader)
    return Run(name or p.name, p, config, metrics, rows, cols)


def load_runs(paths: list[str]) -> list[Run]:
    runs = [load_run(p) for p in paths]
    seen: dict[str, int] = {}
    for r in runs:  # two directories with the same base name: qualify with the parent directory
        seen[r.name] = seen.get(r.name, 0) + 1
    for r in runs:
        if seen[r.name] > 1:
            r.name = f"{r.path.parent.name}/{r.path.name}"
    return runs


def summary(run: Run) -> dict:
    """Final and best accuracy (%), uploads, and participants per round of one run."""
    ev = run.evaluated()
    last = run.metrics[-1] if run.metrics else {}
    parts = [r["participants"] for r in run.metrics if "participants" in r]
    return {
        "run": run.name, "algo": run.algo, "availability": run.availability,
        "rounds": len(run.metrics),
        "final_acc": 100 * ev[-1]["accuracy"] if ev else None,
        "best_acc": 100 * max(r["accuracy"] for r in ev) if ev else None,
        "uploads": last.get("uploads"), "client_uploads": last.get("client_uploads"),
        "participants_mean": float(np.mean(parts)) if parts else None,
        "participants_min": min(parts) if parts else None,
        "participants_max": max(parts) if parts else None,
    }


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def comparison_table(runs: list[Run]) -> str:
    """Markdown table, one row per run."""
    head = ("| run | algorithm | availability | rounds | final acc. (%) | best acc. (%) | uploads | client uploads "
            "| participants / round (mean [min, max]) |")
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        s = summary(r)
        part = (f"{s['participants_mean']:.1f} [{s['participants_min']}, {s['participants_max']}]"
                if s["participants_mean"] is not None else "–")
        lines.append(f"| {s['run']} | {s['algo']} | {s['availability']} | {s['rounds']} | {_fmt(s['final_acc'])} "
                     f"| {_fmt(s['best_acc'])} | {_fmt(s['uploads'])} | {_fmt(s['client_uploads'])} | {part} |")
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def accuracy_plot(curves: dict[str, tuple[list[float], list[float]]], out: Path, title: str = "",
                  xlabel: str = "model uploads") -> Path:
    """One line per name (the legend's label): (uploads, accuracy in %); whole numbers on the x axis."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (x, y) in curves.items():
        ax.plot(x, y, label=name, linewidth=1.4)
    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("test accuracy (%)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend()
    else:   # no run has evaluated a round yet: say so instead of matplotlib's empty-legend warning
        ax.text(0.5, 0.5, "no evaluated runs yet", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def run_curve(run: Run) -> tuple[list[float], list[float]]:
    ev = run.evaluated()
    return [r["uploads"] for r in ev], [100 * r["accuracy"] for r in ev]


def raster_codes(run: Run, n_clients: int | None = None) -> tuple[np.ndarray, list[str]]:
    """[clients, rounds] integer codes into `labels` ("participated", "not_selected",
    "unavailable: battery", "dropped: deadline", ...); -1 where the log has no row."""
    if run.columnar is not None:
        return columnar_codes(*run.columnar)
    rows = run.participation
    if not rows:
        raise UserError(f"{run.path}: no participation.csv")
    try:
        parsed = [(int(r["round"]), int(r["client"]), r["status"], r["reason"] or "") for r in rows]
    except (TypeError, ValueError):
        raise UserError(f"{run.path}/participation.csv: a row has a non-integer round or client") from None
    n = n_clients or 1 + max(c for _, c, _, _ in parsed)
    rounds = 1 + max(t for t, _, _, _ in parsed)
    labels: list[str] = []
    index: dict[str, int] = {}
    codes = np.full((n, rounds), -1, dtype=np.int32)
    for t, c, status, reason in parsed:
        if status not in STATUSES:
            raise UserError(f"{run.path}/participation.csv: unknown status {status!r} in round {t}")
        label = status if status in STATUS_COLOURS else f"{status}: {reason or '?'}"
        if label not in index:
            index[label] = len(labels)
            labels.append(label)
        codes[c, t] = index[label]
    return codes, labels


def columnar_codes(rounds: np.ndarray, status: np.ndarray, reason: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """`raster_codes` from the columnar log's arrays: the same labels, computed per (status, reason) pair."""
    names = ("",) + REASONS
    pair = status.astype(np.int32) * 256 + reason
    uniq, inverse = np.unique(pair, return_inverse=True)
    labels = []
    for code in uniq.tolist():
        st, why = columnar.STATUSES[code // 256], names[code % 256]
        labels.append(st if st in STATUS_COLOURS else f"{st}: {why or '?'}")
    codes = np.full((status.shape[1], int(rounds.max()) + 1), -1, dtype=np.int32)
    codes[:, rounds] = inverse.reshape(status.shape).T
    return codes, labels


def label_colours(labels: list[str]) -> list[str]:
    un, dr = iter(UNAVAILABLE_COLOURS * 4), iter(DROPPED_COLOURS * 4)
    out = []
    for lab in labels:
        if lab in STATUS_COLOURS:
            out.append(STATUS_COLOURS[lab])
        else:
            out.append(next(dr) if lab.startswith("dropped") else next(un))
    return out


def participation_raster(run: Run, out: Path) -> Path:
    """Clients × rounds image, one colour per status (and reason, for absent clients); rounds numbered from 1
    as the progress lines and the final line number them (the logs' `round` column + 1)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    codes, labels = raster_codes(run)
    order = sorted(range(len(labels)), key=lambda i: (labels[i] != "participated", labels[i] != "not_selected",
                                                      labels[i]))
    remap = np.full(len(labels) + 1, -1)
    for new, old in enumerate(order):
        remap[old] = new
    codes = np.where(codes >= 0, remap[codes], -1)
    labels = [labels[i] for i in order]
    colours = label_colours(labels)
    img = np.ma.masked_less(codes, 0)
    n, rounds = codes.shape
    fig, ax = plt.subplots(figsize=(min(14, 4 + rounds / 15), min(10, 2.5 + n / 12)))
    cmap = ListedColormap(colours).with_extremes(bad="white")
    ax.imshow(img, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5, vmax=len(labels) - 0.5,
              origin="lower", extent=(0.5, rounds + 0.5, -0.5, n - 0.5))
    ax.set_xlabel("round")
    ax.set_ylabel("client")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"participation: {run.label}")
    ax.legend(handles=[Patch(color=c, label=lab) for c, lab in zip(colours, labels)],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_report(runs: list[Run], out_dir: str | Path, progress: bool = False) -> dict[str, Path]:
    """accuracy_vs_uploads.png, participation-<run>.png per run, friends-<run>.png per FL-FDMS run,
    comparison.md (table + image links). `progress`: a bar over the runs' rasters on a terminal (~0.5 s each)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    files["accuracy"] = accuracy_plot({r.label: run_curve(r) for r in runs}, out / "accuracy_vs_uploads.png",
                                      "test accuracy against model uploads")
    rasters = []
    for r in bar(runs, desc="rasters", unit="run", enabled=progress and len(runs) > 1):
        if r.participation or r.columnar is not None:
            safe = r.name.replace("/", "_")
            files[f"raster:{r.name}"] = participation_raster(r, out / f"participation-{safe}.png")
            rasters.append((r.label, f"participation-{safe}.png"))
    from coordinator.report.friends import friend_panel

    friends = []   # FL-FDMS runs: the friend panel (coordinator/report/friends.py)
    for r in runs:
        safe = r.name.replace("/", "_")
        panel = friend_panel(r.path, r.label, out / f"friends-{safe}.png")
        if panel is not None:
            files[f"friends:{r.name}"] = panel[0]
            friends.append((r.label, panel[0].name, panel[1]))
    table = comparison_table(runs)
    md = ["# Run comparison", "", table, "![accuracy against uploads](accuracy_vs_uploads.png)", ""]
    for name, png in rasters:
        md += [f"## Participation: {name}", "", f"![participation of {name}]({png})", ""]
    for name, png, text in friends:
        md += [f"## FL-FDMS friends: {name}", "", text, "", f"![friends of {name}]({png})", ""]
    (out / "comparison.md").write_text("\n".join(md))
    files["table"] = out / "comparison.md"
    return files
