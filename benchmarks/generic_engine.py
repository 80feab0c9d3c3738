"""The generic batched engine (coordinator/sim/functional.py, torch.func) against the per-client loop, side by side.

Two models that have no hand-written batched forward (defined here, as a user's plugin would be):
- `lenet`: a LeNet-5 on 28×28×1 (MimiC's FMNIST CNN, as its own class), batch 16;
- `resnet8`: a ResNet-8 on 32×32×3 with BatchNorm (stem + three basic blocks 16/32/64, 78k parameters), batch 32.
Each round: `--clients` clients (15) × `--steps` SGD steps, random data, float32, on the CPU with `--threads`
intra-op threads (default "2,1": each setting measured in turn). Variants, interleaved (A B B A ...) per repeat,
each timed by wall clock and by this process's CPU time, best of `--repeats`:
- `loop`: `edge_client.trainer.local_train`, one client after another (the reference);
- `generic`: `FunctionalEngine.run` (vmap over functional_call, one backward of Σ losses) — the engine;
- `vmap(grad)`: the same step as `vmap(grad_and_value(loss))` (torch.func's per-sample-gradient idiom);
- `nchw`: the engine with its images in plain NCHW layout (`--variants` to include it: slow).
Reported: client-steps/s, each variant's ratio to the loop, and the largest |Δ delta| to the loop.

    .venv/bin/python benchmarks/generic_engine.py [--threads 2,1] [--steps 3] [--repeats 2] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad_and_value, vmap

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_model  # noqa: E402

from coordinator.sim.functional import FunctionalEngine  # noqa: E402
from edge_client.models import get_flat  # noqa: E402
from edge_client.trainer import TrainTask, local_train  # noqa: E402


class LeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(256, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1))))))


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out)
        self.c2, self.b2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out)
        self.short = nn.Sequential() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + self.short(x))


class ResNet8(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16)
        self.l1, self.l2, self.l3 = Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        h = self.l3(self.l2(self.l1(torch.relu(self.bn(self.stem(x))))))
        return self.fc(h.mean((2, 3)))


WORKLOADS = {"lenet": (LeNet, (1, 28, 28), 16), "resnet8": (ResNet8, (3, 32, 32), 32)}


class GradEngine(FunctionalEngine):
    """The step as vmap(grad_and_value(loss)): per-client gradients by torch.func's own transform."""

    def _step(self, params, buffers, x, y, masks):
        grads, loss = vmap(grad_and_value(self._client_loss), randomness="different")(params, buffers, x, y, masks)
        return loss, tuple(grads[n] for n in params)


class NchwEngine(FunctionalEngine):
    """The engine with its images in plain NCHW layout (what its channels-last input avoids)."""

    def _inputs(self, rows):
        return self.x_all[rows]


def measure(name: str, clients: int, steps: int, repeats: int, variants: list[str]) -> dict:
    cls, shape, batch = WORKLOADS[name]
    torch.manual_seed(0)
    model = cls()
    w = get_flat(model)
    g = torch.Generator().manual_seed(0)
    data = [(torch.rand(batch * steps, *shape, generator=g), torch.randint(0, 10, (batch * steps,), generator=g))
            for _ in range(clients)]
    tasks = [TrainTask(client=i, round=0, lr=0.05, batch_size=batch, steps=steps, seed=1) for i in range(clients)]
    engines = {"generic": FunctionalEngine, "vmap(grad)": GradEngine, "nchw": NchwEngine}
    made = {v: engines[v](model, data, device="cpu") for v in variants if v != "loop"}
    loop_model = copy.deepcopy(model)

    def run(v: str):
        if v == "loop":
            return [local_train(loop_model, w, *data[t.client], t) for t in tasks]
        return made[v].run(w, tasks)

    for v in made:   # warm-up (allocator, oneDNN primitives)
        made[v].run(w, tasks[:2])
    run("loop") if steps <= 2 else None
    best = {v: (float("inf"), float("inf")) for v in variants}
    ref, diffs = None, {}
    for r in range(repeats):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            wall, cpu = time.perf_counter(), time.process_time()
            out = run(v)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best[v] = (min(best[v][0], wall), min(best[v][1], cpu))
            if v == "loop":
                ref = out
            else:
                diffs[v] = out
    n = clients * steps
    rows = {}
    for v in variants:
        rows[v] = {"client_steps_per_s": n / best[v][0], "cpu_s_per_client_step": best[v][1] / n,
                   "ratio_wall": best["loop"][0] / best[v][0], "ratio_cpu": best["loop"][1] / best[v][1]}
        if v != "loop":
            rows[v]["max_abs_delta_diff"] = max(float((a.delta - b.delta).abs().max()) for a, b in zip(diffs[v], ref))
    return {"model": name, "params": w.numel(), "input": list(shape), "batch": batch, "clients": clients,
            "steps": steps, "variants": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--clients", type=int, default=15)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", default="lenet,resnet8")
    ap.add_argument("--variants", default="loop,generic,vmap(grad)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    variants = a.variants.split(",")
    if variants[0] != "loop":
        variants = ["loop"] + [v for v in variants if v != "loop"]
    results = []
    load_before = os.getloadavg()
    for threads in [int(t) for t in a.threads.split(",")]:
        torch.set_num_threads(threads)
        for name in a.models.split(","):
            r = measure(name, a.clients, a.steps, a.repeats, variants) | {"threads": threads}
            results.append(r)
            for v, row in r["variants"].items():
                print(f"{name:8s} threads={threads} {v:11s} {row['client_steps_per_s']:8.1f} client-steps/s  "
                      f"x{row['ratio_wall']:.2f} wall, x{row['ratio_cpu']:.2f} cpu vs loop"
                      + (f"  |Δ|≤{row['max_abs_delta_diff']:.1e}" if "max_abs_delta_diff" in row else ""),
                      flush=True)
    meta = {"cpu": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "command": " ".join(sys.argv)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "generic_engine.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    lines = ["# Generic batched engine (torch.func) vs the per-client loop", "",
             f"CPU: {meta['cpu']} ({meta['isa']}, {meta['cores']} cores), torch {meta['torch']}; "
             f"load average {load_before[0]:.1f} before, {meta['loadavg_after'][0]:.1f} after (a shared machine).",
             f"`{meta['command']}`", "",
             "| model | batch | threads | variant | client-steps/s | × loop (wall) | × loop (CPU) | max abs Δ delta |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for v, row in r["variants"].items():
            d = f"{row['max_abs_delta_diff']:.1e}" if "max_abs_delta_diff" in row else ""
            lines.append(f"| {r['model']} | {r['batch']} | {r['threads']} | {v} | {row['client_steps_per_s']:.1f} | "
                         f"{row['ratio_wall']:.2f} | {row['ratio_cpu']:.2f} | {d} |")
    (out / "generic_engine.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'generic_engine.json'} and {out / 'generic_engine.md'}")


if __name__ == "__main__":
    main()
