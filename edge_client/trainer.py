"""Local training: the reference per-client SGD loop, shared by simulation and the edge agent.

A client's training is a pure function of (global weights, its data, the task): mini-batches and
dropout masks come from a generator seeded by (run seed, round, client), so the same task gives the
same update in simulation, on a device, or in the batched engine, whatever the worker count.

Update convention (the MimiC/MIFA released code's "delta units"): the client returns
    delta = w_global − w_local,
so the server applies w ← w − aggregate(deltas).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from edge_client.models import dropout_layers, get_buffers, get_flat, set_buffers, set_flat
from edge_client.objectives import Correction, LocalObjective, Proximal, correction_of, proximal_mu, with_objective


@dataclass(init=False)
class TrainTask:
    """What the coordinator asks one client to do in one round.

    `objectives`: what the client does differently in local training, applied in order (edge_client/objectives.py:
    FedProx's `Proximal`, SCAFFOLD's `Correction`, or a plugin's). `prox_mu=` and `grad_correction=` are
    shorthands that set the proximal and correction objectives; `.prox_mu` and `.grad_correction` read them back
    (0.0 and None without one)."""

    client: int
    round: int
    lr: float
    batch_size: int
    epochs: int | None = 1          # full passes over the local data (drop_last=False) ...
    steps: int | None = None        # ... or exactly this many SGD steps (takes precedence)
    seed: int = 0
    dropout_rate: float | None = None  # FedDD: upload only 1 − D of the model (edge_client/feddd.py)
    sparse_download: bool = False      # FedDD eq. (5): this round's download is W^t on the last mask only
    objectives: tuple[LocalObjective, ...] = ()

    def __init__(self, client: int, round: int, lr: float, batch_size: int, epochs: int | None = 1,
                 steps: int | None = None, *, seed: int = 0, dropout_rate: float | None = None,
                 sparse_download: bool = False, objectives: Sequence[LocalObjective] = (),
                 prox_mu: float | None = None, grad_correction: torch.Tensor | None = None):
        self.client, self.round, self.lr, self.batch_size = client, round, lr, batch_size
        self.epochs, self.steps, self.seed = epochs, steps, seed
        self.dropout_rate, self.sparse_download = dropout_rate, sparse_download
        objectives = tuple(objectives)
        if prox_mu is not None:
            objectives = with_objective(objectives, Proximal(prox_mu) if prox_mu else None, Proximal)
        if grad_correction is not None:
            objectives = with_objective(objectives, Correction(grad_correction), Correction)
        self.objectives = objectives

    @property
    def prox_mu(self) -> float:
        """FedProx's μ (0.0 without a proximal objective)."""
        return proximal_mu(self.objectives)

    @property
    def grad_correction(self) -> torch.Tensor | None:
        """SCAFFOLD's c − c_i (None without a correction objective)."""
        return correction_of(self.objectives)


@dataclass
class LocalResult:
    delta: torch.Tensor   # w_global − w_local
    num_samples: int
    steps: int
    loss: float           # mean training cross-entropy over the steps (local objectives' terms not included)
    seconds: float        # wall time of the training
    # what actually trained it, where an engine has more than one path (the batched engine's native parts, e.g.
    # "conv+fc+loss+step"), and why a part it could have used did not run (None: nothing to say)
    path: str | None = None
    fallback: str | None = None
    # the model's buffers after training (BatchNorm's running statistics, edge_client.models.get_buffers); None for
    # a model without buffers. Not in `delta`: the coordinator averages them apart (coordinator/buffers.py)
    buffers: dict[str, torch.Tensor] | None = None


def client_generator(seed: int, rnd: int, client: int) -> torch.Generator:
    """The one source of randomness of a client's round (batch order, dropout masks)."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + rnd) * 1_000_033 + client)
    return g


def batch_table(n: int, task: TrainTask, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Index batches for one round: successive random permutations of 0..n-1 (one `randperm` per
    epoch begun) cut into batches of `batch_size` (the last batch of an epoch may be smaller), for
    `epochs` passes or `steps` steps. As a table: rows [steps, batch_size] int64, step j's batch in
    rows[j, :sizes[j]] and -1 after it, and sizes [steps]. (The batched engine reads the table as it is;
    `batch_plan` is the same batches as a list.)"""
    bs = task.batch_size
    limit = 0 if n == 0 else task.steps if task.steps is not None else (task.epochs or 0) * -(-n // bs)
    per_epoch, full = -(-n // bs) if n else 1, n // bs
    epochs = -(-limit // per_epoch)
    perms = torch.stack([torch.randperm(n, generator=gen) for _ in range(epochs)]) if epochs else \
        torch.zeros(0, n, dtype=torch.long)
    table = torch.full((epochs, per_epoch, bs), -1, dtype=torch.long)
    table[:, :full] = perms[:, :full * bs].reshape(epochs, full, bs)
    if n > full * bs:   # an epoch's last, smaller batch
        table[:, full, :n - full * bs] = perms[:, full * bs:]
    sizes = torch.tensor([bs] * full + ([n - full * bs] if n > full * bs else []), dtype=torch.long).repeat(epochs)
    return table.reshape(-1, bs)[:limit], sizes[:limit]


def batch_plan(n: int, task: TrainTask, gen: torch.Generator) -> list[torch.Tensor]:
    """`batch_table`'s batches as a list of index tensors (the reference loop's form)."""
    rows, sizes = batch_table(n, task, gen)
    return [r[:s] for r, s in zip(rows, sizes.tolist())]


def local_train(model: nn.Module, w_global: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                task: TrainTask, buffers: dict[str, torch.Tensor] | None = None,
                out: torch.Tensor | None = None) -> LocalResult:
    """Plain SGD (no momentum, no weight decay), cross-entropy, from `w_global`. Reference path.
    `buffers`: the global buffers the client starts from (BatchNorm's running statistics; None: the model's own).
    `out`: where to write the delta (a tensor of w_global's shape on its device, of the dtype w_global − weights
    has; the result's `delta` is then `out`, with the same bits as a new tensor would have; None: a new tensor).

    The model and (x, y) may be on a GPU (the agent's `--device cuda`, edge_client/agent/device.py): the
    weights are copied in, batch orders and dropout masks still come from the CPU generator, and the delta
    comes back on `w_global`'s device (the CPU)."""
    start = time.perf_counter()
    gen = client_generator(task.seed, task.round, task.client)
    plan = batch_plan(len(y), task, gen)
    set_flat(model, w_global)  # copies: w_global is never written
    if buffers:
        set_buffers(model, buffers)
    model.train()
    for layer in dropout_layers(model):
        layer.generator = gen
    params = list(model.parameters())
    # the task's local objectives (FedProx's term, SCAFFOLD's correction, a plugin's), on the model's device;
    # the anchor is w_global as the model holds it
    objectives = [o.to(params[0].device) for o in task.objectives] if params else []
    anchor = [p.detach().clone() for p in params] if objectives else []
    loss_sum = 0.0
    for idx in plan:
        for p in params:
            p.grad = None
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        total = loss
        for o in objectives:   # a loss term (autograd differentiates it with the cross-entropy)
            term = o.loss(params, anchor)
            if term is not None:
                total = total + term
        total.backward()
        loss_sum += float(loss.detach())   # the data loss: the objectives' terms are not in it
        with torch.no_grad():
            grads = [p.grad for p in params]
            for o in objectives:   # FedProx: g + μ(w − w_t); SCAFFOLD: g + (c − c_i); in the task's order
                grads = o.gradient(grads, params, anchor)
            for p, g in zip(params, grads):
                p.add_(g, alpha=-task.lr)
    # on w_global's device (the CPU: a no-op there); the subtraction writes into get_flat's new vector (one pass
    # and one allocation less on a big model, the same bits)
    flat = get_flat(model).to(w_global.device)
    if out is not None:   # the generic engine's worker: straight into the block its parent reads (functional.py)
        delta = torch.sub(w_global, flat, out=out)
    else:
        delta = torch.sub(w_global, flat, out=flat) if flat.dtype == w_global.dtype else w_global - flat
    after = {n: b.to(w_global.device) for n, b in get_buffers(model).items()} or None
    return LocalResult(delta, len(y), len(plan), loss_sum / max(len(plan), 1), time.perf_counter() - start,
                       buffers=after)


@torch.no_grad()
def evaluate(model: nn.Module, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
             batch: int = 2000, buffers: dict[str, torch.Tensor] | None = None) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of weights `w` (and `buffers`, where given: the global BatchNorm statistics)
    on (x, y), in eval mode."""
    set_flat(model, w)
    if buffers:
        set_buffers(model, buffers)
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(y), batch):
        out = model(x[i:i + batch])
        loss += float(nn.functional.cross_entropy(out, y[i:i + batch], reduction="sum"))
        correct += int((out.argmax(1) == y[i:i + batch]).sum())
    n = max(len(y), 1)
    return correct / n, loss / n
