"""The registries (edge_client/registry.py): built-ins resolve; a plugin given as module:attr, or installed with an
entry point, runs a `dropfl sim` end to end; a bad name is one line before anything is written; `dropfl plugins`
and `--help` list the registries' names; each model fact is declared once, with the model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from coordinator import cli, config
from coordinator.availability.models import AVAILABILITY, Bounded
from coordinator.strategies import STRATEGIES, FedAvg
from edge_client import datasets, models, partition
from edge_client.registry import PluginError, Registry

ROOT = Path(__file__).resolve().parents[1]
MOD = "dropfl_test_plugin"   # the plugin module, written into a temporary directory put on sys.path

PLUGIN = '''
"""A user's plugins: FedAvgM, a tiny CNN, a synthetic image set, a round-robin partition, Markov on/off."""
import numpy as np
import torch
from torch import nn

from coordinator.availability.models import Availability
from coordinator.strategies.base import mean_delta
from coordinator.strategies.fedavg import FedAvg
from edge_client.datasets import Dataset, Split

CALLS = []


class FedAvgM(FedAvg):
    """FedAvg with server momentum (Hsu et al. 2019): v = beta v + d, w = w - v."""
    name = "fedavgm"
    beta = 0.9

    def init_state(self, n_clients, w0):
        CALLS.append("fedavgm")
        return {"v": torch.zeros_like(w0)}

    def aggregate(self, state, t, w, updates):
        if not updates:
            return w, state
        v = self.beta * state["v"] + mean_delta(updates, self.weighting)
        return w - v, {**state, "v": v}


class TinyNet(nn.Module):
    def __init__(self, input_shape, num_classes, dropout=None):
        super().__init__()
        c = input_shape[0]
        self.conv = nn.Conv2d(c, 4, 3, padding=1)
        self.fc = nn.Linear(4 * input_shape[1] * input_shape[2], num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def tiny_images(data_dir):
    g = torch.Generator().manual_seed(0)
    def split(n):
        y = torch.arange(n) % 10
        x = torch.rand(n, 1, 6, 6, generator=g) * 0.1
        x[torch.arange(n), 0, y % 6, y // 6] += 1.0        # each class lights one pixel
        return Split(x, y.to(torch.int64))
    return Dataset("tiny-images", split(200), split(50))


def round_robin(labels, n_clients, seed):
    return [np.arange(i, len(labels), n_clients, dtype=np.int64) for i in range(n_clients)]


class MarkovOnOff(Availability):
    """Each client flips on -> off with probability 0.3 and off -> on with 0.5 per round."""
    name = "markov"

    def round(self, t):
        from coordinator.availability.models import RoundAvailability
        rng = np.random.default_rng([self.seed, 7])
        on = np.ones(self.n, bool)
        for _ in range(t):
            u = rng.random(self.n)
            on = np.where(on, u >= 0.3, u < 0.5)
        if t == 0 and self.first_round_all:
            on[:] = True
        return RoundAvailability(on, {int(i): "model_draw" for i in np.flatnonzero(~on)})


NOT_A_STRATEGY = 42


def broken_loader(data_dir):
    raise RuntimeError("the plugin's own bug")
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plugin module on sys.path (as PYTHONPATH would put it), and an installed distribution declaring entry
    points for it (a .dist-info folder on sys.path, as pip would write it)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / f"{MOD}.py").write_text(textwrap.dedent(PLUGIN))
    info = src / "dropfl_test_plugin-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dropfl-test-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(
        f"[dropfl.models]\ntinynet = {MOD}:TinyNet\n\n"
        f"[dropfl.strategies]\nfedavgm = {MOD}:FedAvgM\nbad-kind = {MOD}:NOT_A_STRATEGY\n"
        f"fedavg = {MOD}:FedAvgM\n")
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.delitem(sys.modules, MOD, raising=False)
    yield src
    sys.modules.pop(MOD, None)


# --- built-ins -----------------------------------------------------------------------------------------------------

def test_builtins_resolve_in_their_order_and_are_built_in():
    assert list(STRATEGIES)[:3] == ["fedavg", "full", "fedprox"] and STRATEGIES["fedavg"] is FedAvg
    assert models.MODELS.registered() == ["mimic-cnn", "fdms-cnn", "cifar-lenet", "vgg11", "mlp", "logreg"]
    assert datasets.DATASETS.registered() == ["fmnist", "mnist", "cifar10", "npz", "imagefolder", "leaf"]
    assert "dirichlet" in partition.PARTITIONERS.registered()
    assert AVAILABILITY.registered() == ["always", "bounded", "static", "timevarying", "diurnal", "cluster-dropout",
                                         "replay", "device-trace"]
    for reg in (STRATEGIES, models.MODELS, datasets.DATASETS, partition.PARTITIONERS, AVAILABILITY):
        assert {reg.entry(n).origin for n in reg.registered()} == {"built-in"}
    assert models.MODELS.meta("mimic-cnn", "cpu_first") and not models.MODELS.meta("vgg11", "cpu_first")


