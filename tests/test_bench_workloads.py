"""benchmarks/sim_throughput.py --workload: the workloads' models have the shapes they claim, and a framework that is
not installed (or does not install) is one recorded line, not a traceback. Nothing here measures speed."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from torch import nn

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
workloads = importlib.import_module("workloads")
sim_throughput = importlib.import_module("sim_throughput")
machine = importlib.import_module("machine")


@pytest.mark.parametrize("name", list(workloads.WORKLOADS))
def test_each_workload_s_models_take_its_input_and_give_ten_logits(name):
    wl = workloads.WORKLOADS[name]
    x = torch.rand(3, *wl.shape)
    for model in (workloads.build(name), sim_throughput.workload_model(name, wl)):   # other frameworks', dropfl's
        assert model(x).shape == (3, 10)


def test_the_pfl_cnn_is_pfl_research_s_simple_cnn_and_dropfl_s_copy_replays_its_dropout():
    from edge_client.models import SeededDropout
    wl = workloads.WORKLOADS["pfl-cifar10"]
    assert (wl.clients, wl.per_round, wl.batch, wl.samples // wl.batch) == (1000, 50, 10, wl.steps)
    theirs = workloads.build("pfl-cifar10")
    ours = sim_throughput.workload_model("pfl-cifar10", wl)
    shapes = [tuple(p.shape) for p in theirs.parameters()]
    assert shapes == [(32, 3, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 12544), (128,), (10, 128), (10,)]
    assert sum(p.numel() for p in theirs.parameters()) == 1_626_442
    assert [tuple(p.shape) for p in ours.parameters()] == shapes
    assert [type(m) for m in theirs.modules() if "Dropout" in type(m).__name__] == [nn.Dropout, nn.Dropout]
    assert [m.p for m in ours.modules() if isinstance(m, SeededDropout)] == [0.25, 0.5]


def test_the_resnet8_workload_is_the_examples_package_s_with_batchnorm():
    model = sim_throughput.workload_model("resnet8-cifar", workloads.WORKLOADS["resnet8-cifar"])
    assert type(model).__module__ == "dropfl_examples.resnet"
    assert sum(p.numel() for p in model.parameters()) == 78_042
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def test_a_missing_framework_is_one_line_saying_how_to_install_it(tmp_path):
    status = sim_throughput.framework_status(tmp_path / "python", "setup_pfl.sh", False, 2, "pfl")
    assert status.startswith("not measured: ") and "--setup-pfl runs benchmarks/setup_pfl.sh" in status
    assert "\n" not in status
    assert sim_throughput.framework_status(tmp_path / "python", "setup_flower.sh", False, 0, "flower") == \
        "not measured: --flower-runs 0"


def test_a_framework_that_does_not_install_records_pip_s_error(tmp_path, monkeypatch):
    out = "WARNING: Location 'file:///x' is ignored\nERROR: No matching distribution found for pfl==0.6.0\n"
    monkeypatch.setattr(sim_throughput.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 1, stdout="", stderr=out))
    status = sim_throughput.framework_status(tmp_path / "python", "setup_pfl.sh", True, 2, "pfl")
    assert status == ("not measured: benchmarks/setup_pfl.sh failed (exit 1): "
                      "ERROR: No matching distribution found for pfl==0.6.0")


def test_an_unknown_workload_is_a_one_line_error_before_anything_runs(tmp_path):
    with pytest.raises(SystemExit) as e:
        sim_throughput.run_workloads(Namespace(workload="mimic-fmnist,nope", out=str(tmp_path)))
    assert str(e.value).startswith("sim_throughput: error: --workload nope: unknown; one of mimic-fmnist")
    assert list(tmp_path.iterdir()) == []


def test_a_framework_run_that_hangs_is_killed_and_said_so():
    with pytest.raises(RuntimeError, match=r"did not finish within 1 s \(its process group was killed\)"):
        sim_throughput.run_framework([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)


def test_the_gpu_benchmark_without_a_gpu_is_one_line_and_its_record_is_its_own_rendering(tmp_path):
    """benchmarks/gpu_throughput.py: where torch sees no GPU, one line and nothing written; the committed record's
    table is what the script renders from the committed JSON (not edited by hand)."""
    gpu = importlib.import_module("gpu_throughput")
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(BENCH / "gpu_throughput.py"), "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and list(tmp_path.iterdir()) == []
        assert proc.stderr.strip().splitlines()[-1] == \
            "gpu_throughput: error: torch sees no GPU here; run it on a machine with one"
    record = json.loads((BENCH / "results" / "gpu_throughput.json").read_text())
    assert gpu.markdown(record) == (BENCH / "results" / "gpu_throughput.md").read_text()
    assert set(record["workloads"]) == set(workloads.WORKLOADS)


def test_the_results_name_a_cpu_by_its_model_and_a_vm_s_bare_line_by_its_family_and_model_too():
    block = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: {f}\nmodel\t\t: {m}\nmodel name\t: {name}\n\n"
    two = block.format(n=0, f=26, m=2, name="AMD EPYC") + block.format(n=1, f=99, m=9, name="other")
    assert machine.cpu_model(two) == "AMD EPYC (family 26, model 2)"   # the first CPU's block
    named = block.format(n=0, f=6, m=106, name="Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz")
    assert machine.cpu_model(named) == "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"
    assert machine.cpu_model("processor\t: 0\nmodel name\t: AMD EPYC\n") == "AMD EPYC"   # no family: as it is


@pytest.mark.parametrize("record", ["sim_throughput_workloads", "sim_throughput_workloads_zen5"])
def test_each_committed_benchmark_of_record_is_its_own_rendering(record):
    """The markdown is `workloads_markdown` of the JSON beside it, records from before the peak's two kernels
    included (their bound says it was the matmul alone)."""
    o = json.loads((BENCH / "results" / f"{record}.json").read_text())
    md = (BENCH / "results" / f"{record}.md").read_text()
    assert sim_throughput.workloads_markdown(o).strip() == md.strip()
    first = next(iter(o["workloads"].values()))["setup"]
    assert ("the peak kernels" in md) == ("peak_method" in first) != ("(the matmul on" in md)
