"""Per-client tables on disk (--state-store disk) give the same bits as in RAM, checkpoints of the disk store
resume exactly, and the columnar participation log (--participation-format npz) holds what participation.csv
holds, for `dropfl report`, `dropfl trace show` and `--availability replay` (docs/scale-out.md)."""

import csv
import json

import numpy as np
import pytest
import torch
from strategy_helpers import cache_dataset_loads

from coordinator.availability import columnar
from coordinator.availability.models import RoundAvailability
from coordinator.cli import main
from coordinator.cli.trace import summarise
from coordinator.report.compare import load_run, raster_codes
from coordinator.sim.clock import table4_profile
from coordinator.statestore import DiskTable, StateStore, row_sum

N = 6
TINY = ["--clients", str(N), "--steps", "1", "--batch-size", "8", "--lr", "0.05", "--model", "logreg",
        "--threads", "1", "--no-progress", "--engine", "loop", "--availability", "bounded", "--tau-max", "3",
        "--min-active", "2"]
STORED = ["mifa", "mimic", "mimic-client", "fedlaavg", "scaffold", "feddd"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    (d / "profile.json").write_text(json.dumps(table4_profile(N, seed=0, batch_size=8).to_json()))
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        yield d


def algo_args(algo: str, base) -> list[str]:
    extra = ["--algo", algo]
    if algo == "fedlaavg":
        extra += ["--beta", "0.5"]
    if algo == "feddd":  # a virtual clock: measured times that do not depend on the wall clock
        extra += ["--clock-profile", str(base / "profile.json")]
    return extra


def sim(out, *args: str) -> bytes:
    assert main(["sim", *TINY, *args, "--out", str(out)]) == 0
    return (out / "model.pt").read_bytes()


@pytest.mark.parametrize("algo", STORED)
def test_disk_store_gives_the_memory_store_bits_and_resumes_exactly(base, algo):
    args = algo_args(algo, base)
    mem = sim(base / f"{algo}-mem", *args, "--rounds", "4", "--state-store", "memory")
    disk_dir = base / f"{algo}-disk"
    assert sim(disk_dir, *args, "--rounds", "4", "--state-store", "disk") == mem
    live = sorted(p.name for p in (disk_dir / "state").iterdir())
    assert live, "the disk store wrote no table"
    ck = torch.load(disk_dir / "checkpoint.pt", weights_only=False)
    assert not any(isinstance(v, torch.Tensor) and v.dim() == 2 for v in ck["state"].values())  # refs, not tables
    # two rounds, then resume to four: the checkpoint's snapshot, not the live tables, is what continues
    part = base / f"{algo}-part"
    sim(part, *args, "--rounds", "2", "--state-store", "disk")
    snaps = sorted(p.name for p in (part / "checkpoint.state").iterdir())
    assert snaps == ["r0", "r1"]  # checkpoint.pt's and checkpoint.prev.pt's, nothing else
    assert main(["sim", *TINY, *args, "--rounds", "4", "--state-store", "disk", "--out", str(part), "--resume"]) == 0
    assert (part / "model.pt").read_bytes() == mem
    assert sorted(p.name for p in (part / "checkpoint.state").iterdir()) == ["r2", "r3"]


def test_resume_may_move_the_tables_between_stores(base):
    args = algo_args("mimic", base)
    full = sim(base / "mv-full", *args, "--rounds", "4", "--state-store", "memory")
    for a, b in (("memory", "disk"), ("disk", "memory")):
        out = base / f"mv-{a}-{b}"
        sim(out, *args, "--rounds", "2", "--state-store", a)
        assert main(["sim", *TINY, *args, "--rounds", "4", "--state-store", b, "--out", str(out), "--resume"]) == 0
        assert (out / "model.pt").read_bytes() == full


def test_a_crash_after_the_snapshot_and_before_checkpoint_pt_resumes_from_the_old_checkpoint(base):
    args = algo_args("mifa", base)
    full = sim(base / "crash-full", *args, "--rounds", "3", "--state-store", "disk")
    out = base / "crash"
    sim(out, *args, "--rounds", "2", "--state-store", "disk")
    # the state of a crash in round 2's save: its snapshot complete, checkpoint.pt still round 1's, live tables
    # already written by round 2 (here: garbage)
    live = out / "state" / "mifa.latest.bin"
    live.write_bytes(b"\x7f" * live.stat().st_size)
    (out / "checkpoint.state" / "r2").mkdir()
    assert main(["sim", *TINY, *args, "--rounds", "3", "--state-store", "disk", "--out", str(out), "--resume"]) == 0
    assert (out / "model.pt").read_bytes() == full


def test_disk_table_indexing_and_row_sum_match_a_tensor(tmp_path, monkeypatch):
    import coordinator.statestore as ss

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(37, 5, generator=g)
    t = DiskTable(tmp_path / "t.bin", 37, 5)
    t[0:37] = ref
    idx = torch.tensor([3, 1, 3, 36])
    assert torch.equal(t[idx], ref[idx]) and torch.equal(t[4], ref[4]) and torch.equal(t[-1], ref[-1])
    ref[idx] = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    t[idx] = torch.arange(20, dtype=torch.float32).reshape(4, 5)  # repeated index: the last row wins, as torch
    assert torch.equal(t[0:37], ref)
    assert torch.equal(row_sum(t), row_sum(ref)) and torch.equal(row_sum(ref), ref.sum(0))  # one block
    monkeypatch.setattr(ss, "SUM_BLOCK_BYTES", 3 * 5 * 4)  # blocks of 3 rows: the same on both stores
    assert torch.equal(row_sum(t), row_sum(ref))
    with pytest.raises(IndexError):
        t[37]
    store = StateStore("disk", tmp_path)
    back = StateStore("memory", tmp_path).adopt("x", store.adopt("x", ref))
    assert torch.equal(back, ref)


def test_columnar_log_holds_the_csv_rows_and_is_read_by_report_trace_show_and_replay(base):
    args = ["--algo", "fedlaavg", "--beta", "0.5"]
    csv_run, npz_run = base / "p-csv", base / "p-npz"
    ref = sim(csv_run, *args, "--rounds", "5", "--participation-format", "csv")
    assert sim(npz_run, *args, "--rounds", "5", "--participation-format", "npz") == ref
    assert not (npz_run / "participation.csv").exists()
    with open(csv_run / "participation.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert columnar.to_rows(*columnar.read_columnar(npz_run / "participation")) == rows
    # dropfl report: the same raster codes and labels; dropfl trace show: the same summary
    a, b = raster_codes(load_run(csv_run)), raster_codes(load_run(npz_run))
    assert sorted(a[1]) == sorted(b[1])
    assert np.array_equal(np.array(a[1], object)[a[0]], np.array(b[1], object)[b[0]])
    assert summarise(npz_run) == summarise(csv_run)
    assert main(["report", str(npz_run), "--out", str(base / "p-report")]) == 0
    assert (base / "p-report" / "participation-p-npz.png").exists()
    # a replay of the columnar log is the recorded run, bit for bit
    again = sim(base / "p-replay", *args, "--rounds", "5", "--availability", "replay",
                "--trace", str(npz_run / "participation"))
    assert again == ref


def test_columnar_log_chunks_rounds_and_cuts_back_on_resume(tmp_path, monkeypatch):
    monkeypatch.setattr(columnar, "CHUNK", 3)
    d = tmp_path / "participation"
    log = columnar.ColumnarLog(d)
    avail = RoundAvailability(np.array([True, True, False, True]), {2: "battery"})
    for t in range(7):
        log.write_round(t, 4, avail, [0, 1], {0}, {1: "deadline"})
    names = sorted(p.name for p in d.iterdir())
    assert names == ["round-000006.npz", "rounds-000000-000002.npz", "rounds-000003-000005.npz"]
    rounds, status, reason = columnar.read_columnar(d)
    assert rounds.tolist() == list(range(7))
    assert status[4].tolist() == [columnar.PARTICIPATED, columnar.DROPPED, columnar.UNAVAILABLE,
                                  columnar.NOT_SELECTED]
    assert columnar.to_rows(rounds[:1], status[:1], reason[:1])[1:3] == [
        {"round": "0", "client": "1", "status": "dropped", "reason": "deadline"},
        {"round": "0", "client": "2", "status": "unavailable", "reason": "battery"}]
    columnar.ColumnarLog(d, resume_from_round=4)  # a resume from the checkpoint of round 3
    assert columnar.read_columnar(d)[0].tolist() == [0, 1, 2, 3]


def test_overwrite_removes_the_disk_store_and_the_columnar_log(base):
    out = base / "ow"
    sim(out, "--algo", "mimic", "--rounds", "1", "--state-store", "disk", "--participation-format", "npz")
    assert (out / "state").is_dir() and (out / "checkpoint.state").is_dir() and (out / "participation").is_dir()
    assert main(["sim", *TINY, "--algo", "mimic", "--rounds", "1", "--state-store", "memory", "--out", str(out),
                 "--overwrite"]) == 0
    assert not any((out / d).exists() for d in ("state", "checkpoint.state", "participation"))
    assert (out / "participation.csv").is_file()


def test_resume_refuses_a_damaged_snapshot_and_touches_nothing(base, capsys):
    out = base / "damaged"
    sim(out, "--algo", "scaffold", "--rounds", "2", "--state-store", "disk")
    snap = out / "checkpoint.state" / "r1" / "state.c_clients.bin"
    snap.write_bytes(snap.read_bytes()[:-4])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["sim", *TINY, "--algo", "scaffold", "--rounds", "3", "--state-store", "disk", "--out", str(out),
                 "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dropfl: error: --resume:") and "state.c_clients.bin" in err and "checkpoint.prev.pt" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
