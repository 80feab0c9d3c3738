"""What measuring a round costs the agent (edge_client/telemetry.py): rounds of local training (FMNIST-shaped
mimic-cnn, CPU torch, one thread) run side by side, interleaved, in three ways — plain; inside a RoundRecord
without a power sensor (energy modelled); inside a RoundRecord with a fake Jetson INA3221 hwmon tree, so
that the sampler thread reads the sensor every `--interval` seconds while the round runs. Prints and writes
the median seconds per round of each and their ratios to plain.

    .venv/bin/python benchmarks/telemetry_overhead.py     # writes benchmarks/results/telemetry_overhead.{json,md}
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "telemetry_overhead"))
    args = p.parse_args()

    import torch

    from edge_client.battery import BatteryConfig
    from edge_client.models import build_model, get_flat
    from edge_client.telemetry import RoundRecord, Telemetry, TelemetryConfig
    from edge_client.trainer import TrainTask, local_train

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(2000, 1, 28, 28, generator=g), torch.randint(0, 10, (2000,), generator=g)
    model = build_model("mimic-cnn", (1, 28, 28), 10, 0)
    w = get_flat(model)
    with tempfile.TemporaryDirectory() as tmp:
        hw = Path(tmp) / "sys/class/hwmon/hwmon0"
        hw.mkdir(parents=True)
        files = {"name": "ina3221", "in1_label": "VDD_IN", "in1_input": "5000", "curr1_input": "1000"}  # 5 W
        for name, text in files.items():
            (hw / name).write_text(text + "\n")
        tels = {"modelled": Telemetry(TelemetryConfig(sysfs_root=tmp, vcgencmd=""), BatteryConfig()),
                "sensor": Telemetry(TelemetryConfig(sysfs_root=tmp, vcgencmd="", interval_s=args.interval),
                                    BatteryConfig())}
        tels["modelled"].power = tels["modelled"].counter = None  # no sensor: the modelled path
        for t in tels.values():
            t.start()
        times: dict[str, list[float]] = {"plain": [], "modelled": [], "sensor": []}
        joules = []
        for r in range(args.rounds + 1):  # round 0 warms up, not counted
            for way in times:
                task = TrainTask(client=0, round=r, lr=0.05, batch_size=16, steps=args.steps, epochs=None, seed=r)
                t0 = time.perf_counter()
                rec = RoundRecord(tels[way], None) if way != "plain" else None
                if rec:
                    rec.begin("train", busy=True)
                local_train(model, w, x, y, task)
                if rec:
                    rec.begin("upload", busy=False)
                    out = rec.finish(None)
                    if way == "sensor":
                        joules.append((out["energy_j"], out["energy_source"]))
                if r:
                    times[way].append(time.perf_counter() - t0)
        bare = []  # a record alone (no training): what the measuring itself costs, with the model's RSS resident
        for _ in range(200):
            t0 = time.perf_counter()
            RoundRecord(tels["sensor"], None).finish(None)
            bare.append(time.perf_counter() - t0)
        for t in tels.values():
            t.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"command": " ".join(["python benchmarks/telemetry_overhead.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.platform(),
              "rounds": args.rounds, "steps": args.steps, "interval_s": args.interval,
              "median_round_s": med, "ratio_to_plain": {k: med[k] / med["plain"] for k in med},
              "sensor_energy_j_median": statistics.median(j for j, _ in joules[1:]), "sensor": joules[0][1],
              "record_alone_ms_median": 1e3 * statistics.median(bare)}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    md = ["# Telemetry overhead per round\n", f"`{result['command']}` ({result['date']}, {result['machine']})\n",
          f"{args.rounds} rounds of {args.steps} SGD steps (mimic-cnn, batch 16, 1 thread), interleaved:\n",
          "| way | median s / round | ratio to plain |", "|---|---:|---:|"]
    md += [f"| {k} | {med[k]:.4f} | {result['ratio_to_plain'][k]:.3f} |" for k in med]
    md.append(f"\nsensor: {result['sensor']} (fake hwmon tree, 5 W), sampled every {args.interval} s; median "
              f"energy per round {result['sensor_energy_j_median']:.3f} J\n")
    md.append(f"a RoundRecord alone (start and finish, sensor path, no training): median "
              f"{result['record_alone_ms_median']:.3f} ms\n")
    Path(args.out + ".md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
