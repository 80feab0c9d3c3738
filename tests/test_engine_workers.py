"""The batched engine's worker processes never outlive a killed simulation."""

import signal
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
CODE = r'''
import sys, torch
sys.path.insert(0, sys.argv[1])
from coordinator.sim.batched import BatchedEngine
from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask
m = build_model("mimic-cnn", (1, 28, 28))
data = [(torch.rand(32, 1, 28, 28), torch.randint(0, 10, (32,))) for _ in range(4)]
e = BatchedEngine(m, data, workers=2, device="cpu")
e.run(get_flat(m), [TrainTask(i, 0, 0.01, 16, steps=1) for i in range(4)])  # workers are up
print("ready", flush=True)
e.run(get_flat(m), [TrainTask(i, 0, 0.01, 16, steps=10**7) for i in range(4)])  # a very long round
'''


def test_workers_die_with_a_killed_parent():
    p = subprocess.Popen([sys.executable, "-c", CODE, str(ROOT)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        workers = [c for c in psutil.Process(p.pid).children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) >= 2
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    _, alive = psutil.wait_procs(workers, timeout=20)
    for w in alive:
        w.kill()
    assert alive == []
