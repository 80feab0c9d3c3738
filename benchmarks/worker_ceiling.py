"""What two cores give per-client training, and what the generic engine's worker processes get of it.

The generic engine trains the CIFAR workloads' clients with `local_train`, one client after another, in one worker
process of one thread per core (per-client mode). Its ceiling on a machine is what that many independent processes
doing the same work reach at once: the cores share caches and memory bandwidth, so two processes need not give twice
one. For each workload this measures, side by side in one run (`--repeats` rounds each, the first of each set
dropped as start-up, the median kept):

- `one process`: a process training half the round's clients as one of the engine's workers does (`PerClientEngine`:
  each client's `local_train` on the engine's copy of the model, one thread, freed memory kept), alone;
- `two processes`: two such processes at once, each half the clients; their rates summed (the ceiling);
- `engine`: `GenericEngine` in per-client mode, 2 worker processes, the whole round (`run`: the clients' results
  back in the calling process, each delta its own tensor), in a process of its own;
- `engine before` (with `--before DIR`): the same, with the code of the dropfl checkout in DIR (`git worktree add
  DIR <commit>`): a change to the engine against the code before it, side by side.

`engine ÷ two processes` is what the engine's own work costs (handing the round out, the deltas' way back into the
calling process); `two ÷ one` is what the second core gives.

    .venv/bin/python benchmarks/worker_ceiling.py [--before DIR]   # writes benchmarks/results/worker_ceiling.{md,json}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# the dropfl checkout whose code runs: this one, or the one `--engine-child CODE` measures (read from argv here, not
# in main: the engine's spawned workers run this module's top again, with the same argv, before they import dropfl)
CODE = sys.argv[sys.argv.index("--engine-child") + 1] if "--engine-child" in sys.argv[:-1] else str(HERE.parent)
sys.path.insert(0, CODE)
sys.path.insert(0, str(HERE))

from machine import cpu_model, git_commit  # noqa: E402
from workloads import WORKLOADS, build  # noqa: E402

# dropfl's own modules are imported where they are used (from CODE)

NAMES = ("resnet8-cifar", "pfl-cifar10")


def setup(name: str, clients: int):
    """The workload's model (dropfl's: SeededDropout), `clients` clients' synthetic data and their tasks."""
    from edge_client.models import SeededDropout
    from edge_client.trainer import TrainTask
    wl = WORKLOADS[name]
    model = build(name, dropout=SeededDropout, seed=0)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.rand(wl.samples, *wl.shape, generator=gen), torch.randint(0, 10, (wl.samples,), generator=gen))
            for _ in range(clients)]
    tasks = [TrainTask(c, 1, wl.lr, wl.batch, steps=wl.steps, seed=0) for c in range(clients)]
    return wl, model, data, tasks


