"""The FL-FDMS friend panel of `dropfl report`: did friend discovery find the right friends?

Reads a run directory's friends.jsonl (written by the FL-FDMS strategy every round; docs/run-directory.md) and
draws, side by side: the similarity matrix R after the last round (the paper's Fig. 3), how often each client
was substituted by each other client over the run (the friend matrix), and, where the partition has clusters
(`fdms-clustered*`: consecutive blocks of clients), the share of the round's dropped clients whose friend is in
their own cluster, per round.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from coordinator.errors import UserError

CLUSTERED = ("fdms-clustered", "fdms-clustered-80-20")
N_CLUSTERS = 5   # edge_client.partition.fdms_clustered's default, the paper's


def read_friends(path: Path) -> list[dict] | None:
    """The rows of <run>/friends.jsonl, or None when the run has none (not an FL-FDMS run)."""
    p = Path(path) / "friends.jsonl"
    if not p.exists():
        return None
    from coordinator.rundir import read_metrics

    rows = read_metrics(p)
    for r in rows:
        if not isinstance(r.get("friend"), list):
            raise UserError(f"{p}: round {r['round']} has no friend list; not an FL-FDMS friend log")
    return rows


def friend_counts(rows: list[dict], n: int) -> np.ndarray:
    """counts[k, j] = rounds in which dropped client k was substituted by j."""
    counts = np.zeros((n, n), dtype=np.int64)
    for r in rows:
        for k, j in enumerate(r["friend"]):
            if j >= 0:
                counts[k, j] += 1
    return counts


def cluster_share(rows: list[dict], n: int, n_clusters: int = N_CLUSTERS) -> list[float | None]:
    """Per round: the share of substituted clients whose friend is in their own cluster (None: nobody dropped)."""
    from edge_client.partition import cluster_of

    out = []
    for r in rows:
        pairs = [(k, j) for k, j in enumerate(r["friend"]) if j >= 0]
        out.append(None if not pairs else
                   sum(cluster_of(k, n, n_clusters) == cluster_of(j, n, n_clusters) for k, j in pairs) / len(pairs))
    return out


def friend_panel(run_path: Path, name: str, out: Path) -> tuple[Path, str] | None:
    """friends-<run>.png and a Markdown paragraph; None when the run has no friend log."""
    from coordinator.report.compare import _pyplot

    rows = read_friends(run_path)
    if not rows:
        return None
    cfg_path = Path(run_path) / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    n = len(rows[0]["friend"])
    clustered = cfg.get("data", {}).get("partition") in CLUSTERED and n % N_CLUSTERS == 0
    sim = rows[-1].get("similarity")
    counts = friend_counts(rows, n)
    plt = _pyplot()
    panels = 2 + (sim is not None) + clustered
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4.2), squeeze=False)
    ax = iter(axes[0])
    if sim is not None:
        a = next(ax)
        im = a.imshow(np.array(sim, dtype=float), cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        a.set_title(f"similarity R after round {rows[-1]['round'] + 1}")  # rounds from 1, as the logs print them
        fig.colorbar(im, ax=a, fraction=0.046)
    a = next(ax)
    im = a.imshow(counts, cmap="magma", interpolation="nearest")
    a.set_title("friend matrix: rounds k (row) was\nsubstituted by j (column)")
    fig.colorbar(im, ax=a, fraction=0.046)
    from matplotlib.ticker import MaxNLocator

    for a in axes[0][: 1 + (sim is not None)]:
        a.set_xlabel("client j")
        a.set_ylabel("client k")
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.yaxis.set_major_locator(MaxNLocator(integer=True))
    text = [f"Friend discovery (friends.jsonl, {len(rows)} rounds, {int(counts.sum())} substitutions)."]
    shares = None
    if clustered:
        shares = cluster_share(rows, n)
        a = next(ax)
        xs = [r["round"] + 1 for r, s in zip(rows, shares) if s is not None]
        a.plot(xs, [100 * s for s in shares if s is not None], marker=".", linewidth=1)
        a.set_ylim(-5, 105)
        a.set_xlabel("round")
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.set_ylabel("friend in own cluster (%)")
        a.set_title(f"{N_CLUSTERS} clusters of {n // N_CLUSTERS} consecutive clients")
        a.grid(alpha=0.3)
        got = [s for s in shares if s is not None]
        if got:
            text.append(f"Share of dropped clients whose friend is in their own cluster: {100 * got[-1]:.1f} % in "
                        f"the last round with a dropout, {100 * np.mean(got):.1f} % over all such rounds.")
    a = next(ax)
    per_round = [sum(j >= 0 for j in r["friend"]) for r in rows]
    a.plot([r["round"] + 1 for r in rows], per_round, linewidth=1)
    a.set_xlabel("round")
    a.set_ylabel("substituted clients")
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.yaxis.set_major_locator(MaxNLocator(integer=True))
    a.set_title("dropped clients substituted per round")
    a.grid(alpha=0.3)
    fig.suptitle(f"FL-FDMS friends: {name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out, " ".join(text)
