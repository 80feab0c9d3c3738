"""The batched engine's worker processes never outlive a killed simulation."""

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

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


# --- no room in shared memory (a container's /dev/shm is 64 MB unless it is given more) -----------------------------

SHM_ERROR = "unable to allocate shared memory(shm) for file </torch_1_2_0>: No space left on device (28)"


def _no_shm(monkeypatch) -> None:
    """torch.Tensor.share_memory_ fails as torch's does on a full /dev/shm."""
    import torch

    def refuse(self):
        raise RuntimeError(SHM_ERROR)
    monkeypatch.setattr(torch.Tensor, "share_memory_", refuse)


def test_without_room_for_the_data_the_engines_train_in_this_process(monkeypatch, caplog):
    """Where the training data does not fit in shared memory, both batched engines run their slices in this process
    (said once, with the room there is and what to do; `in_process` in their details) and give the results their
    worker processes give."""
    import torch

    from coordinator.sim.batched import BatchedEngine
    from coordinator.sim.functional import GenericEngine
    from edge_client.models import build_model, get_flat
    from edge_client.trainer import TrainTask

    g = torch.Generator().manual_seed(0)
    data = [(torch.rand(24, 1, 28, 28, generator=g), torch.randint(0, 10, (24,), generator=g)) for _ in range(4)]
    tasks = [TrainTask(c, 0, 0.05, 8, steps=3, seed=1) for c in (2, 0, 3, 1)]
    for make in (lambda m: BatchedEngine(m, data, workers=2, device="cpu"),
                 lambda m: GenericEngine(m, data, "cpu", workers=2, mode="per-client")):
        model = build_model("mimic-cnn", (1, 28, 28), seed=0)
        w = get_flat(model)
        pooled = make(model)
        try:
            ref = pooled.run(w, tasks)
        finally:
            pooled.close()
        with monkeypatch.context() as mp:
            _no_shm(mp)
            caplog.clear()
            with caplog.at_level("WARNING", logger="dropfl.sim"):
                here = make(model)
        got = here.run(w, tasks)
        here.close()
        why = here.details()["in_process"]
        assert here.details()["workers"] == 0 and why.startswith("shared memory cannot hold the ")
        assert "MB of training data (/dev/shm: " in why and SHM_ERROR in why and "--shm-size" in why
        assert [r.message for r in caplog.records if why in r.message] and len(caplog.records) == 1
        assert all(torch.equal(a.delta, b.delta) and a.loss == b.loss for a, b in zip(got, ref))


def test_a_round_whose_deltas_find_no_room_trains_in_this_process(monkeypatch, caplog):
    """The generic engine's delta blocks (made at the first round, grown later) may find /dev/shm full: that round's
    slices run in this process with the same results, said once however many rounds it happens to."""
    import torch

    from coordinator.sim import functional
    from coordinator.sim.functional import GenericEngine
    from edge_client.models import build_model, get_flat
    from edge_client.trainer import TrainTask

    g = torch.Generator().manual_seed(1)
    data = [(torch.rand(24, 1, 28, 28, generator=g), torch.randint(0, 10, (24,), generator=g)) for _ in range(4)]
    model = build_model("mimic-cnn", (1, 28, 28), seed=0)
    w = get_flat(model)
    engine = GenericEngine(model, data, "cpu", workers=2, mode="per-client")
    try:
        assert engine.workers == 2
        ref = engine.run(w, [TrainTask(c, 0, 0.05, 8, steps=2, seed=3) for c in range(4)])

        def full(self, *a):
            raise RuntimeError(SHM_ERROR)
        monkeypatch.setattr(functional._DeltaBlocks, "get", full)
        with caplog.at_level("WARNING", logger="dropfl.sim"):
            rounds = [engine.run(w, [TrainTask(c, 0, 0.05, 8, steps=2, seed=3) for c in range(4)]) for _ in range(2)]
    finally:
        engine.close()
    warned = [r.message for r in caplog.records]
    assert len(warned) == 1 and "where its deltas do not fit in shared memory" in warned[0]
    assert "MB of a round's deltas" in warned[0] and "--shm-size" in warned[0]
    for got in rounds:
        assert all(torch.equal(a.delta, b.delta) and a.loss == b.loss for a, b in zip(got, ref))


