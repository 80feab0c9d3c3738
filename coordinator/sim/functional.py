"""The generic batched engine: a round's clients of ANY `nn.Module` as one computation, with `torch.func`.

The reference path of the batched engine (docs/engine.md, "The generic engine"): where a model has no
hand-written batched forward (`batched.batched_forward`), `SimTransport` trains its clients here instead of on
the per-client loop. Every parameter and buffer gets a leading client dimension ([K, *shape]), and one step of
K clients is `vmap(functional_call)` over the model's own forward: torch's batching rules turn a convolution
into a grouped convolution and a linear layer into a batched matmul, so no layer is written by hand. One batching
rule is the engine's own: a max pool pools the clients' channels in the grouped layout (`_ClientsMaxPool`, the
same bits as torch's rule, faster). Where vmap does not pay (`choose_mode`), a slice's clients are trained one
after the other by `local_train` (`PerClientEngine`).

Exactly `local_train`'s algorithm, client by client:
- batches: `batch_table` with the client's own `client_generator`, in its order;
- `SeededDropout` masks: `rand(real batch shape, client generator) >= p`, drawn per client in the model's
  forward order after the batch table (as the loop does), then handed into the vmapped forward;
- loss: `F.cross_entropy` (mean) over the client's real rows. No padding: at each step the clients still
  training are grouped by their real batch size, one computation per size (padded rows would enter a
  BatchNorm's batch statistics, and any other op that mixes the rows of a batch);
- clients that finished (fewer steps) are frozen: sorted by step count, the active clients are a prefix;
- the tasks' local objectives (edge_client/objectives.py): FedProx g + μ(w − w_global) and SCAFFOLD g + (c − c_i)
  stacked over the clients; any other objective (a plugin's) client by client through its own hooks (its loss
  term differentiated apart from the cross-entropy and added to the gradient); then w ← w − lr·g with the
  client's own lr;
- buffers (BatchNorm's running statistics, `num_batches_tracked`): one copy per client, starting from the
  round's global buffers (`run(..., buffers=)`; without them, the model's buffers when the engine was built),
  updated by the client's own steps as its forward updates them; they are not in the delta (`get_flat` is
  parameters only, as in the loop) and come back in each client's `LocalResult.buffers` (coordinator/buffers.py
  averages them).

What is not the loop's bits: the batched kernels sum in another order (float32: ~1e-7 relative per step;
float64: 1e-12), and torch's own `nn.Dropout` draws from the global generator in both paths (under vmap,
each client its own mask: `randomness="different"`), so a model with it is not reproducible on either path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap
from torch.overrides import TorchFunctionMode

from coordinator.sim import channels_last
from coordinator.sim.batched import (
    AUTO_SLICES_MAX,
    PoolOwner,
    _die_with_parent,
    _keep_freed_memory,
    _strip_generators,
    contiguous_slices,
    cpus,
    shm_error,
)
from edge_client import objectives as objectives_
from edge_client.determinism import cuda_deterministic, is_cuda
from edge_client.models import SeededDropout
from edge_client.trainer import LocalResult, TrainTask, batch_table, client_generator, local_train

log = logging.getLogger("dropfl.sim")


class _Masks:
    """The dropout masks of one vmapped forward, in the order its `SeededDropout` layers are called."""

    def __init__(self) -> None:
        self.queue: list[torch.Tensor] = []
        self.record: list[tuple[SeededDropout, tuple[int, ...]]] | None = None   # the probe's: (layer, feature shape)

    def forward(self, layer: SeededDropout, x: torch.Tensor) -> torch.Tensor:
        """`SeededDropout.forward` with the mask handed in: x · keep / (1 − p), as the layer computes it."""
        if not layer.training or layer.p == 0.0:
            return x
        if self.record is not None:   # the probe: which layer draws which shape per sample
            self.record.append((layer, layer.mask_shape(x)[1:]))
            return x
        return x * self.queue.pop(0) / (1.0 - layer.p)


def _pool_args(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """F.max_pool2d's arguments, bound by name (a call may pass any of them either way)."""
    return input, kernel_size, stride, padding, dilation, ceil_mode, return_indices


class _PoolingMode(TorchFunctionMode):
    """A mode that computes the model's 2-D max pools of a 4-D batch, by `F.max_pool2d`, `torch.max_pool2d` or
    `nn.MaxPool2d`, its own way (`pool`, None: torch's); every other call, and pools that return their indices,
    as they are."""

    def pool(self, x: torch.Tensor, args: tuple) -> torch.Tensor | None:
        """`F.max_pool2d(x, *args)`, args = (kernel, stride, padding, dilation, ceil_mode), or None for torch's own
        pool (this base class's answer for every pool)."""
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.max_pool2d or func is torch.max_pool2d:
            x, kernel, stride, padding, dilation, ceil_mode, indices = _pool_args(*args, **kwargs)
            if not indices and x.dim() == 4:
                out = self.pool(x, (kernel, stride or kernel, padding, dilation, ceil_mode))
                if out is not None:
                    return out
        return func(*args, **kwargs)


