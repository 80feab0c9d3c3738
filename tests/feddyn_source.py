"""FedDyn (Acar et al., ICLR 2021) as a user's module, written into a temporary directory by the tests of local
objectives (tests/test_objectives.py) and of objectives through Flower (tests/test_flower_objectives.py)."""

import sys

PLUGIN = '''
"""FedDyn, Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, "Federated Learning Based on Dynamic
Regularization", ICLR 2021 (Algorithm 1), as one module: the client's term, the server's rule, and a small model
without a hand-written batched forward."""
import dataclasses

import torch
from torch import nn

from coordinator.strategies.base import Strategy
from edge_client.objectives import LocalObjective, split_like


@dataclasses.dataclass(frozen=True, eq=False)
class FedDynTerm(LocalObjective):
    """Client k's term: L_k(θ) − ⟨g_k, θ⟩ + (α/2)‖θ − θ^{t−1}‖², g_k = ∇L_k(θ_k^{t−1}) (Alg. 1, line 6)."""
    alpha: float
    g: torch.Tensor
    name = "feddyn-term"

    def loss(self, params, anchor):
        g = split_like(self.g.to(params[0].dtype), params)
        linear = sum((gj * p).sum() for gj, p in zip(g, params))
        prox = sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
        return self.alpha / 2 * prox - linear


class FedDyn(Strategy):
    """Server side; the clients' g_k are kept on the server (as SCAFFOLD's c_i), from d_k = θ^{t−1} − θ_k^t."""
    name = "feddyn"

    def __init__(self, *, weighting="uniform", alpha=0.1):
        self.alpha = alpha

    def init_state(self, n_clients, w0):
        return {"h": torch.zeros_like(w0), "g": torch.zeros(n_clients, w0.numel(), dtype=w0.dtype)}

    def configure(self, state, t, task):
        term = FedDynTerm(self.alpha, state["g"][task.client].clone())
        return dataclasses.replace(task, objectives=task.objectives + (term,))

    def aggregate(self, state, t, w, updates):
        if not updates:
            return w, state
        g = state["g"]
        for i in sorted(updates):
            g[i] += self.alpha * updates[i].delta   # line 7: g_k ← g_k − α(θ_k^t − θ^{t−1})
        deltas = torch.stack([updates[i].delta for i in sorted(updates)])
        h = state["h"] + self.alpha / g.shape[0] * deltas.sum(0)   # line 9: h ← h − (α/m) Σ (θ_k^t − θ^{t−1})
        return w - deltas.mean(0) - h / self.alpha, {"h": h, "g": g}   # line 10: θ^t = mean θ_k^t − h/α


class TinyNet(nn.Module):
    def __init__(self, c, h, w, k):
        super().__init__()
        self.conv = nn.Conv2d(c, 3, 3)
        self.fc = nn.Linear(3 * (h - 2) * (w - 2), k)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def tiny_net(input_shape, num_classes=10, dropout=None):
    c, h, w = input_shape
    return TinyNet(c, h, w, num_classes)
'''


def user_module(tmp_path, monkeypatch, mod: str, trap: str):
    """The user's module `mod` (PLUGIN) and a module `trap` that must never be imported (a task message names it as
    module:attr), in a directory put on sys.path as PYTHONPATH would; nothing registered or installed. A generator
    for a pytest fixture: yields the directory, then forgets both modules."""
    src = tmp_path / "src"
    src.mkdir()
    (src / f"{mod}.py").write_text(PLUGIN)
    (src / f"{trap}.py").write_text('raise RuntimeError("a task message made this process import this module")\n')
    monkeypatch.syspath_prepend(str(src))
    for m in (mod, trap):
        monkeypatch.delitem(sys.modules, m, raising=False)
    yield src
    for m in (mod, trap):
        sys.modules.pop(m, None)


def install_entry_point(src, mod: str, dist: str) -> None:
    """Install the objective as a distribution `dist` 1.0 would: its dist-info with a dropfl.objectives entry
    point `feddyn-term`."""
    info = src / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[dropfl.objectives]\nfeddyn-term = {mod}:FedDynTerm\n")
