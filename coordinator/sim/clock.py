"""Virtual clock for simulation: per-client rates from a profile, round time by FedDD eq. (12).

A profile gives, for every client 0..N-1, its compute speed and link rates:

    JSON: {"clients": [{"client": 0, "compute_s_per_step": 0.02, "up_Bps": 250000, "down_Bps": 1000000}, ...]}
    CSV:  client,compute_s_per_step,up_Bps,down_Bps      (one row per client)

With a profile, a simulated client's round takes (eqs. 7, 9, 11)
    t_n = download_bytes / down_Bps + steps · compute_s_per_step + upload_bytes / up_Bps
with the bytes that really travel (dense float32 model, or the FedDD sparse payload), and the round
takes max_n t_n over the clients that took part (eq. 12). Each update carries these as a
`ClientReport`, as if the client had measured them, so FedDD and FedCS see "measured" rates.

`python -m coordinator.sim.clock table4 --clients 100 --out profile.json` draws a profile from the FedDD
paper's Table 4 ranges (uniform per client): f ∈ [1, 10] GHz, c ∈ [1, 10] Mcycles/sample (so
compute_s_per_step = B · c / f), r^u ∈ [1, 5] kbit/s, r^d ∈ [40, 200] kbit/s (stored in bytes/s).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from coordinator.errors import UserError
from coordinator.statestore import StateStore
from coordinator.strategies.base import ClientUpdate
from edge_client import feddd
from edge_client.models import get_flat
from edge_client.report import ClientReport
from edge_client.trainer import TrainTask, local_train

FIELDS = ("compute_s_per_step", "up_Bps", "down_Bps")


@dataclass(frozen=True)
class Profile:
    compute_s_per_step: np.ndarray
    up_Bps: np.ndarray
    down_Bps: np.ndarray

    def to_json(self) -> dict:
        return {"clients": [{"client": i, **{k: float(getattr(self, k)[i]) for k in FIELDS}}
                            for i in range(len(self.up_Bps))]}


def load_profile(path: str | Path, n_clients: int) -> Profile:
    """Read a JSON or CSV profile; every client 0..n_clients-1 must be there with positive finite rates."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise UserError(f"--clock-profile: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"--clock-profile: {path} is not a text file (UTF-8 JSON or CSV); "
                        f"write one with `python -m coordinator.sim.clock`") from None
    try:
        rows = json.loads(text)["clients"] if p.suffix == ".json" else list(csv.DictReader(text.splitlines()))
        table = {int(r["client"]): [float(r[k]) for k in FIELDS] for r in rows}
    except (KeyError, ValueError, TypeError, OverflowError) as e:
        raise UserError(f"--clock-profile: {path} is not a profile (client + {', '.join(FIELDS)}): {e!r}") from None
    missing = [i for i in range(n_clients) if i not in table]
    if missing:
        raise UserError(f"--clock-profile: {path} has no row for clients {missing[:5]} (needs 0..{n_clients - 1})")
    a = np.array([table[i] for i in range(n_clients)], dtype=float)
    if not np.isfinite(a).all() or (a[:, 1:] <= 0).any() or (a[:, 0] < 0).any():
        raise UserError(f"--clock-profile: {path}: rates must be finite and > 0, compute_s_per_step >= 0")
    return Profile(a[:, 0], a[:, 1], a[:, 2])


def table4_profile(n_clients: int, seed: int, batch_size: int) -> Profile:
    """FedDD Table 4 ranges, drawn uniformly and independently per client."""
    rng = np.random.default_rng(seed)
    f_hz = rng.uniform(1e9, 10e9, n_clients)
    c_cycles = rng.uniform(1e6, 10e6, n_clients)
    return Profile(batch_size * c_cycles / f_hz, rng.uniform(1e3, 5e3, n_clients) / 8,
                   rng.uniform(4e4, 2e5, n_clients) / 8)