class _ClientsMaxPool(torch.autograd.Function):
    """`F.max_pool2d` of one client's batch [B, C, H, W], whose vmap rule pools every client's channels in one call
    on the layout vmap's grouped convolutions give (physically [B, K·C, H, W], channels-last): a max pool is per
    channel, so the client dimension only joins the channels (a view). Torch's own batching rule moves the client
    dimension in front of the batch instead, which copies to NCHW, pools there (torch's NCHW max pool, the slower)
    and leaves the next convolution and ReLU's backward mixed layouts to copy back: measured on mimic-cnn's LeNet
    (15 clients, batch 16, 1 thread), the step's CPU time fell from 582 to 273 ms with this rule. The same values
    and the same gradient routing (first maximum of each window), from torch's own pooling op; the layout of what
    follows changes, so the next layers round as their kernels round on that layout (within the engine's
    tolerance, docs/engine.md)."""

    @staticmethod
    def forward(x, args):
        return F.max_pool2d(x, *args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.args = inputs[1]

    @staticmethod
    def backward(ctx, grad):   # outside vmap (not how the engine calls it): torch's pool, differentiated
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            return torch.autograd.grad(F.max_pool2d(x, *ctx.args), x, grad)[0], None

    @staticmethod
    def vmap(info, in_dims, x, args):
        x = x.movedim(in_dims[0], 1)   # [B, K, C, H, W]
        b, k, c, h, w = x.shape
        y = F.max_pool2d(x.reshape(b, k * c, h, w), *args)
        return y.view(b, k, c, *y.shape[-2:]), 1


class _ClientPooling(_PoolingMode):
    """Within a vmapped forward (`FunctionalEngine._client_loss`): the model's max pools through `_ClientsMaxPool`."""

    def pool(self, x: torch.Tensor, args: tuple) -> torch.Tensor:
        return _ClientsMaxPool.apply(x, args)


# A 2-D max pool's input elements per sample from which `_ChannelsLastMaxPool` is used in per-client mode. Torch's
# NCHW max pool, forward and backward, one thread, side by side: 10×64×28×28 (pfl's CNN) 2.78 ms against 0.88 with
# the channels-last copy; 16×32×16×16 0.73 against 0.27; 16×6×24×24 (LeNet) even (0.27); 16×16×8×8 0.06 against
# 0.09 (the copies cost more than they save).
CHANNELS_LAST_POOL_MIN = 8192


class _ChannelsLastMaxPool(torch.autograd.Function):
    """`F.max_pool2d` of an NCHW batch computed by torch's channels-last max pool on a channels-last copy (torch's
    NCHW kernel is the slower one for big planes), its output made NCHW again; the backward is torch's own NCHW
    max-pool backward with the indices the channels-last kernel found. Both kernels take the first maximum of each
    window (a NaN wins), so the values, the indices and the gradient are `F.max_pool2d`'s bit for bit
    (tests/test_client_pooling.py), and what follows sees the same NCHW tensor."""

    @staticmethod
    def forward(ctx, x, args):
        y, idx = torch.ops.aten.max_pool2d_with_indices(x.contiguous(memory_format=torch.channels_last), *args)
        ctx.save_for_backward(x, idx.contiguous())
        ctx.args = args
        return y.contiguous()

    @staticmethod
    def backward(ctx, grad):
        x, idx = ctx.saved_tensors
        return torch.ops.aten.max_pool2d_with_indices_backward(grad.contiguous(), x, *ctx.args, idx), None


class _LargePooling(_PoolingMode):
    """Around `local_train` in per-client mode: the model's max pools of an NCHW batch of at least
    CHANNELS_LAST_POOL_MIN elements per sample through `_ChannelsLastMaxPool`. `seen`: whether one was (the
    engine's probe)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def pool(self, x: torch.Tensor, args: tuple) -> torch.Tensor | None:
        if not (x.is_contiguous() and x.device.type == "cpu" and x[0].numel() >= CHANNELS_LAST_POOL_MIN):
            return None
        self.seen = True
        pair = (lambda v: [v, v] if isinstance(v, int) else list(v))   # noqa: E731 - aten takes pairs
        kernel, stride, padding, dilation, ceil_mode = args
        return _ChannelsLastMaxPool.apply(x, (pair(kernel), pair(stride), pair(padding), pair(dilation),
                                              bool(ceil_mode)))


def _packed_data(client_data: list[tuple[torch.Tensor, torch.Tensor]] | None,
                 packed: tuple[torch.Tensor, torch.Tensor, list[int]] | None
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """The clients' samples and labels concatenated (x_all, y_all), each client's size and its first row: from
    `client_data`, or from `packed` (x_all, y_all, sizes), as a worker process of `GenericEngine` gets them."""
    if packed is None:
        assert client_data is not None
        packed = (torch.cat([x for x, _ in client_data]), torch.cat([y for _, y in client_data]),
                  [len(y) for _, y in client_data])
    sizes = list(packed[2])
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    return packed[0], packed[1], sizes, offsets


def _two_samples(x: torch.Tensor) -> torch.Tensor:
    """The first two samples of `x` (the first twice where it has one): a probe's batch, two rows so that
    BatchNorm has a batch statistic."""
    return x[:2] if len(x) > 1 else x[:1].expand(2, *x.shape[1:])


def _engine_device(requested: str | None) -> torch.device:
    """--sim-device for a model without a hand-written forward: auto = a GPU where torch sees one, else the CPU."""
    if requested in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"FunctionalEngine: device {requested!r}, but torch sees no usable GPU here")
    return device


class FunctionalEngine:
    """`BatchedEngine`'s interface (run, describe, details, close) for any model, in this process (one slice).

    `device`: "auto" (a GPU where there is one, else the CPU), "cpu" or "cuda" (deterministic arithmetic:
    edge_client/determinism.py). `threads`: the intra-op threads of a round's computation on the CPU (default:
    this process's setting when the engine is built), fixed so that a run's rounding does not follow whatever
    else changes the process's setting. Raises TypeError (the transport then trains on the loop) where
    torch.func cannot run the model's forward and backward (checked here on two samples)."""

    mode = "vmap"

    def __init__(self, model: nn.Module, client_data: list[tuple[torch.Tensor, torch.Tensor]] | None,
                 device: str | None = "auto", threads: int | None = None,
                 packed: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None):
        # `packed`: (x_all, y_all, sizes), the clients' data already concatenated (a worker process of
        # `GenericEngine` gets the parent's, in shared memory), instead of `client_data`
        self.device = _engine_device(device)
        if is_cuda(self.device):
            cuda_deterministic()   # before anything reaches the GPU
        self.threads = threads or torch.get_num_threads()
        self.model = _strip_generators(model).to(self.device).train()
        x_all, y_all, self.sizes, self.offsets = _packed_data(client_data, packed)
        self.x_all, self.y_all = x_all.to(self.device), y_all.to(self.device)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.shapes = [p.shape for _, p in self.model.named_parameters()]
        self.buffers0 = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        self.masks = _Masks()
        for layer in self.model.modules():   # this copy's dropout layers take their masks from `self.masks`
            if isinstance(layer, SeededDropout):
                layer.forward = lambda x, layer=layer: self.masks.forward(layer, x)   # type: ignore[method-assign]
            elif isinstance(layer, nn.modules.batchnorm._BatchNorm):
                # Under vmap a BatchNorm's input is channels-last wherever the convolution before it read
                # channels-last (`_inputs`), and torch's CPU BatchNorm kernel sums a channels-last batch's gradients
                # far less precisely than an NCHW one's (float32, one BatchNorm2d, 32×16×32×32: weight and bias
                # gradients 9e-6 and 2e-6 from float64 against 4e-7 and 4e-8). Through the example ResNet-8 that was
                # 3e-5 to 6e-5 of the update after 2 steps, 30-400× the loop's own distance from float64; made
                # contiguous, the engine is as close to float64 as the loop (tests/test_functional_engine.py).
                channels_last.nchw_input(layer)
        self.drops: list[tuple[SeededDropout, tuple[int, ...]]] = []
        # the threads that draw the clients' dropout masks (`_draw`): on a GPU one per CPU (at most 16), else none
        self.draw_threads = min(cpus(), 16) if is_cuda(self.device) else 0
        self._drawers = None
        self.last_buffers: dict[str, torch.Tensor] = {}   # the last round's per-client buffers, in task order
        self._probe()

    # -- one step of k clients ------------------------------------------------------------------------------
    def _client_loss(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor,
                     y: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
        """One client's loss on one batch, as `local_train` computes it (vmapped over clients by `_step`)."""
        self.masks.queue = list(masks)
        with _ClientPooling():
            out = functional_call(self.model, (params, buffers), (x,))
        return F.cross_entropy(out, y)

    def _step(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor,
              y: torch.Tensor, masks: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """k clients' losses [k] and gradients ([k, *shape] each), from params [k, *shape] and batches x [k, s, ...]:
        the forward vmapped over clients, one backward of Σ_k loss_k (each loss reads only its own slice of every
        stack, so each client gets exactly its own gradient). The buffers are updated in place."""
        live = {n: p.detach().requires_grad_() for n, p in params.items()}
        loss = vmap(self._client_loss, randomness="different")(live, buffers, x, y, masks)
        grads = torch.autograd.grad(loss.sum(), list(live.values()))
        return loss.detach(), grads

    @staticmethod
    def _term_grads(objs, params: dict[str, torch.Tensor], anchors: dict[str, torch.Tensor],
                    grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """`grads` plus the gradients of the clients' loss terms (`LocalObjective.loss`), where they have one."""
        live = [p.detach().requires_grad_() for p in params.values()]
        with torch.enable_grad():
            term = objectives_.loss_stacked(objs, live, list(anchors.values()))
        if term is None:
            return list(grads)
        extra = torch.autograd.grad(term, live, allow_unused=True)
        return [g if e is None else g + e for g, e in zip(grads, extra)]

    def _probe(self) -> None:
        """Run one step on two samples: records the dropout layers' calls (`self.drops`) and checks that
        torch.func runs the model (TypeError where it does not, with torch's reason)."""
        if len(self.y_all) == 0:
            return
        x = _two_samples(self.x_all)
        y = torch.zeros(2, dtype=torch.long, device=self.device)
        self.masks.record = []
        try:
            with torch.no_grad():
                _strip_generators(self.model)(x)   # (a copy: its buffers are updated)
            self.drops, self.masks.record = self.masks.record, None
            params = {n: p.detach().unsqueeze(0) for n, p in self.model.named_parameters()}
            buffers = {n: b.unsqueeze(0).clone() for n, b in self.buffers0.items()}
            masks = [torch.ones(1, 2, *shape, dtype=x.dtype, device=self.device) for _, shape in self.drops]
            self._step(params, buffers, x.unsqueeze(0), y.unsqueeze(0), masks)
        except Exception as e:   # noqa: BLE001 (any failure means: this model trains on the loop)
            raise TypeError(f"generic batched engine: torch.func cannot train {type(self.model).__name__} "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
        finally:
            self.masks.record, self.masks.queue = None, []

    def _draw(self, gens: list[torch.Generator], size: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """This step's dropout masks for clients with generators `gens` and a real batch of `size`: per client,
        one `rand((size, *shape), generator) >= p` per dropout call in forward order (the loop's draws), as
        one [k, size, *shape] stack per call. Each client's draws go straight into its row of the stacks
        (`uniform_` is what `rand` runs: the same numbers). On a GPU the clients are drawn on `draw_threads` threads
        (a CPU generator draws serially; each client's has its own state, so the numbers do not depend on the
        threads), the stacks are pinned and their copies to the GPU do not wait: the next step's masks are drawn
        while the GPU computes this one's."""
        cuda = is_cuda(self.device)
        stacks = [torch.empty((len(gens), size, *shape), pin_memory=cuda) for _, shape in self.drops]

        def draw(i: int) -> None:
            for st in stacks:
                st[i].uniform_(0.0, 1.0, generator=gens[i])

        if self.draw_threads > 1 and len(gens) > 1:
            if self._drawers is None:
                from concurrent.futures import ThreadPoolExecutor
                self._drawers = ThreadPoolExecutor(self.draw_threads, thread_name_prefix="dropfl-masks")
            list(self._drawers.map(draw, range(len(gens))))
        else:
            for i in range(len(gens)):
                draw(i)
        for (layer, _), st in zip(self.drops, stacks):
            st.ge_(layer.p)   # 1.0 where rand >= p, else 0.0, as (rand >= p).to(float32)
        return [st.to(self.device, dtype, non_blocking=cuda) for st in stacks]

    # -- a round ----------------------------------------------------------------------------------------------
    def run(self, w_global: torch.Tensor, tasks: list[TrainTask],
            buffers: dict[str, torch.Tensor] | None = None, out: torch.Tensor | None = None) -> list[LocalResult]:
        """The tasks' results, in task order. `buffers`: the global buffers every client starts from (None: the
        model's when the engine was built); each result carries its client's buffers after the round. `out`: a
        [len(tasks), P] tensor to write the deltas into, row i task i's (its result's `delta` is then that row);
        None: each delta its own tensor."""
        saved = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._run(w_global, tasks, buffers, out)
        finally:
            torch.set_num_threads(saved)

    def _run(self, w_global: torch.Tensor, tasks: list[TrainTask],
             start: dict[str, torch.Tensor] | None = None, rows_out: torch.Tensor | None = None) -> list[LocalResult]:
        t_start = time.perf_counter()
        gens = [client_generator(t.seed, t.round, t.client) for t in tasks]
        plans = [batch_table(self.sizes[t.client], t, g) for t, g in zip(tasks, gens)]   # (rows, sizes) each
        order = sorted(range(len(tasks)), key=lambda i: -len(plans[i][1]))   # most steps first: active = a prefix
        tasks, gens, plans = [tasks[i] for i in order], [gens[i] for i in order], [plans[i] for i in order]
        k_all, dev = len(tasks), self.device
        w0 = w_global.to(dev, next(iter(self.model.parameters())).dtype)   # set_flat's copy into the model
        chunks = [c.view(s) for c, s in zip(torch.split(w0, [s.numel() for s in self.shapes]), self.shapes)]
        anchors = dict(zip(self.names, chunks))   # FedProx's w_global, per parameter
        params = {n: a.expand(k_all, *a.shape).clone() for n, a in anchors.items()}
        start = self.buffers0 if start is None else {n: start[n].to(dev, b.dtype) for n, b in self.buffers0.items()}
        buffers = {n: b.expand(k_all, *b.shape).clone() for n, b in start.items()}
        # FedProx's μ and SCAFFOLD's c − c_i stacked; where a task has any other objective (a plugin's, or these in
        # another order), every task's objectives through their hooks instead (`hooked`)
        hooked = None if all(objectives_.builtin_only(t.objectives) for t in tasks) else \
            [tuple(o.to(dev) for o in t.objectives) for t in tasks]
        cs = [None if hooked else objectives_.correction_of(t.objectives) for t in tasks]
        corr = None
        if any(c is not None for c in cs):
            zero = torch.zeros_like(w0)
            c = torch.stack([c.to(dev, w0.dtype) if c is not None else zero for c in cs])
            corr = {n: cc.reshape(k_all, *s) for n, s, cc in
                    zip(self.names, self.shapes, torch.split(c, [s.numel() for s in self.shapes], 1))}
        mu = torch.tensor([0.0 if hooked else objectives_.proximal_mu(t.objectives) for t in tasks],
                          dtype=w0.dtype, device=dev)
        neg_lr = torch.tensor([-t.lr for t in tasks], dtype=w0.dtype, device=dev)   # (one lr: the float itself)
        n_steps = [len(s) for _, s in plans]
        losses: list[tuple[list[int], torch.Tensor]] = []   # on the device until the round's end: no wait per step
        for j in range(max(n_steps, default=0)):
            k = sum(1 for n in n_steps if n > j)   # the clients still training: a prefix
            by_size: dict[int, list[int]] = {}
            for i in range(k):
                by_size.setdefault(int(plans[i][1][j]), []).append(i)
            for size, idx in by_size.items():
                losses.append((idx, self._update(j, size, idx, tasks, gens, plans, params, buffers, anchors, corr,
                                                 mu, neg_lr, hooked)))
        loss_sum = torch.zeros(k_all, dtype=torch.float64)
        if losses:
            for (idx, _), loss in zip(losses, torch.cat([v.double() for _, v in losses]).cpu().split(
                    [len(i) for i, _ in losses])):
                loss_sum[idx] += loss
        flat = torch.cat([p.reshape(k_all, -1) for p in params.values()], 1)
        deltas = (w0.unsqueeze(0) - flat).to(w_global.device, w_global.dtype)
        self.last_buffers = {n: b[torch.tensor(_inverse(order), dtype=torch.long, device=dev)]
                             for n, b in buffers.items()}
        seconds = time.perf_counter() - t_start
        out: list[LocalResult | None] = [None] * k_all
        for j, i in enumerate(order):
            delta = deltas[j].clone() if rows_out is None else rows_out[i].copy_(deltas[j])
            out[i] = LocalResult(delta, self.sizes[tasks[j].client], n_steps[j],
                                 float(loss_sum[j]) / max(n_steps[j], 1), seconds,
                                 buffers={n: b[j].to(w_global.device, copy=True) for n, b in buffers.items()} or None)
        return out   # type: ignore[return-value]

    def _inputs(self, rows: torch.Tensor) -> torch.Tensor:
        """The samples `rows` [k, s] of the clients, [k, s, ...]. Images [k, s, C, H, W] are held as [s, H, W, k, C]:
        vmap's grouped convolution ([s, k·C, H, W]) then reads them channels-last without a copy (with one input
        channel per group, the NCHW grouped convolution's backward was ~30x slower here: docs/engine.md)."""
        x = self.x_all[rows]
        if x.dim() == 5:
            x = x.permute(1, 3, 4, 0, 2).contiguous().permute(3, 0, 4, 1, 2)
        return x

    def _update(self, j: int, size: int, idx: list[int], tasks, gens, plans, params, buffers, anchors, corr,
                mu: torch.Tensor, neg_lr: torch.Tensor, hooked=None) -> torch.Tensor:
        """Step j for clients `idx` (real batch `size` each): forward, backward, SGD update in place. Their loss [k]."""
        lo, hi = idx[0], idx[-1] + 1
        sel: slice | torch.Tensor = slice(lo, hi) if hi - lo == len(idx) else \
            torch.tensor(idx, dtype=torch.long, device=self.device)   # a range: views, else copies written back
        rows = torch.stack([plans[i][0][j, :size] + self.offsets[tasks[i].client] for i in idx])
        rows = rows.pin_memory().to(self.device, non_blocking=True) if is_cuda(self.device) else rows
        x, y = self._inputs(rows), self.y_all[rows]
        masks = self._draw([gens[i] for i in idx], size, x.dtype)
        p_sub = {n: p[sel] for n, p in params.items()}
        b_sub = {n: b[sel] for n, b in buffers.items()}
        loss, grads = self._step(p_sub, b_sub, x, y, masks)
        if hooked is not None:   # the objectives' loss terms, then their gradient hooks, client by client
            objs = [hooked[i] for i in idx]
            grads = objectives_.apply_stacked(objs, self._term_grads(objs, p_sub, anchors, grads),
                                              list(p_sub.values()), list(anchors.values()))
        with torch.no_grad():
            m, lr = mu[sel], neg_lr[sel]
            same_lr = len({tasks[i].lr for i in idx}) == 1
            for (n, p), g in zip(p_sub.items(), grads):
                col = (-1,) + (1,) * (p.dim() - 1)
                if any(tasks[i].prox_mu for i in idx):   # FedProx: g + μ (w − w_global)
                    g = g + m.view(col) * (p - anchors[n])
                if corr is not None:                    # SCAFFOLD: g + (c − c_i)
                    g = g + corr[n][sel]
                if same_lr:                             # w ← w − lr·g, as p.add_(g, alpha=−lr)
                    p.add_(g, alpha=-tasks[idx[0]].lr)
                else:
                    p.addcmul_(g, lr.view(col))
            if isinstance(sel, torch.Tensor):           # copies: write them back
                for n in params:
                    params[n][sel] = p_sub[n]
                for n in buffers:
                    buffers[n][sel] = b_sub[n]
        return loss

    # -- BatchedEngine's interface ----------------------------------------------------------------------------
    def describe(self) -> str:
        """metrics.jsonl's `engine`: "batched (torch.func)", on a GPU "batched (torch.func, cuda)"."""
        return "batched (torch.func)" if self.device.type == "cpu" else f"batched (torch.func, {self.device.type})"

    def details(self) -> dict:
        return {"device": str(self.device), "workers": 0, "slices": 1, "native": False, "kernel": None,
                "generic": True, "mode": self.mode, "threads": self.threads}

    def close(self) -> None:
        """The engine runs in this process: only the mask-drawing threads (on a GPU) to stop."""
        if self._drawers is not None:
            self._drawers.shutdown()
            self._drawers = None


# --- per client: the other way to compute a slice ----------------------------------------------------------------

class PerClientEngine:
    """A slice's clients one after the other, each with `local_train` (the reference loop's function) on a copy of
    the model, on `threads` (1) thread(s): the way the generic engine computes a slice on the CPU where a model is
    too big for vmap to pay (`choose_mode`). Each client starts from the global weights and buffers, so a client's
    result depends on nothing else in its slice: it is `local_train`'s on one thread, bit for bit. The copy is
    channels-last where `channels_last.layout_rule` says so (a Conv2d-BatchNorm model: oneDNN's faster NHWC
    convolutions, BatchNorm summed in double; the images stay NCHW, the first convolution's output is channels-last
    as its weight is): then a result is `local_train`'s on `channels_last_copy(model)`, bit for bit, and the loop's
    to float rounding."""

    mode = "per-client"

    def __init__(self, model: nn.Module, client_data: list[tuple[torch.Tensor, torch.Tensor]] | None,
                 device: str | None = "cpu", threads: int | None = 1,
                 packed: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None):
        self.device = torch.device("cpu")
        self.threads = threads or 1
        self.model = _strip_generators(model).train()   # local_train gives each client's generator to its layers
        self.x_all, self.y_all, self.sizes, self.offsets = _packed_data(client_data, packed)
        self.buffers0 = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        self.channels_last, self.layout_reason = channels_last.layout_rule(self.model, self.x_all)
        self.batchnorm: str | None = None
        if self.channels_last:
            self.model = channels_last.channels_last_copy(self.model)
            self.batchnorm = channels_last.backend()
        # NCHW max pools (on a channels-last copy the pools are torch's channels-last kernel already)
        self.large_pools = not self.channels_last and self._has_large_pools()

    def _has_large_pools(self) -> bool:
        """Whether the model's forward on two samples pools through `_ChannelsLastMaxPool` (then `run` trains under
        `_LargePooling`; a model without such pools is not slowed by the mode's look at every call)."""
        if len(self.y_all) == 0:
            return False
        mode = _LargePooling()
        try:
            with torch.no_grad(), mode:
                _strip_generators(self.model)(_two_samples(self.x_all))
        except Exception:   # noqa: BLE001 - local_train will raise it where it matters; without the mode
            return False
        return mode.seen

    def run(self, w_global: torch.Tensor, tasks: list[TrainTask],
            buffers: dict[str, torch.Tensor] | None = None, out: torch.Tensor | None = None) -> list[LocalResult]:
        """The tasks' results, in task order; each client from `buffers` (None: the model's when the engine was
        built), `out` as `FunctionalEngine.run`'s (here `local_train` writes each delta into its row)."""
        saved = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        start = self.buffers0 if buffers is None else buffers
        try:
            with _LargePooling() if self.large_pools else contextlib.nullcontext():
                results = []
                for i, t in enumerate(tasks):
                    lo, n = self.offsets[t.client], self.sizes[t.client]
                    results.append(local_train(self.model, w_global, self.x_all[lo:lo + n], self.y_all[lo:lo + n],
                                               t, buffers=start or None, out=None if out is None else out[i]))
        finally:
            torch.set_num_threads(saved)
        return results

    def describe(self) -> str:
        return "batched (per client, channels-last)" if self.channels_last else "batched (per client)"

    def details(self) -> dict:
        return {"device": "cpu", "workers": 0, "slices": 1, "native": False, "kernel": None, "generic": True,
                "mode": self.mode, "threads": self.threads, "channels_last_pools": self.large_pools,
                "layout": "channels-last" if self.channels_last else "NCHW", "layout_reason": self.layout_reason,
                "batchnorm": self.batchnorm}

    def close(self) -> None:
        """Nothing to stop: the engine runs in this process."""


# vmap over clients pays where a step's ops are small (their dispatch, Python and a convolution's per-call setup
# dominate, once per step for K clients instead of K times), and loses where they are big (a grouped convolution of
# K clients ran slower than K plain ones; a batched matmul is no faster than K plain ones). Measured on one thread
# each, side by side (benchmarks/generic_mode.py, results/generic_mode.md): convolutional models (most of their
# FLOPs in convolutions) gained from vmap up to 3.4 MFLOP per sample (LeNets 1.2-1.7x, a width-8 ResNet 1.7x), were
# even at 13-13.5 and lost beyond (ResNet-8 1.3x, pfl's CNN 1.4x slower); models of linear layers gained at
# 0.01-0.03 MFLOP and lost from 0.88 on (dropfl's mlp 1.7x slower).
PER_CLIENT_FLOPS_PER_SAMPLE = 10e6        # any model: per-client from here on
PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE = 0.5e6   # a model with at most half its FLOPs in convolutions: from here on


def training_flops(model: nn.Module, x: torch.Tensor) -> tuple[float, float] | None:
    """FLOPs of one training step per sample (forward and backward of the cross-entropy on the 2 samples `x`,
    torch's FlopCounterMode: matmuls and convolutions), all and those of convolutions, on a copy of the model;
    None where it cannot run."""
    from torch.utils.flop_counter import FlopCounterMode
    m = _strip_generators(model).train()
    try:
        with FlopCounterMode(display=False) as counter:
            out = m(x)
            F.cross_entropy(out, torch.zeros(len(x), dtype=torch.long)).backward()
    except Exception:   # noqa: BLE001 - any failure: the rule cannot tell, the caller keeps vmap
        return None
    per_op = counter.get_flop_counts().get("Global", {})
    conv = sum(v for op, v in per_op.items() if "convolution" in str(op))
    return counter.get_total_flops() / len(x), conv / len(x)


def choose_mode(model: nn.Module, x_all: torch.Tensor, device: torch.device) -> tuple[str, str]:
    """How the generic engine computes a slice, and why: "vmap" (`FunctionalEngine`) on a GPU, and on the CPU for
    models of fewer than PER_CLIENT_FLOPS_PER_SAMPLE training FLOPs per sample that have most of them in
    convolutions, or fewer than PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE; else "per-client" (`PerClientEngine`). A
    function of the model and the input shape only (never of timings), so a run's bits do not depend on the load."""
    if device.type != "cpu":
        return "vmap", f"on {device.type}"
    if len(x_all) == 0:
        return "vmap", "no data"
    counted = training_flops(model, _two_samples(x_all))
    if counted is None:
        return "vmap", "its FLOPs could not be counted"
    f, conv = counted
    what = f"{f / 1e6:.2f} MFLOP per sample and step, {100 * conv / f if f else 0:.0f}% in convolutions"
    if f >= PER_CLIENT_FLOPS_PER_SAMPLE:
        return "per-client", f"{what}: at least {PER_CLIENT_FLOPS_PER_SAMPLE / 1e6:g} MFLOP"
    if f >= PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE and 2 * conv <= f:
        return "per-client", f"{what}: at least {PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE / 1e6:g} MFLOP, at most half " \
                             "in convolutions"
    if f < PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE:
        return "vmap", f"{what}: under {PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE / 1e6:g} MFLOP"
    return "vmap", f"{what}: under {PER_CLIENT_FLOPS_PER_SAMPLE / 1e6:g} MFLOP, most in convolutions"


# --- the engine SimTransport runs: a round in slices, the slices in worker processes ----------------------------

GENERIC_SLICES = 2   # on the CPU: a round's tasks in this many contiguous slices, whatever the number of workers


def generic_slices(mode: str, device: torch.device) -> int:
    """A round's slices: vmap on the CPU `GENERIC_SLICES`, fixed (the clients that share a computation change its
    rounding); per-client one per CPU, from `GENERIC_SLICES` to `AUTO_SLICES_MAX` (each client is `local_train` on
    one thread, the same bits in any slice: a machine's cores all work; each slice is a worker process holding the
    model, as --slices auto's); on a GPU one."""
    if device.type != "cpu":
        return 1
    return max(GENERIC_SLICES, min(cpus(), AUTO_SLICES_MAX)) if mode == "per-client" else GENERIC_SLICES


_WORKER: FunctionalEngine | PerClientEngine | None = None
MODES = {"vmap": FunctionalEngine, "per-client": PerClientEngine}


def _init_worker(model: nn.Module, x_all: torch.Tensor, y_all: torch.Tensor, sizes: list[int],
                 mode: str = "vmap") -> None:
    global _WORKER
    _die_with_parent()
    _keep_freed_memory()
    torch.set_num_threads(1)
    _WORKER = MODES[mode](model, None, "cpu", threads=1, packed=(x_all, y_all, sizes))


_BLOCKS: dict[int, torch.Tensor] = {}   # a worker's hold on the parent's delta blocks, by slice (see `_DeltaBlocks`)

BY_VALUE_BELOW = 1 << 20   # bytes: a buffer smaller than this crosses between the processes by value (`by_value`)


def by_value(buffers: dict[str, torch.Tensor] | None) -> dict | None:
    """Buffers (a round's global ones on their way to a worker, a client's after training on their way back) with
    each small one as a numpy array, which pickles into the pipe's stream by value. As a tensor each would cross in
    a shared-memory file of its own (torch's reduction: a file made, mapped and faulted for every tensor): ResNet-8's
    27 buffers × 10 clients a slice kept a round's results ~0.1 s from the parent after its workers had finished,
    a sixth of the round (the engine 1.14× faster without it: benchmarks/results/worker_ceiling.md). A large
    buffer, or one of a dtype numpy lacks, still crosses as a tensor; either way the bits are the tensor's
    (`from_value`)."""
    if buffers is None:
        return None
    return {k: v.detach().numpy() if v.nbytes < BY_VALUE_BELOW and v.device.type == "cpu" and _numpy_dtype(v.dtype)
            else v for k, v in buffers.items()}


def from_value(buffers: dict | None) -> dict[str, torch.Tensor] | None:
    """`by_value`'s buffers as tensors again (the numpy arrays' memory, no copy)."""
    if buffers is None:
        return None
    return {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for k, v in buffers.items()}


@functools.cache   # asked for every buffer of every client of every round
def _numpy_dtype(dtype: torch.dtype) -> bool:
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:   # bfloat16, the float8 kinds and other dtypes numpy lacks
        return False
    return True


def _train_in_worker(w_global: torch.Tensor, tasks: list[TrainTask], buffers: dict[str, torch.Tensor] | None,
                     block: tuple[int, torch.Tensor]) -> list[LocalResult]:
    """A slice's results, without their deltas: `block` is (the slice's number, the parent's shared-memory block
    for its deltas, `_DeltaBlocks`), and each delta is written into its row there."""
    assert _WORKER is not None, "worker not initialised"
    number, rows = block
    # held until the parent sends another block for this slice: torch then finds the mapping in its cache
    # (multiprocessing/reductions.py, by the shared file's inode) instead of mapping and faulting the pages again
    _BLOCKS[number] = rows
    results = _WORKER.run(w_global, tasks, from_value(buffers), out=rows[:len(tasks)])
    for r in results:
        r.delta = None   # type: ignore[assignment]  # in the parent's block
        r.buffers = by_value(r.buffers)
    return results


class _DeltaBlocks:
    """The generic engine's return path for its workers' deltas: one [rows, P] block in shared memory per slice,
    made here once and kept (grown when a slice has more tasks than its block has rows), into which the slice's
    worker writes each client's delta (`local_train(out=)`); here each delta is then copied out into its own tensor
    (a result must not hold the block, which the next round overwrites). Against packing them in the worker
    (`_pack`: a stack, then torch copies the stack into a fresh shared-memory file whose every page faults, in the
    worker and again here) the deltas cross once. Held for the engine's life: one round's deltas, in /dev/shm."""

    def __init__(self) -> None:
        self.blocks: dict[int, torch.Tensor] = {}

    def get(self, number: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        b = self.blocks.get(number)
        if b is not None and b.shape[1] == width and b.dtype == dtype:
            if b.shape[0] >= rows:
                return b
            rows = max(rows, b.shape[0] * 5 // 4)   # grown by a quarter at least
        b = self.blocks[number] = torch.empty(rows, width, dtype=dtype).share_memory_()
        return b


class GenericEngine(PoolOwner):
    """The generic engine as `SimTransport` runs it: on the CPU a round's tasks in contiguous slices (`generic_slices`:
    in vmap mode `GENERIC_SLICES`, fixed by the task list alone), each slice computed on 1 thread in the `mode` that
    `choose_mode` picks for the model (or the caller names): "vmap", one `FunctionalEngine` computation, or
    "per-client", `PerClientEngine` (`local_train` client after client); the slices in worker processes (one per
    slice, at most one per CPU: `batched.cpus()`), as the hand-written engine runs its slices. So a run's bits do
    not depend on the number of workers: with one CPU, or a model that does not pickle (a class defined inside a
    function), the slices run one after the other in this process, with the same bits (said once as a warning).
    On CUDA one slice, in this process, vmap. Raises TypeError where the mode is vmap and torch.func cannot run the
    model (the probe of `FunctionalEngine`, in this process, before any worker starts). The workers write their
    deltas into shared-memory blocks this engine keeps (`_DeltaBlocks`)."""

    HERE = "the generic engine trains a round's slices in this process, one after the other"   # `_no_room`'s words

    def __init__(self, model: nn.Module, client_data: list[tuple[torch.Tensor, torch.Tensor]],
                 device: str | None = "auto", workers: int | None = None, mode: str | None = None):
        dev = _engine_device(device)
        cpu = dev.type == "cpu"
        if mode is None:   # the rule's probe needs two samples of one client (the first that has any)
            x0 = next((x[:2] for x, _ in client_data if len(x)), torch.empty(0))
            mode, self.mode_reason = choose_mode(model, x0, dev)
        else:
            if mode not in MODES or (mode == "per-client" and not cpu):
                raise ValueError(f"generic engine mode {mode!r}: one of {', '.join(MODES)} (per-client on the CPU)")
            self.mode_reason = "chosen by the caller"
        self.mode = mode
        self.local = MODES[mode](model, client_data, device, threads=1 if cpu else None)   # vmap: probes
        self.device, self.threads = self.local.device, self.local.threads
        self.groups = generic_slices(mode, self.device)
        if workers is None:
            n = cpus() if cpu else 1
            workers = min(self.groups, n) if n > 1 else 0
        if workers > 0:
            import pickle
            shipped = _strip_generators(model)   # the model as the workers get it (the engine's copy holds lambdas)
            try:
                pickle.dumps(shipped)
            except Exception as e:   # noqa: BLE001 - whatever pickle raises for this model's objects
                self.in_process_reason = f"{type(model).__name__} does not pickle ({type(e).__name__}: {e})"
                log.warning("the generic engine runs its %d slices in this process, one after the other: %s",
                            self.groups, self.in_process_reason)
                workers = 0
        # the data, shared once with every worker
        if workers > 0 and not self.share_data([self.local.x_all, self.local.y_all], "generic engine", self.groups):
            workers = 0
        self.workers = workers
        self.blocks, self.blocks_lock = _DeltaBlocks(), threading.Lock()
        self.param_dtype = next((p.dtype for p in model.parameters()), torch.float32)
        if workers > 0:
            self.start_pool(workers, _init_worker, (shipped, self.local.x_all, self.local.y_all, self.local.sizes,
                                                    mode))

    def slices(self, tasks: list[TrainTask]) -> list[list[TrainTask]]:
        """`groups` contiguous slices of the task list (`BatchedEngine.slices`' rule)."""
        return contiguous_slices(tasks, self.groups)

    def run(self, w_global: torch.Tensor, tasks: list[TrainTask],
            buffers: dict[str, torch.Tensor] | None = None) -> list[LocalResult]:
        """The tasks' results, in task order (`FunctionalEngine.run`, slice by slice)."""
        parts = self.slices(tasks)
        if self.pool is None:
            return self._here(w_global, parts, buffers)
        # the dtype the deltas have: local_train's w_global − weights; vmap's are w_global's
        dtype = w_global.dtype if self.mode == "vmap" else torch.promote_types(w_global.dtype, self.param_dtype)
        width = w_global.numel()
        with self.blocks_lock:   # a block is one slice's of one round at a time
            try:
                blocks = [self.blocks.get(k, len(p), width, dtype) for k, p in enumerate(parts)]
            except RuntimeError as e:
                if not shm_error(e):
                    raise
                need = sum(len(p) for p in parts) * width * dtype.itemsize
                self._no_room(self.HERE, "its deltas do not fit in shared memory", need, "a round's deltas", e)
                return self._here(w_global, parts, buffers)
            sent = by_value(buffers)
            futures = [self.pool.submit(_train_in_worker, w_global, p, sent, (k, b))
                       for k, (p, b) in enumerate(zip(parts, blocks))]
            # every slice finished (or failed) before any block is read or handed out again
            concurrent.futures.wait(futures)
            full = next((e for e in (f.exception() for f in futures) if e is not None and shm_error(e)), None)
            if full is not None:
                # the weights, the buffers or a slice's results on their way (no worker writes into a block now)
                need = w_global.nbytes + sum(b.nbytes for b in (buffers or {}).values())
                self._no_room(self.HERE, "the round does not fit in shared memory on its way to or from the workers",
                              need, "a round's weights and buffers (and its results)", full)
                return self._here(w_global, parts, buffers)
            out = []
            for f, b in zip(futures, blocks):
                results = f.result()
                for i, r in enumerate(results):
                    r.delta = b[i].clone()
                    r.buffers = from_value(r.buffers)
                out.extend(results)
            return out

    def _here(self, w_global: torch.Tensor, parts: list[list[TrainTask]],
              buffers: dict[str, torch.Tensor] | None) -> list[LocalResult]:
        """The slices one after the other in this process (the same bits as in the workers)."""
        return [r for p in parts for r in self.local.run(w_global, p, buffers)]

    def describe(self) -> str:
        return self.local.describe()

    def close(self) -> None:
        """The worker processes, and the in-process engine's threads (on a GPU: its mask drawers)."""
        super().close()
        if getattr(self, "blocks", None) is not None:
            self.blocks.blocks.clear()
        local = getattr(self, "local", None)   # (None where __init__ failed before it; __del__ calls close)
        if local is not None:
            local.close()

    def details(self) -> dict:
        out = self.local.details() | {"workers": self.workers, "slices": self.groups, "mode": self.mode,
                                      "mode_reason": self.mode_reason}
        if self.in_process_reason:
            out["in_process"] = self.in_process_reason
        return out


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for j, i in enumerate(order):
        inv[i] = j
    return inv
