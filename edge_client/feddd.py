"""FedDD client side (Feng et al., "FedDD", Algorithm 2, eqs. 5-6, 20-21): which parameters to upload,
and the sparse wire encoding that makes the upload smaller.

Units of selection are whole output channels of conv layers and whole neurons of linear layers:
unit k of a layer is `weight[k, ...]` together with `bias[k]`. Every layer drops the same rate D
(Algorithm 2 "the same dropout rate for each layer"), keeping round(N_l · (1 − D)) units per layer
(the paper prints N_l · D, a typo: 1 − D is the uploaded fraction). Parameters outside conv/linear
layers (none in dropfl's models) are always uploaded.

Sparse payload (little-endian), for a model whose conv/linear layers have K units in total:

    b"FDS1" | u32 K | u32 count | unit bitmap: ceil(K/8) bytes (np.packbits, bitorder="little",
    units in model order) | count × float32 values of the kept coordinates, in flat-parameter order

so a payload is 12 + ceil(K/8) + 4·count bytes (`sparse_nbytes`) against 4·P for the dense float32
vector (`dense_nbytes`). This module never imports the coordinator or cvxpy.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from edge_client.models import get_flat
from edge_client.trainer import LocalResult, TrainTask, local_train

MAGIC = b"FDS1"
WIRE_ENCODING = "feddd-sparse-1"  # `meta.encoding` of an MQTT update whose body is this payload (docs/protocol.md)
_HEAD = struct.Struct("<4sII")
EPS = 1e-12  # |W| below this is replaced by ±EPS in eq. (20)'s division (the paper leaves W = 0 open)


class SparseError(ValueError):
    """A sparse payload does not match the layout it is decoded with."""


@dataclass(frozen=True)
class Layer:
    """One conv/linear layer: `units` rows, each made of `row` coordinates of every tensor listed."""

    name: str
    units: int                        # N_l
    tensors: tuple[tuple[int, int], ...]  # (flat offset, coordinates per unit) of weight, bias


@dataclass(frozen=True)
class Layout:
    layers: tuple[Layer, ...]
    always: tuple[tuple[int, int], ...]   # (offset, numel) of parameters outside conv/linear layers
    numel: int                            # P, length of the flat parameter vector

    @property
    def units(self) -> int:
        """K, the number of channels and neurons of the model."""
        return sum(layer.units for layer in self.layers)


UNIT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def unit_layout(model: nn.Module) -> Layout:
    """The channel/neuron structure of `model` over its flat vector (`models.get_flat` order)."""
    offsets, pos = {}, 0
    for p in model.parameters():
        offsets[id(p)] = pos
        pos += p.numel()
    layers, covered = [], set()
    for name, m in model.named_modules():
        if isinstance(m, UNIT_LAYERS):
            tensors = [(offsets[id(m.weight)], m.weight[0].numel())]
            covered.add(id(m.weight))
            if m.bias is not None:
                tensors.append((offsets[id(m.bias)], 1))
                covered.add(id(m.bias))
            layers.append(Layer(name, m.weight.shape[0], tuple(tensors)))
    always = tuple((offsets[id(p)], p.numel()) for p in model.parameters() if id(p) not in covered)
    return Layout(tuple(layers), always, pos)


def keep_count(units: int, dropout: float) -> int:
    """Algorithm 2 with the N_l·D typo fixed: round(N_l (1 − D)), halves rounded up."""
    return min(units, int(math.floor(units * (1.0 - dropout) + 0.5)))


def label_score(y: torch.Tensor, num_classes: int) -> float:
    """q_n = Σ_c min(C · dis_n^c, 1) (FedDD eq. 13's data-distribution term), in [1, C]."""
    counts = torch.bincount(y.long(), minlength=num_classes).double()
    return float(torch.clamp(num_classes * counts / max(len(y), 1), max=1.0).sum())


def importance(layout: Layout, w_old: torch.Tensor, w_new: torch.Tensor,
               coverage: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Per layer, the score of every unit k (FedDD eqs. 20-21):
        I_k = ‖ΔW ⊙ (W + ΔW) ⊘ W‖_(k) / CR(k),   ΔW = Ŵ − W, L2 norm over the unit's weight row and bias.
    `w_old` is W (the model training started from), `w_new` is Ŵ (after local training); `coverage`
    is CR(k) per layer (the fraction of clients owning unit k; None = 1, the homogeneous case)."""
    W = w_old.double()
    dW = w_new.double() - W
    safe = torch.where(W.abs() < EPS, torch.where(W < 0, -EPS, EPS), W)
    g = dW * (W + dW) / safe                                        # eq. (20), element-wise
    scores = []
    for i, layer in enumerate(layout.layers):
        sq = torch.zeros(layer.units, dtype=torch.float64)
        for off, row in layer.tensors:
            sq += (g[off:off + layer.units * row].view(layer.units, row) ** 2).sum(1)
        s = sq.sqrt().numpy()
        scores.append(s / coverage[i] if coverage is not None else s)  # eq. (21)
    return scores


def unit_masks(scores: list[np.ndarray], dropout: float) -> list[np.ndarray]:
    """Keep the top round(N_l (1 − D)) units of every layer by score (ties: the lower index)."""
    masks = []
    for s in scores:
        keep = np.argsort(-s, kind="stable")[:keep_count(len(s), dropout)]
        m = np.zeros(len(s), dtype=bool)
        m[keep] = True
        masks.append(m)
    return masks


def flat_mask(layout: Layout, masks: list[np.ndarray]) -> torch.Tensor:
    """Expand per-unit masks to a bool mask over the flat parameter vector."""
    out = torch.zeros(layout.numel, dtype=torch.bool)
    for layer, m in zip(layout.layers, masks):
        mt = torch.as_tensor(m)
        for off, row in layer.tensors:
            out[off:off + layer.units * row] = mt.repeat_interleave(row)
    for off, n in layout.always:
        out[off:off + n] = True
    return out


def select_upload(layout: Layout, w_old: torch.Tensor, w_new: torch.Tensor, dropout: float,
                  coverage: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Algorithm 2: the per-layer unit masks M_n^t for dropout rate D_n^t."""
    if not 0.0 <= dropout <= 1.0:
        raise ValueError(f"dropout rate must be in [0, 1], got {dropout}")
    return unit_masks(importance(layout, w_old, w_new, coverage), dropout)


def dense_nbytes(layout: Layout) -> int:
    """Bytes of the dense float32 vector (a full upload's tensor body)."""
    return 4 * layout.numel


def sparse_nbytes(layout: Layout, masks: list[np.ndarray]) -> int:
    """Exact bytes of `encode_sparse(layout, masks, ...)`."""
    count = sum(int(m.sum()) * sum(row for _, row in layer.tensors) for layer, m in zip(layout.layers, masks))
    count += sum(n for _, n in layout.always)
    return _HEAD.size + math.ceil(layout.units / 8) + 4 * count


def encode_sparse(layout: Layout, masks: list[np.ndarray], values: torch.Tensor) -> bytes:
    """The kept coordinates of the flat vector `values` as a sparse payload (format in the module doc)."""
    keep = flat_mask(layout, masks)
    vals = values.detach().float()[keep].numpy().astype("<f4")
    bits = np.packbits(np.concatenate(masks) if masks else np.zeros(0, bool), bitorder="little")
    return _HEAD.pack(MAGIC, layout.units, len(vals)) + bits.tobytes() + vals.tobytes()


def decode_sparse(layout: Layout, payload: bytes) -> tuple[list[np.ndarray], torch.Tensor, torch.Tensor]:
    """(unit masks, flat bool mask, flat float32 values with 0 off the mask) of a sparse payload."""
    if len(payload) < _HEAD.size:
        raise SparseError(f"sparse payload of {len(payload)} bytes is shorter than its {_HEAD.size}-byte header")
    magic, k, count = _HEAD.unpack_from(payload)
    if magic != MAGIC:
        raise SparseError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if k != layout.units:
        raise SparseError(f"payload has {k} units, the model has {layout.units}")
    nbits = math.ceil(k / 8)
    bits = np.unpackbits(np.frombuffer(payload, np.uint8, nbits, _HEAD.size), count=k, bitorder="little")
    bounds = np.cumsum([0] + [layer.units for layer in layout.layers])
    masks = [bits[a:b].astype(bool) for a, b in zip(bounds[:-1], bounds[1:])]
    if len(payload) != sparse_nbytes(layout, masks) or _HEAD.size + nbits + 4 * count != len(payload):
        raise SparseError(f"payload of {len(payload)} bytes does not match its bitmap and count {count} "
                          f"(expected {sparse_nbytes(layout, masks)} bytes)")
    keep = flat_mask(layout, masks)
    out = torch.zeros(layout.numel, dtype=torch.float32)
    out[keep] = torch.from_numpy(np.frombuffer(payload, "<f4", count, _HEAD.size + nbits).astype(np.float32))
    return masks, keep, out


def delta_from_upload(layout: Layout, payload: bytes, w_global: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Coordinator side of an upload: (delta = W^t − Ŵ on the mask and 0 elsewhere, flat bool mask) from a
    payload of the client's kept values Ŵ (`encode_sparse(layout, memory.masks, memory.w_local)`)."""
    _, keep, values = decode_sparse(layout, payload)
    return torch.where(keep, w_global - values, torch.zeros_like(w_global)), keep


@dataclass
class Memory:
    """What a FedDD client keeps between rounds for the sparse download (eq. 5)."""

    round: int                 # the round of its last upload
    w_local: torch.Tensor      # Ŵ_n, its locally trained model
    masks: list[np.ndarray]    # M_n, the units it uploaded


def merge_download(memory: Memory, layout: Layout, w_global: torch.Tensor) -> torch.Tensor:
    """FedDD eq. (5): W_n = W ⊙ M_n + Ŵ_n ⊙ (1 − M_n) (only W on M_n is read: the sparse download)."""
    return torch.where(flat_mask(layout, memory.masks), w_global, memory.w_local)


@dataclass
class FedDDResult:
    result: LocalResult            # local training (loss, steps, seconds)
    delta: torch.Tensor            # w_global − Ŵ on the uploaded coordinates, 0 elsewhere
    mask: torch.Tensor             # flat bool mask M_n
    upload_bytes: int              # sparse payload bytes
    download_bytes: int            # dense or sparse bytes of the model received
    sparse_download: bool


def client_round(model: nn.Module, layout: Layout, w_global: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                 task: TrainTask, memory: Memory | None,
                 coverage: list[np.ndarray] | None = None) -> tuple[FedDDResult, Memory]:
    """One FedDD client round (Algorithm 1, steps 1-3, 6-7), for `task.dropout_rate` = D_n^t.

    Start point: eq. (5) (merge the sparse download into the own model) when the task asks for a sparse
    download and the client uploaded in the previous round; otherwise eq. (6), the full W^t.
    Upload: Ŵ on the Algorithm 2 mask, expressed as delta = W^t − Ŵ so the server needs no client state."""
    sparse = bool(task.sparse_download) and memory is not None and memory.round == task.round - 1
    start = merge_download(memory, layout, w_global) if sparse else w_global
    down = sparse_nbytes(layout, memory.masks) if sparse else dense_nbytes(layout)
    r = local_train(model, start.clone(), x, y, task)  # a copy: set_flat makes the parameters views of it
    w_hat = get_flat(model).to(w_global.device)  # the model may train on a GPU (agent --device cuda)
    masks = select_upload(layout, start, w_hat, float(task.dropout_rate), coverage)
    mask = flat_mask(layout, masks)
    delta = torch.where(mask, w_global - w_hat, torch.zeros_like(w_hat))
    out = FedDDResult(r, delta, mask, sparse_nbytes(layout, masks), down, sparse)
    return out, Memory(task.round, w_hat, masks)