def test_a_round_that_cannot_reach_the_workers_trains_in_this_process(monkeypatch, caplog):
    """A round's weights and buffers go to the workers, and their results come back, through shared memory (torch's
    pickling): where /dev/shm is full on the way (the futures raise torch's error), that round's slices run in this
    process with the same results, said once however many rounds it happens to; a round that fits goes to the
    workers again."""
    import concurrent.futures

    import torch

    from coordinator.sim.functional import GenericEngine
    from edge_client.models import build_model, get_flat
    from edge_client.trainer import TrainTask

    g = torch.Generator().manual_seed(1)
    data = [(torch.rand(24, 1, 28, 28, generator=g), torch.randint(0, 10, (24,), generator=g)) for _ in range(4)]
    model = build_model("mimic-cnn", (1, 28, 28), seed=0)
    w = get_flat(model)
    tasks = [TrainTask(c, 0, 0.05, 8, steps=2, seed=3) for c in range(4)]
    engine = GenericEngine(model, data, "cpu", workers=2, mode="per-client")
    try:
        assert engine.workers == 2
        ref = engine.run(w, tasks)
        submit = engine.pool.submit
        sent = []

        def full(fn, *args):   # what a full /dev/shm does to a round: its futures fail with torch's error
            sent.append(fn)
            f = concurrent.futures.Future()
            f.set_exception(RuntimeError(SHM_ERROR))
            return f
        monkeypatch.setattr(engine.pool, "submit", full)
        with caplog.at_level("WARNING", logger="dropfl.sim"):
            rounds = [engine.run(w, tasks) for _ in range(2)]
        monkeypatch.setattr(engine.pool, "submit", submit)
        again = engine.run(w, tasks)
    finally:
        engine.close()
    assert len(sent) == 4   # both rounds were tried on the workers first
    warned = [r.message for r in caplog.records]
    assert len(warned) == 1 and "does not fit in shared memory on its way to or from the workers" in warned[0]
    assert "MB of a round's weights and buffers" in warned[0] and "--shm-size" in warned[0]
    for got in [*rounds, again]:
        assert all(torch.equal(a.delta, b.delta) and a.loss == b.loss for a, b in zip(got, ref))


def test_a_hand_written_engine_slice_that_cannot_reach_its_worker_trains_in_this_process(monkeypatch, caplog):
    """The hand-written batched engine: a slice whose weights or deltas find /dev/shm full on their way to or from its
    worker (its future raises torch's error) trains in this process, through `run`, `run_iter` and `run_parts` alike,
    with the worker's results bit for bit, said once; a slice that fits goes to its worker again (the first slice of
    a round fails, the second reaches its worker)."""
    import concurrent.futures

    import torch

    from coordinator.sim.batched import BatchedEngine
    from edge_client.models import build_model, get_flat
    from edge_client.trainer import TrainTask

    g = torch.Generator().manual_seed(2)
    data = [(torch.rand(24, 1, 28, 28, generator=g), torch.randint(0, 10, (24,), generator=g)) for _ in range(4)]
    model = build_model("mimic-cnn", (1, 28, 28), seed=0)
    w = get_flat(model)
    tasks = [TrainTask(c, 0, 0.05, 8, steps=2, seed=3) for c in range(4)]
    engine = BatchedEngine(model, data, workers=2, device="cpu")
    try:
        assert engine.workers == 2
        ref = engine.run(w, tasks)
        submit, sent = engine.pool.submit, []

        def first_full(fn, *args):   # the round's first slice meets a full /dev/shm, the second goes through
            sent.append(args[1])
            if len(sent) % 2:
                f = concurrent.futures.Future()
                f.set_exception(RuntimeError(SHM_ERROR))
                return f
            return submit(fn, *args)
        monkeypatch.setattr(engine.pool, "submit", first_full)
        with caplog.at_level("WARNING", logger="dropfl.sim"):
            got = [engine.run(w, tasks), [r for part in engine.run_iter(w, tasks) for r in part],
                   [r for part in engine.run_parts([(w, p, None, None) for p in engine.slices(tasks)]) for r in part]]
        assert engine._here_group is not None
        assert list(engine.no_room) == ["it does not fit in shared memory on its way to or from its worker"]
    finally:
        engine.close()
    assert len(sent) == 6 and all(len(s) == 2 for s in sent)   # every slice was sent to a worker first
    warned = [r.message for r in caplog.records]
    assert len(warned) == 1 and "trains a slice in this process" in warned[0], warned
    assert "on its way to or from its worker" in warned[0] and "--shm-size" in warned[0]
    for results in got:
        assert [r.steps for r in results] == [2] * 4
        assert all(torch.equal(a.delta, b.delta) and a.loss == b.loss for a, b in zip(results, ref))