def child(name: str, clients: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` rounds of `clients` clients trained one after another on one thread, as one of
    the engine's workers trains them: `PerClientEngine` (`local_train` on the engine's copy of the model, e.g.
    channels-last), with freed memory kept as the workers keep it."""
    from coordinator.sim.batched import _keep_freed_memory
    from coordinator.sim.functional import PerClientEngine
    from edge_client.models import get_flat
    _keep_freed_memory()
    torch.set_num_threads(1)
    _, model, data, tasks = setup(name, clients)
    w0 = get_flat(model).clone()
    eng = PerClientEngine(model, data, threads=1)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        eng.run(w0, tasks)
        times.append(time.perf_counter() - start)
    return times


def processes(name: str, half: int, repeats: int, k: int) -> list[float]:
    """Client-steps/s of each of `k` processes started at once, each training `half` clients `repeats` times."""
    steps = half * WORKLOADS[name].steps
    procs = [subprocess.Popen([sys.executable, __file__, "--child", name, str(half), str(repeats)],
                              stdout=subprocess.PIPE, text=True) for _ in range(k)]
    out = []
    for p in procs:
        text, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"worker_ceiling: a child process failed (exit {p.returncode})")
        out.append(steps / statistics.median(json.loads(text)[1:]))
    return out


def engine(name: str, repeats: int) -> float:
    """Client-steps/s of the generic engine, per-client mode, 2 workers, the whole round (in this process: the
    `--engine-child` process of `engine_rate`)."""
    import coordinator
    assert Path(coordinator.__file__).resolve().is_relative_to(Path(CODE).resolve()), coordinator.__file__
    from coordinator.sim.functional import GenericEngine
    from edge_client.models import get_flat
    wl, model, data, tasks = setup(name, WORKLOADS[name].per_round)
    w0 = get_flat(model).clone()
    eng = GenericEngine(model, data, "cpu", workers=2, mode="per-client")
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            eng.run(w0, tasks)
            times.append(time.perf_counter() - start)
    finally:
        eng.close()
    return len(tasks) * wl.steps / statistics.median(times[1:])


def _commit(code: Path) -> str:
    """The checkout's commit (`machine.git_commit`), "+" where its working tree differs from it ("?" outside git)."""
    head = git_commit(code)
    if not head:
        return "?"
    changed = subprocess.run(["git", "-C", str(code), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True).stdout.strip()
    return head + ("+" if changed else "")


def engine_rate(code: Path, name: str, repeats: int) -> float:
    """`engine` in a child process that imports the dropfl checkout at `code`."""
    p = subprocess.run([sys.executable, __file__, "--engine-child", str(code), name, str(repeats)],
                       stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"worker_ceiling: the engine's process for {code} failed (exit {p.returncode})")
    return float(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=3, metavar=("NAME", "CLIENTS", "REPEATS"), help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=7, help="rounds per measurement, the first dropped (default 7)")
    ap.add_argument("--sets", type=int, default=3, help="interleaved sets of the three measurements (median)")
    ap.add_argument("--engine-child", nargs=3, metavar=("CODE", "NAME", "REPEATS"), help=argparse.SUPPRESS)
    ap.add_argument("--before", metavar="DIR", help="also measure the engine of the dropfl checkout in DIR (e.g. "
                                                    "`git worktree add DIR HEAD` before a change), interleaved")
    ap.add_argument("--out", default=str(HERE / "results" / "worker_ceiling"))
    args = ap.parse_args()
    if args.child:
        name, clients, repeats = args.child
        print(json.dumps(child(name, int(clients), int(repeats))))
        return
    if args.engine_child:
        _, name, repeats = args.engine_child   # its checkout is on the path already (CODE)
        print(engine(name, int(repeats)))
        return
    if args.repeats < 2 or args.sets < 1:
        raise SystemExit("worker_ceiling: error: --repeats must be at least 2 and --sets at least 1")
    before = Path(args.before).resolve() if args.before else None
    if before is not None and not (before / "coordinator" / "sim" / "functional.py").is_file():
        raise SystemExit(f"worker_ceiling: error: --before {args.before}: no dropfl checkout with the generic engine "
                         "there (coordinator/sim/functional.py missing); make one with `git worktree add DIR <commit>`")
    load_before = os.getloadavg()[0]
    rows = {}
    for name in NAMES:
        half = WORKLOADS[name].per_round // 2
        kinds = ["one", "two", "engine"] + (["before"] if before else [])
        got: dict[str, list[float]] = {k: [] for k in kinds}
        for s in range(args.sets):
            for what in kinds[s % len(kinds):] + kinds[:s % len(kinds)]:   # each set in another order
                if what in ("engine", "before"):
                    got[what].append(engine_rate(HERE.parent if what == "engine" else before, name, args.repeats))
                else:
                    got[what].append(sum(processes(name, half, args.repeats, 1 if what == "one" else 2)))
            print(f"{name} set {s + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in got.items()), flush=True)
        med = {k: statistics.median(v) for k, v in got.items()}
        rows[name] = {"half_clients": half, "steps": WORKLOADS[name].steps, "sets": got, "median": med,
                      "two_over_one": med["two"] / med["one"], "engine_over_two": med["engine"] / med["two"]}
        if before:
            rows[name]["engine_over_before"] = med["engine"] / med["before"]
    meta = {"cpu": f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})", "cpus": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
            "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["benchmarks/worker_ceiling.py", *sys.argv[1:]]), "repeats": args.repeats,
            "before": None if before is None else {"dir": str(before), "commit": _commit(before)},
            "commit": _commit(HERE.parent),
            "load_avg_1min": [load_before, os.getloadavg()[0]]}
    Path(args.out + ".json").write_text(json.dumps(meta | {"workloads": rows}, indent=1) + "\n")
    md = ["# Two cores for per-client training: the ceiling and the engine (benchmarks/worker_ceiling.py)", "",
          f"`.venv/bin/python {meta['command']}`", "",
          f"CPU: {meta['cpu']}, {meta['cpus']} CPUs; torch {meta['torch']}, Python {meta['python']}; measured "
          f"{meta['measured']}, 1-min load {load_before:.2f} before, {meta['load_avg_1min'][1]:.2f} after.", "",
          f"Client-steps/s, median of {args.sets} interleaved sets; in each, a measurement's median round of "
          f"{args.repeats - 1} (after one start-up round). `one process`: half the round's clients trained as one of "
          "the engine's workers trains them (one thread, freed memory kept), alone; `two processes`: two such at "
          "once, summed; `engine`: the generic engine in "
          "per-client mode, 2 worker processes, the whole round, in a process of its own" + (
              f" (this checkout, {meta['commit']}); `engine before`: the same with the code of "
              f"{meta['before']['commit']}" if before else "") + ".", "",
          "| workload | one process | two processes | engine |" + (" engine before |" if before else "") +
          " two ÷ one | engine ÷ two |" + (" engine ÷ before |" if before else ""),
          "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if before else "")]
    for name, r in rows.items():
        m = r["median"]
        md.append(f"| {name} ({r['half_clients']} clients a process, {r['steps']} steps) | {m['one']:.1f} | "
                  f"{m['two']:.1f} | {m['engine']:.1f} |" + (f" {m['before']:.1f} |" if before else "") +
                  f" {r['two_over_one']:.2f} | {r['engine_over_two']:.2f} |" +
                  (f" {r['engine_over_before']:.2f} |" if before else ""))
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