def test_a_builtin_availability_is_built_as_before():
    cfg = config.SimConfig()
    cfg.availability.kind, cfg.data.clients, cfg.availability.tau_max = "bounded", 7, 3
    from coordinator.runsetup import build_availability
    got, want = build_availability(cfg), Bounded(7, 0, tau_max=3, tau_dist="uniform")
    assert all((got.round(t).available == want.round(t).available).all() for t in range(6))


def test_a_builtin_model_is_built_bitwise_as_its_class():
    a = models.build_model("fdms-cnn", (1, 28, 28), 10, seed=3, dropout=0.2)
    torch.manual_seed(3)
    b = models.FdmsMnistCNN(1, 10, dropout=0.2)
    assert torch.equal(models.get_flat(a), models.get_flat(b))
    assert models.build_model("mimic-cnn", (1, 28, 28), 10, dropout=0.3) is not None   # ignores --dropout, as before


def test_register_is_the_call_builtins_use_and_checks_the_kind():
    reg = Registry("widget", "dropfl.test-widgets", check=lambda o: None if callable(o) else "a callable",
                   meta={"fast": False})
    reg.register("w", len, fast=True)
    assert reg.entry("w").meta == {"fast": True}
    assert reg.entry("w").origin == "registered by builtins"   # a script's registration: not dropfl's own
    assert reg.entry("w").meta["fast"] and reg.meta("nope", "fast") is False
    with pytest.raises(PluginError, match="not a callable"):
        reg.register("x", 3)
    with pytest.raises(TypeError, match="unknown fact"):
        reg.register("y", len, slow=True)


# --- plugins, end to end --------------------------------------------------------------------------------------------

def _sim(out: Path, *extra: str) -> int:
    return cli.main(["sim", "--out", str(out), "--clients", "4", "--rounds", "3", "--steps", "2", "--batch-size", "8",
                     "--engine", "loop", "--threads", "1", "--no-progress", *extra])


def test_module_attr_plugins_of_every_kind_run_a_sim_end_to_end(plugin, tmp_path):
    out = tmp_path / "run"
    assert _sim(out, "--algo", f"{MOD}:FedAvgM", "--model", f"{MOD}:TinyNet", "--dataset", f"{MOD}:tiny_images",
                "--partition", f"{MOD}:round_robin", "--availability", f"{MOD}:MarkovOnOff") == 0
    saved = json.loads((out / "config.json").read_text())
    assert (saved["strategy"]["algo"], saved["model"]["model"], saved["data"]["dataset"], saved["data"]["partition"],
            saved["availability"]["kind"]) == (f"{MOD}:FedAvgM", f"{MOD}:TinyNet", f"{MOD}:tiny_images",
                                               f"{MOD}:round_robin", f"{MOD}:MarkovOnOff")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2] and all(0 <= r["accuracy"] <= 1 for r in rows)
    assert sys.modules[MOD].CALLS == ["fedavgm"]      # the plugin's own class ran
    assert any(r["available"] < 4 for r in rows[1:])  # the Markov model took clients away
    # the run's config.json runs again as it is (the plugin names resolve the same way)
    again = tmp_path / "again"
    assert cli.main(["sim", "--config", str(out / "config.json"), "--out", str(again), "--no-progress"]) == 0
    a, b = torch.load(again / "model.pt"), torch.load(out / "model.pt")
    assert list(a) == ["conv.weight", "conv.bias", "fc.weight", "fc.bias"] and all(torch.equal(a[k], b[k]) for k in a)


def test_an_entry_point_plugin_runs_by_its_name_and_a_builtin_name_wins(plugin, tmp_path):
    out = tmp_path / "run"
    assert _sim(out, "--algo", "fedavgm", "--model", "tinynet", "--dataset", f"{MOD}:tiny_images",
                "--partition", "iid") == 0
    assert json.loads((out / "config.json").read_text())["strategy"]["algo"] == "fedavgm"
    assert STRATEGIES["fedavg"] is FedAvg                 # the entry point named fedavg is shadowed
    assert STRATEGIES.entry("fedavgm").origin == f"entry point dropfl-test-plugin==0.3 ({MOD}:FedAvgM)"
    assert "tinynet" in list(models.MODELS) and "fedavgm" in list(STRATEGIES)