class SimClients:
    """The simulated devices' side of a round when the task asks for FedDD (`task.dropout_rate`) or a
    profile drives a virtual clock: trains, applies Algorithm 2's mask, keeps each client's eq. (5)
    memory, and reports compute time, rates and bytes. `round_stats` gives eq. (12)'s round time."""

    def __init__(self, model: torch.nn.Module, profile: Profile | None = None, num_classes: int | None = None,
                 store: StateStore | None = None, n_clients: int = 0):
        self.model, self.profile, self.num_classes = model, profile, num_classes
        self.layout = feddd.unit_layout(model)
        self.store, self.n_clients = store, n_clients
        # the devices' eq. (5) memory: a dict in RAM, or tables of the disk state store (--state-store disk)
        self.memory: dict[int, feddd.Memory] | TableMemory = (
            TableMemory(store, n_clients, self.layout) if store is not None and store.kind == "disk" else {})

    def run(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, task: TrainTask) -> ClientUpdate:
        mask = None
        if task.dropout_rate is not None:
            out, self.memory[task.client] = feddd.client_round(self.model, self.layout, w, x, y, task,
                                                               self.memory.get(task.client))
            r, delta, mask, up, down = out.result, out.delta, out.mask, out.upload_bytes, out.download_bytes
        else:
            r = local_train(self.model, w.clone(), x, y, task)   # a copy: set_flat makes parameters views of it
            delta, up = w - get_flat(self.model), feddd.dense_nbytes(self.layout)
            down = up
        report = ClientReport(compute_s=r.seconds, upload_bytes=up, download_bytes=down,
                              label_score=feddd.label_score(y, self.num_classes) if self.num_classes else None)
        if self.profile is not None:
            i = task.client
            report.compute_s = r.steps * float(self.profile.compute_s_per_step[i])
            report.up_Bps, report.down_Bps = float(self.profile.up_Bps[i]), float(self.profile.down_Bps[i])
        return ClientUpdate(task.client, delta, r.num_samples, r.steps, task.lr, r.loss, mask=mask, report=report)

    def state_dict(self) -> dict:
        """What the devices keep between rounds (FedDD eq. (5) memory), for the run's checkpoint."""
        if isinstance(self.memory, TableMemory):
            return {"memory_tables": self.memory.state_dict()}
        return {"memory": {i: {"round": m.round, "w_local": m.w_local, "masks": list(m.masks)}
                           for i, m in self.memory.items()}}

    def load_state_dict(self, state: dict) -> None:
        if "memory_tables" in state:  # a disk-store checkpoint: its snapshot tables
            loaded = TableMemory.from_state(self.store, state["memory_tables"], self.layout)
            memory = {i: loaded.get(i) for i in loaded.clients()}
        else:
            memory = {int(i): feddd.Memory(int(m["round"]), m["w_local"], list(m["masks"]))
                      for i, m in state.get("memory", {}).items()}
        if isinstance(self.memory, TableMemory):
            if "memory_tables" in state:
                self.memory = loaded
                return
            for i, m in memory.items():
                self.memory[i] = m
        else:
            self.memory = memory


    def round_stats(self, updates: dict[int, ClientUpdate]) -> dict[str, float]:
        """Bytes moved this round and, with a profile, the virtual round time (eq. 12)."""
        reports = [u.report for u in updates.values() if u.report is not None]
        if not reports:
            return {}
        stats = {"upload_bytes": float(sum(r.upload_bytes or 0 for r in reports)),
                 "download_bytes": float(sum(r.download_bytes or 0 for r in reports))}
        if self.profile is not None:
            stats["virtual_s"] = max((client_seconds(r) for r in reports), default=0.0)
        return stats


def client_seconds(r: ClientReport) -> float:
    """FedDD eqs. (7), (9), (11): t^d + t^cmp + t^u of one client's round."""
    return r.download_bytes / r.down_Bps + r.compute_s + r.upload_bytes / r.up_Bps


class TableMemory:
    """FedDD's device memory on the disk state store: Ŵ_n as a row of an [N, M] float32 table, M_n as a row of
    an [N, units] uint8 table, and the round of the last upload in RAM (int64 [N], −1 = none). `get` gives the
    same `feddd.Memory` the dict holds (same bits), so clients train identically on either store."""

    def __init__(self, store: StateStore, n: int, layout: feddd.Layout, tables: dict | None = None):
        self.layout, self.n = layout, n
        if tables is None:
            tables = {"round": torch.full((n,), -1, dtype=torch.int64),
                      "w_local": store.zeros("feddd.w_local", n, layout.numel),
                      "masks": store.zeros("feddd.masks", n, max(1, layout.units), torch.uint8)}
        self.tables = tables
        self.bounds = np.cumsum([0] + [layer.units for layer in layout.layers])

    @classmethod
    def from_state(cls, store: StateStore, state: dict, layout: feddd.Layout) -> TableMemory:
        tables = {"round": state["round"].clone(), "w_local": store.adopt("feddd.w_local", state["w_local"]),
                  "masks": store.adopt("feddd.masks", state["masks"])}
        return cls(store, len(tables["round"]), layout, tables)

    def clients(self) -> list[int]:
        return [int(i) for i in torch.nonzero(self.tables["round"] >= 0).flatten()]

    def get(self, i: int) -> feddd.Memory | None:
        r = int(self.tables["round"][i])
        if r < 0:
            return None
        flat = self.tables["masks"][i].numpy().astype(bool)
        masks = [flat[a:b].copy() for a, b in zip(self.bounds[:-1], self.bounds[1:])]
        return feddd.Memory(r, self.tables["w_local"][i].clone(), masks)

    def __setitem__(self, i: int, m: feddd.Memory) -> None:
        flat = np.concatenate([np.asarray(x, bool) for x in m.masks]) if m.masks else np.zeros(0, bool)
        row = np.zeros(self.tables["masks"].shape[1], np.uint8)
        row[:len(flat)] = flat
        self.tables["masks"][i] = torch.from_numpy(row)
        self.tables["w_local"][i] = m.w_local
        self.tables["round"][i] = m.round

    def state_dict(self) -> dict:
        return dict(self.tables)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m coordinator.sim.clock", description="Write a virtual-clock profile.")
    p.add_argument("kind", choices=["table4"], help="table4: the FedDD paper's simulation ranges")
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="samples per SGD step (compute_s_per_step = B·c/f)")
    p.add_argument("--out", required=True, help="profile file (.json or .csv)")
    a = p.parse_args(argv)
    prof = table4_profile(a.clients, a.seed, a.batch_size)
    out = Path(a.out)
    if out.suffix == ".json":
        out.write_text(json.dumps(prof.to_json(), indent=1) + "\n")
    else:
        with out.open("w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(("client",) + FIELDS)
            for row in prof.to_json()["clients"]:
                wr.writerow([row["client"]] + [repr(row[k]) for k in FIELDS])
    print(f"wrote {out}: {a.clients} clients, uplink {math.floor(prof.up_Bps.min())}-"
          f"{math.ceil(prof.up_Bps.max())} B/s")


if __name__ == "__main__":
    main()
