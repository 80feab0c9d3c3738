"""coordinator/alloc.py: glibc keeps freed memory for reuse in the coordinator's process. Evaluations in
one thread after another do not fault their buffers in again (page faults counted by the kernel, not
timed), the setting can be turned off, and a simulation gives the same bytes either way."""

import json
import os
import platform
import subprocess
import sys

import pytest
from fieldkit import CLI, ROOT

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt is glibc's; elsewhere keep_freed_memory is a no-op")

FAULTS = """
import resource, sys, threading
import coordinator.cli   # as `dropfl` starts: one arena, before torch's first thread
import torch
from coordinator.alloc import keep_freed_memory
from edge_client.models import build_model, get_flat
from edge_client.trainer import evaluate
print(keep_freed_memory(), file=sys.stderr)
torch.manual_seed(0)
x, y = torch.rand(10_000, 1, 28, 28), torch.randint(0, 10, (10_000,))
m = build_model("mimic-cnn", (1, 28, 28), 10, seed=0)
w = get_flat(m)

def work():
    for _ in range(2):
        evaluate(m, w, x, y)   # the coordinator's evaluation: batches of 2,000, buffers of 28-115 MB

work()   # the first evaluation faults its pages in either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):   # one thread after another, as lockstep's runs take turns
    t = threading.Thread(target=work)
    t.start()
    t.join()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(env_malloc: str | None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "DROPFL_MALLOC"}
    if env_malloc is not None:
        env["DROPFL_MALLOC"] = env_malloc
    p = subprocess.run([sys.executable, "-c", FAULTS], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300, check=True)
    return int(p.stdout.strip()), p.stderr.strip()


def test_freed_memory_is_reused_not_faulted_in_again():
    kept, applied = faults(None)
    default, off = faults("default")
    assert applied == "True" and off == "False"
    # glibc's defaults: ~110,000 faults per evaluation (measured 658,631 for these 6; kept: 2,686)
    assert default > 100_000, default
    assert kept < default / 20, (kept, default)


def test_a_simulation_gives_the_same_bytes_either_way(tmp_path):
    args = ["sim", "--dataset", "fmnist", "--clients", "4", "--model", "mimic-cnn", "--steps", "2", "--rounds", "2",
            "--threads", "1", "--no-progress"]
    out = {}
    for name, value in (("kept", None), ("default", "default")):
        env = {k: v for k, v in os.environ.items() if k != "DROPFL_MALLOC"}
        if value:
            env["DROPFL_MALLOC"] = value
        subprocess.run(CLI + args + ["--out", str(tmp_path / name)], cwd=ROOT, env=env, check=True, timeout=600,
                       capture_output=True)
        out[name] = (tmp_path / name / "model.pt").read_bytes(), [
            {k: v for k, v in json.loads(x).items() if k not in ("seconds", "elapsed")}
            for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert out["kept"] == out["default"]