def test_dropfl_plugins_lists_builtins_and_the_plugin_with_its_origin(plugin, capsys):
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    lines = {tuple(line.split(None, 1)) for line in out.splitlines() if line.startswith("  ")}
    assert ("fedavg", "built-in") in lines and ("mimic-cnn", "built-in") in lines and ("replay", "built-in") in lines
    assert ("tinynet", f"entry point dropfl-test-plugin==0.3 ({MOD}:TinyNet)") in lines
    assert ("fedavgm", f"entry point dropfl-test-plugin==0.3 ({MOD}:FedAvgM)") in lines
    bad = next(o for n, o in lines if n == "bad-kind")
    assert bad.startswith("error: it is a int, not a strategy class")
    shadowed = [o for n, o in lines if n == "fedavg" and o != "built-in"]
    assert len(shadowed) == 1 and "shadowed by the built-in strategy" in shadowed[0]
    for header in ("strategy (--algo", "model (--model", "dataset (--dataset", "partitioner (--partition",
                   "availability (--availability", "local objective (attached to tasks by a strategy"):
        assert header in out
    assert ("proximal", "built-in") in lines and ("correction", "built-in") in lines
    assert cli.main(["plugins", "objective", "proximal"]) == 0
    assert capsys.readouterr().out == "objective proximal: built-in\n"
    assert cli.main(["plugins", "model"]) == 0
    assert "fedavg" not in capsys.readouterr().out


# --- errors: one line, nothing written -------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,needle", [
    (["--algo", "nope"], 'strategy.algo must be one of: fedavg, full, '),
    (["--algo", "no_such_module_xyz:Thing"], "no module named 'no_such_module_xyz': install it, or put the directory"),
    (["--algo", f"{MOD}:Missing"], f"module {MOD} has no attribute 'Missing': check the name after ':'"),
    (["--algo", f"{MOD}:NOT_A_STRATEGY"], "it is a int, not a strategy class"),
    (["--algo", "bad-kind"], "it is a int, not a strategy class"),
    (["--model", f"{MOD}:NOT_A_STRATEGY"], "model.model"),
    (["--model", "resnet"], "model.model must be one of: mimic-cnn, "),
    (["--dataset", f"{MOD}:"], "a plugin is named module:attr"),
    (["--availability", "json:nope"], "availability.kind"),
    (["--dataset", f"{MOD}:broken_loader"], "raised RuntimeError: the plugin's own bug: fix the plugin"),
])
def test_a_bad_plugin_name_is_one_line_before_anything_is_written(plugin, tmp_path, capsys, flags, needle):
    out = tmp_path / "run"
    capsys.readouterr()
    assert _sim(out, *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dropfl: error: ") and needle in err[0], err
    assert not out.exists()


def test_a_module_that_does_not_import_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "dropfl_broken_plugin.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _sim(tmp_path / "run", "--algo", "dropfl_broken_plugin:X") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "module dropfl_broken_plugin does not import (ModuleNotFoundError" in err[0], err


def test_a_plugin_name_in_a_config_file_is_checked_like_a_flag(plugin, tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text(f'[strategy]\nalgo = "{MOD}:Missing"\n')
    assert cli.main(["sim", "--config", str(f), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert f'strategy.algo "{MOD}:Missing" in {f}: module {MOD} has no attribute' in err


# --- the CLI reads the registries -------------------------------------------------------------------------------------

def test_help_lists_the_registries_names(plugin, capsys):
    with pytest.raises(SystemExit):
        cli.main(["sim", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for names in (STRATEGIES.names(), models.MODELS.names(), datasets.DATASETS.names(),
                  partition.PARTITIONERS.names(), AVAILABILITY.names()):
        assert "one of: " + ", ".join(names) in text
    assert "tinynet" in models.MODELS.names() and "fedavgm" in STRATEGIES.names()   # the installed plugin's too


def test_there_is_one_model_name_list():
    """A model's facts are declared with its registration (edge_client/models.py), nowhere else."""
    code = [p for d in ("coordinator", "edge_client", "dropfl") for p in (ROOT / d).rglob("*.py")]
    for name in ("CPU_FIRST", "BATCH_INDEPENDENT"):
        assert not [p for p in code if name in p.read_text()], name
    text = (ROOT / "edge_client" / "models.py").read_text()
    assert 'elif name == "' not in text and "MODELS = (" not in text
    lock = (ROOT / "coordinator" / "sim" / "lockstep.py").read_text()
    assert '"mimic-cnn"' not in lock and '"logreg"' not in lock


def test_the_device_side_registry_does_not_import_the_coordinator():
    code = ("import sys, edge_client.registry, edge_client.models, edge_client.datasets, edge_client.partition; "
            "print([m for m in sys.modules if m.split('.')[0] == 'coordinator'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