def _unshare_usable() -> str | None:
    import os
    import shutil
    if os.geteuid() != 0:
        return "needs root (a private mount namespace with a small /dev/shm)"
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    return None


@pytest.mark.root
@pytest.mark.skipif(_unshare_usable() is not None, reason=str(_unshare_usable()))
def test_a_run_with_an_8_mb_dev_shm_completes_with_the_same_model(tmp_path):
    """`dropfl sim` where /dev/shm is an 8 MB tmpfs (a private mount namespace; a container's default is 64 MB) and
    FMNIST's 189 MB cannot be shared: the run completes, says once why its engine trains in one process and what to
    do, and its model and metrics are those of the same run with room (the slices are the same)."""
    import json

    import torch
    args = [sys.executable, "-m", "coordinator.cli", "sim", "--dataset", "fmnist", "--model", "mlp", "--clients", "6",
            "--rounds", "2", "--steps", "2", "--threads", "1"]
    roomy = subprocess.run(args + ["--out", str(tmp_path / "roomy")], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert roomy.returncode == 0, roomy.stderr
    small = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$@"', "sh",
                            *args, "--out", str(tmp_path / "small")], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert small.returncode == 0, small.stderr
    said = [line for line in (small.stdout + small.stderr).splitlines() if "shared memory cannot hold" in line]
    assert len(said) == 1 and "/dev/shm: 8 MB free of 8 MB" in said[0] and "--shm-size" in said[0], said
    assert "shared memory" not in roomy.stdout + roomy.stderr
    a, b = (torch.load(tmp_path / d / "model.pt") for d in ("roomy", "small"))   # state dicts
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def metrics(d):   # every field but the wall times
        rows = [json.loads(r) for r in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in ("seconds", "elapsed")} for r in rows]
    assert len(metrics("roomy")) == 2 and metrics("roomy") == metrics("small")


def _malloc_settings() -> dict:
    """In a worker process: the mallopt settings `coordinator.alloc` applied there, and whether they took."""
    from coordinator import alloc
    return dict(alloc._applied)


@pytest.mark.parametrize("env", [None, "default"])
def test_the_workers_keep_freed_memory_unless_told_not_to(env, monkeypatch):
    """The engines' worker processes tell glibc to keep freed memory (mmap threshold and trim threshold 1 GiB: no page
    faults on each step's buffers), through `coordinator.alloc` like the coordinator's process; DROPFL_MALLOC=default
    keeps glibc's own settings there too."""
    import platform

    import torch

    from coordinator.sim.functional import GenericEngine
    from edge_client.models import build_model

    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's; elsewhere the workers keep the allocator's defaults")
    if env is None:
        monkeypatch.delenv("DROPFL_MALLOC", raising=False)
    else:
        monkeypatch.setenv("DROPFL_MALLOC", env)   # the spawned workers inherit it
    data = [(torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,))) for _ in range(2)]
    engine = GenericEngine(build_model("mimic-cnn", (1, 28, 28), seed=0), data, "cpu", workers=2, mode="per-client")
    try:
        assert engine.workers == 2
        settings = engine.pool.submit(_malloc_settings).result(timeout=120)
    finally:
        engine.close()
    assert settings == {((-3, 1 << 30), (-1, 1 << 30)): env is None}
